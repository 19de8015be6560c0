"""What a rank will read this epoch, fetched ahead of it within the cache's bound, and deleted once read.

The plan is computed from the order alone: rank ``r`` of ``W`` reads positions ``start + r + k*W`` (its k-th
sample), so for every window of every lane the first and last ``k`` at which this rank reads it are known before
the epoch starts (a linear congruence per lane; O(windows), never O(samples)). The prefetcher, a thread of the
rank's main process, fetches windows in the order they are first needed while the bytes held stay within the
bound, and deletes a window's pieces once the sampler has handed out indices far enough past its last use that
every DataLoader worker has read it (the loader runs at most ``prefetch_factor * workers`` batches ahead).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

from trainer.data.shards.cache import PieceCache
from trainer.data.shards.order import Piece, ShardOrder
from trainer.errors import DataError, described

__all__ = ["PlannedWindow", "Prefetcher", "bytes_open_at_once", "rank_plan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlannedWindow:
    first: int  # the rank's first read of it (its k-th sample)
    last: int
    pieces: tuple[Piece, ...]


def rank_plan(order: ShardOrder, start: int, rank: int, world_size: int) -> list[PlannedWindow]:
    """The windows rank reads from position ``start`` on, by first read."""
    if order.lanes == 0:
        return _plan_without_lanes(order, start, rank, world_size)
    lanes, residue = order.lanes, (start + rank) % world_size
    common = math.gcd(lanes, world_size)
    step = world_size // common  # the rank reads every step-th place of a lane it shares
    plan = []
    for lane in range(lanes):
        if (lane - residue) % common:
            continue  # another rank's lane
        # place q of the lane is position lane + q*lanes; this rank's when lane + q*lanes = residue (mod W)
        wanted = ((residue - lane) // common) * pow(lanes // common, -1, step) % step if step > 1 else 0
        first_place = max(0, -(-(start - lane) // lanes))
        for window in range(first_place // order.window, order.windows_in_lane(lane)):
            low = max(window * order.window, first_place)
            high = window * order.window + order.window_size(lane, window)  # exclusive
            first_q = low + (wanted - low) % step
            last_q = high - 1 - (high - 1 - wanted) % step
            if first_q > last_q:
                continue
            first_k = (lane + first_q * lanes - start - rank) // world_size
            last_k = (lane + last_q * lanes - start - rank) // world_size
            pieces = tuple(order.window_pieces(lane, window))
            plan.append(PlannedWindow(first_k, last_k, pieces))
    plan.sort(key=lambda planned: (planned.first, planned.last))
    return plan


def _plan_without_lanes(order: ShardOrder, start: int, rank: int, world_size: int) -> list[PlannedWindow]:
    """Index order, read in one contiguous block from ``start`` (evaluation): each shard of it is one window."""
    del rank, world_size  # the block is this rank's already
    plan, position = [], 0
    for shard, count in enumerate(order.counts):
        low, high = max(position, start), position + count
        if low < high:
            plan.append(PlannedWindow(low - start, high - 1 - start, (Piece(shard, 0, count),)))
        position += count
    return plan


def bytes_open_at_once(plan: list[PlannedWindow], lag_samples: int, size_of: Callable[[PlannedWindow], int]) -> int:
    """The most bytes the plan needs in the cache at one time: the windows read at that moment, each held from its
    first read until ``lag_samples`` after its last."""
    events = sorted([(window.first, size_of(window)) for window in plan]
                    + [(window.last + lag_samples + 1, -size_of(window)) for window in plan],
                    key=lambda event: (event[0], event[1]))
    held = peak = 0
    for _, change in events:
        held += change
        peak = max(peak, held)
    return peak


class Prefetcher:
    """Fetches the plan's windows ahead of the sampler and deletes the read ones. Errors are kept, not raised: the
    worker that needs the piece fetches it itself and raises the error where the loop sees it."""

    def __init__(self, cache: PieceCache, bound_bytes: int, lag_samples: int, who: str) -> None:
        self.cache = cache
        self.bound_bytes = bound_bytes
        self.lag_samples = lag_samples
        self.who = who
        self._plan: list[PlannedWindow] = []
        self._key: object = None
        self._dispatched = -1
        self._generation = 0
        self._wake = threading.Condition()
        self._stopped = False
        self.error: BaseException | None = None
        self.peak_bytes = 0
        self._evicted_shards: set[int] = set()
        self._thread: threading.Thread | None = None

    def begin(self, key: object, make_plan: Callable[[], list[PlannedWindow]]) -> None:
        """The plan of an epoch from a position (``key`` names them): what another plan held goes; the same one
        again (the first-batch check iterated the sampler before the loader did) keeps what it fetched."""
        with self._wake:
            if key == self._key:
                return
            self._key = key
            self._plan = make_plan()
            self._dispatched = -1
            self._generation += 1
            self._wake.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shard-prefetch", daemon=True)
            self._thread.start()

    def dispatched(self, k: int) -> None:
        """The sampler handed out this rank's k-th sample of the plan."""
        with self._wake:
            self._dispatched = k
            self._wake.notify_all()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        held: dict[int, tuple[PlannedWindow, int]] = {}  # plan index -> (window, bytes)
        generation, plan, fetched_to = -1, [], 0
        while True:
            with self._wake:
                if self._stopped:
                    break
                if generation != self._generation:
                    for window, _ in held.values():
                        self._evict(window)
                    held.clear()
                    self._evict_indexes(held)
                    self.cache.evict_all()  # the last plan's reads are all done when another begins
                    generation, plan, fetched_to = self._generation, self._plan, 0
                read_before = self._dispatched - self.lag_samples
            done = [index for index, (window, _) in held.items() if window.last < read_before]
            for index in done:
                self._evict(held.pop(index)[0])
            if done:
                self._evict_indexes(held)
            progressed = False
            while fetched_to < len(plan):
                window = plan[fetched_to]
                if window.last < read_before:  # already read (fetched by the workers themselves): skip it
                    fetched_to += 1
                    continue
                size = 0
                try:
                    size = sum(self.cache.piece_bytes(piece) for piece in window.pieces)
                    held_bytes = sum(size for _, size in held.values())
                    if held and held_bytes + size > self.bound_bytes:
                        break
                    for piece in window.pieces:
                        self.cache.ensure(piece, self.who)
                except (DataError, OSError) as error:
                    # Held all the same, so that what a worker fetches of it is deleted in turn; the worker that
                    # reads it meets the error itself and ends the run where the loop sees it.
                    self.error = error
                    log.warning("%s: prefetching a window failed (%s); the loader's workers fetch it themselves",
                                self.who, described(error))
                    held_bytes = sum(size for _, size in held.values())
                held[fetched_to] = (window, size)
                self.peak_bytes = max(self.peak_bytes, held_bytes + size)
                fetched_to += 1
                progressed = True
                with self._wake:
                    if self._stopped or generation != self._generation:
                        break
            if not progressed:
                with self._wake:
                    if not self._stopped and generation == self._generation:
                        self._wake.wait(timeout=1.0)
        for window, _ in held.values():
            self._evict(window)
        self._evict_indexes({})
        self.cache.evict_all()

    def _evict(self, window: PlannedWindow) -> None:
        for piece in window.pieces:
            self.cache.evict(piece)
        self._evicted_shards.update(piece.shard for piece in window.pieces)

    def _evict_indexes(self, held: dict[int, tuple[PlannedWindow, int]]) -> None:
        """The shard indexes of evicted pieces that no held window reads: the cache holds O(open windows), never
        O(shards)."""
        open_shards = {piece.shard for window, _ in held.values() for piece in window.pieces}
        for shard in self._evicted_shards - open_shards:
            self.cache.evict_index(shard)
        self._evicted_shards &= open_shards
