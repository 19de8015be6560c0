"""Random state, all of it in one place: seeding, capture and restore for checkpoints, per-item seeds.

Three generators matter: Python's ``random``, NumPy's global one and torch's (CPU, and CUDA where
present). A checkpoint holds each rank's state as plain types and tensors, so that it loads with
``weights_only=True`` (NumPy's state is an ndarray, which that refuses).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

RngState = dict[str, Any]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_after_resize(seed: int, step: int, rank: int) -> None:
    """A fresh stream for a rank of a resumed job whose world size changed: its processes are not the
    ones that saved, so no saved state belongs to it. Derived from where training stands, so that two
    resumes of the same checkpoint agree."""
    seed_everything(seed + 1_000_003 * step + rank)


def capture_rng() -> RngState:
    key, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss = random.getstate()
    state: RngState = {
        # Its 625 numbers as one tensor, not a tuple: pickled one by one they were a third of a small save.
        "python": (version, torch.tensor(internal, dtype=torch.int64), gauss),
        "numpy": {
            "key": str(key),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: RngState) -> None:
    version, internal, gauss = state["python"]
    # A tensor since checkpoint format 3's later saves; a tuple of ints before.
    numbers = internal.tolist() if isinstance(internal, torch.Tensor) else internal
    random.setstate((version, tuple(numbers), gauss))
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


@contextmanager
def isolated() -> Iterator[None]:
    """Random numbers drawn inside do not change what is drawn after (CPU generators)."""
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


def item_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one item of one epoch, unrelated to its neighbours' (a hash, not a sum)."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_item(seed: int, epoch: int, index: int) -> None:
    """Seed every generator from (seed, epoch, index): an item's random transforms then come out the same
    whichever rank, DataLoader worker or resumed process fetches it."""
    value = item_seed(seed, epoch, index)
    random.seed(value)
    np.random.seed(value % 2**32)
    # default_generator, not torch.manual_seed: that also queues a CUDA seeding, ~100 µs a call.
    torch.default_generator.manual_seed(value)

