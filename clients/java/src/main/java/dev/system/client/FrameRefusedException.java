package dev.system.client;

import dev.system.gateway.v1.FrameError;
import io.grpc.Status;

/**
 * The gateway refused one of our frames with a FrameError (the stream stays open). The code
 * says what to do: INVALID_ARGUMENT fix the frame, NOT_FOUND join the player first,
 * ALREADY_EXISTS use a fresh request id, RESOURCE_EXHAUSTED wait and let the player retry.
 */
public class FrameRefusedException extends RuntimeException {
  private final FrameError error;

  public FrameRefusedException(FrameError error) {
    super(Status.fromCodeValue(error.getCode()).getCode() + ": " + error.getMessage());
    this.error = error;
  }

  /** The gRPC status code of the refusal. */
  public Status.Code code() {
    return Status.fromCodeValue(error.getCode()).getCode();
  }

  /** The refusal as the gateway sent it. */
  public FrameError error() {
    return error;
  }
}
