"""ddp-export on a checkpoint written in this process: tied weights (a language model's embedding and output
layer are one tensor) survive into both output formats."""

from __future__ import annotations

import json
import logging

import torch
import torch.distributed.checkpoint as dcp

from tests.support.checkpoint_reading import state_at
from trainer.checkpoint import CheckpointManager, Monitor
from trainer.config import CheckpointConfig
from trainer.export import TIED_KEY, export_weights


def test_tied_weights_are_written_once_to_safetensors_and_named_and_stay_tied_in_a_torch_file(runtime, tmp_path):
    import safetensors.torch as safetensors  # a dev dependency: CI has it
    embedding = torch.arange(12.0).view(4, 3)
    state = state_at(1, embedding)
    state.parts["model"].update({"head.weight": embedding, "first_rows": embedding[:2], "bias": torch.ones(3)})
    manager = CheckpointManager(CheckpointConfig(), str(tmp_path / "ckpt"), runtime, logging.getLogger("export"),
                                Monitor("loss", "min"))
    manager.prepare()
    manager.save(state)
    manager.finish()
    manager.close()
    checkpoint = str(tmp_path / "ckpt" / "step-00000001")

    assert export_weights(checkpoint, str(tmp_path / "weights.safetensors")) == 4
    written = safetensors.load_file(str(tmp_path / "weights.safetensors"))
    assert set(written) == {"weight", "first_rows", "bias"}  # head.weight: the same tensor as weight
    from safetensors import safe_open

    with safe_open(str(tmp_path / "weights.safetensors"), "pt") as opened:
        assert json.loads(opened.metadata()[TIED_KEY]) == {"head.weight": "weight"}
    assert torch.equal(written["weight"], embedding) and torch.equal(written["first_rows"], embedding[:2])

    export_weights(checkpoint, str(tmp_path / "weights.pt"))
    loaded = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert loaded["head.weight"].data_ptr() == loaded["weight"].data_ptr()  # still one tensor
    assert torch.equal(loaded["first_rows"], embedding[:2])

    # A DCP folder, read back by torch's own reader: every name, tied ones too, at the top level.
    assert export_weights(checkpoint, str(tmp_path / "weights-dcp"), "dcp") == 4
    read_back = {key: torch.empty_like(value) for key, value in loaded.items()}
    dcp.load(read_back, checkpoint_id=str(tmp_path / "weights-dcp"), no_dist=True)
    assert all(torch.equal(read_back[key], value) for key, value in loaded.items())
    assert not (tmp_path / "weights-dcp.partial").exists()
