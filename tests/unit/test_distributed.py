"""Device, backend and thread choices, and the wait for the master, as pure decisions."""

from __future__ import annotations

import socket

import pytest
import torch
from torch import nn

from trainer.config import DistConfig
from trainer.distributed import Runtime, choose_backend, choose_device, threads_per_rank, wait_for_master
from trainer.errors import ConfigError, DeviceError, RendezvousError
from trainer.gradsync import DataParallelSync
from trainer.launchers import identity_from_env

NODE_RANK3 = identity_from_env({"RANK": "7", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                                "GROUP_RANK": "1", "MASTER_ADDR": "m", "MASTER_PORT": "1",
                                "TORCHELASTIC_RUN_ID": "x"})


def test_cuda_device_follows_the_local_rank_not_the_global_rank():
    assert choose_device(DistConfig(), NODE_RANK3, cuda_count=4) == torch.device("cuda", 3)


def test_without_cuda_auto_means_cpu_and_gloo():
    device = choose_device(DistConfig(), NODE_RANK3, cuda_count=0)
    assert device == torch.device("cpu") and choose_backend(DistConfig(), device) == "gloo"
    assert choose_backend(DistConfig(), torch.device("cuda", 0)) == "nccl"


def test_explicit_cpu_wins_over_present_gpus():
    assert choose_device(DistConfig(device="cpu"), NODE_RANK3, cuda_count=4) == torch.device("cpu")


def test_more_local_ranks_than_gpus_is_a_clear_error():
    with pytest.raises(DeviceError, match="local rank 3 needs GPU 3 but this node has 2 GPU"):
        choose_device(DistConfig(), NODE_RANK3, cuda_count=2)


def test_cuda_without_gpus_and_nccl_on_cpu_are_clear_errors():
    with pytest.raises(DeviceError, match="no CUDA device"):
        choose_device(DistConfig(device="cuda"), NODE_RANK3, cuda_count=0)
    with pytest.raises(DeviceError, match="nccl needs CUDA"):
        choose_backend(DistConfig(backend="nccl"), torch.device("cpu"))


def test_threads_respect_omp_num_threads_then_split_the_cores():
    assert threads_per_rank(DistConfig(), NODE_RANK3, {"OMP_NUM_THREADS": "3"}) == 3
    assert threads_per_rank(DistConfig(threads_per_rank=5), NODE_RANK3, {"OMP_NUM_THREADS": "3"}) == 5
    assert threads_per_rank(DistConfig(), NODE_RANK3, {}) >= 1


def test_wait_for_master_returns_once_the_port_accepts():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert wait_for_master("127.0.0.1", server.getsockname()[1], timeout_s=5) == 1


def test_wait_for_master_gives_up_at_the_deadline_with_what_it_tried():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound but not listening: connections are refused
        with pytest.raises(RendezvousError, match=rf"127.0.0.1:{port} not reachable after 0.5s and \d+ attempts"):
            wait_for_master("127.0.0.1", port, timeout_s=0.5, initial_delay_s=0.05)


def test_dataparallel_refuses_several_processes_and_is_the_plain_model_on_cpu():
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="--sync dp runs one process"):
        DataParallelSync(Runtime(NODE_RANK3, torch.device("cpu"), "gloo")).wrap(model)
    single = identity_from_env({})
    assert DataParallelSync(Runtime(single, torch.device("cpu"), "gloo")).wrap(model) is model
