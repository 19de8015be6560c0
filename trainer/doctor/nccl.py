"""The doctor's NCCL preflight: what makes NCCL fail or hang at its first collective, found beforehand.

Every rank describes its GPU, NCCL version and NCCL settings (``nccl_facts``); the descriptions travel
over the gloo control group (trainer.distributed.Runtime.control), which works when NCCL would not, and
``nccl_problems`` compares them. Each problem is one line that names the ranks and the fix.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from typing import Any

import torch

# Settings that change NCCL's protocol or transport: ranks that disagree on them may wait for each other for ever.
MUST_AGREE = ("NCCL_PROTO", "NCCL_ALGO", "NCCL_NET", "NCCL_IB_DISABLE")


def nccl_facts(device: torch.device, environ: Mapping[str, str]) -> dict[str, Any]:
    """This rank's side of the preflight (plain values: they are pickled to rank 0)."""
    facts: dict[str, Any] = {
        "nccl_settings": {name: value for name, value in environ.items() if name.startswith("NCCL_")},
        "interfaces": sorted(name for _, name in socket.if_nameindex()),
    }
    if device.type == "cuda":
        facts["gpu"] = str(torch.cuda.get_device_properties(device).uuid)
        facts["nccl_version"] = ".".join(str(part) for part in torch.cuda.nccl.version())
    return facts


def nccl_problems(ranks: Sequence[Mapping[str, Any]]) -> list[str]:
    """What would break NCCL, given each rank's ``nccl_facts`` plus its "rank" and "host"."""
    return [*_shared_gpus(ranks), *_versions(ranks), *_interfaces(ranks), *_disagreements(ranks)]


def _shared_gpus(ranks: Sequence[Mapping[str, Any]]) -> list[str]:
    owners: dict[tuple[str, str], list[int]] = {}
    for facts in ranks:
        if "gpu" in facts:
            owners.setdefault((facts["host"], facts["gpu"]), []).append(facts["rank"])
    return [f"ranks {_listed(sharing)} on {host} share one GPU ({gpu}), which NCCL refuses ('Duplicate GPU "
            f"detected'): start at most one rank per GPU (--nproc-per-node no more than the node's GPUs) and let "
            f"each rank see its own (CUDA_VISIBLE_DEVICES)"
            for (host, gpu), sharing in owners.items() if len(sharing) > 1]


def _versions(ranks: Sequence[Mapping[str, Any]]) -> list[str]:
    by_version = _ranks_by(ranks, lambda facts: facts.get("nccl_version"))
    if len(by_version) < 2:
        return []
    found = "; ".join(f"{version} on ranks {_listed(members)}" for version, members in by_version.items())
    return [f"ranks run different NCCL versions ({found}): their collectives may not match; run the same image "
            f"(the same torch) on every node"]


def _interfaces(ranks: Sequence[Mapping[str, Any]]) -> list[str]:
    problems = []
    for facts in ranks:
        wanted = facts["nccl_settings"].get("NCCL_SOCKET_IFNAME", "")
        if wanted and not _matches_an_interface(wanted, facts["interfaces"]):
            problems.append(f"rank {facts['rank']} on {facts['host']}: NCCL_SOCKET_IFNAME={wanted} matches none of "
                            f"its network interfaces ({', '.join(facts['interfaces'])}), so NCCL cannot open its "
                            f"sockets; name one that exists on every node, or unset it")
    return problems


def _matches_an_interface(wanted: str, interfaces: Sequence[str]) -> bool:
    """NCCL's rule: a comma-separated list of name prefixes; ``=`` first: exact names; ``^`` first: names to
    leave out (any other interface will do)."""
    if wanted.startswith("^"):
        return True
    exact = wanted.startswith("=")
    names = [name for name in wanted.lstrip("=").split(",") if name]
    return any(interface == name if exact else interface.startswith(name) for name in names for interface in interfaces)


def _disagreements(ranks: Sequence[Mapping[str, Any]]) -> list[str]:
    problems = []
    for setting in MUST_AGREE:
        values = _ranks_by(ranks, lambda facts, setting=setting: facts["nccl_settings"].get(setting, "(unset)"))
        if len(values) > 1:
            found = "; ".join(f"{value} on ranks {_listed(members)}" for value, members in values.items())
            problems.append(f"{setting} differs between ranks ({found}): ranks that pick different protocols or "
                            f"transports can wait for each other for ever; set it alike on every node")
    return problems


def _ranks_by(ranks: Sequence[Mapping[str, Any]], key: Any) -> dict[str, list[int]]:
    grouped: dict[str, list[int]] = {}
    for facts in ranks:
        value = key(facts)
        if value is not None:
            grouped.setdefault(str(value), []).append(facts["rank"])
    return grouped


def _listed(ranks: Sequence[int]) -> str:
    return ", ".join(str(rank) for rank in sorted(ranks))
