"""trainer.checkpoint.node_copy: one download per node of an object store's state file, shared by the node's ranks
(here threads, whose separate opens of the lock exclude each other as processes' do), in a folder of this user's
alone; a failed download leaves nothing a later one would take for whole."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import IO

import pytest

from trainer.checkpoint import node_copy


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

    found: list[tuple[str, bool] | None] = []
    ranks = [threading.Thread(target=lambda: found.append(node_copy.fetch("key", 100, download))) for _ in range(2)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(10)
    assert len(downloads) == 1 and len(found) == 2 and all(copy is not None for copy in found)
    paths = {copy[0] for copy in found if copy}
    assert len(paths) == 1 and sorted(copy[1] for copy in found if copy) == [False, True]
    [path] = paths
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
        node_copy.fetch("key", 100, failing)
    copy = node_copy.fetch("key", 100, lambda handle: handle.write(b"y" * 100))
    assert copy is not None and copy[1] and Path(copy[0]).read_bytes() == b"y" * 100
    assert sorted(entry.name for entry in Path(copy[0]).parent.iterdir()) == [f"{node_copy.PREFIX}key.pt",
                                                                             f"{node_copy.PREFIX}key.pt.lock"]


def test_a_folder_another_user_could_write_into_is_not_used(own_tmpdir):
    folder = own_tmpdir / f"ddp-deploy-{os.getuid()}"
    folder.mkdir(mode=0o700)
    folder.chmod(0o777)  # as another user could have made it, or left it open
    assert node_copy.fetch("key", 1, lambda handle: handle.write(b"z")) is None
    assert list(folder.iterdir()) == []


def test_a_copy_left_by_a_crash_a_day_ago_is_removed_by_the_next_download(own_tmpdir):
    first = node_copy.fetch("old", 1, lambda handle: handle.write(b"o"))
    assert first is not None
    old = time.time() - node_copy.STALE_AFTER_S - 60
    os.utime(first[0], (old, old))
    node_copy.fetch("new", 1, lambda handle: handle.write(b"n"))
    assert not os.path.exists(first[0])
