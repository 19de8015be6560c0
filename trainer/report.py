"""What training tells people: rank-tagged log lines, a progress bar or periodic lines on rank 0,
metrics as JSON lines and TensorBoard events, and the final summary."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from trainer.errors import OutputError
from trainer.launchers import DistIdentity
from trainer.redact import redact


def setup_logging(identity: DistIdentity, stream: TextIO | None = None) -> logging.Logger:
    """One logger for the process; every line carries the rank, so interleaved logs stay readable."""
    log = logging.getLogger("trainer")
    log.handlers.clear()
    handler = logging.StreamHandler(stream or sys.stderr)  # the stream of now, not of import time
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s [rank {identity.rank}/{identity.world_size}] %(levelname)s %(message)s", "%H:%M:%S"))
    handler.addFilter(_redact_record)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    return log


def _redact_record(record: logging.LogRecord) -> bool:
    """No URL's password or token reaches a log line, whichever message carries it."""
    record.msg, record.args = redact(record.getMessage()), None
    return True


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """A failed write of the run's own output (a full disk, a read-only folder) as one line that says what to
    do; callers agree on it across ranks (trainer.distributed.agreed), so that every rank exits alike."""
    try:
        yield
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = f"free space on {path.parent} or choose another --output-dir"
        else:
            fix = f"fix the permissions of {path.parent} or choose another --output-dir"
        raise OutputError(f"cannot write {path} ({error.strerror or error}); {fix}") from None


def seconds_since_process_start() -> float | None:
    """How long this process has run, from the kernel's record of its start (Linux; None elsewhere): what a
    resume's record counts its start-up from (interpreter, imports, the process group)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
        start_ticks = int(fields[19])  # field 22 of proc(5), counted from the state (field 3)
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class MetricsWriter:
    """Rank 0's metrics sink: appends to metrics.jsonl (a resumed run continues the same file) and writes
    TensorBoard scalars. Other ranks get ``enabled=False`` and write nothing. A failed write raises
    OutputError."""

    def __init__(self, output_dir: Path, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.jsonl_path, self.tensorboard_path = output_dir / "metrics.jsonl", output_dir / "tensorboard"
        self._jsonl: TextIO | None = None
        self._tensorboard: Any = None
        self._previous_excepthook = threading.excepthook
        if not enabled:
            return
        with writing(self.jsonl_path):
            output_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # imported late: it pulls in TensorBoard

            with writing(self.tensorboard_path):
                self._tensorboard = SummaryWriter(log_dir=str(self.tensorboard_path))
            # TensorBoard's writer thread keeps a write error for the next call (a one-line OutputError
            # here) and also lets it escape the thread, which would print a traceback; that copy is hidden.
            threading.excepthook = self._hide_tensorboard_write_errors

    def write(self, kind: str, step: int, values: dict[str, float | int]) -> None:
        if not self.enabled:
            return
        assert self._jsonl is not None
        with writing(self.jsonl_path):
            self._jsonl.write(json.dumps({"kind": kind, "step": step, "time": round(time.time(), 3), **values})
                              + "\n")
            self._jsonl.flush()
        if self._tensorboard is not None:
            # TensorBoard writes in a thread of its own; its failure comes back at the next call.
            with writing(self.tensorboard_path):
                for key, value in values.items():
                    self._tensorboard.add_scalar(f"{kind}/{key}", value, step)

    def _hide_tensorboard_write_errors(self, args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        self._previous_excepthook(args)

    def close(self) -> None:
        """Best effort: every record was flushed when written; an error here would reach one rank only."""
        with contextlib.suppress(OSError):
            if self._jsonl is not None:
                self._jsonl.close()
            if self._tensorboard is not None:
                self._tensorboard.close()
        if self._tensorboard is not None:
            threading.excepthook = self._previous_excepthook


class ProgressDisplay:
    """A tqdm bar on rank 0 when attached to a terminal (or forced on); plain periodic lines otherwise."""

    def __init__(self, mode: str, enabled: bool, log: logging.Logger, stream: TextIO | None = None) -> None:
        self.log = log
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.use_bar = enabled and (mode == "on" or (mode == "auto" and self.stream.isatty()))
        self._bar: Any = None

    def start_epoch(self, epoch: int, epochs: int, total_steps: int, done_steps: int) -> None:
        if self.use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=done_steps, desc=f"epoch {epoch + 1}/{epochs}",
                             unit="step", file=self.stream, dynamic_ncols=True, leave=True)

    def step(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def show_loss(self, loss: float) -> None:
        """The last log window's loss, beside the bar: a value already read, at a log step."""
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def line(self, text: str) -> None:
        """A periodic metrics line: logged when there is no bar, shown above the bar otherwise."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            self.log.info(text)

    def end_epoch(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def write_summary(output_dir: Path, summary: dict[str, Any]) -> Path:
    path = output_dir / "summary.json"
    with writing(path):
        output_dir.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".json.tmp")
        temporary.write_text(json.dumps(summary, indent=2) + "\n")
        temporary.replace(path)
    return path


def final_line(summary: dict[str, Any]) -> str:
    """``final test accuracy 0.9050 (loss 0.2712, 10000 samples, world size 2)``: the task's metrics, then the loss."""
    metrics = summary["test_metrics"]
    shown = ", ".join(f"{name} {value:.4f}" for name, value in metrics.items() if name not in ("loss", "samples"))
    return (f"final test {shown + ' (' if shown else '('}loss {metrics['loss']:.4f}, {metrics['samples']} samples, "
            f"world size {summary['world_size']})")
