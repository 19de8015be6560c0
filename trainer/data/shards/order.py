"""The epoch's order over a sharded dataset: which sample stands at each global position, computed, never listed.

The trainer's order is one number per epoch, the global position (trainer.sampler): positions are dealt to the
ranks round-robin, and a resume at any world size continues at the same position of the same order. For a
map-style dataset that order is a full permutation; here it must also be local in shards, or every node would
read every shard. It is built in three steps, each a function of (seed, epoch, lanes) alone:

1. The shards are permuted, and their samples laid end to end in that order: the epoch's *stream*.
2. The stream is cut into ``lanes`` equal contiguous parts (sizes differ by one at most). Position ``p``
   belongs to lane ``p % lanes``, at place ``p // lanes`` in it. With ``W`` ranks and ``W`` dividing ``lanes``,
   rank ``r`` reads lanes ``r, r + W, ...`` only, whatever position the epoch (or a resume) starts at: a lane,
   and so a shard, is read on one rank. A lane holds whole shards except at its two ends.
3. Each lane is cut into windows of ``window`` samples; inside a window the samples are permuted.

So any ``lanes * window`` consecutive positions draw from ``lanes`` windows of at most a few shards each, a global
batch mixes ``lanes`` parts of the dataset, and each rank holds ``lanes / W`` windows open. The memory is the
shards' sample counts (O(shards)) and the permutation of the windows in use (O(window)); never O(samples).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["AUTO_MIN_LANES", "Piece", "ShardOrder", "auto_lanes"]

# An automatic lane count is a multiple of the world size of at least 12, so that resizes to 1, 2, 3, 4 and 6
# ranks (and any divisor of the count) keep every lane on one rank.
AUTO_MIN_LANES = 12
_PERMUTATIONS_KEPT = 64  # windows' permutations kept per order: a rank's open windows, with room to spare


def auto_lanes(world_size: int) -> int:
    """The smallest multiple of the world size that is at least AUTO_MIN_LANES."""
    return world_size * math.ceil(AUTO_MIN_LANES / world_size)


def _seed(*values: int) -> int:
    digest = hashlib.blake2b(",".join(map(str, values)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _permutation(size: int, *seed: int) -> Sequence[int]:
    """A seeded permutation of range(size), 8 bytes an element (a window's can be a million samples)."""
    generator = torch.Generator()
    generator.manual_seed(_seed(*seed))
    return array("q", torch.randperm(size, generator=generator).numpy().tobytes())


@dataclass(frozen=True)
class Piece:
    """Samples ``first..end-1`` (indices within the shard) of one shard: what is fetched and cached as one file."""

    shard: int
    first: int
    end: int

    @property
    def samples(self) -> int:
        return self.end - self.first


@dataclass
class ShardOrder:
    """The order of one epoch. ``lanes == 0``: no shuffle, position p is sample p, read by whole shards (``window``
    0: evaluation's blocks) or one sample at a time (``window`` 1: random access)."""

    counts: Sequence[int]  # samples per shard, in the index's order
    seed: int
    epoch: int
    lanes: int
    window: int  # samples per window of a lane
    _shard_order: list[int] = field(init=False, repr=False)
    _stream_starts: list[int] = field(init=False, repr=False)  # first stream position of each shard, stream order
    _sample_starts: list[int] = field(init=False, repr=False)  # first sample id of each shard, index order
    _permutations: OrderedDict[tuple[int, int], Sequence[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.window < (1 if self.lanes else 0):
            raise ValueError(f"window must be >= 1, got {self.window}")
        self._sample_starts = _starts(self.counts)
        self.size = self._sample_starts[-1]
        shards = len(self.counts)
        self._shard_order = (list(range(shards)) if self.lanes == 0
                             else list(_permutation(shards, self.seed, self.epoch)))
        self._stream_starts = _starts([self.counts[shard] for shard in self._shard_order])
        self._permutations = OrderedDict()
        if self.lanes:
            self._base, self._extra = divmod(self.size, self.lanes)

    # Lanes: lane l holds stream positions lane_start(l) .. lane_start(l + 1) - 1; the first `extra` lanes hold one
    # more than the others, so that the last round of positions (p // lanes == base) covers exactly lanes 0..extra-1.
    def lane_start(self, lane: int) -> int:
        return lane * self._base + min(lane, self._extra)

    def lane_length(self, lane: int) -> int:
        return self._base + (1 if lane < self._extra else 0)

    def windows_in_lane(self, lane: int) -> int:
        return -(-self.lane_length(lane) // self.window)

    def locate(self, position: int) -> tuple[int, int]:
        """(lane, window in the lane) of a position of the epoch."""
        lane, place = position % self.lanes, position // self.lanes
        return lane, place // self.window

    def sample(self, position: int) -> int:
        """The sample id (index order: shard 0's samples first) at a position of the epoch."""
        if not 0 <= position < self.size:
            raise IndexError(f"position {position} outside 0..{self.size - 1}")
        if self.lanes == 0:
            return position
        lane, place = position % self.lanes, position // self.lanes
        window, offset = divmod(place, self.window)
        stream = self.lane_start(lane) + window * self.window + self._window_permutation(lane, window)[offset]
        return self._sample_at(stream)

    def piece_of(self, position: int) -> Piece:
        """The piece (a window's part of one shard) that holds the position's sample; without lanes, its shard."""
        if self.lanes == 0:
            shard, index = self.shard_of(position)
            return Piece(shard, index, index + 1) if self.window else Piece(shard, 0, self.counts[shard])
        sample = self.sample(position)
        lane, window = self.locate(position)
        shard = bisect.bisect_right(self._sample_starts, sample) - 1
        return next(piece for piece in self.window_pieces(lane, window) if piece.shard == shard)

    def window_pieces(self, lane: int, window: int) -> list[Piece]:
        """The pieces of one window, in stream order: its stream range cut at shard boundaries."""
        first = self.lane_start(lane) + window * self.window
        end = min(first + self.window, self.lane_start(lane) + self.lane_length(lane))
        pieces = []
        index = bisect.bisect_right(self._stream_starts, first) - 1
        while first < end:
            shard = self._shard_order[index]
            shard_end = self._stream_starts[index + 1]
            stop = min(end, shard_end)
            start_in_shard = first - self._stream_starts[index]
            if stop > first:
                pieces.append(Piece(shard, start_in_shard, start_in_shard + stop - first))
            first, index = stop, index + 1
        return pieces

    def window_size(self, lane: int, window: int) -> int:
        return min(self.window, self.lane_length(lane) - window * self.window)

    def _window_permutation(self, lane: int, window: int) -> Sequence[int]:
        key = (lane, window)
        permutation = self._permutations.get(key)
        if permutation is None:
            permutation = _permutation(self.window_size(lane, window), self.seed, self.epoch, self.lanes, lane, window)
            self._permutations[key] = permutation
            if len(self._permutations) > _PERMUTATIONS_KEPT:
                self._permutations.popitem(last=False)
        else:
            self._permutations.move_to_end(key)
        return permutation

    def _sample_at(self, stream: int) -> int:
        index = bisect.bisect_right(self._stream_starts, stream) - 1
        shard = self._shard_order[index]
        return self._sample_starts[shard] + stream - self._stream_starts[index]

    def shard_of(self, sample: int) -> tuple[int, int]:
        """(shard, index within the shard) of a sample id."""
        shard = bisect.bisect_right(self._sample_starts, sample) - 1
        return shard, sample - self._sample_starts[shard]


def _starts(counts: Sequence[int]) -> list[int]:
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    return starts
