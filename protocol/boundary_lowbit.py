"""Boundary codecs below 4 bits on average (issue 20 part 2): the quantizers behind `protocol.boundary_codec`'s
low-bit codecs (`LOWBIT`).

A codec picks a scheme and a number of levels L for activations and another for gradients (`LOWBIT`); the frame's
kind says which applies, so the header carries neither. All use every one of the L codes, k in [0, L), and the
grid's outermost levels are the tensor's own extremes: a tensor decoded and
encoded again (the driver relays every activation and gradient between two stages) gets the same codes back, so a
relay loses nothing more. L = 2^b is b bits a value; other L pack n codes into one base-L word of ceil(n log2 L)
bits (`packing`: 22 levels 2 per 9 bits, 4.5 bits a value; 25 levels 3 per 14, 4.67; 5 levels 3 per 7, 2.33).

- ``channel`` (activations): per channel (the last dimension) asymmetric, value = lo_c + k x step_c with lo_c the
  channel's min and step_c = (max_c - min_c) / (L - 1). Measured on the harness model's boundary activations, whose channels carry a large
  per-channel offset (|mean| / std about 0.7): 3.2 % relative error at 4 bits where symmetric per channel loses
  4.9 % and a rotated per-row grid 9.7 % (the same grids with cells rather than endpoints; `tests/unit`).
- ``row`` (gradients): per row (one position's vector), symmetric: value = (k - (L - 1) / 2) x step_r with
  step_r = max_r |x| / ((L - 1) / 2), stored as
  S x 2^(-e_r / 16) with one float32 S per tensor and one uint8 e_r per row, rounded so that the stored step is at
  most 4.4 % smaller than that (the row's largest values clip to the outermost level, which keeps a relay exact). Boundary gradients differ by position (row norms vary 4x) far more
  than by channel.
- ``block`` (gradients): ``row`` with one scale per BLOCK = 16 consecutive values of a row instead of per row.
- ``row_rot``: ``row`` after a fixed orthogonal rotation R of each row (QuaRot-style): random signs, then a
  normalized Walsh-Hadamard transform over blocks of the largest power of two dividing the width; the signs come
  from SHA-256 of the width, so both sides know R and it costs no bytes; decoding multiplies by R^T (R is its own
  inverse up to float error). A rotation spreads outlier channels over all of them; the harness model has none
  (max channel range / median 2), so there it loses more than it gains (kept to measure that on larger models).

Gradients are rounded stochastically (k = floor(x' + u), u ~ U[0, 1), x' the value in steps from the lowest level):
E[decoded] = the gradient, so the error averages out over steps instead of biasing every step the same way; activations are rounded to nearest.
The noise u comes from a `torch.Generator` the encoder passes in (`encode_rows`'s `rounding`), never from torch's
global RNG, which training's determinism (init, dropout, data order) depends on.

Payloads (1-D uint8), words of `packing(L)` bits, the first code the least significant digit, packed by
`protocol.bitpack` (least significant bit first, the last byte padded with zero bits; the last word's missing
digits 0)::

    channel:                  channels x float32 lo | channels x float32 step | codes (`codes_size`)
    row, row_rot:             float32 S | rows x uint8 e | codes

The entropy-coded codecs (`ENTROPY_CODED`, names ending in z) keep these scales and grids and put a raw deflate
stream of the codes where the packed words were (`protocol.boundary_entropy`), at most `payload_size(..., coded=True)`.

Decoding refuses (CompressionError, BAD_SCALE) a step or S that is NaN, Inf, negative or above `MAX_SCALE`, and a lo
that is not finite or beyond `MAX_LO`, and (BAD_CODE) a word of L^n or more (it would alias one on the grid); a row
exponent may be any byte (it only shrinks S).
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Literal

import torch

from protocol import boundary_entropy as entropy
from protocol.bitpack import pack_bits, packed_size, unpack_bits
from protocol.compress import BAD_SCALE, MAX_SCALE, _read_scales
from protocol.errors import CompressionError

Scheme = Literal["channel", "row", "row_rot", "block"]
# codec -> ((scheme, levels) of activations, (scheme, levels) of gradients)
LOWBIT: dict[str, tuple[tuple[Scheme, int], tuple[Scheme, int]]] = {
    "a4g2": (("channel", 16), ("row", 4)),
    "a3g3": (("channel", 8), ("row", 8)),
    "rot4g2": (("row_rot", 16), ("row_rot", 4)),
    "a4g2b": (("channel", 16), ("block", 4)),
    # fractional bits (`packing`), each within the 8x of issue 20 at the harness's shapes, scales and frames included
    "a4g2.3": (("channel", 16), ("row", 5)),
    "a4g2.7": (("channel", 16), ("row", 6)),
    "a4.5g2": (("channel", 22), ("row", 4)),
    "a4.7g2": (("channel", 25), ("row", 4)),
    "a4.3g2.3": (("channel", 20), ("row", 5)),
    # entropy coded (`protocol.boundary_entropy`): the grids of the name without the z, Huffman-coded codes
    "a4.7g2.7z": (("channel", 25), ("row", 6)),
    "a5g2.3z": (("channel", 32), ("row", 5)),
    "a5g2.7z": (("channel", 32), ("row", 6)),
    "a5g3z": (("channel", 32), ("row", 8)),
}
# codecs whose codes travel entropy coded: a payload of variable length, at most `payload_size`
ENTROPY_CODED = frozenset(name for name in LOWBIT if name.endswith("z"))
BLOCK = 16  # values per scale of the "block" scheme (consecutive channels of a row; the row if the width is not a multiple)
MAX_LO = 256 * MAX_SCALE  # a channel's min beyond this travels as fp32
_EXPONENT_STEPS = 16  # a row's step is S x 2^(-e/16): steps of 4.4 %, rows down to 2^-16 of the largest
BAD_CODE = entropy.BAD_CODE  # a code word off the grid (levels not a power of two)
_ROTATION_DOMAIN = b"hivenode/boundary-rotation/v1/"
_F32 = 4


def scheme_of(codec: str, gradient: bool) -> tuple[Scheme, int]:
    """(scheme, levels) of `codec`'s activations or gradients."""
    return LOWBIT[codec][1 if gradient else 0]


