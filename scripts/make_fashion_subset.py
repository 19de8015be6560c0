"""Regenerate trainer/data/fashion_mnist_subset/ from the full Fashion-MNIST.

The subset keeps the first N images of each class, in the dataset's own (already shuffled) order,
so that it is stratified, deterministic, and its first K images still mix all classes. The gzip
files carry no timestamp: running this again on the same source gives the same bytes.

    sudo apt-get install dataset-fashion-mnist
    PYTHONPATH=. .venv/bin/python scripts/make_fashion_subset.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from trainer.data import SHIPPED_FASHION_MNIST, SYSTEM_FASHION_MNIST, read_idx, write_idx

SPLITS = (("train", 500), ("t10k", 100))  # (file prefix, images per class): 5000 + 1000 images, about 2.6 MB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=SYSTEM_FASHION_MNIST, help="folder with the full dataset")
    parser.add_argument("--out", type=Path, default=SHIPPED_FASHION_MNIST, help="folder to write the subset to")
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    for prefix, per_class in SPLITS:
        images = read_idx(source_file(args.source, f"{prefix}-images-idx3-ubyte"), 3)
        labels = read_idx(source_file(args.source, f"{prefix}-labels-idx1-ubyte"), 1)
        keep = np.sort(np.concatenate([np.flatnonzero(labels == c)[:per_class] for c in np.unique(labels)]))
        write_idx(args.out / f"{prefix}-images-idx3-ubyte.gz", images[keep])
        write_idx(args.out / f"{prefix}-labels-idx1-ubyte.gz", labels[keep])
        print(f"{prefix}: {len(keep)} of {len(labels)} images, {per_class} per class -> {args.out}")


def source_file(folder: Path, name: str) -> Path:
    for candidate in (folder / f"{name}.gz", folder / name):
        if candidate.is_file():
            return candidate
    raise SystemExit(f"{folder} has no {name}[.gz]: install the Debian package dataset-fashion-mnist or pass --source")


if __name__ == "__main__":
    main()
