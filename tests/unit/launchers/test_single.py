"""No launcher: one process."""

from __future__ import annotations

from trainer.launchers import identity_from_env


def test_no_launcher_means_a_single_process():
    identity = identity_from_env({}, hostname="laptop")
    assert (identity.rank, identity.world_size, identity.local_rank, identity.num_nodes) == (0, 1, 0, 1)
    assert identity.launcher == "single-process" and identity.is_main and not identity.distributed
