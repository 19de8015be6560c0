"""Crash consistency: a process SIGKILLed at any moment of a save leaves every committed checkpoint valid,
the next start resumes from the newest one and clears the temporaries, and no temporary is ever loaded."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools.processes import REPO_ROOT, clean_env
from trainer.checkpoint import open_storage, verify

STATE_MB = 32  # large enough that a save takes a good fraction of a second, so kills land inside it

# (how the moment is found, then how much later to kill, as a fraction of one save's duration)
KILL_MOMENTS = [
    ("temporary folder appears", 0.0), ("save announced", 0.0), ("temporary folder appears", 0.4),
    ("save announced", 0.5), ("temporary folder appears", 0.8), ("save announced", 1.0),
]


class Saver:
    """tests/workers/checkpoint_saver.py in its own process, read line by line."""

    def __init__(self, checkpoint_dir: Path, log: Path, sharded: bool) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.log = log
        with open(log, "w") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.workers.checkpoint_saver", str(checkpoint_dir), str(STATE_MB),
                 *(["sharded"] if sharded else [])],
                env=clean_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)

    def expect(self, word: str) -> list[str]:
        line = self.process.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith(word), f"expected {word!r}, got {line!r}; log: {self.log.read_text()[-2000:]}"
        return line.split()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.process.stdout.close()  # type: ignore[union-attr]


def temporaries(checkpoint_dir: Path) -> list[str]:
    return [path.name for path in checkpoint_dir.iterdir() if path.name.startswith(".tmp-")]


def wait_for_a_temporary_folder(saver: Saver) -> None:
    """Poll until a save's temporary folder exists (the write is under way)."""
    while not any(name.startswith(".tmp-step-") for name in temporaries(saver.checkpoint_dir)):
        assert saver.process.poll() is None, saver.log.read_text()[-2000:]
        time.sleep(0.001)


@pytest.mark.parametrize("sharded", [False, True], ids=["state-file", "sharded"])
def test_sigkill_at_any_moment_of_a_save_leaves_the_checkpoints_usable(tmp_path, sharded):
    """Sharded: the weights are a DTensor, written to the rank's shard file before the state file and the
    manifest (trainer.checkpoint.shards), so the kills land in either."""
    checkpoint_dir = tmp_path / "checkpoints"
    choose = random.Random(1234)
    newest: str | None = None
    kills_leaving_a_temporary = 0
    for attempt, (trigger, fraction) in enumerate([*KILL_MOMENTS, ("after resume", 0.0)]):
        saver = Saver(checkpoint_dir, tmp_path / f"saver-{attempt}.log", sharded)
        try:
            _, resumed = saver.expect("resumed")
            # The start cleared what the last kill left, then took the newest checkpoint, never a temporary.
            assert resumed == (str(checkpoint_dir / newest) if newest else "none")
            assert not temporaries(checkpoint_dir)
            if trigger == "after resume":
                break
            saver.expect("saving")
            one_save_s = float(saver.expect("saved")[2])
            if trigger == "save announced":
                saver.expect("saving")
            else:
                wait_for_a_temporary_folder(saver)
            time.sleep(fraction * one_save_s * choose.uniform(0.8, 1.2))  # the kill moment, not a synchronisation
        finally:
            saver.kill()
        kills_leaving_a_temporary += bool(temporaries(checkpoint_dir))
        storage = open_storage(str(checkpoint_dir))
        committed = storage.list_checkpoints()
        assert committed, f"no checkpoint left after kill {attempt}"
        for name in committed:
            verify(storage, name)  # raises InvalidCheckpoint with the reason
        newest = committed[0]
    assert kills_leaving_a_temporary > 0, "no kill landed inside a save; the test did not test anything"
