"""Benchmarks (`make bench`). Each writes its figures under bench/results/ with the machine."""
