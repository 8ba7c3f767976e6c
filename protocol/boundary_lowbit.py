"""Boundary codecs below 4 bits on average (issue 20 part 2): the quantizers behind `protocol.boundary_codec`'s
``a4g2``, ``a4g2b``, ``a3g3`` and ``rot4g2``.

A codec picks a scheme and a bit width b for activations and another for gradients (`LOWBIT`); the frame's kind says
which applies, so the header carries neither. All use every one of the 2^b codes, k in [0, 2^b), and the grid's
outermost levels are the tensor's own extremes: a tensor decoded and encoded again (the driver relays every
activation and gradient between two stages) gets the same codes back, so a relay loses nothing more.

- ``channel`` (activations): per channel (the last dimension) asymmetric, value = lo_c + k x step_c with lo_c the
  channel's min and step_c = (max_c - min_c) / (2^b - 1). Measured on the harness model's boundary activations, whose channels carry a large
  per-channel offset (|mean| / std about 0.7): 3.2 % relative error at 4 bits where symmetric per channel loses
  4.9 % and a rotated per-row grid 9.7 % (the same grids with cells rather than endpoints; `tests/unit`).
- ``row`` (gradients): per row (one position's vector), symmetric: value = (k + 1/2 - 2^(b-1)) x step_r with
  step_r = max_r |x| / (2^(b-1) - 1/2), stored as
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

Payloads (1-D uint8), codes b bits each, packed by `protocol.bitpack` (least significant bit first, the last byte
padded with zero bits)::

    channel:        channels x float32 lo | channels x float32 step | ceil(numel x b / 8) bytes of codes
    row, row_rot:   float32 S | rows x uint8 e | ceil(numel x b / 8) bytes of codes

Decoding refuses (CompressionError, BAD_SCALE) a step or S that is NaN, Inf, negative or above `MAX_SCALE`, and a lo
that is not finite or beyond `MAX_LO`; a row exponent may be any byte (it only shrinks S).
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Literal

import torch

from protocol.bitpack import pack_bits, packed_size, unpack_bits
from protocol.compress import BAD_SCALE, MAX_SCALE, _read_scales
from protocol.errors import CompressionError

Scheme = Literal["channel", "row", "row_rot", "block"]
# codec -> ((scheme, bits) of activations, (scheme, bits) of gradients)
LOWBIT: dict[str, tuple[tuple[Scheme, int], tuple[Scheme, int]]] = {
    "a4g2": (("channel", 4), ("row", 2)),
    "a3g3": (("channel", 3), ("row", 3)),
    "rot4g2": (("row_rot", 4), ("row_rot", 2)),
    "a4g2b": (("channel", 4), ("block", 2)),
}
BLOCK = 16  # values per scale of the "block" scheme (consecutive channels of a row; the row if the width is not a multiple)
MAX_LO = 256 * MAX_SCALE  # a channel's min beyond this travels as fp32
_EXPONENT_STEPS = 16  # a row's step is S x 2^(-e/16): steps of 4.4 %, rows down to 2^-16 of the largest
_ROTATION_DOMAIN = b"hivenode/boundary-rotation/v1/"
_F32 = 4


def scheme_of(codec: str, gradient: bool) -> tuple[Scheme, int]:
    return LOWBIT[codec][1 if gradient else 0]


def payload_size(scheme: Scheme, bits: int, shape: tuple[int, ...]) -> int:
    numel, width = math.prod(shape), shape[-1]
    scales = 2 * _F32 * width if scheme == "channel" else _F32 + numel // _group(scheme, width)
    return scales + packed_size(numel, bits)


def encode_rows(
    rows: torch.Tensor, scheme: Scheme, bits: int, *, rounding: torch.Generator | None
) -> torch.Tensor | None:
    """The payload of `rows` ((positions, width) float32), or None when the scheme cannot carry it (non-finite
    values, a range beyond what the stored scales may hold). `rounding`: round stochastically with noise drawn from
    this generator (gradients); None: round to nearest (activations)."""
    if scheme == "channel":
        lo, hi = rows.amin(dim=0), rows.amax(dim=0)
        step = (hi - lo) / ((1 << bits) - 1)
        if (
            not bool(torch.isfinite(step).all())
            or float(step.max()) > MAX_SCALE
            or float(lo.abs().max()) > MAX_LO
        ):
            return None
        codes = _quantize(rows - lo, step, bits, rounding)
        return torch.cat([lo.view(torch.uint8), step.view(torch.uint8), pack_bits(codes, bits)])
    data = (rotate(rows) if scheme == "row_rot" else rows).reshape(-1, _group(scheme, rows.shape[-1]))
    half = 1 << (bits - 1)
    needed = data.abs().amax(dim=1) / (half - 0.5)  # the row's max is the outermost level
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
    codes = _quantize(data + ((half - 0.5) * step).unsqueeze(1), step.unsqueeze(1), bits, rounding)
    return torch.cat([big.view(torch.uint8), exponent.to(torch.uint8), pack_bits(codes, bits)])


def _quantize(
    shifted: torch.Tensor, step: torch.Tensor, bits: int, rounding: torch.Generator | None
) -> torch.Tensor:
    """Codes k of `shifted` (in [0, (2^b - 1) x step] up to float error) on the grid k x step, k in [0, 2^b)."""
    safe = torch.where(step > 0, step, torch.ones_like(step))  # an all-equal channel or all-zero row: step 0
    x = shifted / safe
    # stochastic: floor(x + u), u ~ U[0, 1): k or k + 1 with the probabilities that make it unbiased
    noise = None if rounding is None else torch.rand(x.shape, generator=rounding)
    k = torch.round(x) if noise is None else torch.floor(x + noise)
    return k.clamp_(0, (1 << bits) - 1).to(torch.uint8).reshape(-1)


def decode_rows(data: torch.Tensor, shape: tuple[int, ...], scheme: Scheme, bits: int) -> torch.Tensor:
    """`encode_rows`'s inverse, for a payload whose length the caller checked against `payload_size`."""
    width = shape[-1]
    positions = math.prod(shape) // width
    if scheme == "channel":
        lo = data[: _F32 * width].view(torch.float32)
        if not bool((lo.abs() <= MAX_LO).all()):  # NaN fails the comparison too
            raise CompressionError(f"a channel offset is NaN, Inf or beyond {MAX_LO}", reason=BAD_SCALE)
        step = _read_scales(data[_F32 * width :], width, 8 * _F32)
        codes = unpack_bits(data[2 * _F32 * width :], positions * width, bits)
        return codes.to(torch.float32).view(positions, width).mul_(step).add_(lo).view(shape)
    group = _group(scheme, width)
    groups = math.prod(shape) // group
    big = _read_scales(data, 1, 8 * _F32)  # finite, >= 0 and <= MAX_SCALE, or refused
    step = big * torch.exp2(-data[_F32 : _F32 + groups].to(torch.float32) / _EXPONENT_STEPS)
    codes = unpack_bits(data[_F32 + groups :], groups * group, bits)
    levels = codes.to(torch.float32).add_(0.5 - (1 << (bits - 1))).view(groups, group).mul_(step.unsqueeze(1))
    return (unrotate(levels.view(-1, width)) if scheme == "row_rot" else levels).view(shape)


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
