"""The doctor's NCCL preflight (trainer.doctor.nccl): every rank's facts compared, one line per problem."""

from __future__ import annotations

import socket

import torch

from trainer.doctor.nccl import nccl_facts, nccl_problems


def rank(number: int, host: str = "node0", gpu: str = "", version: str = "2.21.5", interfaces: tuple[str, ...] =
         ("lo", "eth0"), **settings: str) -> dict:
    facts = {"rank": number, "host": host, "nccl_settings": settings, "interfaces": list(interfaces),
             "nccl_version": version}
    facts["gpu"] = gpu or f"GPU-{host}-{number}"
    return facts


def test_a_healthy_two_node_job_has_no_problem():
    ranks = [rank(0), rank(1), rank(2, host="node1", gpu="GPU-node1-0"), rank(3, host="node1", gpu="GPU-node1-1")]
    assert nccl_problems(ranks) == []


def test_two_ranks_on_one_gpu_are_named_with_the_fix():
    (problem,) = nccl_problems([rank(0, gpu="GPU-a"), rank(1, gpu="GPU-a"), rank(2, host="node1", gpu="GPU-a")])
    assert problem.startswith("ranks 0, 1 on node0 share one GPU (GPU-a), which NCCL refuses ('Duplicate GPU")
    assert "--nproc-per-node" in problem and "CUDA_VISIBLE_DEVICES" in problem


def test_different_nccl_versions_are_listed_by_rank():
    (problem,) = nccl_problems([rank(0), rank(1, version="2.19.3"), rank(2)])
    assert "different NCCL versions (2.21.5 on ranks 0, 2; 2.19.3 on ranks 1)" in problem


def test_a_socket_interface_that_does_not_exist_is_found_by_nccls_matching_rules():
    assert nccl_problems([rank(0, NCCL_SOCKET_IFNAME="eth")]) == []  # a prefix of eth0
    assert nccl_problems([rank(0, NCCL_SOCKET_IFNAME="^docker")]) == []  # exclusions leave eth0
    assert nccl_problems([rank(0, NCCL_SOCKET_IFNAME="ib9,eth0")]) == []
    (problem,) = nccl_problems([rank(0, NCCL_SOCKET_IFNAME="=eth")])  # exact names only
    assert problem.startswith("rank 0 on node0: NCCL_SOCKET_IFNAME==eth matches none of its network interfaces "
                              "(lo, eth0)")
    assert nccl_problems([rank(0), rank(1, NCCL_SOCKET_IFNAME="ens5")])[0].startswith("rank 1 on node0:")


def test_protocol_settings_must_agree_between_ranks():
    (problem,) = nccl_problems([rank(0, NCCL_PROTO="Simple"), rank(1)])
    assert problem.startswith("NCCL_PROTO differs between ranks (Simple on ranks 0; (unset) on ranks 1)")
    assert nccl_problems([rank(0, NCCL_DEBUG="INFO"), rank(1)]) == []  # logging may differ


def test_this_machines_facts_name_its_interfaces_and_nccl_settings_only():
    facts = nccl_facts(torch.device("cpu"), {"NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "lo"})
    assert facts["nccl_settings"] == {"NCCL_DEBUG": "INFO"}
    assert set(facts["interfaces"]) == {name for _, name in socket.if_nameindex()}
    assert "gpu" not in facts
