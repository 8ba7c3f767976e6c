"""Compressed activations and gradients between pipeline stages, negotiated in the run manifest (issue 20, part 2).

Codecs (`[activation_codec]` in run.toml; every peer of a run uses the one its signed manifest names):

- ``fp32``: boundary tensors travel as float32, as before codecs (the default until a run measures otherwise).
- ``int8``: per channel (the last dimension, the model width): scale_c = absmax_c / 127 over every other position,
  q = round(x / scale_c) in [-127, 127]; ~4x smaller.
- ``int4``: the same with q in [-7, 7], two values per byte (low nibble first), stored as q + 8; ~8x smaller.
- ``rot4``, ``rot3``, ``rot4g2``: rotate, then quantize to few bits (QuaRot-style). Each position's vector along the
  last dimension is multiplied by a fixed orthogonal matrix R (random signs, then a normalized Walsh-Hadamard
  transform over blocks of the largest power of two dividing the width; the signs derive from the width alone, so
  both sides know R and it costs no bytes). Rotation spreads a few outlier channels over all of them, so a coarse
  grid loses much less. The rotated rows are quantized on the half-integer grid (k + 1/2) x scale_row with
  k in [-2^(b-1), 2^(b-1) - 1] (all 2^b codes used), one scale per row (position): scale_row = S x 2^(-e/16)
  with one float32 S per tensor and one uint8 e per row (rounded up so nothing clips). Activations are rounded to
  nearest; gradients stochastically (unbiased: E[decoded] = the gradient, so the noise averages out over steps
  instead of biasing them). Bits (activations/gradients): rot4 4/4, rot3 3/3, rot4g2 4/2; the frame's kind says
  which applies. The decoder multiplies by R^T (R is its own inverse up to float error).

Payload, the frame's "" tensor (1-D uint8)::

    channels x float32 scale | numel x int8   (int4: ceil(numel / 2) bytes of nibbles)
    rot*: float32 S | rows x uint8 e | ceil(numel / 8) x b bytes (each 8 codes k + 2^(b-1), b bits each, packed
          little-endian into b bytes)

with the header, ``{"codec", "shape"}``, in the frame's meta under `META_PREFIX`. The sender encodes after its stage
computed (`encode`); the receiver decodes right after `open_envelope` and before the tensor is used or checked
(`decode_opened`), so SENTINEL and the spot checks see decoded tensors. The header is untrusted: `decode_opened`
checks its schema, the codec against the manifest's, the declared shape against the receiver's `TensorLimits` for
the float32 tensor it would build (the cap, before anything is allocated), the payload's exact length, and the
scales (finite, >= 0, <= `compress.MAX_SCALE`; a rot codec's row exponents are any byte and only shrink S); each
refusal is a `CompressionError` with a reason tag.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast

import torch

from protocol.codec import TensorLimits, check_spec
from protocol.compress import (
    BAD_HEADER,
    MAX_SCALE,
    TOO_LARGE,
    WRONG_CODEC,
    WRONG_LENGTH,
    _pack_nibbles,
    _read_scales,
    _scales,
    header_from_meta,
)
from protocol.envelope import Kind, MetaScalar, MetaValue, Opened
from protocol.errors import CompressionError, TensorPolicyError

BoundaryCodecName = Literal["fp32", "int8", "int4", "rot4", "rot3", "rot4g2"]
BOUNDARY_CODECS: tuple[BoundaryCodecName, ...] = ("fp32", "int8", "int4", "rot4", "rot3", "rot4g2")
META_PREFIX = "b_"  # the header's keys in a pipeline frame's meta
_QMAX = {"int8": 127, "int4": 7}
_SCALE_BYTES = 4  # float32 scales: a channel's absmax may be anywhere an activation's range goes
# rotated codecs: bits of (activations, gradients)
_ROTATED: dict[str, tuple[int, int]] = {"rot4": (4, 4), "rot3": (3, 3), "rot4g2": (4, 2)}
_EXPONENT_STEPS = 16  # a row's scale is S x 2^(-e/16): steps of 4.4 %, rows down to 2^-16 of the largest
_ROTATION_DOMAIN = b"hivenode/boundary-rotation/v1/"
# Stochastic rounding's noise: private, so that encoding never moves the training RNG (`reseed_rounding`).
_ROUNDING = torch.Generator().manual_seed(0)


def reseed_rounding(seed: int) -> None:
    """Restart the stochastic rounding's random stream (benchmarks: each arm starts from the same one)."""
    _ROUNDING.manual_seed(seed)


@dataclass(frozen=True, kw_only=True, slots=True)
class BoundaryCodecSpec:
    """How boundary activations and gradients travel; the run manifest fixes one (`[activation_codec]`)."""

    codec: BoundaryCodecName = "fp32"

    def __post_init__(self) -> None:
        if self.codec not in BOUNDARY_CODECS:
            raise ValueError(f"bad activation codec {str(self.codec)[:16]!r}: one of {BOUNDARY_CODECS}")

    @property
    def enabled(self) -> bool:
        return self.codec != "fp32"


