"""trainer.step_timing on CUDA: the forward's time is the device's (events), not the host's time queueing it."""

from __future__ import annotations

import time

import torch
from torch import nn

from trainer.step_timing import StepTiming

STEPS = 3
DEVICE_SLEEP_CYCLES = 50_000_000  # tens of milliseconds of a GPU's clock: far longer than queueing it takes


def test_the_forward_is_timed_on_the_device_where_the_host_only_queues_it():
    device = torch.device("cuda", 0)
    model = nn.Linear(8, 8).to(device)
    timing = StepTiming(model, device, enabled=True, time_compute=True)
    host_s = 0.0
    for batch in timing.batches([torch.randn(4, 8).pin_memory() for _ in range(STEPS)]):
        with timing.copying():
            batch = batch.to(device, non_blocking=True)
        queued = time.perf_counter()
        outputs = model(batch)
        torch.cuda._sleep(DEVICE_SLEEP_CYCLES)  # the device busy after the forward; the host goes on at once
        timing.computed()
        host_s += time.perf_counter() - queued
        outputs.sum().backward()
        timing.step_done()
    parts = timing.window()
    assert parts.steps == STEPS and parts.data_s > 0
    assert parts.compute_s > 10 * host_s, (parts, host_s)
    assert timing.window().compute_s == 0.0  # read once: the next window starts empty
    timing.close()
