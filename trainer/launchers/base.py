"""What every launcher dialect provides, and the readings they share.

A dialect is a ``Launcher``: ``detect`` says whether this process was started by it (from the variables
alone, no side effects), ``identity`` reads its variables into a ``DistIdentity`` or raises one
``LaunchEnvError`` line naming the variable and the fix, and ``job`` names the job its restarts belong to.
``trainer.launchers.LAUNCHERS`` asks them in order; the first that detects wins.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from trainer.errors import LaunchEnvError
from trainer.launchers.identity import DistIdentity

__all__ = ["TORCHRUN_HINT", "LaunchEnv", "Launcher", "is_loopback", "kernel_boot_id"]

TORCHRUN_HINT = "start the trainer through torchrun (torchrun --nnodes ... --nproc-per-node ... trainer/main.py)"
# The variables that make a process one of a group in the plain, torchrun and PyTorchJob dialects.
PROCESS_VARIABLES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK"})
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "localhost6", "localhost6.localdomain6",
                  "ip6-loopback")


@dataclass(frozen=True)
class LaunchEnv:
    """The environment as a dialect reads it, with what the flags add (--master-port, --job-id)."""

    variables: Mapping[str, str]
    hostname: str
    master_port: int = 0  # --master-port: where the launcher names none (Slurm); 0 derives it
    job_id: str = ""  # --job-id
    boot_id: str = ""  # this host's kernel boot id ("" where unknown): see Launcher.job_at_address
    present: frozenset[str] = field(init=False)  # the variables set to something other than blanks

    def __post_init__(self) -> None:
        object.__setattr__(self, "present", frozenset(name for name, value in self.variables.items() if value.strip()))

    def has(self, *names: str) -> bool:
        return all(name in self.present for name in names)

    def get(self, name: str) -> str:
        return self.variables.get(name, "").strip()

    def prefixed(self, prefix: str) -> list[str]:
        return sorted(name for name in self.present if name.startswith(prefix))

    def launched(self) -> bool:
        """Whether a RANK, WORLD_SIZE or LOCAL_RANK says this process is one of a group."""
        return bool(self.present & PROCESS_VARIABLES)

    def number(self, name: str, fix: str, minimum: int = 0) -> int:
        raw = self.variables[name]
        try:
            value = int(raw.strip())
        except ValueError:
            raise LaunchEnvError(f"{name}={raw!r} is not an integer; {fix}") from None
        if value < minimum:
            raise LaunchEnvError(f"{name}={value} must be >= {minimum}; {fix}")
        return value

    def number_or(self, name: str, default: int, fix: str, minimum: int = 0) -> int:
        return self.number(name, fix, minimum) if self.has(name) else default


class Launcher(ABC):
    """One launcher dialect; see the module's docstring."""

    name: ClassVar[str]
    # The variables it reads and the prefixes of families of them: a process started from a launched one (a
    # test, a benchmark, a nested launcher) must not inherit its parent's place in a group.
    variables: ClassVar[tuple[str, ...]] = ()
    prefixes: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def detect(self, env: LaunchEnv) -> bool:
        """Whether this dialect started the process (the dialects before it in the order did not)."""

    @abstractmethod
    def identity(self, env: LaunchEnv) -> DistIdentity:
        """The process's place, or LaunchEnvError for the first inconsistency."""

    def job(self, env: LaunchEnv, master_addr: str, master_port: int) -> tuple[str, bool]:
        """Who "the same job" is across restarts, for the checkpoint folder's lease: (name, whether a launcher
        named it). The same for every attempt of one job, different for any two jobs that may share a folder
        (two machines, one NFS folder or bucket). By default a rendezvous address other hosts reach (a
        PyTorchJob's ``<name>-master-0``, Compose's ``node0``): two jobs cannot listen on one at once. A
        loopback address is the same on every host and names nothing: the process is then its own job."""
        if not is_loopback(master_addr):
            return f"{self.name}@{master_addr}:{master_port}", True
        return f"{self.name}-{env.hostname}-{os.getpid()}", False

    def job_at_address(self, env: LaunchEnv, master_addr: str, master_port: int) -> tuple[str, bool]:
        """For ranks started by hand, where nothing but the address names the job: the address (as ``job``) and
        the kernel boot id of the host, which is rank 0's there (rank 0 runs at the master address), whose lease is
        the only one taken. Two such jobs on two hosts with the same address (two stacks whose first node is
        ``node0``) are then two jobs; a restart on the same host (until it reboots) is the same one. The other
        ranks' ids name their own hosts and are never used. (No launcher of these restarts workers in place, so
        no lease is kept for a next attempt that a rank 0 on another host would then be refused.)"""
        job, named = Launcher.job(self, env, master_addr, master_port)
        return (f"{job}/{env.boot_id[:8]}" if named and env.boot_id else job), named

    def place(self, env: LaunchEnv, rank: int, local_rank: int, world_size: int, local_world_size: int,
              node_rank: int, num_nodes: int, master: tuple[str, int], restart_count: int = 0,
              **extra: bool | int | None) -> DistIdentity:
        """The identity, after the checks every dialect shares and with this dialect's job name."""
        if local_rank >= local_world_size:
            raise LaunchEnvError(f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world_size}; "
                                 f"local ranks run from 0 to {local_world_size - 1}")
        if local_world_size > world_size:
            raise LaunchEnvError(f"LOCAL_WORLD_SIZE={local_world_size} exceeds WORLD_SIZE={world_size}")
        given = env.job_id.strip() or env.get("DDP_JOB_ID")  # --job-id, else DDP_JOB_ID: the user's name wins
        job, named = (given, True) if given else self.job(env, *master)
        return DistIdentity(rank, local_rank, world_size, local_world_size, node_rank, num_nodes, master[0],
                            master[1], self.name, env.hostname, restart_count, job=job, job_named=named, **extra)


