"""The lease's files: ``.lease/holder-<generation>.json``, each a record of the job that holds (or held) the
checkpoint folder (trainer.checkpoint.lease): who, where its pid means something, when it last renewed it, how it
took it, and its attempt's progress (trainer.checkpoint.attempts)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, fields

from trainer.checkpoint.attempts import Attempt
from trainer.launchers.base import kernel_boot_id

LEASE_FOLDER = ".lease"
HOLDER_FILE = re.compile(r"^holder-(\d{8,})\.json$")
ATTEMPT_FIELDS = {item.name: int if item.type == "int" else str for item in fields(Attempt)}


def holder_file(generation: int) -> str:
    return f"holder-{generation:08d}.json"


@dataclass(frozen=True)
class Holder:
    """What a lease file says about the job that holds it."""

    job: str
    host: str
    pid: int
    renewed_unix: float
    expires_after_s: float
    released: bool = False
    # Kept for the job's next attempt by a run that stopped (CheckpointManager.release_lease): no longer renewed,
    # by anyone, so once expired it is free without watching it first.
    kept: bool = False
    # Where its pid means something: the kernel's boot id and the process namespace (empty where unknown).
    boot: str = ""
    pid_namespace: str = ""
    took: str = ""  # from whom and why this holder took the lease, for the job it was taken from
    attempt: Attempt = field(default_factory=Attempt)  # its progress, for its job's next (trainer.checkpoint.attempts)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), indent=2).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Holder | None:
        """None for a file that is not (yet) a holder record."""
        try:
            raw = json.loads(data)
            return cls(str(raw["job"]), str(raw["host"]), int(raw["pid"]), float(raw["renewed_unix"]),
                       float(raw["expires_after_s"]), bool(raw.get("released", False)), bool(raw.get("kept", False)),
                       str(raw.get("boot", "")), str(raw.get("pid_namespace", "")), str(raw.get("took", "")),
                       Attempt(**{name: kind(value) for name, value in raw.get("attempt", {}).items()
                                  if (kind := ATTEMPT_FIELDS.get(name))}))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def process_place() -> tuple[str, str]:
    """This process's kernel boot id and pid namespace ("" where unknown: not Linux): two records that agree on
    both were written where a pid names the same process."""
    try:
        return kernel_boot_id(), os.readlink("/proc/self/ns/pid")
    except OSError:
        return "", ""
