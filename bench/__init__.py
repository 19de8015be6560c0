"""The benchmark suite, ``python -m bench.run``: figures/ measure one thing each, harness/ launches,
measures and records, workers/ are the scripts the figures start as processes."""
