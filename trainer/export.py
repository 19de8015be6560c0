"""``ddp-export CHECKPOINT OUTPUT``: the model's weights of one checkpoint as one file, for inference.

Any checkpoint: a DDP run's (its state file holds whole tensors) or a sharded one's, whatever world size wrote
it (each tensor put together from every rank's rows, one process, no process group). The checkpoint is
verified against its manifest first. OUTPUT ending in ``.safetensors`` is written with safetensors (installed
separately: ``pip install safetensors``), tied weights once (the others named in its metadata, ``TIED_KEY``);
anything else as a torch file of plain tensors, which
``torch.load(OUTPUT, weights_only=True)`` reads: ``model.load_state_dict(torch.load(OUTPUT, weights_only=True))``;
``--format dcp`` as a torch.distributed.checkpoint folder (TorchTitan's layout, which ``--init-from`` reads).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from trainer.checkpoint import InvalidCheckpoint
from trainer.checkpoint.reading import UnknownFormat
from trainer.checkpoint.shards import fit_all
from trainer.checkpoint.verification import verify_path
from trainer.errors import EXIT_OK, EXIT_USAGE
from trainer.redact import RedactingArgumentParser, redact

__all__ = ["FORMATS", "TIED_KEY", "export_weights", "main", "untied"]

# The safetensors metadata entry that names the tied weights written once: {"lm_head.weight": "embed.weight"}.
TIED_KEY = "ddp-deploy.tied"


class ExportError(Exception):
    """Why a checkpoint cannot be exported, in one line."""


FORMATS = ("auto", "torch", "safetensors", "dcp")


def export_weights(checkpoint: str, output: str, kind: str = "auto") -> int:
    """Write the checkpoint's model weights to ``output``; returns the number of tensors written. ``kind``: auto
    (by the output's name: .safetensors, else torch), torch, safetensors, or dcp (a torch.distributed.checkpoint
    folder, the model's tensors at its top level by name: TorchTitan's layout, which --init-from reads)."""
    if kind == "auto":
        kind = "safetensors" if output.endswith(".safetensors") else "torch"
    try:
        loaded = verify_path(checkpoint)
        # A sharded checkpoint's tensors are read into memory mapped from files beside the output (removed at
        # once: the mappings keep them), which the kernel writes back and frees under pressure, so the export
        # does not hold the model (a DDP checkpoint's state file is mapped already).
        source = loaded.shard_source(allocate=_file_backed(Path(output).resolve().parent))
        weights = fit_all(loaded.state.model, None, source)
    except ExportError:
        raise
    except (InvalidCheckpoint, UnknownFormat, ValueError) as problem:
        raise ExportError(f"{checkpoint}: {problem}") from None
    except OSError as error:
        raise ExportError(f"{checkpoint}: cannot read it ({error.strerror or error})") from None
    except Exception as error:  # noqa: BLE001 - a storage client's own (botocore's): one line, never a traceback
        raise ExportError(f"{checkpoint}: cannot read it ({' '.join(str(error).split())[:300]})") from None
    tensors = {key: value.detach() for key, value in weights.items() if isinstance(value, torch.Tensor)}
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    partial = f"{output}.partial"
    if kind == "dcp":
        return _write_dcp(tensors, output)
    if kind == "safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ExportError("writing .safetensors needs the safetensors package: pip install safetensors, or "
                              "name a .pt output") from None
        kept, tied = untied(tensors)
        metadata = {"step": str(loaded.manifest.get("step", ""))}
        if tied:
            metadata[TIED_KEY] = json.dumps(tied, sort_keys=True)
        save_file(kept, partial, metadata=metadata)
    else:
        # torch.save keeps tied weights tied (one storage, two names), as load_state_dict expects them.
        torch.save({key: value.contiguous() for key, value in tensors.items()}, partial)
    os.replace(partial, output)  # a reader never finds half a file under the name
    return len(tensors)


# Tensors smaller than this are read into plain memory: a file each would cost more than they hold.
FILE_BACKED_BYTES = 1 << 20


def _file_backed(folder: Path) -> Callable[[list[int], torch.dtype], torch.Tensor]:
    def allocate(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        count = math.prod(shape)
        size = count * torch.empty((), dtype=dtype).element_size()
        if size < FILE_BACKED_BYTES:
            return torch.empty(shape, dtype=dtype)
        folder.mkdir(parents=True, exist_ok=True)
        descriptor, path = tempfile.mkstemp(prefix=".ddp-export-", dir=folder)
        try:
            # The blocks reserved now: a full disk is ENOSPC here, in one line, not SIGBUS when a page is written.
            os.posix_fallocate(descriptor, 0, size)
            return torch.from_file(path, shared=True, size=count, dtype=dtype).view(shape)
        except OSError as error:
            raise ExportError(f"no room for the weights' working copy in {folder} ({error.strerror or error}); "
                              f"free space there or write the output elsewhere") from None
        finally:
            os.close(descriptor)
            os.unlink(path)

    return allocate


def _write_dcp(tensors: dict[str, torch.Tensor], output: str) -> int:
    """A DCP folder written by torch's own writer (one process), under a temporary name, then renamed: a reader
    never finds half a folder under the name."""
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp

    if Path(output).exists():
        raise ExportError(f"{output} exists; a DCP export writes a new folder: remove it or name another")
    partial = f"{output}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: the intent
        dcp.save({key: value.contiguous() for key, value in tensors.items()}, checkpoint_id=partial, no_dist=True)
    os.replace(partial, output)
    return len(tensors)


def untied(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors safetensors accepts (it refuses two that share memory) and the ties it cannot hold: a name that is
    the very same tensor as an earlier one (a language model's tied embedding and output layer) is written once,
    under the earlier name, and recorded as ``{name: written name}``; a different view of a shared storage is
    written as a copy of its own."""
    kept: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], str] = {}
    storages: set[int] = set()
    for name, tensor in tensors.items():
        view = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if view in seen and tensor.numel():
            tied[name] = seen[view]
            continue
        storage = tensor.untyped_storage().data_ptr()
        shared = storage in storages and tensor.numel() > 0
        kept[name] = tensor.clone() if shared else tensor.contiguous()
        seen[view] = name
        storages.add(storage)
    return kept, tied


def main(argv: Sequence[str] | None = None) -> int:
    parser = RedactingArgumentParser(prog="ddp-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint folder (step-NNNNNNNN, or step-NNNNNNNN.<save> on an "
                                           "object store), local or a storage URL")
    parser.add_argument("output", help="the file to write: NAME.safetensors, or NAME.pt (torch, weights only); a "
                                           "folder with --format dcp")
    parser.add_argument("--format", choices=FORMATS, default="auto",
                        help="auto (by the output's name), torch, safetensors, or dcp (a torch.distributed.checkpoint "
                             "folder, the model's tensors by name at its top level, as TorchTitan keeps them)")
    args = parser.parse_args(argv)
    try:
        count = export_weights(args.checkpoint, args.output, args.format)
    except ExportError as problem:
        print(f"ddp-export: {redact(str(problem), args.checkpoint)}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {count} tensors to {args.output}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
