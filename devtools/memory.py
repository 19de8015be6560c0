"""How much memory a process's own allocations hold, at most, over a stretch of its work (tests and bench)."""

from __future__ import annotations

import threading


def anonymous_resident_bytes() -> int:
    """RssAnon: the resident memory of this process's own allocations. The libraries' code pages are left out:
    the first use of a torch feature (DTensor, FSDP) maps them in by the hundred megabytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    """The highest RssAnon seen, sampled every millisecond by a thread, from construction until stop()."""

    def __init__(self) -> None:
        self.before = anonymous_resident_bytes()
        self.peak = self.before
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="memory-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stopped.wait(0.001):
            self.peak = max(self.peak, anonymous_resident_bytes())

    def stop(self) -> int:
        """The growth: the highest value seen over the value at the start."""
        self._stopped.set()
        self._thread.join()
        return max(self.peak, anonymous_resident_bytes()) - self.before
