"""Shared server plumbing, the gateway, the model gateway and the simulated game server."""

import os

# gRPC's fork support runs its post-fork handler in every child of a process with live gRPC
# state, and grpcio 1.80+ can then crash a subprocess.Popen child with "epoll_wait error: Bad
# file descriptor" (SIGABRT) between fork and exec, once the child has closed gRPC's fds
# (grpc/grpc#43055). Nothing here forks with gRPC running: subprocesses exec at once, and
# `workers` forks before any gRPC object exists (services.runtime.workers). So it stays off,
# for this process and the services it starts; it must be set before gRPC initialises, which
# is why test and bench entry points import this package first.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
