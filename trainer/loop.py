"""The training loop: steps, evaluation, checkpoints at the right moments, exact resume, preemption."""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.build import TrainingSetup, seed_everything
from trainer.checkpoint import CheckpointManager, LoadedCheckpoint
from trainer.checkpoint.state import restore_rng
from trainer.config import Config
from trainer.distributed import Runtime
from trainer.errors import CheckpointError, Preempted, first_line
from trainer.gradsync import broadcast_buffers, unwrap
from trainer.position import TrainingPosition
from trainer.preemption import PreemptionWatcher
from trainer.report import MetricsWriter, ProgressDisplay


@dataclass
class EvalResult:
    accuracy: float
    loss: float
    samples: int


def evaluate(model: nn.Module, setup: TrainingSetup, runtime: Runtime) -> EvalResult:
    """Every test sample counted exactly once: each rank scores its own shard (no padding), then one
    all-reduce adds the totals. Ranks may have different batch counts, so no collective runs inside
    the loop, and the plain module is used (DDP's forward would broadcast buffers)."""
    broadcast_buffers(model, runtime)
    plain = unwrap(model)
    plain.eval()
    # Totals stay on the device: a .item() per batch would wait for the GPU at every batch.
    totals = torch.zeros(3, dtype=torch.float64, device=runtime.device)
    with torch.no_grad(), setup.autocast(runtime.device):
        for images, labels in setup.test_loader:
            images, labels = images.to(runtime.device, non_blocking=True), labels.to(runtime.device)
            logits = plain(images).float()
            totals[0] += nn.functional.cross_entropy(logits, labels, reduction="sum").double()
            totals[1] += (logits.argmax(dim=1) == labels).sum()
            totals[2] += labels.numel()
    plain.train()
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return EvalResult(accuracy=correct / max(count, 1), loss=loss_sum / max(count, 1), samples=int(count))


