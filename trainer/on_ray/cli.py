"""``ddp-train-ray``: its own options, all named --ray-, then any of ddp-train's (they pass through to the trainer:
its --num-workers, --run-name, ... are not Ray's)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from trainer.errors import EXIT_OK
from trainer.on_ray.driver import run_on_ray
from trainer.on_ray.settings import RayRun, new_run_name

__all__ = ["main", "ray_parser"]


def _workers(text: str) -> tuple[int, int]:
    low_text, colon, high_text = text.partition(":")
    try:
        low, high = int(low_text), int(high_text if colon else low_text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN:MAX") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX")
    return low, high


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: need a number above 0")
    return value


def ray_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddp-train-ray", allow_abbrev=False, add_help=False,
        description="Train with Ray Train: these options, then any of ddp-train's (ddp-train --help)")
    parser.add_argument("--ray-workers", type=_workers, default=(1, 1), metavar="N|MIN:MAX",
                        help="Ray workers (one rank each); MIN:MAX lets Ray resize the run within it")
    parser.add_argument("--ray-run-name", default=None,
                        help="the Ray run's name (a plain name); the same name goes on with that run (default: a "
                             "new name each time, printed at the start)")
    parser.add_argument("--ray-storage-path", default="~/ray_results",
                        help="a folder every node mounts at the same path (checked); the run's folder is "
                             "STORAGE_PATH/RUN_NAME")
    parser.add_argument("--ray-address", default=None, help="the cluster's GCS address (default: RAY_ADDRESS, or a "
                                                            "local cluster)")
    parser.add_argument("--ray-gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--ray-cpus-per-worker", type=_positive, default=1.0)
    parser.add_argument("--ray-max-failures", type=int, default=3,
                        help="worker-group restarts after failures (-1: no limit)")
    parser.add_argument("--ray-resize-check-s", type=_positive, default=60.0,
                        help="elastic runs: how often Ray looks for room to grow")
    parser.add_argument("--ray-cluster-autoscales", action="store_true",
                        help="do not refuse workers the cluster cannot place now (its autoscaler adds nodes)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = ray_parser()
    args, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        parser.print_help()
        return EXIT_OK
    name = new_run_name() if args.ray_run_name is None else args.ray_run_name  # "": refused, not replaced
    ray_run = RayRun(num_workers=args.ray_workers, name=name,
                     storage_path=args.ray_storage_path, address=args.ray_address, use_gpu=args.ray_gpu,
                     cpus_per_worker=args.ray_cpus_per_worker, max_failures=args.ray_max_failures,
                     resize_check_s=args.ray_resize_check_s, cluster_autoscales=args.ray_cluster_autoscales)
    return run_on_ray(None, rest, ray_run)
