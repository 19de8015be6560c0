"""The checkpoints' CRC-32 (trainer.checkpoint.storage.checksum): zlib-ng's where installed, and always the very
checksum zlib computes, so that checkpoints written with either are read with the other."""

from __future__ import annotations

import io
import os
import zlib

from trainer.checkpoint.storage.checksum import PARALLEL_CHECKSUM_BYTES, ChecksumWriter, crc32


def test_the_checksum_is_zlibs_crc32_piece_by_piece():
    data = os.urandom(3 * PARALLEL_CHECKSUM_BYTES + 12345)
    assert crc32.__module__ == "zlib_ng.zlib_ng"  # the package's dependency is what CI runs
    for cut in (0, 1, 4095, PARALLEL_CHECKSUM_BYTES + 7, len(data)):
        assert crc32(data[cut:], crc32(data[:cut])) == zlib.crc32(data)


def test_a_file_streamed_in_pieces_large_and_small_has_zlibs_checksum_of_its_bytes():
    pieces = [os.urandom(size) for size in (10, 2 * PARALLEL_CHECKSUM_BYTES + 3, 0, 777, PARALLEL_CHECKSUM_BYTES)]
    target = io.BytesIO()
    with ChecksumWriter(target) as checksummed:
        for piece in pieces:
            checksummed.write(piece)
    whole = b"".join(pieces)
    assert target.getvalue() == whole
    assert checksummed.summary() == {"bytes": len(whole), "crc32": f"{zlib.crc32(whole):08x}"}
