"""``ddp-shard``: write a dataset as tar shards with their index, or index WebDataset shards that exist.

    ddp-shard write --dataset fashion-mnist --output s3://bucket/fmnist --shard-mb 64
    ddp-shard write --dataset imagefolder --data-dir /data/photos --output /data/photo-shards
    ddp-shard index s3://bucket/laion --split train='train-*.tar' --split eval='val-*.tar'

Then train with ``ddp-train --dataset shards --data-dir s3://bucket/fmnist``. Any other map-style dataset is
written from Python: trainer.data.shards.writer.write_dataset.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.data.catalog import SPECS
from trainer.data.imagefolder import load_imagefolder
from trainer.data.locate import default_data_dir, find_files, local_filesystem
from trainer.data.shards.writer import DEFAULT_SHARD_MB, ShardWriter, encode_image_item, index_shards
from trainer.data.synthetic import make_synthetic
from trainer.errors import EXIT_USAGE, UserError, user_message
from trainer.redact import RedactingArgumentParser, redact

__all__ = ["main"]

BUILT_IN = (*SPECS, "synthetic", "imagefolder")


def _parser() -> argparse.ArgumentParser:
    parser = RedactingArgumentParser(prog="ddp-shard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="a built-in dataset or an image folder as shards with their index")
    write.add_argument("--dataset", required=True, choices=BUILT_IN, help="what to write")
    write.add_argument("--data-dir", default="", help="where the dataset is (a local folder; default as ddp-train's)")
    write.add_argument("--output", required=True, help="folder or fsspec URL to write the shards and index.json to")
    write.add_argument("--shard-mb", type=float, default=DEFAULT_SHARD_MB, help="target size of a shard, in MB")
    write.add_argument("--image-size", type=int, default=224, help="imagefolder: recorded as the size to train at "
                                                                    "(the files are kept as they are)")
    write.add_argument("--eval-fraction", type=float, default=0.1, help="imagefolder without train/ and val/: "
                                                                         "the share held out for evaluation")
    write.add_argument("--seed", type=int, default=0, help="imagefolder: the seed of that split")
    write.add_argument("--synthetic-shape", default="1,28,28", help="synthetic: C,H,W")
    write.add_argument("--synthetic-train-size", type=int, default=2048)
    write.add_argument("--synthetic-test-size", type=int, default=512)
    write.add_argument("--synthetic-classes", type=int, default=10)
    index = commands.add_parser("index", help="index existing WebDataset tar shards in place")
    index.add_argument("url", help="folder or fsspec URL that holds the shards")
    index.add_argument("--split", action="append", default=[], metavar="NAME=GLOB",
                       help="a split and the shards' file names (default: train='*.tar')")
    index.add_argument("--num-classes", type=int, default=0, help="classes (default: counted from the .cls members)")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parser().parse_args(argv)
    try:
        if args.command == "write":
            written = _write(args)
        else:
            patterns = dict(_split_pattern(value) for value in args.split) or {"train": "*.tar"}
            written = index_shards(args.url, patterns, {"num_classes": args.num_classes} if args.num_classes else {})
    except UserError as error:
        print(f"error: {redact(user_message(error))}", file=sys.stderr)
        return EXIT_USAGE
    counts = ", ".join(f"{split}: {sum(entry.samples for entry in entries)} samples in {len(entries)} shards"
                       for split, entries in written.splits.items())
    print(f"{redact(args.output if args.command == 'write' else args.url)}: {counts}")
    return 0


def _split_pattern(value: str) -> tuple[str, str]:
    name, equals, pattern = value.partition("=")
    if not equals or not name or not pattern:
        raise SystemExit(f"ddp-shard index: --split {value!r}: give NAME=GLOB, such as train='train-*.tar'")
    return name, pattern


def _write(args: argparse.Namespace) -> Any:
    writer = ShardWriter(args.output, int(args.shard_mb * 1e6))
    splits, info = _items(args)
    for split, items in splits.items():
        for number, (extension, data, label) in enumerate(items):
            members = encode_image_item((data, label)) if extension is None else {extension: data,
                                                                                   "cls": str(label).encode()}
            writer.add(split, f"{number:09d}", members)
    return writer.close(info)


Items = Iterator[tuple[str | None, Any, int]]  # (extension of the kept file, or None: an image tensor to encode)


def _items(args: argparse.Namespace) -> tuple[dict[str, Items], dict[str, Any]]:
    if args.dataset == "imagefolder":
        if not args.data_dir:
            raise UserError("ddp-shard write --dataset imagefolder needs --data-dir: the folder of class folders")
        train, test, info = load_imagefolder(Path(args.data_dir).expanduser(), args.image_size, args.eval_fraction,
                                             args.seed)

        def files(dataset: Any) -> Items:
            for path, label in zip(dataset.files, dataset.labels.tolist(), strict=True):
                yield Path(path).suffix.lstrip(".").lower(), Path(path).read_bytes(), label

        return {"train": files(train), "eval": files(test)}, {"num_classes": info.num_classes, "channels": 3}
    if args.dataset == "synthetic":
        shape = tuple(int(part) for part in args.synthetic_shape.split(","))
        train, test, info = make_synthetic(shape, args.synthetic_classes, args.synthetic_train_size,  # type: ignore[arg-type]
                                           args.synthetic_test_size)
    else:
        spec = SPECS[args.dataset]
        folder = args.data_dir or default_data_dir(spec.name)
        found = find_files(local_filesystem(), folder, spec, shown_as=folder, hint="point --data-dir at it")
        from trainer.data.dataset import ImageTensorDataset

        (train_images, train_labels), (test_images, test_labels) = spec.read({n: Path(f.path)
                                                                              for n, f in found.items()})
        train = ImageTensorDataset(train_images, train_labels, spec.mean, spec.std)
        test = ImageTensorDataset(test_images, test_labels, spec.mean, spec.std)
        info = spec.info

    def tensors(dataset: Any) -> Items:
        for image, label in zip(dataset.images, dataset.labels.tolist(), strict=True):
            yield None, image, label

    details = {"num_classes": info.num_classes, "channels": info.in_channels, "image_size": info.image_size[0],
               "mean": list(train.mean), "std": list(train.std)}
    return {"train": tensors(train), "eval": tensors(test)}, details


if __name__ == "__main__":
    sys.exit(main())
