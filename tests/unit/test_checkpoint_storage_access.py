"""A checkpoint folder the trainer may not write: refused at start in one line that says who the process is and who
owns the folder, the two facts a file share mounted with another owner needs fixing (docs/kubernetes.md, Storage).
Tested for real: a forked child drops root for nobody and meets the kernel's own refusal."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from trainer.checkpoint.storage.local import LocalStorage
from trainer.errors import CheckpointError

NOBODY = 65534


def test_a_folder_owned_by_another_user_is_refused_naming_both_users():
    if os.getuid() != 0:
        pytest.fail("this test drops root for nobody: run it as root, as CI does")
    with tempfile.TemporaryDirectory(dir="/tmp") as scratch:  # pytest's own folders are closed to other users
        os.chmod(scratch, 0o755)
        share = Path(scratch) / "share"
        share.mkdir(mode=0o755)
        message = _check_as_nobody(share)
    assert message.startswith(f"checkpoint folder {share / 'ckpt'} is not writable (Permission denied): this process "
                              f"runs as uid {NOBODY}, gid {NOBODY} (groups none more), and {share} is owned by uid 0, "
                              f"gid 0, mode 755; give this user write access there"), message
    assert "docs/kubernetes.md" in message and "\n" not in message


def _check_as_nobody(share: Path) -> str:
    """check_writable in a forked child that runs as nobody; its message, or what else went wrong."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        message = "no error"
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            LocalStorage(str(share / "ckpt")).check_writable()
        except CheckpointError as error:
            message = str(error)
        except BaseException as error:  # noqa: BLE001 - anything else is the test's failure, reported
            message = f"unexpected {error!r}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        message = pipe.read()
    os.waitpid(child, 0)
    return message
