"""Reading a checkpoint's files as its manifest describes them: the manifest itself, and any file checked against
the size and CRC-32 the manifest promises. What is wrong is said in one line (InvalidCheckpoint: the folder is
skipped, an older one tried; UnknownFormat: refused, never skipped)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from trainer.checkpoint.save_failures import is_transient
from trainer.checkpoint.schema import READABLE
from trainer.checkpoint.storage import MANIFEST, CheckpointStorage, NotAFile, crc32_hex
from trainer.checkpoint.storage.checksum import crc32
from trainer.errors import CheckpointError, StorageUnavailable

STATE_FILE = "state.pt"
# Ours are well under 4 KB; a larger one is not read (it could be anything, of any size).
MAX_MANIFEST_BYTES = 1 << 20
# torch.distributed.checkpoint's own name for its metadata file: the one file name with a dot that a manifest
# may list (any other is refused as something that is no part of a checkpoint).
DCP_METADATA = ".metadata"
# A local file's checksum is taken in pieces of this size: the check never holds the file.
CHECK_PIECE = 16 << 20


class InvalidCheckpoint(Exception):
    """Why one checkpoint folder cannot be used (it is skipped, the next older one is tried)."""


class StorageUnreadable(StorageUnavailable):
    """A checkpoint's file that the storage did not return (an I/O error, a throttled or unreachable store): nothing
    is decided on it, the checkpoint is neither skipped for an older one nor taken; the resume stops in one line,
    with exit 200 (the restarted job finds the store answering)."""


def unreadable(filename: str, error: OSError) -> Exception:
    """What a failed read of one of the checkpoint's files means: a file gone is the checkpoint's fault (skipped for
    an older one); any other error the storage's, which may not repeat (the resume stops: StorageUnreadable, or a
    CheckpointError where no retry fixes it, no permission)."""
    if isinstance(error, FileNotFoundError):
        return InvalidCheckpoint(f"{filename} is missing (the manifest lists it)")
    return storage_failure(f"{filename} unreadable ({error.strerror or error}); the checkpoint is not skipped for an "
                           f"older one on an error the storage may not repeat: start the run again once it answers, "
                           f"or pass --resume with another checkpoint or none", error)


def storage_failure(said: str, error: BaseException) -> CheckpointError:
    """A read the storage failed, which stops the resume (never skipped for an older checkpoint): StorageUnreadable
    (exit 200) where a retry may read it, else CheckpointError (exit 2)."""
    return (StorageUnreadable if is_transient(error) else CheckpointError)(said)


class UnknownFormat(Exception):
    """A checkpoint in a format this trainer cannot read: refused, never skipped, so that a format change
    cannot make ``--resume latest`` quietly start afresh and prune the checkpoints it could not read."""


def expected(manifest: dict[str, Any], filename: str) -> tuple[int, str]:
    """The size and CRC-32 the manifest promises for one of the checkpoint's files."""
    try:
        entry = manifest["files"][filename]
        return int(entry["bytes"]), str(entry["crc32"])
    except (KeyError, TypeError, ValueError):
        raise InvalidCheckpoint(f"{MANIFEST} does not describe {filename}") from None


def checked_read(storage: CheckpointStorage, name: str, filename: str, manifest: dict[str, Any]) -> bytes:
    """One of the checkpoint's files, its size and checksum those the manifest promises."""
    size, checksum = expected(manifest, filename)
    try:
        # The size first: a file that is not what the manifest promises is not read at all.
        check_size(storage, name, filename, size)
        data = storage.read(name, filename)
    except NotAFile as problem:
        raise InvalidCheckpoint(str(problem)) from None
    except OSError as error:
        raise unreadable(filename, error) from None
    if len(data) != size:
        raise InvalidCheckpoint(f"{filename} has {len(data)} bytes, the manifest says {size}")
    if crc32_hex(data) != checksum:
        raise InvalidCheckpoint(f"{filename} does not match the manifest's crc32 checksum (corrupted)")
    return data


def checked_pieces(storage: CheckpointStorage, name: str, filename: str, manifest: dict[str, Any],
                   keep: Callable[[bytes], None] = lambda piece: None) -> None:
    """``checked_read`` in pieces of CHECK_PIECE bytes, each handed to ``keep`` as it is read (a local copy of an
    object store's file), never the whole file held."""
    size, checksum = expected(manifest, filename)
    check_size(storage, name, filename, size)
    crc, done = 0, 0
    while done < size:
        try:
            piece = storage.read_range(name, filename, done, min(CHECK_PIECE, size - done))
        except OSError as error:
            raise unreadable(filename, error) from None
        if not piece:
            break
        keep(piece)
        crc, done = crc32(piece, crc), done + len(piece)
    if done != size:
        raise InvalidCheckpoint(f"{filename} has {done} bytes, the manifest says {size}")
    if f"{crc:08x}" != checksum:
        raise InvalidCheckpoint(f"{filename} does not match the manifest's crc32 checksum (corrupted)")