def value_bits(codec: BoundaryCodecName, gradient: bool) -> int:
    """Bits per value of `codec` for an activation, or a gradient (`gradient`)."""
    if codec in _ROTATED:
        return _ROTATED[codec][1 if gradient else 0]
    return {"fp32": 32, "int8": 8, "int4": 4}[codec]


def payload_size(codec: BoundaryCodecName, shape: tuple[int, ...], gradient: bool = False) -> int:
    """Bytes of the payload for a tensor of `shape` (float32 bytes for fp32)."""
    numel = math.prod(shape)
    if codec == "fp32":
        return 4 * numel
    if codec in _ROTATED:
        return _SCALE_BYTES + numel // shape[-1] + -(-numel // 8) * value_bits(codec, gradient)
    values = numel if codec == "int8" else -(-numel // 2)
    return shape[-1] * _SCALE_BYTES + values


def compression_ratio(
    codec: BoundaryCodecName, shape: tuple[int, ...], gradient: bool | None = None
) -> float:
    """fp32 bytes over payload bytes; `gradient` None: activations and gradients alike (one of each)."""
    if gradient is None:
        both = payload_size(codec, shape, False) + payload_size(codec, shape, True)
        return 8 * math.prod(shape) / both
    return 4 * math.prod(shape) / payload_size(codec, shape, gradient)


def encode(
    tensor: torch.Tensor, spec: BoundaryCodecSpec, *, gradient: bool = False
) -> tuple[torch.Tensor, dict[str, MetaValue]]:
    """(the tensor to seal, the meta to add): `tensor` itself and no meta for fp32, else the uint8 payload.
    `gradient`: the tensor is a boundary gradient (a rot codec's bits and rounding differ; the receiver reads which
    from the frame's kind).

    A tensor the codec cannot carry (an empty dimension, NaN or Inf, a channel max above 127 x `MAX_SCALE`) travels
    as it is, in fp32: the receiver's finite-value policy and the verifier's checks then judge it as they would
    without a codec (a codec must not turn a detectable fault into an encoding error).
    """
    shape = tuple(int(d) for d in tensor.shape)
    if not spec.enabled or not shape or any(d <= 0 for d in shape):
        return tensor, {}
    rows = tensor.detach().to("cpu", torch.float32).reshape(-1, shape[-1])
    if spec.codec in _ROTATED:
        payload = _encode_rotated(rows, value_bits(spec.codec, gradient), stochastic=gradient)
        if payload is None:
            return tensor, {}
        return payload, _meta(spec.codec, shape)
    absmax = rows.abs().amax(dim=0)
    qmax = _QMAX[spec.codec]
    if not bool(torch.isfinite(absmax).all()) or float(absmax.max()) > qmax * MAX_SCALE:
        return tensor, {}
    stored = _scales(absmax, float(qmax), 32)
    safe = torch.where(stored > 0, stored, torch.ones_like(stored))  # an all-zero channel has scale 0: q = 0
    q = torch.round(rows / safe).clamp_(-qmax, qmax).to(torch.int8).reshape(-1)
    values = q.view(torch.uint8) if spec.codec == "int8" else _pack_nibbles(q)
    payload = torch.cat([stored.contiguous().view(torch.uint8), values])
    return payload, _meta(spec.codec, shape)


def _meta(codec: str, shape: tuple[int, ...]) -> dict[str, MetaValue]:
    return {META_PREFIX + "codec": codec, META_PREFIX + "shape": cast("list[MetaScalar]", list(shape))}


def decode_opened(opened: Opened, spec: BoundaryCodecSpec, limits: TensorLimits) -> Opened:
    """`opened` with its "" tensor decoded, if the frame says it is encoded; a frame without the header is returned
    as it is (fp32 boundary tensors, tokens, losses). Raises CompressionError before allocating anything it
    refuses."""
    header = header_from_meta(opened.meta, META_PREFIX)
    if not header:
        return opened
    codec, shape = _parse_header(header, spec, limits)
    data = opened.tensors.get("")
    if data is None or data.dtype != torch.uint8 or data.dim() != 1:
        raise CompressionError("an encoded boundary tensor is a 1-D uint8 payload", reason=BAD_HEADER)
    gradient = opened.header.kind is Kind.GRADIENT
    expected = payload_size(codec, shape, gradient)
    if data.numel() != expected:
        raise CompressionError(
            f"{data.numel()} payload bytes, the header implies {expected}", reason=WRONG_LENGTH
        )
    if codec in _ROTATED:
        decoded = _decode_rotated(data, shape, value_bits(codec, gradient))
        return Opened(opened.header, {**opened.tensors, "": decoded})
    channels = shape[-1]
    scales = _read_scales(data, channels, 8 * _SCALE_BYTES)
    values = data[channels * _SCALE_BYTES :]
    if codec == "int8":
        q = values.view(torch.int8)
    else:  # low nibble first; an odd numel's pad nibble is dropped
        q = (
            torch.stack([values & 0x0F, values >> 4], dim=1).reshape(-1)[: math.prod(shape)].to(torch.int8)
            - 8
        )
    decoded = q.to(torch.float32).view(-1, channels).mul_(scales).view(shape)
    return Opened(opened.header, {**opened.tensors, "": decoded})


def _parse_header(
    header: Mapping[str, object], spec: BoundaryCodecSpec, limits: TensorLimits
) -> tuple[BoundaryCodecName, tuple[int, ...]]:
    if set(header) != {"codec", "shape"}:
        raise CompressionError("a boundary header has exactly the fields codec and shape", reason=BAD_HEADER)
    codec = header["codec"]
    if type(codec) is not str or codec not in BOUNDARY_CODECS or codec == "fp32":
        raise CompressionError(f"unknown boundary codec {str(codec)[:16]!r}", reason=BAD_HEADER)
    if codec != spec.codec:
        raise CompressionError(f"got {codec}, the run's manifest says {spec.codec}", reason=WRONG_CODEC)
    raw_shape = header["shape"]
    try:
        check_spec("float32", raw_shape, limits)  # the float32 tensor decode would build, against our cap
    except TensorPolicyError as e:
        reason = TOO_LARGE if e.reason == "tensor too large" else BAD_HEADER
        raise CompressionError(f"declared shape refused: {e}", reason=reason) from None
    shape = tuple(cast("list[int]", raw_shape))
    if not shape or min(shape) <= 0:
        raise CompressionError(f"declared shape {shape} has an empty dimension", reason=BAD_HEADER)
    return codec, shape


# ------------------------------------------------------------------------------------------------ rotated codecs


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


def _encode_rotated(rows: torch.Tensor, bits: int, *, stochastic: bool) -> torch.Tensor | None:
    """The rot payload of `rows` ((positions, width) float32), or None when the codec cannot carry it."""
    rotated = rotate(rows)
    half = 1 << (bits - 1)
    needed = rotated.abs().amax(dim=1) / (
        half - 0.5
    )  # the row's max lands on the outermost half-integer level
    top = float(needed.max()) if needed.numel() else 0.0
    if not math.isfinite(top) or top > MAX_SCALE:
        return None
    big = torch.tensor([top], dtype=torch.float32)
    # e rounded down, so the stored scale is >= the needed one (nothing clips); the 1e-4 keeps a scale that is exactly
    # on a step (a relayed, already decoded tensor) on it despite float error
    ratio = needed / top if top > 0 else torch.zeros_like(needed)
    exponent = torch.floor(-_EXPONENT_STEPS * torch.log2(ratio) + 1e-4).clamp_(0, 255)
    scale = big * torch.exp2(-exponent / _EXPONENT_STEPS)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)
    x = rotated / safe - 0.5  # the level k + 1/2 nearest to x / scale is k = round(x / scale - 1/2)
    # stochastic: floor(x + u), u ~ U[0, 1): k or k + 1 with the probabilities that make it unbiased
    k = torch.floor(x + torch.rand(x.shape, generator=_ROUNDING)) if stochastic else torch.round(x)
    codes = (k.clamp_(-half, half - 1) + half).to(torch.uint8).reshape(-1)
    header = torch.cat([big.view(torch.uint8), exponent.to(torch.uint8)])
    return torch.cat([header, _pack_bits(codes, bits)])


