"""What every figure shares: the run context, measuring, results, plots, launching processes, data."""