def check_size(storage: CheckpointStorage, name: str, filename: str, size: int) -> None:
    """That the file is one of the folder's own, there, with ``size`` bytes (what a resume checks before it reads
    the files each rank reads and checks itself)."""
    if not is_plain_name(filename):
        raise InvalidCheckpoint(f"{MANIFEST} names a file outside the checkpoint folder ({filename!r})")
    try:
        found = storage.size(name, filename)
    except NotAFile as problem:
        raise InvalidCheckpoint(str(problem)) from None
    except OSError as error:
        raise unreadable(filename, error) from None
    if found != size:
        raise InvalidCheckpoint(f"{filename} has {found} bytes, the manifest says {size}")


def is_plain_name(filename: str) -> bool:
    """A file directly in the checkpoint folder (no path, no hidden file but DCP's metadata)."""
    return bool(filename) and "/" not in filename and "\\" not in filename and (
        not filename.startswith(".") or filename == DCP_METADATA)


def read_manifest(storage: CheckpointStorage, name: str) -> tuple[dict[str, Any], int]:
    """The manifest and its format; its entry for the state file checked here, where its faults have their
    messages (the file itself is read by _checked_read)."""
    try:
        if storage.size(name, MANIFEST) > MAX_MANIFEST_BYTES:
            raise InvalidCheckpoint(f"{MANIFEST} is larger than any manifest this trainer writes "
                                    f"({MAX_MANIFEST_BYTES} bytes at most)")
        manifest = json.loads(storage.read(name, MANIFEST))
        expected = manifest["files"][STATE_FILE]
        int(expected["bytes"]), str(expected["crc32"])  # both present, the size a number: or the errors below
        version = manifest.get("format")
    except NotAFile as problem:
        raise InvalidCheckpoint(str(problem)) from None
    except FileNotFoundError:
        raise InvalidCheckpoint(f"{MANIFEST} is missing") from None
    except OSError as error:
        raise unreadable(MANIFEST, error) from None
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError included
        raise InvalidCheckpoint(f"{MANIFEST} is not valid JSON ({error})") from None
    except KeyError as error:
        raise InvalidCheckpoint(f"{MANIFEST} has no {error} entry") from None
    except (TypeError, AttributeError):
        raise InvalidCheckpoint(f"{MANIFEST} does not have the layout this trainer writes") from None
    if version not in READABLE:
        newer = isinstance(version, int) and version > max(READABLE)
        raise UnknownFormat(
            f"{storage.describe(name)} is in checkpoint format {version!r}, which this trainer cannot read (it reads "
            f"{', '.join(map(str, READABLE))})" + ("; it was written by a newer ddp-deploy: upgrade this one" if newer
                                                   else "") + "; or pass --resume none or another --checkpoint-dir to "
            "start afresh (the checkpoints there are kept)")
    return manifest, version


def load_failure(error: Exception) -> str:
    """The one informative sentence of torch.load's error (its weights_only message is a page long)."""
    text = str(error)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    first = (text.strip().splitlines() or [type(error).__name__])[0]
    return first.split(". ", 1)[0].rstrip(".")[:300]


def agree(group: Any, error: str | None, stops: bool = False, transient: bool = False) -> None:
    """Every rank's outcome of what it read alone before a collective read (DCP's, or the next step of a resume):
    the first failure raised on every rank (a rank that quit alone would leave the others waiting in a collective
    until its timeout). ``stops``: the failure is this machine's (its disk, its network), not the checkpoint's,
    raised as CheckpointError so that the resume stops rather than try an older checkpoint; ``transient``: and a
    retry may read it (StorageUnreadable, exit 200). ``group`` None: this rank alone."""
    outcome = (error, stops, transient) if error else None
    if dist.is_initialized() and group is not None:
        everyone: list[Any] = [None] * dist.get_world_size(group)
        try:
            dist.all_gather_object(everyone, outcome, group=group)
        except Exception as failure:  # noqa: BLE001 - gloo's own (a timeout, a peer gone): said in one line
            raise CheckpointError(f"the ranks could not compare what each read of the checkpoint "
                                  f"({' '.join(str(failure).split())[:200]}): a rank was lost, or took longer than "
                                  f"--checkpoint-timeout-s to read its part") from None
        outcome = next((found for found in everyone if found), None)
    if outcome:
        message, stops, transient = outcome
        raise (StorageUnreadable if transient else CheckpointError if stops else InvalidCheckpoint)(message)
