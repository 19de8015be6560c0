"""trainer.checkpoint.node_copy: one download per node of an object store's state file, shared by the node's ranks
(here threads, whose separate opens of the lock exclude each other as processes' do), in a folder of this user's
alone; a failed download leaves nothing a later one would take for whole."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest

from trainer.checkpoint import node_copy


def fetched(key: str, size: int, download: Callable[[IO[bytes]], object]) -> str:
    path = node_copy.copy_path(key)
    assert path is not None
    node_copy.fetch(path, size, download)  # type: ignore[arg-type]
    return path


@pytest.fixture(autouse=True)
def own_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    return tmp_path


def test_the_ranks_of_a_node_share_one_download_removed_once_released(own_tmpdir):
    downloads: list[int] = []

    def download(handle: IO[bytes]) -> None:
        downloads.append(1)
        time.sleep(0.3)  # the other rank asks meanwhile: it waits for this copy, then maps it
        handle.write(b"x" * 100)

    found: list[str | None] = []
    ranks = [threading.Thread(target=lambda: found.append(fetched("key", 100, download))) for _ in range(2)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(10)
    assert len(downloads) == 1 and len(found) == 2 and None not in found
    [path] = set(found)
    assert path is not None
    folder = Path(path).parent
    assert folder == own_tmpdir / f"ddp-deploy-{os.getuid()}" and folder.stat().st_mode & 0o777 == 0o700
    assert Path(path).read_bytes() == b"x" * 100
    node_copy.release(path)
    assert list(folder.iterdir()) == []


def test_a_failed_download_leaves_no_copy_and_the_next_one_downloads_again():
    def failing(handle: IO[bytes]) -> None:
        handle.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        fetched("key", 100, failing)
    copy = fetched("key", 100, lambda handle: handle.write(b"y" * 100))
    assert copy is not None and Path(copy).read_bytes() == b"y" * 100
    assert sorted(entry.name for entry in Path(copy).parent.iterdir()) == [f"{node_copy.PREFIX}key.pt",
                                                                          f"{node_copy.PREFIX}key.pt.lock"]


def test_a_partial_download_of_a_rank_killed_meanwhile_is_removed_by_the_next_one(own_tmpdir):
    folder = own_tmpdir / f"ddp-deploy-{os.getuid()}"
    folder.mkdir(mode=0o700)
    dead = folder / f"{node_copy.PREFIX}key.pt.partial-{os.getpid()}"
    dead.write_bytes(b"half")  # its process is gone: the lock it held went with it
    copy = fetched("key", 1, lambda handle: handle.write(b"w"))
    assert copy is not None and not dead.exists()


def test_each_resume_and_host_has_a_copy_of_its_own():
    first = node_copy.copy_key("s3://bucket/ckpt", "step-1", "state.pt", "10", "0badc0de", "resume-a")
    assert first != node_copy.copy_key("s3://bucket/ckpt", "step-1", "state.pt", "10", "0badc0de", "resume-b")
    assert "bucket" not in first and len(first) == 24


def test_a_folder_another_user_could_write_into_is_not_used(own_tmpdir):
    folder = own_tmpdir / f"ddp-deploy-{os.getuid()}"
    folder.mkdir(mode=0o700)
    folder.chmod(0o777)  # as another user could have made it, or left it open
    assert node_copy.copy_path("key") is None
    assert list(folder.iterdir()) == []


def test_a_copy_left_by_a_crash_a_day_ago_is_removed_by_the_next_download(own_tmpdir):
    first = fetched("old", 1, lambda handle: handle.write(b"o"))
    old = time.time() - node_copy.STALE_AFTER_S - 60
    os.utime(first, (old, old))
    fetched("new", 1, lambda handle: handle.write(b"n"))
    assert not os.path.exists(first)