class Trainer:
    def __init__(self, config: Config, runtime: Runtime, setup: TrainingSetup, checkpoints: CheckpointManager,
                 watcher: PreemptionWatcher, log: logging.Logger) -> None:
        self.config = config
        self.runtime = runtime
        self.setup = setup
        self.checkpoints = checkpoints
        self.watcher = watcher
        self.log = log
        self.position = TrainingPosition()
        self.resumed_from: str | None = None
        self.output_dir = Path(config.output.output_dir)
        self.metrics = MetricsWriter(self.output_dir, runtime.is_main, config.output.tensorboard)
        self.progress = ProgressDisplay(config.output.progress, runtime.is_main, log)
        self._last_saved_step = -1
        self._sample_log = None
        if config.output.sample_log:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._sample_log = open(  # noqa: SIM115 - closed in close()
                self.output_dir / f"samples-rank{runtime.identity.rank}.jsonl", "a", encoding="utf-8")

    # -- resume --------------------------------------------------------------------------------------------
    def restore(self, loaded: LoadedCheckpoint) -> None:
        state = loaded.state
        saved_model = state["config"]["model"]["model"]
        if saved_model != self.config.model.model:
            raise CheckpointError(
                f"checkpoint {loaded.location} holds a {saved_model!r} model but this run trains "
                f"{self.config.model.model!r}; pass --model {saved_model}, another --checkpoint-dir, or --resume none"
            )
        try:
            unwrap(self.setup.model).load_state_dict(state["model"])
            self.setup.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as error:
            raise CheckpointError(
                f"checkpoint {loaded.location} does not fit this model ({first_line(error)}); it was written with a "
                f"different dataset or model configuration: use another --checkpoint-dir or --resume none"
            ) from None
        self.setup.scaler.load_state_dict(state["scaler"])
        self.position = TrainingPosition.from_dict(state["position"])
        self._last_saved_step = self.position.step
        identity = self.runtime.identity
        if state["world_size"] == identity.world_size:
            restore_rng(state["rng"][identity.rank])
        else:
            # Ranks are not the same processes any more: give each a fresh stream derived from where
            # training stands. The data order does not depend on it (it is seeded by the epoch).
            seed_everything(self.config.train.seed + 1_000_003 * self.position.step + identity.rank)
            self.log.info("resuming a %d-rank checkpoint with %d ranks at sample %d of epoch %d",
                          state["world_size"], identity.world_size, self.position.samples_in_epoch,
                          self.position.epoch + 1)
        self.resumed_from = loaded.location
        if self.position.epoch >= self.config.train.epochs:
            self.log.info("resumed from %s: all %d epochs are done (step %d); evaluating only", loaded.location,
                          self.config.train.epochs, self.position.step)
        else:
            self.log.info("resumed from %s: epoch %d, step %d, %d samples into the epoch", loaded.location,
                          self.position.epoch + 1, self.position.step, self.position.samples_in_epoch)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save_checkpoint(self, test_accuracy: float | None = None) -> None:
        # An epoch-end save replaces a --checkpoint-every save of the same step: it adds the test
        # accuracy (for --keep-best) and the completed epoch.
        if self.position.step == self._last_saved_step and test_accuracy is None:
            return
        broadcast_buffers(self.setup.model, self.runtime)
        state: dict[str, Any] = {
            "model": unwrap(self.setup.model).state_dict(),
            "optimizer": self.setup.optimizer.state_dict(),
            "scheduler": self.setup.schedule.state_dict(),
            "scaler": self.setup.scaler.state_dict(),
            "position": self.position.to_dict(),
            "config": self.config.to_dict(),
            "world_size": self.runtime.identity.world_size,
        }
        manifest = {"step": self.position.step, "epoch": self.position.epoch,
                    "samples_in_epoch": self.position.samples_in_epoch,
                    "world_size": self.runtime.identity.world_size, "model": self.config.model.model,
                    "dataset": self.config.data.dataset}
        if test_accuracy is not None:
            manifest["test_accuracy"] = test_accuracy
        self.checkpoints.save(state, manifest)
        self._last_saved_step = self.position.step

    # -- training ------------------------------------------------------------------------------------------
    def fit(self) -> EvalResult:
        config, setup, runtime = self.config, self.setup, self.runtime
        world_size = runtime.identity.world_size
        result: EvalResult | None = None
        while self.position.epoch < config.train.epochs and not self._reached_max_steps():
            epoch = self.position.epoch
            setup.train_sampler.set_epoch(epoch, start_sample=self.position.samples_in_epoch)
            batches = len(setup.train_loader)
            accum = config.optim.grad_accum_steps
            per_batch = config.train.batch_size * world_size
            full_epoch_batches = math.ceil(len(setup.train_sampler.dataset) / per_batch)
            self.progress.start_epoch(epoch, config.train.epochs, math.ceil(full_epoch_batches / accum),
                                      self.position.samples_in_epoch // per_batch // accum)
            window = _Window(runtime.device)
            batch_order = self._batch_order() if self._sample_log else None
            micro = 0
            for index, (images, labels) in enumerate(setup.train_loader):
                group_size = min(accum, batches - (index - micro))
                final_micro = micro + 1 == group_size
                images = images.to(runtime.device, non_blocking=True)
                labels = labels.to(runtime.device, non_blocking=True)
                context = setup.sync.no_sync(setup.model) if not final_micro else nullcontext()
                with context:
                    with setup.autocast(runtime.device):
                        logits = setup.model(images)
                        loss = nn.functional.cross_entropy(logits.float(), labels)
                    setup.scaler.scale(loss / group_size).backward()
                window.add(loss.detach(), logits.detach(), labels)
                if batch_order is not None:
                    self._record_samples(batch_order[index])
                self.position.samples_in_epoch = min(len(setup.train_sampler.dataset),
                                                     self.position.samples_in_epoch + labels.numel() * world_size)
                self.position.samples_seen += labels.numel() * world_size
                micro += 1
                if not final_micro:
                    continue
                micro = 0
                lr = self._optimizer_step()
                self.progress.step(loss)
                if self.position.step % config.output.log_every == 0:
                    self._log_window(window, lr)
                if self.watcher.should_stop():
                    self._stop_for_preemption()
                if config.checkpoint.checkpoint_every and self.position.step % config.checkpoint.checkpoint_every == 0:
                    self.save_checkpoint()
                if self._reached_max_steps():
                    break
            self.progress.end_epoch()
            finished_epoch = self.position.samples_in_epoch >= len(setup.train_sampler.dataset)
            result = evaluate(setup.model, setup, runtime)
            self._log_eval(result, epoch)
            if finished_epoch:
                self.position.epoch += 1
                self.position.samples_in_epoch = 0
            self.position.best_accuracy = max(self.position.best_accuracy, result.accuracy)
            self.save_checkpoint(test_accuracy=result.accuracy)
        if result is None:  # nothing left to train: the checkpoint was already complete
            result = evaluate(setup.model, setup, runtime)
            self._log_eval(result, self.position.epoch - 1)
        self.checkpoints.finish()
        return result

    def _optimizer_step(self) -> float:
        setup = self.setup
        setup.sync.after_backward(setup.model)
        lr = setup.schedule.apply(setup.optimizer, self.position.samples_seen)
        if self.config.optim.clip_grad_norm:
            setup.scaler.unscale_(setup.optimizer)
            nn.utils.clip_grad_norm_(setup.model.parameters(), self.config.optim.clip_grad_norm)
        setup.scaler.step(setup.optimizer)
        setup.scaler.update()
        setup.optimizer.zero_grad(set_to_none=True)
        self.position.step += 1
        return lr

    def _reached_max_steps(self) -> bool:
        return bool(self.config.train.max_steps) and self.position.step >= self.config.train.max_steps

    def _stop_for_preemption(self) -> None:
        self.log.warning("%s: stopping at step %d to write a checkpoint", self.watcher.describe(), self.position.step)
        self.save_checkpoint()
        self.checkpoints.finish()
        raise Preempted(f"preempted at step {self.position.step}; checkpoint written")

    # -- reporting -----------------------------------------------------------------------------------------
    def _log_window(self, window: _Window, lr: float) -> None:
        loss, accuracy, samples_per_s = window.reduce(self.runtime)
        epoch = self.position.epoch + 1
        self.metrics.write("train", self.position.step, {"loss": loss, "accuracy": accuracy, "lr": lr,
                                                         "samples_per_s": samples_per_s, "epoch": epoch})
        self.progress.line(f"epoch {epoch}/{self.config.train.epochs} step {self.position.step} loss {loss:.4f} "
                           f"acc {accuracy:.3f} lr {lr:.2e} {samples_per_s:,.0f} samples/s")

    def _log_eval(self, result: EvalResult, epoch: int) -> None:
        self.metrics.write("test", self.position.step, {"loss": result.loss, "accuracy": result.accuracy,
                                                        "samples": result.samples, "epoch": epoch + 1})
        if self.runtime.is_main:
            self.log.info("epoch %d: test accuracy %.4f, loss %.4f on %d samples", epoch + 1, result.accuracy,
                          result.loss, result.samples)

    def _batch_order(self) -> list[list[int]]:
        order = list(iter(self.setup.train_sampler))
        size = self.config.train.batch_size
        return [order[i:i + size] for i in range(0, len(order), size)]

    def _record_samples(self, indices: list[int]) -> None:
        assert self._sample_log is not None
        self._sample_log.write(json.dumps({"epoch": self.position.epoch, "step": self.position.step,
                                           "indices": indices}) + "\n")
        self._sample_log.flush()

    def close(self) -> None:
        self.metrics.close()
        if self._sample_log is not None:
            self._sample_log.close()


class _Window:
    """Loss, accuracy and speed since the last log line, summed on the device (no per-step wait for
    the GPU) and reduced across ranks once, when logged."""

    def __init__(self, device: torch.device) -> None:
        self.totals = torch.zeros(3, dtype=torch.float64, device=device)
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        count = labels.numel()
        self.totals[0] += loss.double() * count
        self.totals[1] += (logits.argmax(1) == labels).sum()
        self.totals[2] += count

    def reduce(self, runtime: Runtime) -> tuple[float, float, float]:
        dist.all_reduce(self.totals)
        loss_sum, correct, count = self.totals.tolist()
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.totals.zero_()
        self.started = time.perf_counter()
        return loss_sum / max(count, 1), correct / max(count, 1), count / elapsed
