"""The training loop: steps, evaluation, checkpoints at the right moments, exact resume, preemption."""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import nullcontext
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from trainer.build import TrainingSetup
from trainer.checkpoint import CheckpointManager, LoadedCheckpoint
from trainer.checkpoint.init_from import initial_weights
from trainer.checkpoint.manager import SaveRetry
from trainer.checkpoint.parts import RestoreContext, add_run_parts
from trainer.checkpoint.reading import InvalidCheckpoint
from trainer.checkpoint.schema import TaskRecord
from trainer.config import Config
from trainer.data.shards.fetching import check_epoch_bound, stop_fetching
from trainer.distributed import Runtime, agreed
from trainer.errors import CheckpointError, OutOfMemory, OutputError, Preempted, first_line
from trainer.evaluation import detached, evaluate
from trainer.first_batch import check_first_batches
from trainer.gradsync import broadcast_buffers, unwrap
from trainer.position import TrainingPosition
from trainer.preemption import PreemptionWatcher
from trainer.profiling import StepProfiler, out_of_memory_message
from trainer.prometheus import MetricsEndpoint
from trainer.redact import redacted
from trainer.report import MetricsWriter, ProgressDisplay
from trainer.slow_rank import SlowRanks
from trainer.task import call_task, to_device
from trainer.timed_saves import TimedSaves
from trainer.tracking import Tracking
from trainer.trainjob_progress import TrainJobProgress

Metrics = dict[str, float]


