"""Which checkpoints stay: the newest --keep-last committed ones up to the one just written, the best one by the
monitored metric (--keep-best), and nothing a crashed or a failed save left. Nothing is decided on a storage error
(a folder whose manifest could not be read is left for the next save), and never on another job's folder (the lease
is checked first)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer.checkpoint.reading import MAX_MANIFEST_BYTES
from trainer.checkpoint.storage import MANIFEST, CheckpointStorage, saved_in_place, step_of
from trainer.config import CheckpointConfig
from trainer.errors import described
from trainer.redact import redact


@dataclass(frozen=True)
class Monitor:
    """The manifest metric --keep-best keeps the best checkpoint by."""

    metric: str
    mode: str  # "max" or "min"


class Retention:
    def __init__(self, storage: CheckpointStorage, config: CheckpointConfig, monitor: Monitor | None,
                 log: logging.Logger, check_lease: Callable[[], None]) -> None:
        self.storage = storage
        self.config = config
        self.monitor = monitor
        self.log = log
        self.check_lease = check_lease  # raises where the folder is no longer this job's, or cannot be told

    def prune(self, written: str) -> None:
        """Keep the newest ``keep_last`` committed checkpoints up to the one just written and, optionally,
        the most accurate of them.

        Folders of later steps are left alone: they are either broken ones this run skipped when
        resuming (each is replaced when training reaches its step) or another history the user chose
        to leave with --resume PATH; counting them would delete this run's good fallbacks. An object store's
        saves each have a folder of their own: other folders of the written step are replaced by it, and of two
        committed ones of an older step (a crash came between a save and this removal) the later save is kept.
        """
        self.check_lease()  # never prune another job's checkpoints
        current = step_of(written) or 0
        try:
            listed = self.storage.list_checkpoints()
        except Exception as error:  # noqa: BLE001 - any backend's error: the save stands, the next one prunes
            self.log.warning("checkpoint %s was committed; the older ones were not pruned: cannot list %s (%s)",
                             self.storage.describe(written), self.storage.describe(),
                             redact(described(error), self.storage.location))
            return
        older = [name for name in listed if (step_of(name) or 0) <= current]
        replaced = {name for name in older if step_of(name) == current and name != written}
        committed: list[tuple[str, dict[str, Any]]] = []
        unsure: set[str] = set()
        for name in older:
            if name in replaced:
                continue
            whole, manifest = self.whole(name)
            if whole is None:
                unsure.add(name)  # the storage did not answer (throttled, timed out): left for the next save
                continue
            if not whole:
                continue  # never committed, or its files gone: not counted, and removed below as unusable
            if any(step_of(name) == step_of(later) for later, _ in committed):  # newest first: a later save is kept
                replaced.add(name)
                continue
            committed.append((name, manifest))
        kept = ({name for name, _ in committed[: self.config.keep_last]} | {written} | unsure) - replaced
        if self.config.keep_best and self.monitor is not None:
            best = best_checkpoint(committed, self.monitor)
            if best is not None:
                kept.add(best)
        for name in older:
            if name in kept:
                continue
            try:
                self.storage.remove(name)
            except Exception as error:  # noqa: BLE001 - any backend's error: the next save tries again
                self.log.warning("could not remove old checkpoint %s: %s", self.storage.describe(name),
                                 redact(described(error), self.storage.location))

    def whole(self, name: str) -> tuple[bool | None, dict[str, Any]]:
        """Whether a folder holds a committed checkpoint whose files are all there (their sizes and checksums are
        ``verify``'s business), and its manifest: False without a readable manifest, or with a file it lists missing
        (a save committed in place whose files a later holder of the folder removed: it can never be whole); None
        where the storage did not answer (nothing is decided on that)."""
        try:
            if self.storage.size(name, MANIFEST) > MAX_MANIFEST_BYTES:
                return None, {}  # never read (verify refuses it too), nor removed: not what this trainer writes
            manifest = json.loads(self.storage.read(name, MANIFEST))
            present = set(self.storage.files(name))
        except (FileNotFoundError, ValueError):
            return False, {}
        except Exception:  # noqa: BLE001 - throttled, timed out, any backend's own error: unsure
            return None, {}
        listed = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(listed, dict) or not set(listed) <= present:
            return False, {}
        return True, manifest

    def remove_leftovers(self) -> None:
        """At the start: what saves that crashed left. Where the storage does not answer, it is left for the next
        start (nothing is decided on an error)."""
        try:
            for stale in self.storage.remove_temporaries():
                self.log.warning("removed %s, left by a save that did not finish", self.storage.describe(stale))
            self._remove_unfinished_saves()
        except Exception as error:  # noqa: BLE001 - any backend's error (throttled, timed out)
            self.log.warning("left what earlier saves may have left in %s for the next start: cannot list it (%s)",
                             self.storage.describe(), redact(described(error), self.storage.location))

    def _remove_unfinished_saves(self) -> None:
        """At the start, on the lease's holder: an object store's save folders that will never be whole (no
        manifest, or files missing), left by a save that crashed or by a job that lost the folder meanwhile."""
        for name in self.storage.list_checkpoints():
            if saved_in_place(name) and self.whole(name)[0] is False:
                try:
                    self.storage.remove(name)
                    self.log.warning("removed %s, left by a save that did not finish", self.storage.describe(name))
                except Exception as error:  # noqa: BLE001 - any backend's error, as in _prune: the next start tries
                    self.log.warning("could not remove %s, left by a save that did not finish: %s",
                                     self.storage.describe(name), redact(described(error), self.storage.location))


def best_checkpoint(committed: list[tuple[str, dict[str, Any]]], monitor: Monitor) -> str | None:
    """The checkpoint with the best value of the monitored metric in its manifest (format 2: test_accuracy)."""
    scored = []
    for name, manifest in committed:
        metrics = manifest.get("metrics") if isinstance(manifest.get("metrics"), dict) else {}
        if manifest.get("format") == 2 and "test_accuracy" in manifest:
            metrics = {"accuracy": manifest["test_accuracy"]}
        value = metrics.get(monitor.metric)
        if isinstance(value, int | float) and not isinstance(value, bool):
            scored.append((value if monitor.mode == "max" else -value, step_of(name) or 0, name))
    return max(scored)[2] if scored else None
