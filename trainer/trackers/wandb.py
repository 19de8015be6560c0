"""--tracker wandb: Weights & Biases, online or offline (WANDB_MODE=offline: no network, files to sync later).

W&B reads its own environment (WANDB_API_KEY, WANDB_MODE, WANDB_ENTITY, WANDB_DIR, ...), which nothing here
reads or writes. Its files go to OUTPUT_DIR/wandb unless WANDB_DIR says otherwise.

Mapping: the config and task are the run's config (nested as config.yaml); each metrics record is one history
row with its optimizer step as ``trainer/step``, declared the x-axis of every metric (W&B's own row counter must
only grow, and a resumed run may repeat a step the checkpoint came before); summary.json's numbers are the run's
summary. A resume continues the checkpoint's run id (``resume="allow"``). Offline W&B does not resume: each
segment is a folder of its own with the same id and a row counter that starts again at 0 (``trainer/step`` goes
on); ``wandb sync`` of all of them in one call uploads them in order of start (W&B 0.31's help; what a server
makes of it is not tested here: docs/tracking.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from trainer.redact import redact
from trainer.seams import TRACKERS
from trainer.tracking import FINISHED, KILLED, Tracker, TrackerRun

DEFAULT_PROJECT = "ddp-deploy"
STEP = "trainer/step"
EXIT_CODES = {FINISHED: 0, KILLED: 143}  # FAILED: 1


class WandbTracker(Tracker):
    def __init__(self) -> None:
        self.run: Any = None
        self.mode = ""

    def describe(self) -> str:
        return f"W&B, {self.mode}" if self.mode else ""

    def load(self) -> None:
        import wandb  # noqa: F401 - imported late: an extra (pip install 'ddp-deploy[wandb]')

    def start(self, run: TrackerRun, log: logging.Logger) -> str:
        import wandb  # loaded by load()

        folder = Path(os.environ.get("WANDB_DIR") or run.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(init_timeout=run.settings.tracker_timeout_s, console="off", silent=True)
        with _command_line_redacted():
            self.run = wandb.init(project=run.experiment or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                                  name=run.name, id=run.resume_id, resume="allow", dir=str(folder),
                                  settings=settings)
        self.mode = "offline" if self.run.offline else "online"
        self.run.config.update(run.params, allow_val_change=True)  # a resume may change settings
        if run.forked_from:
            self.run.config.update({"ddp_deploy_forked_from": run.forked_from}, allow_val_change=True)
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)
        return str(self.run.id)

    def log_metrics(self, kind: str, step: int, values: Mapping[str, float], made_at: float) -> None:
        # W&B stamps a record itself, when it is logged; trainer/step orders them (made_at has no public field).
        self.run.log({STEP: step, **{f"{kind}/{key}": value for key, value in values.items()}})

    def log_summary(self, summary: Mapping[str, float], files: tuple[Path, ...]) -> None:
        self.run.summary.update({f"final/{key}": value for key, value in summary.items()})

    def end(self, status: str) -> None:
        self.run.finish(exit_code=EXIT_CODES.get(status, 1))


@contextlib.contextmanager
def _command_line_redacted() -> Iterator[None]:
    """W&B records the command line (sys.argv) in its run's metadata as it is, a --tracking-uri's password or a
    --data-dir URL's token included; it reads it while init() runs, which the training thread waits for."""
    original = sys.argv
    sys.argv = [redact(argument) for argument in original]
    try:
        yield
    finally:
        sys.argv = original


TRACKERS.add("wandb", WandbTracker, "Weights & Biases, online or offline (its WANDB_* environment variables)")