class Trainer:
    def __init__(self, config: Config, runtime: Runtime, setup: TrainingSetup, checkpoints: CheckpointManager,
                 watcher: PreemptionWatcher, log: logging.Logger, tracking: Tracking,
                 trainjob_progress: TrainJobProgress, endpoint: MetricsEndpoint) -> None:
        self.config = config
        self.runtime = runtime
        self.setup = setup
        self.checkpoints = checkpoints
        self.watcher = watcher
        self.log = log
        self.position = TrainingPosition()
        # Stored redacted, as every saved config (trainer.redact); trainer.resume compares it so.
        self.task_record = TaskRecord(setup.task.name, setup.task.source, redacted(setup.task.options_dict()))
        self.state = setup.state
        add_run_parts(self.state, self.position, self.task_record, redacted(config.to_dict()))
        self.tracking = tracking
        self.state.add(tracking.state_part())
        self.trainjob_progress = trainjob_progress
        self.endpoint = endpoint  # Prometheus's (trainer.prometheus): numbers set, nothing waited for
        self.resumed_from: str | None = None
        self.samples_at_start = 0  # where this run started (its throughput counts from there)
        self.output_dir = Path(config.output.output_dir)
        # Rank 0 writes the run's outputs; every rank learns whether it could (exit 2 everywhere if not).
        self.metrics = agreed(runtime, lambda: MetricsWriter(self.output_dir, runtime.is_main,
                                                             config.output.tensorboard), OutputError)
        self.progress = ProgressDisplay(config.output.progress, runtime.is_main, log)
        self.profiler = StepProfiler(config.output.profile_range, self.output_dir, runtime.identity.rank,
                                     runtime.device, log, config.output.memory_snapshot_on_oom)
        # Forward passes that wait for the other ranks are no rank's own compute (trainer.step_timing).
        forward_waits_for = "--sync-bn" if config.model.sync_bn else \
            f"--sync {config.train.sync}" if setup.sync.sharded else ""
        self.slow_ranks = SlowRanks(config.output.slow_rank_every, config.output.slow_rank_ratio, runtime,
                                    setup.model, forward_waits_for, log)
        self.train_metrics = setup.metric_set()
        self.eval_metrics = setup.metric_set()
        self._last_saved_step = -1
        self.timed_saves = TimedSaves(config.checkpoint.checkpoint_every_s, runtime)
        self._sample_log = None
        if config.output.sample_log:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._sample_log = open(  # noqa: SIM115 - closed in close()
                self.output_dir / f"samples-rank{runtime.identity.rank}.jsonl", "a", encoding="utf-8")

    # -- resume --------------------------------------------------------------------------------------------
    def init_from(self, path: str) -> None:
        """--init-from: the model's weights from a DCP folder (trainer.checkpoint.init_from), on every rank."""
        loaded = initial_weights(path, unwrap(self.setup.model), self.checkpoints.side_group())
        if self.runtime.is_main:
            self.log.info("--init-from %s: %s", redacted(path), loaded)

    def restore(self, loaded: LoadedCheckpoint) -> None:
        """Continue from a checkpoint that trainer.resume.check_resume accepted for this run."""
        state, identity = loaded.state, self.runtime.identity
        source = loaded.shard_source(self.checkpoints.side_group())
        context = RestoreContext(identity.rank, identity.world_size, state.world_size, self.config.train.seed,
                                 state.position.step, loaded.location, source)
        try:
            self.state.restore(state, context)
        except InvalidCheckpoint as problem:
            raise CheckpointError(f"checkpoint {loaded.location}: {problem}; use --resume with an older checkpoint "
                                  f"or --resume none") from None
        except (RuntimeError, ValueError, KeyError) as error:
            raise CheckpointError(
                f"checkpoint {loaded.location} does not fit this model ({first_line(error)}); it was written with "
                f"other task options: use another --checkpoint-dir or --resume none"
            ) from None
        finally:
            if source is not None:
                source.close()
        train_size = len(self.setup.train_sampler.dataset)
        if self.position.samples_in_epoch > train_size:
            raise CheckpointError(f"checkpoint {loaded.location} stopped {self.position.samples_in_epoch} samples into "
                                  f"an epoch, but this run's training set has {train_size}; resume with the same "
                                  f"--max-train-samples")
        self._last_saved_step = self.position.step
        self.samples_at_start = self.position.samples_seen
        if state.world_size != identity.world_size:
            self.log.info("resuming a %d-rank checkpoint with %d ranks at sample %d of epoch %d", state.world_size,
                          identity.world_size, self.position.samples_in_epoch, self.position.epoch + 1)
        self.resumed_from = loaded.location
        if self.position.epoch >= self.config.train.epochs:
            self.log.info("resumed from %s: all %d epochs are done (step %d); evaluating only", loaded.location,
                          self.config.train.epochs, self.position.step)
        else:
            self.log.info("resumed from %s: epoch %d, step %d, %d samples into the epoch", loaded.location,
                          self.position.epoch + 1, self.position.step, self.position.samples_in_epoch)

    def record_resume(self, timing: Metrics) -> None:
        """metrics.jsonl's "resume" record: where this process's start-up went (trainer.api.ResumeTiming)."""
        agreed(self.runtime, lambda: self.metrics.write("resume", self.position.step, timing), OutputError)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save_checkpoint(self, metrics: Metrics | None = None, final: bool = False) -> None:
        """A periodic save (one that fails on a storage error is a warning: CheckpointManager.save), or the run's
        ``final`` one, at its end or on preemption: tried again until it commits or its deadline passes."""
        if final:
            self._save_final(metrics)
            return
        # An epoch-end save replaces a --checkpoint-every save of the same step: it adds the evaluation's
        # metrics (for --keep-best) and the completed epoch.
        if self.position.step == self._last_saved_step and metrics is None:
            return
        self._save(metrics)

    def _save(self, metrics: Metrics | None, final_deadline: float | None = None) -> None:
        broadcast_buffers(self.setup.model, self.runtime)
        started = time.perf_counter()
        self.checkpoints.save(self.state.capture(self.runtime.identity.world_size), metrics,
                              self.state.changed_by_step_only, final_deadline)
        self.endpoint.checkpoint_saved(time.perf_counter() - started)
        self._last_saved_step = self.position.step
        self.timed_saves.saved()

    def _save_final(self, metrics: Metrics | None) -> None:
        """The last save is the run's result (or, preempted, what the next attempt resumes): a storage error is
        retried with backoff (rank 0 decides, CheckpointManager._settle) within what is left of the grace period
        after a signal, else within --checkpoint-timeout-s; past it, StorageUnavailable (exit 200)."""
        deadline = self.watcher.exit_deadline()
        if deadline is None:
            deadline = time.monotonic() + self.config.checkpoint.checkpoint_timeout_s
        self.checkpoints.finish()  # an asynchronous save still being written may be of this very step
        while metrics is not None or self.checkpoints.committed_step != self.position.step:
            try:
                self._save(metrics, deadline)
                self.checkpoints.finish()
                return
            except SaveRetry as retry:  # raised on every rank alike
                self.log.warning("%s", retry)
                time.sleep(retry.delay_s)

    # -- training ------------------------------------------------------------------------------------------
    def fit(self) -> Metrics:
        try:
            return self._fit()
        except torch.OutOfMemoryError as error:  # CUDA's; the snapshot (if asked) before the memory is freed
            raise OutOfMemory(out_of_memory_message(error, self.position.step, self.profiler.out_of_memory(),
                                                    bool(self.config.train.global_batch_size))) from None

    def _fit(self) -> Metrics:
        config, setup, runtime = self.config, self.setup, self.runtime
        world_size = runtime.identity.world_size
        train_size = len(setup.train_sampler.dataset)
        result: Metrics | None = None
        checked = primed = False
        if runtime.liveness is not None:
            runtime.liveness.doing = "training"  # what this rank's heartbeat tells a peer that waits for it
        while self.position.epoch < config.train.epochs and not self._reached_max_steps():
            epoch = self.position.epoch
            setup.train_sampler.set_epoch(epoch, start_sample=self.position.samples_in_epoch)
            check_epoch_bound(setup.train_loader, runtime)  # a sharded dataset's cache holds this epoch's windows
            if not checked:
                check_first_batches(setup, runtime)
                checked = True
            batches = len(setup.train_loader)
            accum = config.optim.grad_accum_steps
            per_batch = setup.train_sampler.batch_size * world_size
            self.progress.start_epoch(epoch, config.train.epochs, math.ceil(math.ceil(train_size / per_batch) / accum),
                                      self.position.samples_in_epoch // per_batch // accum)
            # A window of its own per epoch: the last one's tail is not counted, nor the evaluation between.
            self.train_metrics.reset()
            window_started = time.perf_counter()
            batch_order = self._batch_order() if self._sample_log else None
            shares = setup.train_sampler.batch_shares()
            micro = 0
            step_samples = 0
            timing = self.slow_ranks.timing  # each rank's data wait and forward time (trainer.slow_rank)
            for index, (inputs, targets) in enumerate(timing.batches(setup.train_loader)):
                group_size = min(accum, batches - (index - micro))
                final_micro = micro + 1 == group_size
                if micro == 0:  # every rank's real samples in this optimizer step: known here, no collective
                    step_samples = sum(size for _, size in shares[index:index + group_size])
                    self.profiler.before_step(self.position.step + 1)
                mine, global_samples = shares[index]
                with timing.copying():
                    inputs, targets = setup.inputs_on_device(inputs), to_device(targets, runtime.device)
                if not primed:
                    self._prime_gradient_sync(inputs, targets)
                    primed = True
                context = setup.sync.no_sync(setup.model) if not final_micro else nullcontext()
                with context:
                    with setup.autocast():
                        outputs = setup.model(inputs)
                        loss = setup.instance.loss(outputs, targets)
                    timing.computed()
                    if runtime.liveness is not None:
                        runtime.liveness.made_progress()  # a rank stuck before its backward is told from the others
                    setup.scaler.scale(share_of_step(loss, mine, world_size, step_samples)).backward()
                if mine:  # a placeholder batch trains nothing and counts in no metric
                    self.train_metrics.update(loss.detach(), detached(outputs), targets)
                if batch_order is not None:
                    self._record_samples(batch_order[index][:mine])
                self.position.samples_in_epoch = min(train_size, self.position.samples_in_epoch + global_samples)
                self.position.samples_seen += global_samples
                if runtime.liveness is not None:
                    runtime.liveness.made_progress()  # the progress watchdog's sign of life (trainer.liveness)
                micro += 1
                if not final_micro:
                    continue
                micro = 0
                lr = self._optimizer_step()
                for record in self.slow_ranks.after_step(self.position.step):  # the same on every rank
                    self._record("slow_rank", record)
                self.profiler.after_step(self.position.step)
                self.progress.step()  # the loss is shown at log steps only: reading it waits for the device
                if self.position.step % config.output.log_every == 0:
                    self._log_window(lr, time.perf_counter() - window_started)
                    window_started = time.perf_counter()
                if self._evaluation_due(train_size):
                    evaluated = time.perf_counter()
                    self._evaluate(epoch, mid_epoch=True)
                    window_started += time.perf_counter() - evaluated  # the window counts training time only
                if self.watcher.should_stop():
                    self._stop_for_preemption()
                every = config.checkpoint.checkpoint_every
                # Not at the run's last step: the final save follows there (after the evaluation), and a periodic
                # one failing first could end the run (--max-failed-saves) before the final one is even tried.
                last = self._reached_max_steps() or (epoch + 1 >= config.train.epochs and index + 1 >= batches)
                due = self.timed_saves.due()  # a collective: called at every step, on every rank
                if not last and (due or (every and self.position.step % every == 0)):
                    self.save_checkpoint()
                if self._reached_max_steps():
                    break
            if self.watcher.should_stop_now():  # the last step's vote, before a long evaluation
                self._stop_for_preemption()
            self.timed_saves.settle()  # the epoch's end saves anyway
            self.progress.end_epoch()
            finished_epoch = self.position.samples_in_epoch >= train_size
            result = self._evaluate(epoch)
            if finished_epoch:
                self.position.epoch += 1
                self.position.samples_in_epoch = 0
            last = self.position.epoch >= config.train.epochs or self._reached_max_steps()
            self.save_checkpoint(metrics=result, final=last)
        self.profiler.finish()  # --profile-steps past the last step: what was recorded
        self.slow_ranks.finish()
        if result is None:  # nothing left to train: the checkpoint was already complete
            result = self._evaluate(self.position.epoch - 1)
        self.checkpoints.finish()
        return result

    def _prime_gradient_sync(self, inputs: Any, targets: Any) -> None:
        """Before this process's first step, on its batch: DDP fixes its buckets (GradSync.prime), so that a
        resumed process adds up gradients in the order the uninterrupted one did."""
        setup = self.setup

        def first_loss() -> Tensor:
            with setup.autocast():
                loss: Tensor = setup.instance.loss(setup.model(inputs), targets)
            return loss

        call_task(setup.task, "the first training batch's forward and backward pass",
                  lambda: setup.sync.prime(setup.model, first_loss))

    def _optimizer_step(self) -> float:
        setup = self.setup
        setup.sync.after_backward(setup.model)
        lr = setup.schedule.apply(setup.optimizer, self.position.samples_seen)
        if self.config.optim.clip_grad_norm:
            setup.scaler.unscale_(setup.optimizer)
            nn.utils.clip_grad_norm_(setup.model.parameters(), self.config.optim.clip_grad_norm)
        self.checkpoints.before_update()  # an asynchronous save's copy of the parameters is complete
        setup.scaler.step(setup.optimizer)
        setup.scaler.update()
        setup.optimizer.zero_grad(set_to_none=True)
        self.position.step += 1
        if self.runtime.liveness is not None:
            self.runtime.liveness.step = self.position.step  # told to peers that wait for this rank
        self.endpoint.stepped(self.position)
        return lr

    def _evaluation_due(self, train_size: int) -> bool:
        """--eval-every's step, unless the epoch ends here (its own evaluation follows)."""
        every = self.config.train.eval_every
        return bool(every) and self.position.step % every == 0 and self.position.samples_in_epoch < train_size

    def _reached_max_steps(self) -> bool:
        return bool(self.config.train.max_steps) and self.position.step >= self.config.train.max_steps

    def _stop_for_preemption(self) -> None:
        self.log.warning("%s: stopping at step %d to write a checkpoint", self.watcher.describe(), self.position.step)
        self.save_checkpoint(final=True)
        raise Preempted(f"preempted at step {self.position.step}; checkpoint written")

    def _evaluate(self, epoch: int, mid_epoch: bool = False) -> Metrics:
        setup = self.setup
        with self.runtime.busy("evaluating"):
            result = evaluate(setup.model, setup.eval_loader, setup.instance, self.eval_metrics, self.runtime,
                              setup.autocast, setup.inputs_on_device, lockstep=setup.sync.sharded)
        self._record("test", {**result, "epoch": epoch + 1, "samples_seen": self.position.samples_seen})
        if self.runtime.is_main:
            where = f"step {self.position.step} (epoch {epoch + 1})" if mid_epoch else f"epoch {epoch + 1}"
            self.log.info("%s: test %s on %d samples", where, _values(result), result["samples"])
        return result

    # -- reporting -----------------------------------------------------------------------------------------
    def _log_window(self, lr: float, elapsed_s: float) -> None:
        values = self.train_metrics.compute(self.runtime)
        samples_per_s = values.pop("samples") / max(elapsed_s, 1e-9)  # every rank's, reduced
        epoch = self.position.epoch + 1
        throughput = self.setup.throughput  # FLOP/s per device and MFU, where known (trainer.throughput)
        self._record("train", {**values, "lr": lr, "samples_per_s": samples_per_s,
                               **throughput.record(samples_per_s), "epoch": epoch,
                               "samples_seen": self.position.samples_seen})
        self.progress.show_loss(values["loss"])
        # The window's mean step: a full step's samples at its rate (an epoch's shorter last step counts as full).
        step_samples = self.setup.train_sampler.batch_size * self.runtime.identity.world_size * \
            self.config.optim.grad_accum_steps
        self.endpoint.step_time(step_samples / max(samples_per_s, 1e-9))
        self.endpoint.compared(self.slow_ranks.latest)
        self.progress.line(f"epoch {epoch}/{self.config.train.epochs} step {self.position.step} {_values(values)} "
                           f"lr {lr:.2e} {samples_per_s:,.0f} samples/s{throughput.shown(samples_per_s)}")

    def _record(self, kind: str, record: Metrics) -> None:
        """A metrics record to metrics.jsonl and TensorBoard (a failed write ends the run on every rank), then to
        the experiment trackers, the TrainJob's status and Prometheus (which never wait for nor fail the run)."""
        agreed(self.runtime, lambda: self.metrics.write(kind, self.position.step, record), OutputError)
        self.tracking.log_metrics(kind, self.position.step, record)
        self.trainjob_progress.log_metrics(kind, record)
        self.endpoint.record(kind, record)

    def _batch_order(self) -> list[list[int]]:
        sampler = self.setup.train_sampler
        order = sampler.indices()
        size = sampler.batch_size
        return [order[i:i + size] for i in range(0, len(order), size)]

    def _record_samples(self, indices: list[int]) -> None:
        assert self._sample_log is not None
        self._sample_log.write(json.dumps({"epoch": self.position.epoch, "step": self.position.step,
                                           "indices": indices}) + "\n")
        self._sample_log.flush()

    def close(self) -> None:
        self.profiler.finish()  # a run stopped inside the profiled steps (preempted, failed) keeps its trace
        for loader in (self.setup.train_loader, self.setup.eval_loader):
            stop_workers(loader)
        stop_fetching(self.setup.train_loader, self.setup.eval_loader)
        self.slow_ranks.close()
        self.metrics.close()
        if self._sample_log is not None:
            self._sample_log.close()


def share_of_step(loss: Tensor, mine: int, world_size: int, step_samples: int) -> Tensor:
    """This micro-batch's loss (a mean over its ``mine`` samples) weighted so that, once the gradient sync
    averages the ranks, the step's gradient is the mean over the ``step_samples`` real samples of all ranks
    and micro-batches, as one process would compute it: weight ``world_size * mine / step_samples``.

    A full step's weight is 1/micro-batches, applied as the division it always was (the same bits as before
    uneven steps existed); a placeholder batch (``mine`` 0) counts zero."""
    weight = Fraction(world_size * mine, step_samples)
    if weight.numerator == 1:
        return loss / weight.denominator
    return loss * (weight.numerator / weight.denominator)


def stop_workers(loader: DataLoader[Any]) -> None:
    """End a loader's persistent DataLoader workers now.

    They ignore SIGTERM (see trainer.preemption), so the interpreter's exit, which terminates and then
    joins them, would wait for ever if the loader were still alive then: after an error, the traceback
    keeps it so. torch has no public call for this; its iterator's own shutdown is what deleting the
    loader would run.
    """
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None


def _values(values: Metrics) -> str:
    """``loss 0.4123 accuracy 0.853``: the loss first, then the task's metrics, samples left out."""
    shown = [("loss", values["loss"])] + [(k, v) for k, v in values.items() if k not in ("loss", "samples")]
    return " ".join(f"{name} {value:.4f}" for name, value in shown)
