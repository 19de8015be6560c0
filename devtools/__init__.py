"""Helpers the tests and the benchmarks share: starting the trainer and its tools as real processes."""
