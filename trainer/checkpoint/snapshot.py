"""An asynchronous save's copy of the state in host memory: taken when the save is asked for, so that training
can go on changing the originals while a thread writes the copy.

The buffers are kept between saves (``copy_`` into a preallocated tensor is several times faster than
``clone()``), laid out like their originals (a channels-last weight stays channels-last, as a synchronous save
writes it: a resume finds the optimizer's state in its parameters' layout, trainer.optimizers).

Tensors that only the next optimizer step changes (the parameters, the optimizer's state:
trainer.checkpoint.parts) need not be copied before ``take`` returns; everything else (BatchNorm's statistics,
which the next forward changes) must. On the CPU the first are copied by the writer thread while the next
gradients are computed, and ``before_update`` waits for that copy. On CUDA every copy is queued at once on a
side stream into pinned buffers (a copy into pageable memory is synchronous, and on the default stream it would
wait for the step's kernels): the training stream waits, on the GPU and without blocking the host, for the
forward's tensors' copies before its next kernel and for the rest before the optimizer step; only the writer
thread waits on the host, for the copies to land before it writes them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["HostSnapshots", "Snapshot"]


class Snapshot:
    """One save's copy: its state (the buffers in place of the tensors) and the copies still under way."""

    def __init__(self, state: Any, later: list[tuple[torch.Tensor, torch.Tensor]],
                 device_copies: torch.cuda.Event | None, device: torch.device, device_later_bytes: int = 0) -> None:
        self.state = state
        self._later = later  # (buffer, CPU tensor) pairs the writer thread copies
        self._device_copies = device_copies  # recorded on the side stream after every CUDA copy
        self._device = device
        self._copied = threading.Event()
        # What was still being copied when save() returned: the writer thread's copies and the side stream's
        # copies of the tensors only the optimizer step changes.
        self.copied_later_bytes = sum(buffer.nbytes for buffer, _ in later) + device_later_bytes

    def complete(self) -> None:
        """In the writer thread, before it writes: every copy has landed in host memory. The training thread
        waits for the CPU tensors' copies only (those on the device it waits for on the GPU)."""
        try:
            for buffer, tensor in self._later:
                buffer.copy_(tensor)
        finally:
            self._copied.set()  # training may update the parameters now (after a failed copy: nothing to wait for)
        if self._device_copies is not None:
            self._device_copies.synchronize()

    def release(self) -> None:
        """Let a training thread waiting in before_update go (the writer failed before it could complete)."""
        self._copied.set()

    def before_update(self) -> None:
        """In the training thread, before the optimizer changes the parameters: their copies are complete. On
        CUDA the training stream waits for them on the GPU, and the host goes on queueing the step."""
        if self._device_copies is not None:
            torch.cuda.current_stream(self._device).wait_event(self._device_copies)
        if self._later:
            self._copied.wait()


class HostSnapshots:
    """The host buffers of one manager's asynchronous saves, by the tensors' paths in the state."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._stream: torch.cuda.Stream | None = None

    def take(self, state: Any, path: str, deferrable: Callable[[str], bool]) -> Snapshot:
        """``state`` with each tensor replaced by its host buffer. ``deferrable(path)``: whether only the next
        optimizer step changes the tensor at ``path`` (its copy may still be under way when this returns)."""
        now: list[tuple[torch.Tensor, torch.Tensor]] = []
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        copied = self._replace(state, path, deferrable, now, later)
        for buffer, tensor in now:
            if tensor.device.type != "cuda":
                buffer.copy_(tensor)
        urgent = [pair for pair in now if pair[1].device.type == "cuda"]
        deferred = [pair for pair in later if pair[1].device.type == "cuda"]
        later = [pair for pair in later if pair[1].device.type != "cuda"]
        if not urgent and not deferred:
            return Snapshot(copied, later, None, torch.device("cpu"))
        device = (urgent or deferred)[0][1].device
        return Snapshot(copied, later, self._copy_on_side_stream(urgent, deferred, device), device,
                        sum(buffer.nbytes for buffer, _ in deferred))

    def _copy_on_side_stream(self, urgent: list[tuple[torch.Tensor, torch.Tensor]],
                             deferred: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
                             ) -> torch.cuda.Event:
        """Queue every copy on the side stream, after what the training stream has queued so far; the training
        stream waits for ``urgent``'s copies before its next kernel. Returns the event of the last copy."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        training = torch.cuda.current_stream(device)
        self._stream.wait_stream(training)
        with torch.cuda.stream(self._stream):
            for group in (urgent, deferred):
                for buffer, tensor in group:
                    buffer.copy_(tensor, non_blocking=True)
                    tensor.record_stream(self._stream)  # its memory is not reused before the copy has read it
                if group is urgent and urgent:
                    training.wait_event(torch.cuda.current_stream(device).record_event())
            copied = torch.cuda.current_stream(device).record_event()
        return copied

    def _replace(self, state: Any, path: str, deferrable: Callable[[str], bool],
                 now: list[tuple[torch.Tensor, torch.Tensor]], later: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        if isinstance(state, torch.Tensor):
            tensor = state.detach()
            buffer = self._buffer(path, tensor)
            (later if deferrable(path) else now).append((buffer, tensor))
            return buffer
        if isinstance(state, dict):
            return type(state)((key, self._replace(value, f"{path}/{key}", deferrable, now, later))
                               for key, value in state.items())
        if isinstance(state, list | tuple):
            return type(state)(self._replace(value, f"{path}/{index}", deferrable, now, later)
                               for index, value in enumerate(state))
        return state

    def _buffer(self, path: str, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(path)
        pinned = tensor.device.type == "cuda"
        if (buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype
                or buffer.stride() != tensor.stride() or buffer.is_pinned() != pinned):
            buffer = torch.empty_like(tensor, device="cpu", pin_memory=pinned)  # keeps a dense tensor's strides
            self._buffers[path] = buffer
        return buffer
