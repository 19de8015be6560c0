"""ddp-doctor's command line and its run: join the group, check, measure, agree on the verdict.

The flags come from two config dataclasses by the same code as the trainer's (trainer.options): the
trainer's own distributed section, and the doctor's settings below.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from trainer.config import DistConfig
from trainer.distributed import Runtime, choose_backend, choose_device, open_store, process_group
from trainer.doctor.bandwidth import Bandwidth, run_bandwidth
from trainer.doctor.checks import FAIL, Outcome, Probe, run_checks
from trainer.doctor.driver import driver_outcome, share_driver_rows
from trainer.doctor.nccl import nccl_facts, nccl_problems
from trainer.doctor.report import PROG, describe_device, failure_summary, print_report, print_tables, write_json
from trainer.errors import EXIT_FAILURE, EXIT_OK, ConfigError, UserError, described
from trainer.launchers import DistIdentity, identity_from_env
from trainer.options import add_flags, build, check, option
from trainer.redact import RedactingArgumentParser

# A preflight should fail within a minute, not the trainer's ten.
DIST_DEFAULTS = {"collective_timeout_s": 60.0}


@dataclass
class DoctorConfig:
    sizes_mb: str = option("0.25,1,16", "all-reduce sizes to time, in MB (10^6 bytes), comma-separated")
    iterations: int = option(5, "timed all-reduces per size")
    json: str = option("", "rank 0 also writes the full report to this file")

    def __post_init__(self) -> None:
        check(self.iterations >= 1, f"--iterations must be >= 1, got {self.iterations}")
        self.sizes()

    def sizes(self) -> list[float]:
        try:
            sizes = [float(part) for part in self.sizes_mb.split(",")]
        except ValueError:
            sizes = []
        if not sizes or min(sizes) <= 0:
            raise ConfigError(f"--sizes-mb {self.sizes_mb!r}: expected positive sizes in MB separated by commas, "
                              f"e.g. 0.25,1,16")
        return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = RedactingArgumentParser(
        prog=PROG, description="Preflight of a distributed setup: every rank's environment, every collective's "
        "result, all-reduce bandwidth. Run it under the launcher the trainer will use.")
    add_flags(parser.add_argument_group("doctor"), DoctorConfig)
    add_flags(parser.add_argument_group("dist"), DistConfig, DIST_DEFAULTS)
    return parser


def parse(argv: Sequence[str] | None) -> tuple[DoctorConfig, DistConfig]:
    given = vars(build_parser().parse_args(argv))
    doctor_fields = set(DoctorConfig.__dataclass_fields__)
    doctor = build(DoctorConfig, {key: value for key, value in given.items() if key in doctor_fields})
    dist_values = {**DIST_DEFAULTS, **{key: value for key, value in given.items() if key not in doctor_fields}}
    return doctor, build(DistConfig, dist_values)


def diagnose(runtime: Runtime, config: DoctorConfig, probe_type: type[Probe] = Probe,
             found_before: Sequence[Outcome] = ()) -> int:
    """Run the checks and the bandwidth test on this rank, then agree with the others on the verdict.
    ``found_before``: this rank's checks made before it joined (the CUDA driver's), reported with the rest."""
    identity = runtime.identity
    if runtime.backend == "nccl":
        problems = nccl_preflight(runtime)
        if problems:
            for problem in problems:
                print(f"{PROG}: rank {identity.rank}: FAILED: NCCL preflight: {problem}", file=sys.stderr, flush=True)
            return EXIT_FAILURE
    probe = probe_type(identity.rank, identity.world_size, runtime.device)
    checked, in_step = run_checks(probe)
    outcomes = [*found_before, *checked]
    bandwidths: list[Bandwidth] = []
    if in_step:
        bandwidths, measured = run_bandwidth(probe, config.sizes(), config.iterations)
        outcomes += measured
    environment = describe_rank(identity, describe_device(runtime.device))
    shared: list[object] = [None] * identity.world_size
    try:
        dist.all_gather_object(shared, (environment, [asdict(outcome) for outcome in outcomes]))
    except Exception as error:  # the group broke down: this rank can only speak for itself
        local = failure_summary(outcomes)
        message = (f"FAILED: {local}; the other ranks' results are unavailable" if local else
                   f"FAILED: every check passed here, but the other ranks' results could not be collected "
                   f"({described(error)})")
        print(f"{PROG}: rank {identity.rank}: {message}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    environments: list[Mapping[str, object]] = [env for env, _ in shared]  # type: ignore[misc]
    everyone = [Outcome(**outcome) for _, rank_outcomes in shared for outcome in rank_outcomes]  # type: ignore[misc]
    failures = failure_summary(everyone)
    if identity.is_main:
        print_report(runtime, environments, everyone, bandwidths, config.iterations)
        if config.json:
            write_json(config.json, identity.world_size, runtime.backend, environments, everyone, bandwidths,
                       ok=not failures)
    sys.stdout.flush()
    if failures:
        print(f"{PROG}: rank {identity.rank}: FAILED: {failures}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    if identity.is_main:
        print(f"\n{PROG}: every check passed on {identity.world_size} rank(s)", flush=True)
    return EXIT_OK


def describe_rank(identity: DistIdentity, device: str) -> dict[str, object]:
    return {"rank": identity.rank, "node": identity.node_rank, "local_rank": identity.local_rank,
            "host": identity.hostname, "launcher": identity.launcher, "device": device}


def a_driver_failed(store: dist.Store, identity: DistIdentity, driver: Outcome, device: str, config: DoctorConfig,
                    dist_config: DistConfig) -> bool:
    """Every rank's CUDA driver row shared before joining (trainer.doctor.driver): where one failed, rank 0 prints
    the tables and every rank the failure, and none joins."""
    rows = share_driver_rows(store, identity, describe_rank(identity, device), driver, dist_config.rendezvous_timeout_s)
    if not rows.failed:
        return False
    if identity.is_main:
        environments = [environment for environment, _ in rows.everyone]
        outcomes = [outcome for _, outcome in rows.everyone]
        print_tables(identity, "group not joined", environments, outcomes)
        if config.json:
            write_json(config.json, identity.world_size, None, environments, outcomes, [], ok=False)
        sys.stdout.flush()
    print(f"{PROG}: rank {identity.rank}: FAILED: {failure_summary(rows.failed)}", file=sys.stderr, flush=True)
    return True


def nccl_preflight(runtime: Runtime) -> list[str]:
    """Every rank's GPU and NCCL settings compared before NCCL's first collective (trainer.doctor.nccl): they
    travel over gloo, so a setup that would make NCCL hang or abort is reported instead."""
    identity = runtime.identity
    facts = {"rank": identity.rank, "host": identity.hostname, **nccl_facts(runtime.device, os.environ)}
    everyone: list[object] = [facts]
    if runtime.control is not None:
        everyone = [None] * identity.world_size
        dist.all_gather_object(everyone, facts, group=runtime.control)
    return nccl_problems(everyone)  # type: ignore[arg-type]


def run(config: DoctorConfig, dist_config: DistConfig, environ: Mapping[str, str],
        probe_type: type[Probe] = Probe) -> int:
    identity = identity_from_env(environ, master_port=dist_config.master_port)
    if identity.is_main and config.json and not Path(config.json).resolve().parent.is_dir():
        raise ConfigError(f"--json {config.json}: folder {Path(config.json).resolve().parent} does not exist")
    driver = driver_outcome(identity.rank, dist_config.device)
    device = None
    if driver.status == FAIL:
        print(f"{PROG}: rank {identity.rank}: FAILED: CUDA driver: {driver.detail}", file=sys.stderr, flush=True)
    else:
        device = choose_device(dist_config, identity)
        # Printed before joining: when the rendezvous never completes, these lines show who arrived.
        print(f"{PROG}: {identity.describe()}; device {describe_device(device)}, "
              f"backend {choose_backend(dist_config, device)}: joining the group", flush=True)
    store = open_store(dist_config, identity) if identity.world_size > 1 else None
    described_device = "none" if device is None else describe_device(device)
    if store is not None and a_driver_failed(store, identity, driver, described_device, config, dist_config):
        return EXIT_FAILURE
    if device is None:  # one rank, whose driver failed: nobody waits for it
        return EXIT_FAILURE
    with process_group(dist_config, identity, device, store) as runtime:
        return diagnose(runtime, config, probe_type, [driver])


def main(argv: Sequence[str] | None = None, probe_type: type[Probe] = Probe) -> int:
    """``probe_type``: what puts data on the wire (tests/workers/doctor_fault.py passes one that lies)."""
    try:
        config, dist_config = parse(argv)
        return run(config, dist_config, os.environ, probe_type)
    except UserError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)
        return error.exit_code
