"""The figures of the suite, one module each: TITLE and run(ctx) -> FigureResult."""
