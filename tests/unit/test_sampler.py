"""Training order: one permutation per epoch shared by all ranks, resumable at a global position with
any world size; evaluation shards that count every sample once."""

from __future__ import annotations

import pytest

from trainer.sampler import ResumableDistributedSampler, ShardSampler


def rank_orders(size: int, world_size: int, epoch: int, start: int = 0, seed: int = 0) -> list[list[int]]:
    orders = []
    for rank in range(world_size):
        sampler = ResumableDistributedSampler(range(size), world_size, rank, seed)
        sampler.set_epoch(epoch, start_sample=start)
        keys = list(sampler)
        assert all(key // size == epoch for key in keys), "a key is epoch * size + index"
        orders.append([key % size for key in keys])
    return orders


def global_sequence(orders: list[list[int]]) -> list[int]:
    """Interleave the ranks back into the global order they were dealt from."""
    return [order[i] for i in range(len(orders[0])) for order in orders]


def test_ranks_split_one_permutation_without_overlap():
    orders = rank_orders(12, 3, epoch=0)
    assert sorted(sum(orders, [])) == list(range(12))
    assert len({len(order) for order in orders}) == 1


def test_set_epoch_changes_the_order_and_every_rank_agrees():
    first, second = rank_orders(50, 2, epoch=0), rank_orders(50, 2, epoch=1)
    assert global_sequence(first) != global_sequence(second)
    assert sorted(global_sequence(second)) == list(range(50))


def test_uneven_sizes_are_dealt_without_repeats_and_a_rank_with_nothing_steps_on_a_placeholder():
    # 10 samples, 3 ranks, 2 per rank: a global batch of 6, then one of 4 dealt round-robin (2, 1, 1);
    # 11 samples, 4 per rank: one batch of 11 (4, 4, 3).
    for size, batch, shares in ((10, 2, [[(2, 6), (2, 4)], [(2, 6), (1, 4)], [(2, 6), (1, 4)]]),
                                (11, 4, [[(4, 11)], [(4, 11)], [(3, 11)]])):
        samplers = [ResumableDistributedSampler(range(size), 3, rank, seed=0, batch_size=batch) for rank in range(3)]
        assert [sampler.batch_shares() for sampler in samplers] == shares
        real = [key for sampler in samplers for key in list(sampler)[:sum(mine for mine, _ in sampler.batch_shares())]]
        assert sorted(real) == list(range(size))
    # 7 samples, 3 ranks, 2 per rank: 6, then 1: ranks 1 and 2 have nothing left and get one placeholder each.
    samplers = [ResumableDistributedSampler(range(7), 3, rank, seed=0, batch_size=2) for rank in range(3)]
    assert [sampler.batch_shares()[-1] for sampler in samplers] == [(1, 1), (0, 1), (0, 1)]
    assert [len(list(sampler)) for sampler in samplers] == [len(sampler) for sampler in samplers] == [3, 3, 3]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_resume_with_another_world_size_continues_the_same_global_order(before, after):
    size, consumed = 96, 48
    full = global_sequence(rank_orders(size, before, epoch=4))
    resumed = global_sequence(rank_orders(size, after, epoch=4, start=consumed))
    assert full[:consumed] + resumed == full  # nothing skipped, nothing seen twice, same order


def test_evaluation_shards_count_every_sample_exactly_once():
    shards = [list(ShardSampler(range(10), 3, rank)) for rank in range(3)]
    assert sorted(sum(shards, [])) == list(range(10))
    assert [len(shard) for shard in shards] == [4, 3, 3]


class Noisy:
    """Items drawn at random: what a dataset with random augmentation does."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> tuple[float, float, int]:
        import random

        import torch
        return float(torch.rand(())), random.random(), index


def test_seeded_items_give_each_epoch_and_index_its_own_draws_whoever_fetches_them():
    import torch

    from trainer.sampler import SeededItems

    items = SeededItems(Noisy(), seed=3, deterministic=False)
    torch.manual_seed(0)
    before = torch.rand(3)
    first = [items[key] for key in range(12)]  # epochs 0 and 1
    torch.manual_seed(0)
    assert torch.equal(torch.rand(3), before), "fetching items must not move the model's random stream"
    again = [items[key] for key in reversed(range(12))][::-1]  # another order, as another rank or resume
    assert first == again
    assert first[0][:2] != first[6][:2], "the same index draws anew each epoch"
    assert len({draw[:2] for draw in first}) == 12
    assert SeededItems(Noisy(), seed=4, deterministic=False)[0] != first[0]
    assert SeededItems(Noisy(), seed=3, deterministic=True)[7][2] == 1  # keys decoded, nothing seeded
