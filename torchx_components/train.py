# ruff: noqa: UP006, UP007, UP035, UP045
"""The project's TorchX component: TorchX's ``dist.ddp`` with the trainer, its image and its defaults.

    torchx run torchx_components/train.py:ddp -j 2x2 -- --epochs 3
    torchx run -s kubernetes torchx_components/train.py:ddp -j 2x2 --checkpoint_volume ckpt -- --epochs 3
    torchx run torchx_components/train.py:ddp --task forecast:Forecast --image ddp-forecast -- --window 32

TorchX reads this file in its own way, and that shapes it:

* ``torchx run FILE:FN`` executes the file's source inside TorchX's finder module instead of importing it,
  so the file imports only absolute names and its module-level names (all ``_``-prefixed) must not collide.
* TorchX's linter reads the annotations from the source and accepts only primitives and ``typing``'s
  ``Optional``/``List``/``Dict`` (hence the ``noqa`` above for ruff's ``X | None`` rules, and no
  ``from __future__ import annotations``); ``--help`` is generated from the ``Args:`` section.
"""

import posixpath
from typing import Dict, List, Optional

import torchx.specs as specs
from torchx.components.dist import ddp as _dist_ddp

_IMAGE = "ddp-deploy:latest"  # built by `docker build -f docker/Dockerfile -t ddp-deploy .`
_WORKDIR = "/workspace"  # the image's WORKDIR; relative output folders land under it
_RUNS_MOUNT = "/workspace/runs"  # owned by the image's user (uid 1000), so a fresh volume there is writable


def ddp(
    *script_args: str,
    task: Optional[str] = None,
    image: str = _IMAGE,
    script: Optional[str] = None,
    j: str = "1x2",
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 4096,
    h: Optional[str] = None,
    output_dir: str = "runs/torchx",
    checkpoint_volume: Optional[str] = None,
    mounts: Optional[List[str]] = None,
    max_restarts: int = 2,
    max_retries: int = 0,
    rdzv_port: int = 29500,
    env: Optional[Dict[str, str]] = None,
    name: str = "ddp-deploy/",
    debug: bool = False,
) -> specs.AppDef:
    """Data-parallel training with the ddp-deploy trainer: ``torchrun -m trainer`` on every node.

    Trainer flags go after ``--`` (see ``python -m trainer --help``); a run resumes from the newest valid
    checkpoint in its output folder, so a restarted or retried replica continues where the job stopped.

    Args:
        script_args: trainer flags, e.g. ``--epochs 3 --batch-size 64`` (not ``--output-dir``: use --output_dir)
        task: what to train: a built-in task, or your task class as package.module:Class, installed in the
            image (an image derived from ours) or, with local_cwd, in this environment or on PYTHONPATH
            (--env PYTHONPATH=...); its options go after ``--`` like the trainer's flags
        image: container image with the trainer installed (Kubernetes, local_docker; local_cwd runs the
            current directory)
        script: run this script instead of ``-m trainer``, e.g. trainer/main.py (relative to the working directory)
        j: [{min_nnodes}:]{nnodes}x{nproc_per_node}: nodes (replicas) and trainer processes per node
        cpu: CPUs per node
        gpu: GPUs per node (nproc_per_node must not exceed it)
        memMB: memory per node in MB; Docker also sizes /dev/shm to it (Kubernetes pods get an in-memory
            /dev/shm from TorchX), so DataLoader workers do not die on Docker's 64 MB default
        h: a TorchX named resource (e.g. aws_p3.2xlarge); replaces cpu, gpu and memMB when set
        output_dir: the trainer's --output-dir; checkpoints go to OUTPUT_DIR/checkpoints. Relative paths start
            in the working directory (/workspace in the image)
        checkpoint_volume: Kubernetes PersistentVolumeClaim (or Docker volume) mounted at /workspace/runs, so
            checkpoints outlive pods and every node reads the same ones (ReadWriteMany for several nodes);
            output_dir must then lie under runs/
        mounts: further mounts: type=<bind|volume|device>,src=...,dst=...[,readonly]
        max_restarts: how often torchrun restarts the workers of a node in place after a failure
            (exported as PET_MAX_RESTARTS); each restart resumes from the newest checkpoint
        max_retries: how often the scheduler retries the job (Kubernetes/Volcano restarts every pod,
            local_docker the container; local_cwd does not retry)
        rdzv_port: TCP port of the rendezvous store on the first node (multi-node jobs only)
        env: environment variables for the trainer, e.g. LOGLEVEL=INFO,NCCL_DEBUG=WARN
        name: job name: {experiment}/{run}; the run defaults to the module or script name
        debug: run with PyTorch's distributed debug variables set
    """
    if max_restarts < 0:
        raise ValueError(f"--max_restarts {max_restarts}: use 0 (no restarts) or more")
    if task and any(arg == "--task" or arg.startswith("--task=") for arg in script_args):
        raise ValueError("--task given twice: once to the component and once after --; keep the component's")
    if any(arg == "--output-dir" or arg.startswith("--output-dir=") for arg in script_args):
        raise ValueError(
            "--output-dir given to the trainer: set the component's --output_dir instead, which keeps "
            "checkpoints on --checkpoint_volume"
        )
    all_mounts = list(mounts or [])
    if checkpoint_volume:
        in_image = posixpath.normpath(posixpath.join(_WORKDIR, output_dir))
        if not (in_image + "/").startswith(_RUNS_MOUNT + "/"):
            raise ValueError(
                f"--output_dir {output_dir} lies outside {_RUNS_MOUNT}, where --checkpoint_volume "
                f"{checkpoint_volume} is mounted: checkpoints would be lost with the pod; use runs/NAME"
            )
        all_mounts += ["type=volume", f"src={checkpoint_volume}", f"dst={_RUNS_MOUNT}"]
    # torchrun reads each of its options from PET_<OPTION> when the command line does not give it,
    # and dist.ddp's command line has no --max-restarts.
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: a store per rendezvous round, or a node joining an elastic job (-j
    # MIN:MAXxN) never completes the round (trainer/launchers/torchrun.py, ELASTIC_AGENT_ENV; not imported: a
    # component loads where only TorchX is installed).
    job_env = {"PYTHONUNBUFFERED": "1", "PET_MAX_RESTARTS": str(max_restarts),
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}
    task_args = ["--task", task] if task else []
    return _dist_ddp(*task_args, "--output-dir", output_dir, *script_args, script=script,
                     m=None if script else "trainer", image=image, name=name, h=h, cpu=cpu, gpu=gpu, memMB=memMB,
                     j=j, env=job_env, max_retries=max_retries, rdzv_port=rdzv_port, mounts=all_mounts, debug=debug)
