"""The model gateway: the only service that talks to the outside. It runs chat completions
against an OpenAI-compatible endpoint (DeepSeek by default), with timeouts capped by the
caller's deadline, provider failures mapped to gRPC status codes, and token metering."""
