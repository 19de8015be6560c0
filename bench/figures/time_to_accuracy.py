"""Figure 5: wall time to a test accuracy, 2 ranks against 1 process, in the same invocation.

Both are the trainer under torchrun (one thread per rank) on Fashion-MNIST; the time is from the
launch to the first evaluation at or above the target, so start-up and the evaluations count. Both
evaluate every 100 optimizer steps (`--eval-every`, about a fifth of an epoch) besides each epoch's end.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.harness.context import Context
from bench.harness.launch import TrainerRun, run_trainer
from bench.harness.measure import load_average
from bench.harness.results import FigureResult, Goal, Row

TITLE = "Time to accuracy"
GOAL = Goal("<=", 0.6)


@dataclass(frozen=True)
class Recipe:
    target: float
    args: tuple[str, ...]  # both runs
    one_process_args: tuple[str, ...]
    two_rank_args: tuple[str, ...]


# The 2 ranks take 64 samples each: the global batch stays 128, so both runs take the same optimizer steps
# (BatchNorm aside) and need the same epochs. With 128 per rank (global 256) the 2 ranks need more epochs.
FULL = Recipe(0.90, ("--epochs", "2", "--lr", "2e-3", "--eval-every", "100"), ("--batch-size", "128"),
              ("--batch-size", "64"))
# A real subset, small enough for CI: a lower target.
QUICK = Recipe(0.70, ("--epochs", "2", "--lr", "2e-3", "--max-train-samples", "4096", "--max-test-samples", "1000",
                      "--eval-every", "8"), ("--batch-size", "128"), ("--batch-size", "64"))


def run(ctx: Context) -> FigureResult:
    load_before = load_average()
    recipe = ctx.pick(FULL, QUICK)
    common = ["--dataset", "fashion-mnist", "--log-every", "1000", *recipe.args]
    timeout = ctx.pick(900, 240)
    one = run_trainer([*common, *recipe.one_process_args], ctx.scratch("accuracy-1"), nproc=1, timeout_s=timeout)
    two = run_trainer([*common, *recipe.two_rank_args], ctx.scratch("accuracy-2"), nproc=2, timeout_s=timeout)
    curves = {"1 process": _curve(one), "2 ranks": _curve(two)}
    reached = {label: _reached(curve, recipe.target) for label, curve in curves.items()}
    best = {label: max((accuracy for _, accuracy in curve), default=0.0) for label, curve in curves.items()}
    if None in reached.values():
        missed = ", ".join(f"{label} best {best[label]:.4f}" for label, at in reached.items() if at is None)
        row = Row(f"time to {recipe.target:.0%}: 2 ranks / 1 process", None, GOAL,
                  notes=f"not measured: target not reached ({missed})")
    else:
        seconds_one, seconds_two = reached["1 process"], reached["2 ranks"]
        assert seconds_one is not None and seconds_two is not None
        row = Row(f"time to {recipe.target:.0%} test accuracy: 2 ranks / 1 process", seconds_two / seconds_one,
                  GOAL, notes=f"reached after {seconds_one:.0f} s (1 process, `{' '.join(recipe.one_process_args)}`) "
                              f"and {seconds_two:.0f} s (2 ranks, `{' '.join(recipe.two_rank_args)}` each), "
                              f"start-up included, `{' '.join(recipe.args)}`; accuracy at each evaluation: "
                              f"{_accuracies(curves['1 process'])} and {_accuracies(curves['2 ranks'])}")
    details = {"target": recipe.target, "curves": curves, "reached_s": reached, "args": common,
               "one_process_args": list(recipe.one_process_args), "two_rank_args": list(recipe.two_rank_args),
               "load_average": [load_before, load_average()]}
    return FigureResult(5, "accuracy", TITLE, [row], details)


def _curve(trainer: TrainerRun) -> list[tuple[float, float]]:
    """(seconds since launch, test accuracy) at every evaluation."""
    return [(record["time"] - trainer.launched_at, record["accuracy"]) for record in trainer.records
            if record["kind"] == "test"]


def _reached(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((seconds for seconds, accuracy in curve if accuracy >= target), None)


def _accuracies(curve: list[tuple[float, float]]) -> str:
    return ", ".join(f"{accuracy:.4f}" for _, accuracy in curve)