@functools.lru_cache(maxsize=64)
def packing(levels: int) -> tuple[int, int]:
    """(values per word, bits per word) for codes in [0, levels): n values make one base-`levels` word of
    ceil(log2(levels^n)) bits, n <= 4 the fewest bits per value (the smallest n on a tie). 2^b levels: one value of b
    bits (n = 1); 22 levels: 2 per 9 bits (4.5 bits each); 5 levels: 3 per 7 bits (2.33)."""
    best = min(range(1, 5), key=lambda n: (math.ceil(n * math.log2(levels) - 1e-9) / n, n))
    return best, math.ceil(best * math.log2(levels) - 1e-9)


def codes_size(numel: int, levels: int) -> int:
    """Bytes of `numel` codes in [0, levels)."""
    per_word, word_bits = packing(levels)
    return packed_size(-(-numel // per_word), word_bits)


def bits_per_value(levels: int) -> float:
    per_word, word_bits = packing(levels)
    return word_bits / per_word


def scales_size(scheme: Scheme, shape: tuple[int, ...]) -> int:
    """Bytes of the payload before its codes."""
    width = shape[-1]
    return 2 * _F32 * width if scheme == "channel" else _F32 + math.prod(shape) // _group(scheme, width)


def payload_size(scheme: Scheme, levels: int, shape: tuple[int, ...], coded: bool = False) -> int:
    """Bytes of the payload; `coded` (entropy-coded codes): the most it may take."""
    numel = math.prod(shape)
    codes = entropy.stream_bound(numel, levels) if coded else codes_size(numel, levels)
    return scales_size(scheme, shape) + codes


def encode_rows(
    rows: torch.Tensor, scheme: Scheme, levels: int, *, rounding: torch.Generator | None, coded: bool = False
) -> torch.Tensor | None:
    """The payload of `rows` ((positions, width) float32), or None when the scheme cannot carry it (non-finite
    values, a range beyond what the stored scales may hold). `rounding`: round stochastically with noise drawn from
    this generator (gradients); None: round to nearest (activations). `coded`: the codes entropy coded
    (`protocol.boundary_entropy`) instead of packed."""
    if scheme == "channel":
        lo, hi = rows.amin(dim=0), rows.amax(dim=0)
        step = (hi - lo) / (levels - 1)
        if (
            not bool(torch.isfinite(step).all())
            or float(step.max()) > MAX_SCALE
            or float(lo.abs().max()) > MAX_LO
        ):
            return None
        codes = _quantize(rows - lo, step, levels, rounding)
        return torch.cat([lo.view(torch.uint8), step.view(torch.uint8), _pack_codes(codes, levels, coded)])
    data = (rotate(rows) if scheme == "row_rot" else rows).reshape(-1, _group(scheme, rows.shape[-1]))
    half = (levels - 1) / 2  # the outermost level, in steps from 0
    needed = data.abs().amax(dim=1) / half  # the row's max is the outermost level
    top = float(needed.max())
    if not math.isfinite(top) or top > MAX_SCALE:
        return None
    big = torch.tensor([top], dtype=torch.float32)
    # e rounded up: the stored step is at most 4.4 % below the needed one, so a row's largest values clip to the
    # outermost level, which then is the decoded row's max: relayed (decoded, encoded again) the row keeps its step
    # and codes. Rounded down, the max would fall between levels, and stochastic rounding would pick another max on
    # every relay. The 1e-4 keeps a step already on the exponent grid on it despite float error.
    ratio = needed / top if top > 0 else torch.zeros_like(needed)
    exponent = torch.ceil(-_EXPONENT_STEPS * torch.log2(ratio) - 1e-4).clamp_(0, 255)
    step = big * torch.exp2(-exponent / _EXPONENT_STEPS)
    codes = _quantize(data + (half * step).unsqueeze(1), step.unsqueeze(1), levels, rounding)
    return torch.cat([big.view(torch.uint8), exponent.to(torch.uint8), _pack_codes(codes, levels, coded)])


def _quantize(
    shifted: torch.Tensor, step: torch.Tensor, levels: int, rounding: torch.Generator | None
) -> torch.Tensor:
    """Codes k of `shifted` (in [0, (levels - 1) x step] up to float error) on the grid k x step, k in [0, levels)."""
    safe = torch.where(step > 0, step, torch.ones_like(step))  # an all-equal channel or all-zero row: step 0
    x = shifted / safe
    # stochastic: floor(x + u), u ~ U[0, 1): k or k + 1 with the probabilities that make it unbiased
    noise = None if rounding is None else torch.rand(x.shape, generator=rounding)
    k = torch.round(x) if noise is None else torch.floor(x + noise)
    return k.clamp_(0, levels - 1).to(torch.int64).reshape(-1)


def _pack_codes(codes: torch.Tensor, levels: int, coded: bool = False) -> torch.Tensor:
    """`codes` (1-D, in [0, levels)) as `packing(levels)` words, the first code the least significant digit; the
    last word's missing digits are 0. `coded`: a deflate stream instead (`boundary_entropy.encode_codes`)."""
    if coded:
        return entropy.encode_codes(codes, levels)
    per_word, word_bits = packing(levels)
    if per_word == 1:
        return pack_bits(codes, word_bits)
    digits = torch.nn.functional.pad(codes, (0, (-codes.numel()) % per_word)).view(-1, per_word)
    return pack_bits((digits * levels ** torch.arange(per_word, dtype=torch.int64)).sum(dim=1), word_bits)


def _unpack_codes(data: torch.Tensor, count: int, levels: int, coded: bool = False) -> torch.Tensor:
    """`_pack_codes`'s inverse; refuses (BAD_CODE) a word of `levels`^n or more (`_on_grid`; 2^b levels fill their
    bits: no such word), and a deflate stream that does not inflate to exactly `count` codes on the grid."""
    if coded:
        return entropy.decode_codes(data, count, levels)
    per_word, word_bits = packing(levels)
    words = unpack_bits(data, -(-count // per_word), word_bits)
    if per_word == 1:
        return words
    if not _on_grid(words, levels**per_word):
        raise CompressionError(f"a code word beyond {levels}^{per_word}", reason=BAD_CODE)
    digits = (words.unsqueeze(1) // levels ** torch.arange(per_word, dtype=torch.int64)) % levels
    return digits.reshape(-1)[:count]


def _on_grid(words: torch.Tensor, bound: int) -> bool:
    """Every word below `bound`: a word past it would alias a word on the grid (its top digit taken modulo the
    levels), so two payloads would decode alike; only the canonical one is accepted."""
    return bool((words < bound).all())


def decode_rows(
    data: torch.Tensor, shape: tuple[int, ...], scheme: Scheme, levels: int, coded: bool = False
) -> torch.Tensor:
    """`encode_rows`'s inverse, for a payload whose length the caller checked against `payload_size` (`coded`:
    longer than `scales_size` and at most `payload_size`)."""
    width = shape[-1]
    positions = math.prod(shape) // width
    if scheme == "channel":
        lo = data[: _F32 * width].view(torch.float32)
        if not bool((lo.abs() <= MAX_LO).all()):  # NaN fails the comparison too
            raise CompressionError(f"a channel offset is NaN, Inf or beyond {MAX_LO}", reason=BAD_SCALE)
        step = _read_scales(data[_F32 * width :], width, 8 * _F32)
        codes = _unpack_codes(data[2 * _F32 * width :], positions * width, levels, coded)
        return codes.to(torch.float32).view(positions, width).mul_(step).add_(lo).view(shape)
    group = _group(scheme, width)
    groups = math.prod(shape) // group
    big = _read_scales(data, 1, 8 * _F32)  # finite, >= 0 and <= MAX_SCALE, or refused
    step = big * torch.exp2(-data[_F32 : _F32 + groups].to(torch.float32) / _EXPONENT_STEPS)
    codes = _unpack_codes(data[_F32 + groups :], groups * group, levels, coded)
    levels_at = codes.to(torch.float32).sub_((levels - 1) / 2).view(groups, group).mul_(step.unsqueeze(1))
    return (unrotate(levels_at.view(-1, width)) if scheme == "row_rot" else levels_at).view(shape)


def _group(scheme: Scheme, width: int) -> int:
    """Values per scale of a per-row or per-block scheme."""
    return BLOCK if scheme == "block" and width % BLOCK == 0 else width


@functools.lru_cache(maxsize=16)
def _rotation(width: int) -> tuple[torch.Tensor, int]:
    """(the +-1 signs of R, the Hadamard block size) for `width`: the signs come from SHA-256 of the width (the same
    on every machine, no RNG or BLAS involved); the block is the largest power of two dividing the width."""
    stream = b""
    counter = 0
    while len(stream) * 8 < width:
        stream += hashlib.sha256(_ROTATION_DOMAIN + f"{width}/{counter}".encode()).digest()
        counter += 1
    bits = torch.frombuffer(bytearray(stream), dtype=torch.uint8)
    unpacked = ((bits.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1)[:width]
    return 1.0 - 2.0 * unpacked.to(torch.float32), width & -width


def _hadamard(rows: torch.Tensor, block: int) -> torch.Tensor:
    """The normalized Walsh-Hadamard transform of each `block` values along the last dimension (symmetric and
    orthogonal: it is its own inverse)."""
    y = rows.reshape(-1, block)
    h = 1
    while h < block:
        pairs = y.view(-1, block // (2 * h), 2, h)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(rows.shape) * (1.0 / math.sqrt(block))


def rotate(rows: torch.Tensor) -> torch.Tensor:
    """R x each row (rows: (n, width) float32)."""
    signs, block = _rotation(rows.shape[-1])
    return _hadamard(rows * signs, block)


def unrotate(rows: torch.Tensor) -> torch.Tensor:
    """R^T x each row: `rotate`'s inverse."""
    signs, block = _rotation(rows.shape[-1])
    return _hadamard(rows, block) * signs