def _decode_rotated(data: torch.Tensor, shape: tuple[int, ...], bits: int) -> torch.Tensor:
    width = shape[-1]
    positions = math.prod(shape) // width
    big = _read_scales(data, 1, 8 * _SCALE_BYTES)  # finite, >= 0 and <= MAX_SCALE, or refused
    exponent = data[_SCALE_BYTES : _SCALE_BYTES + positions].to(torch.float32)
    scale = big * torch.exp2(-exponent / _EXPONENT_STEPS)
    codes = _unpack_bits(data[_SCALE_BYTES + positions :], bits, positions * width)
    half = 1 << (bits - 1)
    levels = codes.to(torch.float32).sub_(half - 0.5).view(positions, width).mul_(scale.unsqueeze(1))
    return unrotate(levels).view(shape)


def _pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (uint8, each < 2^bits) packed 8 to `bits` bytes, little-endian; the last group padded with zeros."""
    padded = torch.nn.functional.pad(codes.to(torch.int64), (0, (-codes.numel()) % 8)).view(-1, 8)
    word = (padded << (bits * torch.arange(8, dtype=torch.int64))).sum(dim=1, keepdim=True)
    return ((word >> (8 * torch.arange(bits, dtype=torch.int64))) & 0xFF).to(torch.uint8).reshape(-1)


def _unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """`_pack_bits`'s inverse: the first `count` codes (int64)."""
    groups = packed.to(torch.int64).view(-1, bits)
    word = (groups << (8 * torch.arange(bits, dtype=torch.int64))).sum(dim=1, keepdim=True)
    codes = (word >> (bits * torch.arange(8, dtype=torch.int64))) & ((1 << bits) - 1)
    return codes.reshape(-1)[:count]
