"""Benchmarks, each runnable as ``python -m bench.<name>`` and importable by a suite (``run(quick)``)."""
