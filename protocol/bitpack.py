"""Bit packing shared by the codecs that put values narrower than a byte on the wire (`protocol.compress`'s top-k
indices and values, `protocol.boundary_lowbit`'s codes).

Layout: value i occupies bits [i x width, (i + 1) x width) of the stream, least significant bit first, bytes
little-endian; the last byte is padded with zero bits, so `count` values take ceil(count x width / 8) bytes.

Values are packed a group at a time: as many values as fill whole bytes and fit an int64 (`_group_bits`) are summed
into one word and the word cut into bytes, 15-20x faster than one byte per bit (and larger groups are faster than the
smallest that fill bytes: fewer, longer rows). A width whose smallest byte-filling group is wider than an int64
holds (9, 11, 13 or 15 bits: 72 to 120 bits) goes through the bit-wise path instead; both give the same bytes.
"""

from __future__ import annotations

import math

import torch

_WORD_BITS = 63  # what an int64 holds without reaching its sign bit


def packed_size(count: int, width: int) -> int:
    """Bytes of `count` values of `width` bits."""
    return -(-count * width // 8)


def _group_bits(width: int) -> int:
    """Bits of one packing group: the largest multiple of lcm(width, 8) an int64 holds (0: none does)."""
    smallest = math.lcm(width, 8)
    return smallest * (_WORD_BITS // smallest)


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative ints < 2**width (any integer dtype), `width` bits each: a 1-D uint8 tensor of
    `packed_size(values.numel(), width)` bytes."""
    flat = values.reshape(-1).to(torch.int64)
    count = flat.numel()
    group_bits = _group_bits(width)
    if not group_bits:
        return _pack_bitwise(flat, width)
    per_group = group_bits // width
    padded = torch.nn.functional.pad(flat, (0, (-count) % per_group)).view(-1, per_group)
    word = (padded << (width * torch.arange(per_group, dtype=torch.int64))).sum(dim=1, keepdim=True)
    packed = (word >> (8 * torch.arange(group_bits // 8, dtype=torch.int64))) & 0xFF
    return packed.to(torch.uint8).reshape(-1)[: packed_size(count, width)]


def unpack_bits(data: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """`pack_bits`'s inverse: the first `count` values (int64) of the uint8 tensor `data`, which holds at least
    `packed_size(count, width)` bytes (the caller checked its length)."""
    data = data[: packed_size(count, width)]
    group_bits = _group_bits(width)
    if not group_bits:
        return _unpack_bitwise(data, count, width)
    group_bytes = group_bits // 8
    padded = torch.nn.functional.pad(data.to(torch.int64), (0, (-data.numel()) % group_bytes))
    word = (padded.view(-1, group_bytes) << (8 * torch.arange(group_bytes, dtype=torch.int64))).sum(
        dim=1, keepdim=True
    )
    values = (word >> (width * torch.arange(group_bits // width, dtype=torch.int64))) & ((1 << width) - 1)
    return values.reshape(-1)[:count]


def _pack_bitwise(flat: torch.Tensor, width: int) -> torch.Tensor:
    shifts = torch.arange(width, dtype=torch.int64)
    bits = ((flat.unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    bits = torch.nn.functional.pad(bits, (0, (-bits.numel()) % 8))
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    return (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bitwise(data: torch.Tensor, count: int, width: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = ((data.unsqueeze(1) >> shifts) & 1).reshape(-1)[: count * width].to(torch.int64)
    return (bits.view(count, width) << torch.arange(width, dtype=torch.int64)).sum(dim=1)
