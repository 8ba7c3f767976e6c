"""The one bit packer behind the top-k and low-bit codecs: the layout both put on the wire (value i at bits
[i x width, (i + 1) x width), least significant bit first, the last byte zero-padded), for every width either uses."""

from __future__ import annotations

import pytest
import torch

from protocol.bitpack import _pack_bitwise, pack_bits, packed_size, unpack_bits


def reference(values: list[int], width: int) -> bytes:
    """The layout, written out one bit at a time."""
    stream = 0
    for i, value in enumerate(values):
        stream |= value << (i * width)
    return stream.to_bytes(packed_size(len(values), width), "little")


@pytest.mark.parametrize("width", range(1, 17))
def test_every_width_packs_to_the_layout_and_back(width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    for count in (0, 1, 7, 8, 77, 1000):
        values = torch.randint(0, 1 << width, (count,), generator=gen)
        packed = pack_bits(values, width)
        assert packed.dtype == torch.uint8 and packed.numel() == -(-count * width // 8)
        assert bytes(packed.numpy().tobytes()) == reference(values.tolist(), width)
        assert torch.equal(unpack_bits(packed, count, width), values)
        # the word-wise and bit-wise paths agree (the wide widths take the bit-wise one anyway)
        assert torch.equal(_pack_bitwise(values, width), packed)


def test_unpacking_reads_only_the_packed_bytes_and_any_integer_dtype_packs() -> None:
    codes = torch.tensor([3, 0, 2, 1, 3], dtype=torch.uint8)
    packed = pack_bits(codes, 2)
    assert packed.tolist() == [0b01_10_00_11, 0b11]  # 3 | 0 << 2 | 2 << 4 | 1 << 6, then 3
    trailing = torch.cat([packed, torch.full((3,), 0xFF, dtype=torch.uint8)])  # what follows in a payload
    assert unpack_bits(trailing, 5, 2).tolist() == codes.tolist()
