"""The tests' process helper leaves nothing running: a command that times out is killed with its children."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from devtools.processes import run


def test_a_command_that_times_out_is_killed_with_the_processes_it_started(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; "
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
              f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(300)")
    with pytest.raises(subprocess.TimeoutExpired):
        run([sys.executable, "-c", script], timeout_s=3)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild):
        assert time.monotonic() < deadline, f"process {grandchild} outlived the timed-out command"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone in all but name: its parent (the helper's child) was killed and init reaps it.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ", 1)[1][0] != "Z"
