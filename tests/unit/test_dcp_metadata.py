"""DCP's .metadata read restricted (trainer.checkpoint.dcp_metadata.read_metadata): none but DCP's types, no attribute
set on anything but DCP's own records, and a layout whose chunks cover each tensor exactly once, each in a file."""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, ChunkStorageMetadata, Metadata

from trainer.checkpoint.dcp_metadata import read_metadata
from trainer.checkpoint.reading import DCP_METADATA, InvalidCheckpoint


def metadata_bytes(tmp_path: Path) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model.weight": torch.ones(4, 3), "model.step": torch.tensor(2.0)}, checkpoint_id=str(tmp_path),
                 no_dist=True)
    return (tmp_path / ".metadata").read_bytes()


def test_torchs_own_metadata_reads_back(tmp_path):
    metadata = read_metadata(metadata_bytes(tmp_path))
    assert list(metadata.state_dict_metadata["model.weight"].size) == [4, 3]


def test_a_pickle_that_sets_attributes_of_a_class_is_refused_and_changes_nothing(tmp_path):
    """BUILD with a state of (None, {name: value}) sets attributes of whatever is under it: here DCP's Metadata
    class itself, whose __getstate__ every later save would then use."""
    body = pickle.dumps(read_metadata(metadata_bytes(tmp_path)), protocol=2)
    def global_(module: str, name: str) -> bytes:
        return b"c" + module.encode() + b"\n" + name.encode() + b"\n"
    key = b"__getstate__"
    prefix = (global_("torch.distributed.checkpoint.metadata", "Metadata") + b"N}" + b"X"
              + len(key).to_bytes(4, "little") + key + global_("collections", "OrderedDict") + b"s\x86b0")
    before = Metadata.__dict__.get("__getstate__")
    with pytest.raises(InvalidCheckpoint, match=r"^\.metadata sets attributes of type, which DCP's metadata never "
                                                r"does: refused$"):
        read_metadata(b"\x80\x02" + prefix + body[2:])
    assert Metadata.__dict__.get("__getstate__") is before


@pytest.mark.parametrize(("damage", "message"), [
    ("repeat", "the chunks of model.weight do not cover it exactly once"),
    ("drop", "the chunks of model.weight do not cover it exactly once"),
    ("outside", "a chunk of model.weight lies outside its shape [4, 3]"),
    ("overlap", "chunks of model.weight overlap"),
])
def test_chunks_must_cover_each_tensor_exactly_once(damage, message, tmp_path):
    """A chunk listed a thousand times would have every rank read it a thousand times; one left out would leave
    rows of memory unread."""
    metadata = read_metadata(metadata_bytes(tmp_path))
    tensor = metadata.state_dict_metadata["model.weight"]
    [chunk] = tensor.chunks
    if damage == "repeat":
        tensor.chunks = [chunk] * 1000
    elif damage == "drop":
        tensor.chunks = []
    elif damage == "outside":
        tensor.chunks = [ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([4, 3]))]
    else:  # 3 x 4 in three chunks whose volumes add up, two of them overlapping at (1, 1)
        tensor.size = torch.Size([3, 4])
        tensor.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 2])),
                         ChunkStorageMetadata(torch.Size([1, 1]), torch.Size([2, 3])),
                         ChunkStorageMetadata(torch.Size([0, 2]), torch.Size([1, 2]))]
        [(key, info)] = [(key, info) for key, info in metadata.storage_data.items() if key.fqn == "model.weight"]
        metadata.storage_data.update({type(key)("model.weight", chunk.offsets): info for chunk in tensor.chunks})
    with pytest.raises(InvalidCheckpoint, match=f"^{re.escape(DCP_METADATA + ': ' + message)}$"):
        read_metadata(pickle.dumps(metadata))


def test_items_written_through_extensions_of_any_kind_are_one_line(tmp_path):
    metadata = read_metadata(metadata_bytes(tmp_path))
    for info in metadata.storage_data.values():
        info.transform_descriptors = [3, None]
    with pytest.raises(InvalidCheckpoint, match=r"^\.metadata: items written through DCP extensions \(3, None\), "
                                                r"which this trainer does not read$"):
        read_metadata(pickle.dumps(metadata))


def test_an_enum_member_pickled_by_name_reads_and_no_other_getattr_does(tmp_path, monkeypatch):
    """Python 3.11.2 (Debian's) and 3.12 pickle an enum member as getattr(its class, its name); 3.11.7 by value.
    Both are DCP's metadata; a getattr of anything else is refused."""
    members = _MEM_FORMAT_ENCODING
    monkeypatch.setattr(members, "__reduce_ex__", lambda self, protocol: (getattr, (type(self), self.name)))
    written = pickle.dumps(read_metadata(metadata_bytes(tmp_path)))
    assert b"getattr" in written
    assert list(read_metadata(written).state_dict_metadata["model.weight"].size) == [4, 3]

    class Hostile:
        def __reduce__(self):
            return getattr, (Metadata, "__init__")  # a class the metadata may hold, an attribute it never looks up

    with pytest.raises(InvalidCheckpoint, match=r"^\.metadata looks up '__init__' of Metadata, which DCP's metadata "
                                                r"never does: refused$"):
        read_metadata(pickle.dumps(Hostile()))
