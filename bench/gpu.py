"""The GPU figures: ``python -m bench.gpu [--quick] [--only NAME]... [--output-dir DIR]`` (``make gpu-bench``,
``make gpu-bench-smoke``).

A full run needs a CUDA GPU, its own Python and torch (``PYTHONPATH=.``, nothing installed; Accelerate and
Lightning are there), about 8 minutes on an H100 (scripts/gpu-call.sh runs it within the lent machine's limits:
docs/benchmarks.md has the plan and each figure's measured length). It writes results.json, results.md and a
summary plot to bench/results/gpu/ (``--output-dir`` elsewhere, the device tool's $OUT say).
``--quick`` is the smoke mode, on any machine, the CPU included: every figure's code path with tiny sizes (CI
runs it), its numbers meaningless, written to bench/results/raw/gpu-quick/.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bench.figures import gpu_checkpoint, gpu_compile, gpu_input, gpu_loop, gpu_sharded
from bench.run import RESULTS_DIR, Suite, run_suite

FIGURES = {
    "gpu-loop": (gpu_loop.TITLE, gpu_loop.run),
    "gpu-input": (gpu_input.TITLE, gpu_input.run),
    "gpu-checkpoint": (gpu_checkpoint.TITLE, gpu_checkpoint.run),
    "gpu-sharded": (gpu_sharded.TITLE, gpu_sharded.run),
    "gpu-compile": (gpu_compile.TITLE, gpu_compile.run),
}
GPU_SUITE = Suite("bench.gpu", __doc__.split("\n\n")[0], FIGURES, RESULTS_DIR / "gpu",
                  RESULTS_DIR / "raw" / "gpu-quick",
                  "smoke mode on any machine (CI: the CPU): every figure tiny, about 2 minutes, numbers meaningless",
                  full_run_needs_cuda=True)


def main(argv: Sequence[str] | None = None) -> int:
    return run_suite(GPU_SUITE, argv)


if __name__ == "__main__":
    sys.exit(main())
