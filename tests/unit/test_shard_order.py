"""The epoch's order over shards (trainer.data.shards.order) and a rank's plan of what to fetch (prefetch.rank_plan):
a permutation of the samples for every lane count, window and shard layout; the same for the same (seed, epoch) and
another for another epoch; local in shards (a rank reads only its lanes' pieces when the world size divides the
lanes, wherever the epoch resumes); memory independent of the sample count."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from trainer.data.shards.order import ShardOrder, auto_lanes
from trainer.data.shards.prefetch import bytes_open_at_once, rank_plan


def random_layouts(count: int) -> list[tuple[list[int], int, int]]:
    chooser = random.Random(5)
    return [([chooser.randint(1, 9) for _ in range(chooser.randint(1, 12))], chooser.choice([1, 2, 3, 4, 6, 12]),
             chooser.randint(1, 7)) for _ in range(count)]


@pytest.mark.parametrize(("counts", "lanes", "window"), random_layouts(40))
def test_every_position_holds_another_sample_and_its_piece_holds_it(counts, lanes, window):
    order = ShardOrder(counts, seed=3, epoch=2, lanes=lanes, window=window)
    samples = [order.sample(position) for position in range(order.size)]
    assert sorted(samples) == list(range(sum(counts)))
    for position, sample in enumerate(samples):
        piece = order.piece_of(position)
        shard, index = order.shard_of(sample)
        assert piece.shard == shard and piece.first <= index < piece.end


@pytest.mark.parametrize(("counts", "lanes", "window"), random_layouts(40))
def test_a_ranks_plan_lists_every_window_it_reads_from_its_first_read_to_its_last(counts, lanes, window):
    order = ShardOrder(counts, seed=1, epoch=0, lanes=lanes, window=window)
    chooser = random.Random(sum(counts) * lanes + window)
    start, world_size = chooser.randint(0, order.size), chooser.randint(1, 5)
    for rank in range(world_size):
        positions = list(range(start + rank, order.size, world_size))
        plan = rank_plan(order, start, rank, world_size)
        for window_planned in plan:
            reads = [k for k, position in enumerate(positions) if order.piece_of(position) in window_planned.pieces]
            assert reads and (reads[0], reads[-1]) == (window_planned.first, window_planned.last)
        assert {order.piece_of(position) for position in positions} <= {p for w in plan for p in w.pieces}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("start", [0, 7, 50])
def test_with_lanes_a_multiple_of_the_world_size_no_sample_is_read_by_two_ranks_pieces(world_size, start):
    counts = [10, 7, 12, 9, 11, 10, 8, 13, 10, 10]
    order = ShardOrder(counts, seed=0, epoch=1, lanes=12, window=10)
    fetched = [{(piece.shard, i) for window in rank_plan(order, start, rank, world_size) for piece in window.pieces
                for i in range(piece.first, piece.end)} for rank in range(world_size)]
    for rank in range(world_size):
        for other in range(rank + 1, world_size):
            assert not fetched[rank] & fetched[other], (rank, other)


def test_the_order_is_the_same_for_the_same_seed_and_epoch_and_differs_between_epochs():
    counts = [20] * 10
    first = [ShardOrder(counts, 7, 0, 12, 20).sample(p) for p in range(200)]
    assert first == [ShardOrder(counts, 7, 0, 12, 20).sample(p) for p in range(200)]
    assert first != [ShardOrder(counts, 7, 1, 12, 20).sample(p) for p in range(200)]
    assert first != [ShardOrder(counts, 8, 0, 12, 20).sample(p) for p in range(200)]


def test_a_global_batch_mixes_as_many_shards_as_there_are_lanes():
    order = ShardOrder([100] * 50, seed=0, epoch=0, lanes=12, window=100)
    batch = {order.shard_of(order.sample(position))[0] for position in range(48)}
    assert len(batch) >= 12


def test_auto_lanes_are_a_multiple_of_the_world_size_of_at_least_twelve():
    assert [auto_lanes(size) for size in (1, 2, 3, 5, 8, 16)] == [12, 12, 12, 15, 16, 16]


def test_the_order_and_a_ranks_plan_take_memory_by_shards_and_open_windows_not_by_samples():
    """10^6 or 10^8 samples in 1000 shards: the same plan, and one window's permutation (8 bytes a sample of it)."""
    def held(samples_per_shard: int) -> int:
        tracemalloc.start()
        order = ShardOrder([samples_per_shard] * 1000, seed=0, epoch=0, lanes=16, window=samples_per_shard)
        order.sample(order.size // 2)
        plan = rank_plan(order, 0, 3, 8)
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del plan
        return size

    small, large = held(1_000), held(100_000)  # 10^6 and 10^8 samples
    assert large < small + 8 * 100_000 * 2, (small, large)


def test_the_bytes_held_at_once_are_the_windows_read_side_by_side():
    order = ShardOrder([10] * 12, seed=0, epoch=0, lanes=4, window=10)
    plan = rank_plan(order, 0, 0, 2)  # lanes 0 and 2: read side by side, one window (10 samples) at a time each
    peak = bytes_open_at_once(plan, lag_samples=0, size_of=lambda window: sum(p.samples for p in window.pieces))
    assert 20 <= peak <= 40
