"""Scripts the figures start as separate processes (python -m bench.workers.NAME)."""
