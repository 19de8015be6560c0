"""``ddp-export CHECKPOINT OUTPUT``: the model's weights of one checkpoint as one file, for inference.

Any checkpoint: a DDP run's (its state file holds whole tensors) or a sharded one's, whatever world size wrote
it (each tensor put together from every rank's rows, one process, no process group). The checkpoint is
verified against its manifest first. OUTPUT ending in ``.safetensors`` is written with safetensors (installed
separately: ``pip install safetensors``); anything else as a torch file of plain tensors, which
``torch.load(OUTPUT, weights_only=True)`` reads: ``model.load_state_dict(torch.load(OUTPUT, weights_only=True))``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from trainer.checkpoint import InvalidCheckpoint
from trainer.checkpoint.manager import UnknownFormat, verify_path
from trainer.checkpoint.shards import fit
from trainer.errors import EXIT_OK, EXIT_USAGE
from trainer.redact import RedactingArgumentParser

__all__ = ["export_weights", "main"]


class ExportError(Exception):
    """Why a checkpoint cannot be exported, in one line."""


def export_weights(checkpoint: str, output: str) -> int:
    """Write the checkpoint's model weights to ``output``; returns the number of tensors written."""
    try:
        loaded = verify_path(checkpoint)
        source = loaded.shard_source()
        weights = fit(loaded.state.model, None, source)
    except (InvalidCheckpoint, UnknownFormat, ValueError) as problem:
        raise ExportError(f"{checkpoint}: {problem}") from None
    except OSError as error:
        raise ExportError(f"{checkpoint}: cannot read it ({error.strerror or error})") from None
    tensors = {key: value.detach().contiguous() for key, value in weights.items() if isinstance(value, torch.Tensor)}
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    partial = f"{output}.partial"
    if output.endswith(".safetensors"):
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ExportError("writing .safetensors needs the safetensors package: pip install safetensors, or "
                              "name a .pt output") from None
        save_file(tensors, partial, metadata={"step": str(loaded.manifest.get("step", ""))})
    else:
        torch.save(tensors, partial)
    os.replace(partial, output)  # a reader never finds half a file under the name
    return len(tensors)


def main(argv: Sequence[str] | None = None) -> int:
    parser = RedactingArgumentParser(prog="ddp-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint folder (step-NNNNNNNN), local or a storage URL")
    parser.add_argument("output", help="the file to write: NAME.safetensors, or NAME.pt (torch, weights only)")
    args = parser.parse_args(argv)
    try:
        count = export_weights(args.checkpoint, args.output)
    except ExportError as problem:
        print(f"ddp-export: {problem}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {count} tensors to {args.output}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
