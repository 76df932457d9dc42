"""Benchmarks (`make bench`). Each writes its figures under bench/results/ with the machine."""

import services  # noqa: F401, E402 - turns gRPC's fork support off before gRPC loads
