"""What a rank will read this epoch, fetched ahead of it within the cache's bound, and deleted once read.

The plan is computed from the order alone: rank ``r`` of ``W`` reads positions ``start + r + k*W`` (its k-th
sample), so for every window of every lane the first and last ``k`` at which this rank reads it are known before
the epoch starts (a linear congruence per lane; O(windows), never O(samples)). The prefetcher, threads of the
rank's main process, fetches windows in the order they are first needed while the bytes held stay within the
bound, and deletes a window's pieces once the sampler has handed out indices far enough past its last use that
every DataLoader worker has read it (the loader runs at most ``prefetch_factor * workers`` batches ahead).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Collection
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
    """Fetches the plan's windows ahead of the sampler (``cache.fetch_threads`` threads, each taking the first window
    not yet taken), and deletes the read ones in the sampler's own thread as it hands out indices: every window of
    the plan whose last read is far enough behind, whoever fetched it (a thread, or a worker that got there first),
    so deletion never waits for a thread to be scheduled, and what the cache holds is what the plan reads at that
    moment. A window whose fetch failed is held all the same: the worker that reads it meets the error itself and
    ends the run where the loop sees it."""

    def __init__(self, cache: PieceCache, bound_bytes: int, lag_samples: int, who: str) -> None:
        self.cache = cache
        self.bound_bytes = bound_bytes
        self.lag_samples = lag_samples
        self.who = who
        self.error: BaseException | None = None
        self.peak_bytes = 0
        self._wake = threading.Condition()
        self._plan: list[PlannedWindow] = []
        self._by_last: list[int] = []  # the plan's windows by last read, swept in that order
        self._swept = 0
        self._key: object = None
        self._generation = 0
        self._held: dict[int, tuple[PlannedWindow, int]] = {}  # plan index -> (window, bytes); under _wake
        self._read_before = -1  # every sample of the plan before this one has been read by the workers
        self._evicted_shards: set[int] = set()
        self._stopped = False
        self._threads: list[threading.Thread] = []
        self._cursor, self._cursor_generation = 0, -1  # where _next_unfetched resumes its scan
        self._taken: set[int] = set()  # windows a thread is sizing, reserving or fetching; of _taken_generation
        self._taken_generation = -1

    def begin(self, key: object, make_plan: Callable[[], list[PlannedWindow]]) -> None:
        """The plan of an epoch from a position (``key`` names them). Everything of the last plan is deleted here,
        before this one's first index is handed out (no worker reads for it yet); the same plan again (the
        first-batch check iterated the sampler before the loader did) keeps what it fetched."""
        with self._wake:
            if key == self._key:
                return
            self._key = key
            self._plan = make_plan()
            self._by_last = sorted(range(len(self._plan)), key=lambda index: self._plan[index].last)
            self._swept = 0
            self._read_before = -1
            self._generation += 1
            self._drop_everything()
            self._wake.notify_all()
        self._threads = [thread for thread in self._threads if thread.is_alive()]
        while len(self._threads) < self.cache.fetch_threads:
            self._threads.append(threading.Thread(target=self._run, name="shard-prefetch", daemon=True))
            self._threads[-1].start()

    def dispatched(self, k: int) -> None:
        """The sampler hands out this rank's k-th sample of the plan: every window read to its end ``lag_samples``
        before it is deleted now, and the thread may fetch further."""
        with self._wake:
            read_before = self._read_before = k - self.lag_samples
            swept = False
            while self._swept < len(self._by_last) and self._plan[self._by_last[self._swept]].last < read_before:
                index = self._by_last[self._swept]
                self._held.pop(index, None)
                self._evict(self._plan[index])
                self._swept += 1
                swept = True
            late = [index for index, (window, _) in self._held.items() if window.last < read_before]
            for index in late:  # fetched by the thread after the sweep had passed it
                self._evict(self._held.pop(index)[0])
            if swept or late:
                self._evict_indexes()
                self._wake.notify_all()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        deadline = time.monotonic() + 2  # a fetch in flight is not waited for: the process is ending
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._wake:
            self._drop_everything()

    def _run(self) -> None:
        warned = False
        while True:
            try:
                if not self._fetch_next():
                    return
            except Exception as error:  # noqa: BLE001 - a bug here must not end prefetching for the run unnoticed
                self.error = error
                if not warned:
                    log.warning("%s: prefetching failed (%s); the loader's workers fetch what they need",
                                self.who, described(error))
                    warned = True
                with self._wake:
                    self._wake.wait(timeout=1.0)

    def _fetch_next(self) -> bool:
        """Take the plan's first window that no thread has taken, size it, reserve room for it in plan order once
        the bound has room, and fetch it; False once stopped. Threads size and fetch side by side, but reserve one
        after another in the plan's order: a later window never takes the room an earlier one needs (the workers
        would then fetch that one themselves, past the bound)."""
        with self._wake:
            if self._stopped:
                return False
            if self._taken_generation != self._generation:
                self._taken, self._taken_generation = set(), self._generation
            generation, plan = self._generation, self._plan
            index = self._next_untaken()
            if index >= len(plan):
                self._wake.wait(timeout=1.0)
                return True
            self._taken.add(index)
            window = plan[index]
        reserved = False
        try:
            # Sizes need the shards' own indexes, which may come from the store: never under the lock, which the
            # sampler's thread takes at every index it hands out.
            size, failure = self._size(window)
            with self._wake:
                while True:
                    if generation != self._generation or self._stopped or window.last < self._read_before:
                        return True  # a new plan, or the workers read past it meanwhile: not fetched
                    held = sum(size for _, size in self._held.values())
                    if self._next_unfetched() == index and (not self._held or held + size <= self.bound_bytes):
                        break
                    self._wake.wait(timeout=1.0)  # for an earlier window's reservation, or a deletion
                self._held[index] = (window, size)  # held before it is fetched: a sweep meanwhile deletes it
                reserved = True
                self.peak_bytes = max(self.peak_bytes, held + size)
                self._wake.notify_all()  # the next window's thread may reserve now
        finally:
            if not reserved:
                with self._wake:
                    if generation == self._generation:
                        self._taken.discard(index)  # another thread may take it again
                    self._wake.notify_all()
        if failure is None:
            failure = self._fetch(window)
        if failure is not None:
            self.error = failure
            log.warning("%s: prefetching a window failed (%s); the loader's workers fetch it themselves",
                        self.who, described(failure))
        with self._wake:
            if generation != self._generation:
                # A new plan began while this was fetched: its pieces go now, but those the new plan holds or is
                # fetching (the same piece, fetched again after the new plan emptied the cache) stay.
                current = {piece for held_window, _ in self._held.values() for piece in held_window.pieces}
                current.update(piece for taken in self._taken for piece in self._plan[taken].pieces)
                self._evict(window, keep=current)
            elif index not in self._held:
                self._evict(window)  # the sweep passed it while it was fetched
        return True

    def _next_unfetched(self) -> int:
        """The first window of the plan not held and not read already (under the lock)."""
        index = self._cursor if self._cursor_generation == self._generation else 0
        while index < len(self._plan) and (index in self._held or self._plan[index].last < self._read_before):
            index += 1
        self._cursor, self._cursor_generation = index, self._generation
        return index

    def _next_untaken(self) -> int:
        """The first window of the plan that no thread has taken, not held and not read already (under the lock)."""
        index = self._next_unfetched()
        while index < len(self._plan) and (index in self._held or index in self._taken
                                           or self._plan[index].last < self._read_before):
            index += 1
        return index

    def _size(self, window: PlannedWindow) -> tuple[int, BaseException | None]:
        try:
            return sum(self.cache.piece_bytes(piece) for piece in window.pieces), None
        except (DataError, OSError) as error:
            return 0, error

    def _fetch(self, window: PlannedWindow) -> BaseException | None:
        try:
            for piece in window.pieces:
                if window.last < self._read_before:  # read (and deleted) already, by the workers' own fetches
                    break
                self.cache.ensure(piece, self.who)
        except (DataError, OSError) as error:
            return error
        return None

    def _drop_everything(self) -> None:
        self._held.clear()
        self._evicted_shards.clear()
        self.cache.evict_all()

    def _evict(self, window: PlannedWindow, keep: Collection[Piece] = ()) -> None:
        gone = [piece for piece in window.pieces if piece not in keep]
        for piece in gone:
            self.cache.evict(piece)
        self._evicted_shards.update(piece.shard for piece in gone)

    def _evict_indexes(self) -> None:
        """The shard indexes of evicted pieces that no held window reads: the cache holds O(open windows), never
        O(shards)."""
        open_shards = {piece.shard for window, _ in self._held.values() for piece in window.pieces}
        for shard in self._evicted_shards - open_shards:
            self.cache.evict_index(shard)
        self._evicted_shards &= open_shards
