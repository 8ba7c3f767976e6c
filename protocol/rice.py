"""Rice coding of top-k's sorted local indices (`protocol.compress`'s ``topk_rice`` codec).

Plain top-k spends ceil(log2(chunk)) bits on every kept index (12 for 4096), though k sorted positions of a chunk
carry only about log2(C(chunk, k)) / k ~ log2(chunk / k) + 1.44 bits each (8.4 for 32 of 4096). Sending the gaps
between consecutive positions (the first from the chunk's start, each minus one, so every gap is >= 0) Rice-coded
comes within a bit of that: gap g = q x 2^r + rem, rem in `r` fixed bits, q in unary (q zero bits, then a one).

Why Rice and not a library: the gaps are near-geometric, for which a Rice code is close to optimal, and it has a
worst case a decoder can bound from the header alone: the gaps of one chunk sum to at most its length minus its
count, so its quotients sum to at most (length - count) >> r, and a valid payload's unary part has at most
kept + sum of those bits. zlib's Huffman-only mode codes bytes, and 12-bit indices or gaps up to 4095 do not fall
on byte boundaries; its output length has no such tight bound, and a decoder would have to inflate first and
check after. Both parts are vectorized with torch; nothing here loops per index.

`rice_bits` picks r per (chunk, k) to minimize that worst case (ties to the smaller r), so the codec's
guaranteed compression ratio is also its nominal one. Decoding checks everything the receiver can before the
caller allocates the output: exactly `kept` one-bits, no byte past the last one, and the rebuilt positions are
returned for the caller's range check (strictly increasing within a chunk by construction).
"""

from __future__ import annotations

import torch

from protocol.bitpack import pack_bits, packed_size, unpack_bits
from protocol.errors import CompressionError

BAD_INDEX = "bad index"
WRONG_LENGTH = "compressed size mismatch"


def rice_bits(chunk: int, k: int) -> int:
    """The remainder width r that minimizes one full chunk's worst-case index bits, k x r + (chunk - k) >> r."""
    widths = range(max(1, (chunk - 1).bit_length()) + 1)
    return min(widths, key=lambda r: (k * r + ((chunk - k) >> r), r))


def max_quotient_bits(lengths_counts: list[tuple[int, int]], r: int) -> int:
    """The most unary zero-bits a valid stream holds: per chunk (length, kept), (length - kept) >> r."""
    return sum((length - count) >> r for length, count in lengths_counts)


def unary_bounds(kept: int, lengths_counts: list[tuple[int, int]], r: int) -> tuple[int, int]:
    """The fewest and the most bytes a valid unary part of `kept` entries takes."""
    return packed_size(kept, 1), packed_size(kept + max_quotient_bits(lengths_counts, r), 1)


def encode(local: torch.Tensor, chunk_of: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed remainders, packed unary quotients) of `local` (int64 positions, strictly increasing within each
    run of equal `chunk_of`)."""
    gaps = local - _previous(local, chunk_of) - 1
    remainders = pack_bits(gaps & ((1 << r) - 1), r) if r else torch.empty(0, dtype=torch.uint8)
    ends = torch.cumsum((gaps >> r) + 1, dim=0) - 1
    bits = torch.zeros(int(ends[-1]) + 1 if ends.numel() else 0, dtype=torch.uint8)
    bits[ends] = 1
    return remainders, pack_bits(bits, 1)


def _previous(local: torch.Tensor, chunk_of: torch.Tensor) -> torch.Tensor:
    """Each entry's predecessor in its chunk, -1 for a chunk's first."""
    prev = torch.cat([local.new_full((1,), -1), local[:-1]])
    first = torch.cat([chunk_of.new_ones(1, dtype=torch.bool), chunk_of[1:] != chunk_of[:-1]])
    return torch.where(first, torch.full_like(prev, -1), prev)


def decode(remainders: torch.Tensor, unary: torch.Tensor, chunk_of: torch.Tensor, r: int) -> torch.Tensor:
    """The local positions (int64, one per `chunk_of` entry) from the two parts a header sized: `remainders`
    holds exactly packed_size(kept, r) bytes, `unary` at most the caller's bound (checked before this call).
    Raises CompressionError (BAD_INDEX: not exactly kept terminators; WRONG_LENGTH: bytes past the last)."""
    kept = chunk_of.numel()
    bits = ((unary.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1)
    ends = torch.nonzero(bits).reshape(-1)
    if ends.numel() != kept:
        raise CompressionError(f"{ends.numel()} unary terminators for {kept} indices", reason=BAD_INDEX)
    if kept and unary.numel() != packed_size(int(ends[-1]) + 1, 1):
        raise CompressionError("bytes past the last unary terminator", reason=WRONG_LENGTH)
    quotients = torch.diff(ends, prepend=ends.new_full((1,), -1)) - 1
    gaps = quotients << r
    if r:
        gaps |= unpack_bits(remainders, kept, r)
    # positions: a running sum of gap + 1 that restarts at every chunk (chunk_of is non-decreasing)
    steps = torch.cumsum(gaps + 1, dim=0)
    first = torch.cat([chunk_of.new_ones(1, dtype=torch.bool), chunk_of[1:] != chunk_of[:-1]])
    before = torch.where(first, steps - gaps - 1, torch.zeros_like(steps))
    return steps - torch.cummax(before, dim=0).values - 1
