# ruff: noqa: UP006, UP007, UP035, UP045
"""``dist.ddp`` as the design card writes it: ``torchx run dist.ddp -j 2x4 trainer/main.py [FLAGS]``.

TorchX's own ``dist.ddp`` wants the script behind ``--script`` (or a module behind ``-m``) and stops
with a traceback on a bare script path. This one takes a first argument that is a Python script, when
neither is given, as the script; everything else goes to TorchX's ``dist.ddp`` unchanged, so every
command that works with TorchX's works with this one too.

It is found through TorchX's ``[torchx.components]`` entry point (pyproject.toml), which replaces the
built-in component list in the environments where ddp-deploy is installed; the entries there list
TorchX's own components first and this module last, so ``dist.ddp`` is this one and every other
built-in (``dist.spmd``, ``utils.echo``, ...) stays TorchX's own. As TorchX's component files, it keeps
to the annotations its linter reads (hence the ``noqa`` above).
"""

from typing import Dict, List, Optional

import torchx
import torchx.specs as specs
from torchx.components.dist import ddp as _torchx_ddp


def ddp(
    *script_args: str,
    script: Optional[str] = None,
    m: Optional[str] = None,
    image: str = torchx.IMAGE,
    name: str = "/",
    h: Optional[str] = None,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 1024,
    j: str = "1x2",
    env: Optional[Dict[str, str]] = None,
    max_retries: int = 0,
    rdzv_port: int = 29500,
    rdzv_backend: str = "c10d",
    mounts: Optional[List[str]] = None,
    debug: bool = False,
    tee: int = 3,
) -> specs.AppDef:
    """Distributed data parallel: torchrun on every node, as TorchX's dist.ddp, and a script may come first.

    ``torchx run dist.ddp -j 2x4 trainer/main.py --epochs 3`` runs ``trainer/main.py`` with ``--epochs 3``;
    ``--script`` and ``-m`` work as with TorchX's own component.

    Args:
        script_args: the script to run (when neither --script nor -m is given and it ends in .py), then its
            arguments
        script: script to run on every node (relative to the working directory or the image's)
        m: Python module to run instead of a script
        image: container image
        name: job name: {experiment}/{run}; the run defaults to the script or module name
        h: a named resource, which replaces cpu, gpu and memMB
        cpu: CPUs per node
        gpu: GPUs per node (nproc_per_node must not exceed it)
        memMB: memory per node in MB
        j: [{min_nnodes}:]{nnodes}x{nproc_per_node}
        env: environment variables, e.g. A=1,B=2
        max_retries: how often the scheduler retries the job
        rdzv_port: port of the rendezvous store on the first node (multi-node jobs)
        rdzv_backend: torchrun's rendezvous backend (multi-node jobs)
        mounts: mounts: type=<bind|volume|device>,src=...,dst=...[,readonly]
        debug: run with PyTorch's distributed debug variables set
        tee: which streams torchrun copies to the console as well as to files: 0 none, 1 stdout, 2 stderr, 3 both
    """
    if script is None and m is None and script_args and script_args[0].endswith(".py"):
        script, script_args = script_args[0], script_args[1:]
    return _torchx_ddp(*script_args, script=script, m=m, image=image, name=name, h=h, cpu=cpu, gpu=gpu,
                       memMB=memMB, j=j, env=env, max_retries=max_retries, rdzv_port=rdzv_port,
                       rdzv_backend=rdzv_backend, mounts=mounts, debug=debug, tee=tee)
