"""Training state as plain types and tensors only, so that checkpoints load with weights_only=True.

Loading a pickle from shared storage runs code; NumPy's RNG state (an ndarray) and argparse
namespaces are the usual offenders, so they are converted here.
"""

from __future__ import annotations

import platform
import random
from importlib import metadata
from typing import Any

import numpy as np
import torch

import trainer


def capture_rng() -> dict[str, Any]:
    key, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "key": str(key),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state((
        numpy_state["key"],
        numpy_state["keys"].numpy().astype(np.uint32),
        numpy_state["position"],
        numpy_state["has_gauss"],
        numpy_state["cached_gaussian"],
    ))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def library_versions() -> dict[str, str]:
    # str(): torch.__version__ is a TorchVersion, a class weights_only loading refuses. torchvision's
    # version comes from its metadata: importing it costs seconds in processes that only save.
    return {
        "trainer": str(trainer.__version__),
        "torch": str(torch.__version__),
        "torchvision": metadata.version("torchvision"),
        "numpy": str(np.__version__),
        "python": platform.python_version(),
    }