def rank_and_world_size(env: LaunchEnv) -> tuple[int, int]:
    """RANK and WORLD_SIZE, both required once any of RANK, WORLD_SIZE, LOCAL_RANK is set."""
    if not env.has("WORLD_SIZE"):
        present = "LOCAL_RANK" if env.has("LOCAL_RANK") else "RANK"
        raise LaunchEnvError(f"{present} is set but WORLD_SIZE is not; set WORLD_SIZE to the total number of "
                             f"processes, or {TORCHRUN_HINT}")
    world_size = env.number("WORLD_SIZE", "set WORLD_SIZE to the total number of processes", minimum=1)
    if not env.has("RANK"):
        raise LaunchEnvError(f"WORLD_SIZE={world_size} is set but RANK is not; set RANK (0..{world_size - 1})")
    rank = env.number("RANK", f"set RANK to this process's rank in 0..{world_size - 1}")
    if rank >= world_size:
        raise LaunchEnvError(f"RANK={rank} is not below WORLD_SIZE={world_size}; ranks run from 0 to "
                             f"{world_size - 1}")
    return rank, world_size


def master_address(env: LaunchEnv, world_size: int) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT, required for more than one process."""
    if world_size == 1 and "MASTER_ADDR" not in env.variables:
        return "127.0.0.1", 0
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.has(name):
            raise LaunchEnvError(f"WORLD_SIZE={world_size} but {name} is not set; set MASTER_ADDR and MASTER_PORT "
                                 f"to rank 0's host and port")
    return env.get("MASTER_ADDR"), tcp_port(env, "MASTER_PORT")


def tcp_port(env: LaunchEnv, name: str) -> int:
    port = env.number(name, f"set {name} to the master's TCP port (1-65535)", minimum=1)
    if port > 65535:
        raise LaunchEnvError(f"{name}={port} is not a TCP port; set it to a value in 1-65535")
    return port


def kernel_boot_id() -> str:
    """This host's kernel boot id (Linux; "" elsewhere): the same in every container on the host, new at each
    boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def is_loopback(address: str) -> bool:
    """An address every host has for itself: it cannot tell one host's job from another's. The unspecified
    addresses (0.0.0.0, ::) too: a master told to listen on every interface is named by no host."""
    text = address.strip()
    if text.lower() in LOOPBACK_NAMES:
        return True
    ip = _ip_address(text.strip("[]"))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:  # ::ffff:127.0.0.1
        ip = ip.ipv4_mapped
    return ip is not None and (ip.is_loopback or ip.is_unspecified)


def _ip_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An IP address, the short IPv4 forms that inet_aton accepts included (127.1, 0: ipaddress refuses them,
    the resolver does not); None for a host name."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(text))
    except OSError:
        return None
