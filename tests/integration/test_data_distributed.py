"""load_datasets across real processes: one fetch or download per node, and one failure failing every rank."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from devtools.processes import REPO_ROOT, clean_env, free_port, torchrun
from tests.support.data_files import write_idx_dataset
from trainer.data.locate import cache_folder
from trainer.errors import EXIT_USAGE

LOADER = "tests.workers.data_load"


def rank_lines(output: str, rank: int, kind: str) -> list[str]:
    return re.findall(rf"^\[rank {rank}\] {kind}(.*)$", output, flags=re.MULTILINE)


def fail_on_two_local_ranks(*flags: str, env: dict[str, str] | None = None) -> str:
    """Start both ranks of one node as torchrun would, minus its agent so that each exit code is seen.

    Asserts that both exit with the usage code and print one identical error; returns that error.
    """
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, "-m", LOADER, *flags], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         env=clean_env({**(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}))
        for rank in (0, 1)
    ]
    try:
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    errors = [rank_lines(output, rank, "error: ") for rank, output in enumerate(outputs)]
    assert [proc.returncode for proc in procs] == [EXIT_USAGE, EXIT_USAGE], outputs
    assert errors[0] == errors[1] and len(errors[0]) == 1, outputs
    return errors[0][0]


def test_only_local_rank_0_fetches_from_a_url(tmp_path: Path) -> None:
    write_idx_dataset(tmp_path / "bucket")
    url, cache = (tmp_path / "bucket").as_uri(), tmp_path / "cache"
    result = torchrun(["--data-dir", url, "--data-cache-dir", str(cache)], nproc=2, module=LOADER, timeout_s=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(rank_lines(result.stdout, 0, "trainer.data.fetch: fetched 4 of 4 fashion-mnist files")) == 1
    assert rank_lines(result.stdout, 1, "trainer.data.fetch") == []
    loaded = [rank_lines(result.stdout, rank, "loaded ") for rank in (0, 1)]
    assert loaded[0] == loaded[1] == ["fashion-mnist: 40 train, 20 test, label sum 180"]
    assert sorted(p.name for p in cache_folder(url, str(cache)).iterdir()) == sorted(
        f"{name}.gz" for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                                  "t10k-labels-idx1-ubyte"))


def test_a_url_without_the_dataset_fails_every_rank_with_the_same_error(tmp_path: Path) -> None:
    (tmp_path / "bucket").mkdir()
    url = (tmp_path / "bucket").as_uri()
    error = fail_on_two_local_ranks("--data-dir", url, "--data-cache-dir", str(tmp_path / "cache"))
    assert f"--data-dir {url}: no fashion-mnist files" in error


def test_download_without_network_fails_every_rank_with_the_same_error(tmp_path: Path) -> None:
    # Every request goes to a local port where nothing listens: refused at once, no real network used.
    dead_proxy = f"http://127.0.0.1:{free_port()}"
    env = {"http_proxy": dead_proxy, "https_proxy": dead_proxy, "no_proxy": "", "NO_PROXY": ""}
    error = fail_on_two_local_ranks("--dataset", "mnist", "--data-dir", str(tmp_path / "mnist"), "--download", env=env)
    assert f"--download: could not download mnist into {tmp_path / 'mnist'}" in error
    assert "run without --download" in error


def test_a_corrupt_file_on_one_rank_fails_every_rank_with_its_name(tmp_path: Path) -> None:
    write_idx_dataset(good := tmp_path / "good")
    write_idx_dataset(bad := tmp_path / "bad")
    (bad / "t10k-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8b damaged")
    error = fail_on_two_local_ranks("--data-dir", str(good), env={"DATA_TEST_DATA_DIR_RANK_1": str(bad)})
    assert f"{bad / 't10k-labels-idx1-ubyte.gz'}: not a valid gzip file" in error
    assert "(seen by rank 1 on " in error
