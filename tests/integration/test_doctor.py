"""ddp-doctor, the preflight a user runs first on a new cluster: real processes, real collectives."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.processes import env_ranks, free_port, run, torchrun

# Timing-sensitive (a rendezvous timeout of 1 s, timed collectives): never run beside other tests (tests/conftest.py).
pytestmark = pytest.mark.serial

QUICK = ["--sizes-mb", "0.01,0.1", "--iterations", "2", "--collective-timeout-s", "30"]
OPS = ("send_recv", "broadcast", "reduce", "all_reduce_sum", "all_reduce_product", "all_reduce_max",
       "all_reduce_min", "gather", "all_gather", "scatter", "barrier")


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "trainer.doctor", *args], env=env, timeout_s=120)


def row(report: str, ranks: str, op: str, result: str) -> re.Match[str] | None:
    """A line of rank 0's results table: ranks ('all' or one rank), operation, result."""
    return re.search(rf"^{ranks}\s+{re.escape(op)}\s+{result}\b", report, re.MULTILINE)


def assert_passed(result: subprocess.CompletedProcess[str], rank: int = 0) -> None:
    assert result.returncode == 0, f"rank {rank}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"


def test_one_process_passes_every_check_it_can_run() -> None:
    result = doctor(*QUICK)

    assert_passed(result)
    assert row(result.stdout, "all", "cuda_driver", "(ok|skip)"), result.stdout  # this node's: see test_doctor_driver
    assert row(result.stdout, "all", "send_recv", "skip"), result.stdout
    for op in OPS[1:]:
        assert row(result.stdout, "all", op, "ok"), f"{op} missing or not ok:\n{result.stdout}"


def test_two_ranks_under_torchrun_pass_every_check_and_report_bandwidth() -> None:
    result = torchrun(QUICK, nproc=2, module="trainer.doctor", timeout_s=180)

    assert_passed(result)
    for op in OPS:
        assert row(result.stdout, "all", op, "ok"), f"{op} missing or not ok:\n{result.stdout}"
    for size in ("0.01", "0.1"):
        assert row(result.stdout, "all", f"all_reduce_sum {size} MB", "ok"), result.stdout
        assert re.search(rf"^{re.escape(size)}\s+[\d.]+\s+[\d.]+\s+[\d.]+$", result.stdout, re.MULTILINE), \
            f"no bandwidth row for {size} MB:\n{result.stdout}"
    assert "every check passed on 2 rank(s)" in result.stdout


def test_three_plain_env_ranks_pass_and_rank_zero_writes_the_json_report(tmp_path: Path) -> None:
    report_path = tmp_path / "doctor.json"

    results = env_ranks([*QUICK, "--json", str(report_path)], 3, module="trainer.doctor", timeout_s=180)

    for rank, result in enumerate(results):
        assert_passed(result, rank)
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["world_size"] == 3 and report["backend"] == "gloo"
    assert [env["rank"] for env in report["ranks"]] == [0, 1, 2]
    assert {(check["rank"], check["op"]) for check in report["checks"]} >= {(r, op) for r in range(3) for op in OPS}
    assert {check["status"] for check in report["checks"] if check["op"] != "cuda_driver"} == {"ok"}
    assert {check["rank"] for check in report["checks"] if check["op"] == "cuda_driver"} == {0, 1, 2}
    assert [entry["size_mb"] for entry in report["bandwidth"]] == [0.01, 0.1]
    for entry in report["bandwidth"]:
        assert entry["busbw_gbps"] == pytest.approx(entry["algbw_gbps"] * 2 * (3 - 1) / 3)


@pytest.mark.parametrize("op", ["all_gather", "gather"])
def test_a_wrong_value_fails_every_rank_and_names_the_sending_rank_and_the_operation(op: str) -> None:
    """Rank 1 sends wrong data in OP (tests/workers/doctor_fault.py). With gather only the root can tell,
    and it must still run the gather to the next root, or the ranks fall out of step and time out."""
    results = env_ranks([f"1:{op}", *QUICK], 2, module="tests.workers.doctor_fault", timeout_s=180)

    where = "from rank 1" if op == "all_gather" else "at root 0, from rank 1"
    for rank, result in enumerate(results):
        assert result.returncode == 1, f"rank {rank}: exit {result.returncode}\n{result.stderr}"
        assert (f"rank {rank}: FAILED: {op} on ranks 0, 1 ({where}: expected [2, 4, 6, 8], "
                f"got [1000002, 1000004, 1000006, 1000008]") in result.stderr, result.stderr
    table = results[0].stdout
    assert row(table, "0", op, "FAIL") and row(table, "1", op, "FAIL"), table
    for other in set(OPS) - {op}:
        assert row(table, "all", other, "ok"), f"{other} should still pass:\n{table}"


def test_a_rank_whose_driver_is_too_old_is_named_in_rank_zeros_table_and_no_rank_waits_for_it(tmp_path: Path) -> None:
    """Rank 1's CUDA cannot start on its driver (tests/workers/doctor_old_driver.py): it cannot join the group, so
    it tells the others through the store instead of leaving them waiting in the group until the rendezvous
    timeout."""
    results = env_ranks(["1", str(tmp_path), *QUICK], 2, module="tests.workers.doctor_old_driver", timeout_s=180)

    failure = "cuda_driver on rank 1 (CUDA cannot start on this node's GPUs (nvidia0), so --device auto would train on"
    for rank, result in enumerate(results):
        assert result.returncode == 1, f"rank {rank}: exit {result.returncode}\n{result.stderr}"
        assert f"rank {rank}: FAILED: {failure}" in result.stderr, result.stderr
    table = results[0].stdout
    assert "2 rank(s) on 1 host(s), group not joined" in table, table
    assert re.search(r"^1\s+1\s+0\s+\S+\s+env\s+none$", table, re.MULTILINE), table
    assert row(table, "1", "cuda_driver", r"FAIL\s+0\.00\s+CUDA cannot start"), table
    assert not row(table, "all", "send_recv", "ok"), "no collective runs without rank 1"


def test_bad_flags_exit_2_with_one_line_naming_the_flag() -> None:
    result = doctor("--sizes-mb", "1,-2")

    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == ("ddp-doctor: error: --sizes-mb '1,-2': expected positive sizes in MB separated "
                                     "by commas, e.g. 0.25,1,16")


def test_help_shows_the_doctors_own_collective_timeout() -> None:
    result = doctor("--help")

    assert result.returncode == 0 and "--collective-timeout-s" in result.stdout
    assert "(default: 60.0)" in " ".join(result.stdout.split())


def test_a_bad_launcher_environment_exits_2_with_one_line() -> None:
    result = doctor(env={"RANK": "5", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})

    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "RANK=5 is not below WORLD_SIZE=2" in result.stderr


def test_an_unreachable_master_exits_3_naming_its_address_and_port() -> None:
    closed_port = free_port()  # bound once and released: nothing listens there
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(closed_port)}

    result = doctor("--rendezvous-timeout-s", "1", env=env)

    assert result.returncode == 3, result.stderr
    assert f"master 127.0.0.1:{closed_port} not reachable" in result.stderr
