"""trainer.slow_rank's rule on numbers alone: who is named, when, and when not (the ranks' real comparison over
the control channel is tests/integration/test_slow_rank.py)."""

from __future__ import annotations

import pytest

from trainer.cli import parse_config
from trainer.errors import ConfigError
from trainer.slow_rank import IN_A_ROW, Verdicts
from trainer.step_timing import StepParts

STEPS = 10


def window(*ranks: tuple[float, float], step_ms: float = 40.0) -> list[StepParts]:
    """Each rank's (data, compute) in ms per step, over a window of STEPS steps."""
    return [StepParts(data * STEPS / 1e3, compute * STEPS / 1e3, step_ms * STEPS / 1e3, STEPS)
            for data, compute in ranks]


EVEN = window((5.0, 14.0), (5.1, 13.8))
SLOW_COMPUTE = window((5.0, 14.0), (5.0, 21.0), step_ms=35.0)


def fed(verdicts: Verdicts, windows: list[list[StepParts]]) -> list[list[tuple[int, str, bool]]]:
    """The events after each window, as (rank, part, slow)."""
    return [[(event.rank, event.part, event.slow) for event in verdicts.add(w, STEPS * (i + 1))[1]]
            for i, w in enumerate(windows)]


def test_a_rank_slow_three_windows_in_a_row_is_named_once_and_cleared_after_three_even_ones():
    events = fed(Verdicts(1.25), [EVEN, *[SLOW_COMPUTE] * 5, *[EVEN] * IN_A_ROW])
    assert events == [[], [], [], [(1, "compute", True)], [], [], [], [], [(1, "compute", False)]]


def test_a_slow_spell_broken_by_an_even_window_names_no_one():
    assert fed(Verdicts(1.25), [SLOW_COMPUTE, SLOW_COMPUTE, EVEN, SLOW_COMPUTE, SLOW_COMPUTE]) == [[]] * 5


def test_the_named_event_gives_the_figures_of_the_last_windows_and_one_line_for_the_log():
    verdicts = Verdicts(1.25)
    for w in (SLOW_COMPUTE, SLOW_COMPUTE):
        verdicts.add(w, 0)
    comparison, [event] = verdicts.add(SLOW_COMPUTE, 30)
    assert event.record() == {"rank": 1, "slow": 1, "compute_ratio": 1.5, "compute_ms": 21.0,
                              "others_compute_ms": 14.0, "steps": 30, "step_ms": 35.0}
    assert event.describe("node-b, local rank 1") == (
        "rank 1 (node-b, local rank 1) is slow in compute (its forward pass and loss): 1.50x the other ranks' "
        "median over the last 30 steps (21.0 ms a step against 14.0 ms); it costs every rank about 7.0 ms a step "
        "(20% of a step)")
    assert comparison.named == {(1, "compute")} and comparison.step == 30
    compute = comparison.parts[1]
    assert compute.part == "compute" and compute.slowest_rank == 1 and compute.slow == (False, True)


def test_near_zero_data_waits_are_not_named_however_large_their_ratio():
    """0.05 ms against 0.4 ms is 8x, but half a millisecond of a 40 ms step is noise, not a finding."""
    tiny = window((0.05, 14.0), (0.4, 14.0))
    assert fed(Verdicts(1.25), [tiny] * 5) == [[]] * 5


def test_an_excess_under_the_ratio_is_not_named():
    assert fed(Verdicts(1.25), [window((5.0, 14.0), (5.0, 17.0))] * 5) == [[]] * 5
    assert fed(Verdicts(1.2), [window((5.0, 14.0), (5.0, 17.0))] * 3)[-1] == [(1, "compute", True)]


def test_each_rank_is_held_against_the_median_of_the_others_and_each_part_on_its_own():
    four = window((5.0, 14.0), (5.0, 14.5), (12.0, 21.0), (5.2, 13.9))
    assert fed(Verdicts(1.25), [four] * IN_A_ROW)[-1] == [(2, "data", True), (2, "compute", True)]


def test_without_compute_in_the_parts_only_data_is_judged():
    assert fed(Verdicts(1.25, ("data",)), [SLOW_COMPUTE] * IN_A_ROW) == [[]] * IN_A_ROW


@pytest.mark.parametrize(("argv", "message"), [
    (["--slow-rank-every", "-1"], r"^--slow-rank-every must be a number of steps >= 0 \(0: off\), got -1$"),
    (["--slow-rank-ratio", "1"], r"^--slow-rank-ratio must be a number > 1 \(1.4: 40% slower than the "
                                 r"others' median\), got 1$"),
    (["--slow-rank-ratio", "nan"], r"^--slow-rank-ratio must be a number > 1 .*got nan$"),
])
def test_bad_settings_are_one_line_naming_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(argv)
