"""Plain RANK/WORLD_SIZE variables; every inconsistency is one clear error naming the variable."""

from __future__ import annotations

import pytest

from trainer.errors import LaunchEnvError
from trainer.launchers import identity_from_env


def test_plain_compose_style_environment():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    identity = identity_from_env(env, hostname="node1")
    assert (identity.rank, identity.local_rank, identity.node_rank, identity.num_nodes) == (1, 0, 1, 2)
    assert identity.launcher == "env"


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK='x' is not an integer"),
    ({"LOCAL_RANK": "0"}, "LOCAL_RANK is set but WORLD_SIZE is not"),
    ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "RANK is not"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "99999"}, "MASTER_PORT=99999"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({"RANK": "1", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "a",
      "MASTER_PORT": "1"}, "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
])
def test_inconsistent_environment_names_the_variable(env, message):
    with pytest.raises(LaunchEnvError, match=message):
        identity_from_env(env)
