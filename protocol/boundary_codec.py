"""Compressed activations and gradients between pipeline stages, negotiated in the run manifest (issue 20, part 2).

Codecs (`[activation_codec]` in run.toml; every peer of a run uses the one its signed manifest names):

- ``fp32``: boundary tensors travel as float32, as before codecs (the default until a run measures otherwise).
- ``int8``: per channel (the last dimension, the model width): scale_c = absmax_c / 127 over every other position,
  q = round(x / scale_c) in [-127, 127]; ~4x smaller.
- ``int4``: the same with q in [-7, 7], two values per byte (low nibble first), stored as q + 8; ~8x smaller.
- ``a4g2``, ``a3g3``, ``rot4g2``: fewer than 4 bits per value on average (`protocol.boundary_lowbit`): activations
  per channel asymmetric, gradients per position with stochastic (unbiased) rounding, bits (activations/gradients)
  4/2 and 3/3 (``a4g2b``: 4/2 with gradient scales per 16 values instead of per position); ``rot4g2`` rotates every
  position's vector by a fixed Hadamard-based orthogonal matrix first (QuaRot-style) and quantizes per position, 4/2.
- ``a4g2.3``, ``a4g2.7``, ``a4.5g2``, ``a4.7g2``, ``a4.3g2.3``: a4g2's schemes on grids whose number of levels is no
  power of two (5 or 6 gradient levels, 20, 22 or 25 activation levels), several codes per packed word: the
  fractional bits per value the name says, each within 8x of fp32 at the harness's shapes, scales and frames included.
  The frame's kind (activation or gradient) says which grid applies.
- ``a4.7g2.7z``, ``a5g2.3z``, ``a5g2.7z``, ``a5g3z``: the grids of the name without the z, their codes entropy coded
  (`protocol.boundary_entropy`: zlib's Huffman-only deflate), so a payload's length depends on its values and is
  bounded by `payload_size`; fewer bytes than the packed grid wherever the codes are not uniform (the gradients').

Payload, the frame's "" tensor (1-D uint8)::

    channels x float32 scale | numel x int8   (int4: ceil(numel / 2) bytes of nibbles)
    the low-bit codecs: see `protocol.boundary_lowbit`

with the header, ``{"codec", "shape"}``, in the frame's meta under `META_PREFIX`. The sender encodes after its stage
computed (`encode`); the receiver decodes right after `open_envelope` and before the tensor is used or checked
(`decode_opened`), so SENTINEL and the spot checks see decoded tensors. The header is untrusted: `decode_opened`
checks its schema, the codec against the manifest's, the declared shape against the receiver's `TensorLimits` for
the float32 tensor it would build (the cap, before anything is allocated), the payload's exact length (an
entropy-coded codec's: more than its scales, at most its bound; its stream then inflates to exactly the declared
codes or is refused before more is allocated), and the
scales (finite, >= 0, <= `compress.MAX_SCALE`; the low-bit codecs' offsets finite and bounded too), and a packed
word of codes past the grid (`boundary_lowbit.BAD_CODE`); each refusal is a `CompressionError` with a reason tag.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast, get_args

import torch

from protocol import boundary_lowbit as lowbit
from protocol.boundary_lowbit import ENTROPY_CODED, LOWBIT
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

BoundaryCodecName = Literal[
    "fp32",
    "int8",
    "int4",
    "a4g2",
    "a4g2b",
    "a3g3",
    "rot4g2",
    "a4g2.3",
    "a4g2.7",
    "a4.5g2",
    "a4.7g2",
    "a4.3g2.3",
    "a4.7g2.7z",
    "a5g2.3z",
    "a5g2.7z",
    "a5g3z",
]
BOUNDARY_CODECS: tuple[BoundaryCodecName, ...] = get_args(BoundaryCodecName)
META_PREFIX = "b_"  # the header's keys in a pipeline frame's meta
_QMAX = {"int8": 127, "int4": 7}
_SCALE_BYTES = 4  # float32 scales: a channel's absmax may be anywhere an activation's range goes


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


def rounding_generator(seed: int | None = None) -> torch.Generator:
    """A generator of stochastic rounding's noise for one encoder (`encode`'s `rounding`), seeded with `seed`
    (benchmarks and tests: reproducible streams), else from os.urandom.

    One per owner (a stage service, a driver's hop client), never shared: torch serializes the draws of a CPU
    generator, so sharing one would not corrupt it, but the draws of owners encoding on different threads would
    interleave in whatever order the threads ran: no owner's noise reproducible from its seed, and each owner's
    traffic shifting every other's. Owning one also keeps encoding off torch's global RNG, which training's
    determinism depends on."""
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(os.urandom(8), "little") if seed is None else seed)
    return generator


def payload_size(codec: BoundaryCodecName, shape: tuple[int, ...], gradient: bool = False) -> int:
    """Bytes of the payload for a tensor of `shape` (float32 bytes for fp32); an entropy-coded codec's
    (`ENTROPY_CODED`): the most it may take, its actual size depends on the values."""
    numel = math.prod(shape)
    if codec == "fp32":
        return 4 * numel
    if codec in LOWBIT:
        return lowbit.payload_size(*lowbit.scheme_of(codec, gradient), shape, codec in ENTROPY_CODED)
    values = numel if codec == "int8" else -(-numel // 2)
    return shape[-1] * _SCALE_BYTES + values


def compression_ratio(
    codec: BoundaryCodecName, shape: tuple[int, ...], gradient: bool | None = None
) -> float:
    """fp32 bytes over payload bytes; `gradient` None: activations and gradients alike (one of each). For an
    entropy-coded codec, over its largest payload (a lower bound of its ratio)."""
    if gradient is None:
        both = payload_size(codec, shape, False) + payload_size(codec, shape, True)
        return 8 * math.prod(shape) / both
    return 4 * math.prod(shape) / payload_size(codec, shape, gradient)


def encode(
    tensor: torch.Tensor, spec: BoundaryCodecSpec, *, rounding: torch.Generator, gradient: bool = False
) -> tuple[torch.Tensor, dict[str, MetaValue]]:
    """(the tensor to seal, the meta to add): `tensor` itself and no meta for fp32, else the uint8 payload.
    `gradient`: the tensor is a boundary gradient (a low-bit codec's bits and rounding differ; the receiver reads which
    from the frame's kind). `rounding`: the caller's own generator (`rounding_generator`), the noise of a low-bit
    gradient's stochastic rounding.

    A tensor the codec cannot carry (an empty dimension, NaN or Inf, a channel max above 127 x `MAX_SCALE`) travels
    as it is, in fp32: the receiver's finite-value policy and the verifier's checks then judge it as they would
    without a codec (a codec must not turn a detectable fault into an encoding error).
    """
    shape = tuple(int(d) for d in tensor.shape)
    if not spec.enabled or not shape or any(d <= 0 for d in shape):
        return tensor, {}
    rows = tensor.detach().to("cpu", torch.float32).reshape(-1, shape[-1])
    if spec.codec in LOWBIT:
        scheme, bits = lowbit.scheme_of(spec.codec, gradient)
        payload = lowbit.encode_rows(
            rows,
            scheme,
            bits,
            rounding=rounding if gradient else None,
            coded=spec.codec in ENTROPY_CODED,
        )
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
    _check_length(data.numel(), codec, shape, gradient)
    if codec in LOWBIT:
        scheme = lowbit.scheme_of(codec, gradient)
        decoded = lowbit.decode_rows(data, shape, *scheme, codec in ENTROPY_CODED)
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


def _check_length(size: int, codec: BoundaryCodecName, shape: tuple[int, ...], gradient: bool) -> None:
    """The payload's length: exact, or for an entropy-coded codec more than its scales and at most its bound."""
    most = payload_size(codec, shape, gradient)
    if codec in ENTROPY_CODED:
        least = lowbit.scales_size(lowbit.scheme_of(codec, gradient)[0], shape) + 1
        if not least <= size <= most:
            raise CompressionError(
                f"{size} payload bytes, the header implies {least} to {most}", reason=WRONG_LENGTH
            )
    elif size != most:
        raise CompressionError(f"{size} payload bytes, the header implies {most}", reason=WRONG_LENGTH)


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
