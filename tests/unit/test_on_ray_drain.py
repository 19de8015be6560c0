"""What a drained Ray node asks of the trainer (trainer/on_ray/drain.py); tests/deploy/test_ray.py drains
one on a real cluster."""

from __future__ import annotations

from trainer.on_ray.drain import drain_request
from trainer.preemption import StopRequest


def test_a_drain_with_a_deadline_asks_to_be_gone_by_it_and_says_how_soon():
    request = drain_request("1a2b", deadline_ms=1_000_030_000, now_unix_s=1_000_000.0, now_monotonic=50.0)
    assert request == StopRequest("node 1a2b is draining (deadline in 30 s)", exit_by=80.0)


def test_a_drain_without_a_deadline_leaves_the_grace_period_as_it_is():
    assert drain_request("1a2b", 0, 1_000_000.0, 50.0) == StopRequest("node 1a2b is draining (no deadline)")


def test_a_deadline_already_past_asks_to_be_gone_now():
    request = drain_request("1a2b", deadline_ms=999_990_000, now_unix_s=1_000_000.0, now_monotonic=50.0)
    assert request == StopRequest("node 1a2b is draining (deadline in 0 s)", exit_by=50.0)
