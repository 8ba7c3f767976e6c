"""Entropy coding of a boundary codec's codes (issue 20): the ``...z`` codecs of `protocol.boundary_lowbit`.

The codes of a channel or a row quantized on a uniform grid are far from uniform (the middle levels are the common
ones: on the harness's boundary gradients 6 levels carry 2.1 bits of entropy a value, not 2.6), so a Huffman code
spends fewer bits on them than a fixed-width packing. The coder is the standard library's: zlib's raw deflate with
strategy Z_HUFFMAN_ONLY (no string matching, one Huffman table per block over byte symbols: fast C, within a few
percent of the symbols' entropy). Symbols are one code per byte, or two (c0 + L x c1, the first code the least
significant digit) when L^2 <= 256, which brings small alphabets closer to their entropy (4 gradient levels: 1.58
bits a value against 1.75 with one code per byte).

Stream: raw deflate (windowBits -15, no zlib header or checksum: the frame's signature covers the bytes), the whole
payload after the scales. Decoding is bounded before it allocates: the decompressor is asked for at most the
declared number of symbols (`decompressobj.decompress(data, max_length)`), then for one more byte, which must not
exist; a stream that ends short of the declared count, inflates beyond it, carries bytes after its end, fails to
inflate, or holds a symbol of L^n or more (or a nonzero pad code) is refused with a CompressionError before any
tensor of the declared size is built. A deflate stream inflates up to ~1000x, so without the bound a frame under
the cap could make the receiver allocate a gigabyte (`tests/unit/test_boundary_entropy.py` shows both).
"""

from __future__ import annotations

import zlib

import torch

from protocol.errors import CompressionError

BAD_CODE = "bad code"  # a symbol or code word off the grid
BAD_STREAM = "bad stream"  # a deflate stream that fails to inflate to exactly the declared symbols
_WBITS = -15  # raw deflate
_LEVEL = 9  # with Z_HUFFMAN_ONLY the level changes nothing but the block splitting; 9 is as fast here
_MEM_LEVEL = 9  # the largest symbol buffer: fewer blocks, fewer Huffman tables


def codes_per_symbol(levels: int) -> int:
    """Codes per byte symbol: 2 when two codes fit one byte (L^2 <= 256), else 1."""
    return 2 if levels * levels <= 256 else 1


def symbol_count(count: int, levels: int) -> int:
    return -(-count // codes_per_symbol(levels))


def stream_bound(count: int, levels: int) -> int:
    """The most bytes the deflate stream of `count` codes may take: zlib's deflateBound for non-default
    parameters (stored blocks at worst, 5 bytes each, plus slack), so an honest encoder never exceeds it."""
    n = symbol_count(count, levels)
    return n + ((n + 7) >> 3) + ((n + 63) >> 6) + 5


def encode_codes(codes: torch.Tensor, levels: int) -> torch.Tensor:
    """`codes` (1-D int64 in [0, levels), levels <= 256) as a 1-D uint8 raw deflate stream."""
    per = codes_per_symbol(levels)
    if per == 2:
        pairs = torch.nn.functional.pad(codes, (0, codes.numel() % 2)).view(-1, 2)
        codes = pairs[:, 0] + levels * pairs[:, 1]
    compressor = zlib.compressobj(_LEVEL, zlib.DEFLATED, _WBITS, _MEM_LEVEL, zlib.Z_HUFFMAN_ONLY)
    stream = compressor.compress(codes.to(torch.uint8).numpy().tobytes()) + compressor.flush()
    return torch.frombuffer(bytearray(stream), dtype=torch.uint8)


def decode_codes(data: torch.Tensor, count: int, levels: int) -> torch.Tensor:
    """`encode_codes`'s inverse: `count` codes (int64), never inflating more than their symbols."""
    symbols = symbol_count(count, levels)
    raw = _inflate_exactly(data.numpy().tobytes(), symbols)
    values = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
    per = codes_per_symbol(levels)
    if not bool((values < levels**per).all()):
        raise CompressionError(f"a symbol beyond {levels}^{per}", reason=BAD_CODE)
    if per == 1:
        return values
    codes = torch.stack([values % levels, values // levels], dim=1).reshape(-1)
    if codes.numel() > count and int(codes[-1]) != 0:
        # the pad code of an odd count is 0: another value would be a second payload decoding alike
        raise CompressionError("a nonzero pad code", reason=BAD_CODE)
    return codes[:count]


def _inflate_exactly(stream: bytes, symbols: int) -> bytes:
    """The `symbols` bytes `stream` inflates to, asking zlib for no more than that (and then one byte, to see the
    stream ends there)."""
    if symbols < 1:
        # zlib reads a max_length of 0 as no bound at all
        raise CompressionError("no symbols declared", reason=BAD_STREAM)
    inflater = zlib.decompressobj(_WBITS)
    try:
        raw = inflater.decompress(stream, symbols)
        if not inflater.eof:
            # the output is full; what is left must be the end of the stream, inflating to nothing
            extra = inflater.decompress(inflater.unconsumed_tail, 1)
            if extra:
                raise CompressionError(f"the stream inflates beyond {symbols} symbols", reason=BAD_STREAM)
    except zlib.error as e:
        raise CompressionError(f"the stream does not inflate: {e}", reason=BAD_STREAM) from None
    if not inflater.eof:
        raise CompressionError("the stream ends before its last block", reason=BAD_STREAM)
    if len(raw) != symbols or inflater.unused_data or inflater.unconsumed_tail:
        raise CompressionError(
            f"the stream inflates to {len(raw)} symbols (+ {len(inflater.unused_data)} trailing bytes), "
            f"declared {symbols}",
            reason=BAD_STREAM,
        )
    return raw
