"""Compressed outer gradients: codecs for a float32 delta, and a decoder that checks everything before it allocates.

The codecs (issue 20), all of them on the flat tensor (the shape only travels along):

- ``fp32``: the raw little-endian float32 bytes (the uncompressed baseline).
- ``int8``: symmetric block quantization, ``block`` elements per scale, q in [-127, 127], x ~ q * scale.
- ``int4``: the same with q in [-7, 7], two values per byte (low nibble first), stored as q + 8.
- ``topk``: SparseLoCo-style chunked top-k. Per chunk of ``chunk`` elements, the ``k`` largest |x| are kept, their
  local indices in ``ceil(log2(chunk))`` bits each (12 for 4096), their values in ``bits`` bits (2, 4 or 8) on a
  midrise grid (no zero level: a kept value is never zero) scaled per chunk. Everything else decodes to zero, so
  the learner keeps what was dropped in an error-feedback residual (`node.diloco.compression`).
- ``topk_rice``: the same selection and values, the indices Rice-coded as gaps (`protocol.rice`): ~8.5 bits per
  index instead of 12 at 1/128, so with 2-bit values the same bytes keep ~1.34x the entries (43 for 32). Its payload
  length varies with the positions; a header bounds it (`payload_bounds`), and `payload_size` / `compression_ratio`
  give the worst case. (`randk`, below, sends no index at all.)

Payload layouts (every scale first, so the scale bytes start at offset 0 and can be viewed as floats in place)::

    fp32:       numel x float32
    int8/int4:  num_blocks x scale | numel x int8 (int4: ceil(numel / 2) bytes of nibbles)
    topk:       num_chunks x scale | bit-packed local indices | bit-packed values   (`protocol.bitpack`)
    topk_rice:  num_chunks x scale | bit-packed remainders (r bits) | bit-packed values | unary quotients

An `Encoded` is a small header (codec name and integer fields, for an envelope's meta) and the payload bytes (for a
uint8 payload tensor). `decode` reads the header from a peer as untrusted: it checks the schema, the declared size
against the receiver's `TensorLimits` (which come from the manifest, never from the peer) and the codec against the
one the receiver expects, then that the payload has exactly the implied length, then the scales (finite, >= 0, at
most `MAX_SCALE`) and the indices (in range, strictly increasing within each chunk), and only then allocates the
decoded tensor. Every refusal is a `CompressionError` with a short `reason`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from protocol import rice
from protocol.bitpack import pack_bits, packed_size, unpack_bits
from protocol.codec import TensorLimits, check_spec
from protocol.envelope import MetaScalar, MetaValue
from protocol.errors import CompressionError, TensorPolicyError

CodecName = Literal["fp32", "int8", "int4", "topk", "topk_rice", "randk"]
CODECS: tuple[CodecName, ...] = ("fp32", "int8", "int4", "topk", "topk_rice", "randk")
TOPK_CODECS = frozenset({"topk", "topk_rice"})  # a sparse top-k selection (the syncer winsorizes sparsely)
SCALE_DTYPES: dict[int, torch.dtype] = {16: torch.float16, 32: torch.float32}
TOPK_VALUE_BITS = frozenset(
    {2, 4, 8}
)  # widths that divide a byte; 1 bit would be sign-only, below what we test
RANDK_VALUE_BITS = frozenset({1, 2, 4, 8})  # randk: 1 bit is sign x the chunk's scale
MAX_MASK_SEED = (1 << 62) - 1  # a randk mask seed fits an envelope's int with room to spare
MAX_BLOCK = 1 << 16  # block and chunk sizes a receiver accepts (16-bit local indices at most)
# Largest scale a receiver accepts: the largest float16, so a scale means the same in either width. An outer delta
# whose block max is above 127 x 65504 ~ 8e6 is no training update; an encoder refuses to produce one.
MAX_SCALE = 65504.0

# reasons, as the tags of CompressionError
BAD_HEADER = "bad compression header"
TOO_LARGE = "compressed tensor too large"
WRONG_CODEC = "unexpected codec"
WRONG_LENGTH = "compressed size mismatch"
BAD_SCALE = "bad scale"
BAD_INDEX = "bad index"
WRONG_MASK = "unexpected mask"
NON_FINITE = "non-finite values"

_QMAX = {"int8": 127, "int4": 7}
_HEADER_KEYS: dict[str, tuple[str, ...]] = {
    "fp32": ("codec", "numel", "shape"),
    "int8": ("codec", "numel", "shape", "block", "scale_bits"),
    "int4": ("codec", "numel", "shape", "block", "scale_bits"),
    "topk": ("codec", "numel", "shape", "chunk", "k", "bits", "scale_bits"),
    "topk_rice": ("codec", "numel", "shape", "chunk", "k", "bits", "scale_bits"),
    "randk": ("codec", "numel", "shape", "chunk", "k", "bits", "scale_bits", "mask_seed", "mask_stratum"),
}
_MASK_KEYS = ("mask_seed", "mask_stratum")  # per push, not the spec's: parse_header returns them apart


@dataclass(frozen=True, kw_only=True, slots=True)
class CodecSpec:
    """A codec and its parameters; the run manifest fixes one, and a receiver decodes only that one."""

    codec: CodecName = "fp32"
    block: int = 128  # int8/int4: elements per scale
    chunk: int = 4096  # topk: elements per chunk (local indices take ceil(log2(chunk)) bits)
    k: int = 32  # topk: entries kept per chunk (fewer in a last chunk shorter than k)
    bits: int = 2  # topk: bits per kept value
    # 16 (float16) or 32 (float32) per scale. float16 halves the scale cost but flushes a block whose max is under
    # ~4e-6 (int8) or ~2e-7 (int4, topk 2-bit) to zero: far below an outer delta, and error feedback keeps it.
    scale_bits: int = 32
    # learner side, never in a header: error feedback keeps this fraction of its residual after each push (1.0:
    # all of it). SparseLoCo's beta: below 1, what the codec kept dropping fades instead of arriving rounds late
    # as one stale burst (benchmarks/codec_sweep.py measures it).
    feedback_decay: float = 1.0
    # randk, both sides, never in a header (the header names the mask it used, `MaskKey`): True draws one
    # permutation per chunk for the run and fragment and sends its strata in turn, so every coordinate is sent
    # once every ceil(chunk / k) versions; False draws a fresh subset for every base version.
    mask_rotate: bool = True

    def __post_init__(self) -> None:
        problem = _spec_problem(self)
        if problem is not None:
            raise ValueError(f"bad codec spec: {problem}")

    def header_fields(self) -> dict[str, int | str]:
        """The fields of this codec only, so two specs that encode alike have equal headers."""
        every: dict[str, int | str] = {
            "codec": self.codec,
            "block": self.block,
            "chunk": self.chunk,
            "k": self.k,
            "bits": self.bits,
            "scale_bits": self.scale_bits,
        }
        return {key: every[key] for key in _HEADER_KEYS[self.codec] if key in every}


def _spec_problem(spec: CodecSpec) -> str | None:
    if spec.codec not in CODECS:
        return f"unknown codec {str(spec.codec)[:16]!r}"
    ints = (spec.block, spec.chunk, spec.k, spec.bits, spec.scale_bits)
    if any(type(v) is not int for v in ints):  # bool is an int subclass: a block of True is a type confusion
        return "block, chunk, k, bits and scale_bits must be ints"
    if spec.codec in ("int8", "int4") and not 1 <= spec.block <= MAX_BLOCK:
        return f"block {spec.block} not in [1, {MAX_BLOCK}]"
    if spec.codec in TOPK_CODECS:
        if not 2 <= spec.chunk <= MAX_BLOCK or not 1 <= spec.k <= spec.chunk:
            return f"chunk {spec.chunk} not in [2, {MAX_BLOCK}] or k {spec.k} not in [1, chunk]"
        if spec.bits not in TOPK_VALUE_BITS:
            return f"bits {spec.bits} not in {sorted(TOPK_VALUE_BITS)}"
    if spec.codec == "randk":
        if not 2 <= spec.chunk <= MAX_BLOCK or not 1 <= spec.k <= spec.chunk:
            return f"chunk {spec.chunk} not in [2, {MAX_BLOCK}] or k {spec.k} not in [1, chunk]"
        if spec.bits not in RANDK_VALUE_BITS:
            return f"bits {spec.bits} not in {sorted(RANDK_VALUE_BITS)}"
    if type(spec.mask_rotate) is not bool:
        return "mask_rotate must be a bool"
    if spec.scale_bits not in SCALE_DTYPES:
        return f"scale_bits {spec.scale_bits} not in {sorted(SCALE_DTYPES)}"
    decay = spec.feedback_decay
    if type(decay) not in (int, float) or not 0.0 < decay <= 1.0:  # NaN fails the range too
        return f"feedback_decay {str(decay)[:16]} not a number in (0, 1]"
    return None


@dataclass(frozen=True, slots=True)
class Encoded:
    """A compressed tensor: `header` for the envelope's meta, `payload` for a uint8 payload tensor."""

    header: dict[str, MetaValue]
    payload: bytes

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    def payload_tensor(self) -> torch.Tensor:
        """The payload as a 1-D uint8 tensor (a private copy), the form a sealed envelope carries."""
        return torch.frombuffer(bytearray(self.payload), dtype=torch.uint8)


def index_bits(chunk: int) -> int:
    """Bits of one local index in a chunk of `chunk` elements."""
    return max(1, (chunk - 1).bit_length())


def payload_size(spec: CodecSpec, numel: int) -> int:
    """The payload bytes of `numel` elements under `spec` (what a header implies; no data needed): exact, or under
    topk_rice the most a valid payload takes."""
    if spec.codec == "topk_rice":
        return payload_bounds(spec, numel)[1]
    scale_bytes = spec.scale_bits // 8
    if spec.codec == "fp32":
        return 4 * numel
    if spec.codec in ("int8", "int4"):
        values = numel if spec.codec == "int8" else (numel + 1) // 2
        return -(-numel // spec.block) * scale_bytes + values
    num_chunks = -(-numel // spec.chunk)
    if spec.codec == "randk":  # no index: both sides derive the mask
        return num_chunks * scale_bytes + packed_size(randk_kept(spec, numel), spec.bits)
    kept = topk_kept(spec, numel)
    return num_chunks * scale_bytes + packed_size(kept, index_bits(spec.chunk)) + packed_size(kept, spec.bits)


def payload_bounds(spec: CodecSpec, numel: int) -> tuple[int, int]:
    """The fewest and the most payload bytes a valid encoding of `numel` elements takes (equal but for
    topk_rice, whose unary quotients vary with the positions kept)."""
    if spec.codec != "topk_rice":
        size = payload_size(spec, numel)
        return size, size
    kept, r = topk_kept(spec, numel), rice.rice_bits(spec.chunk, spec.k)
    fixed = (
        -(-numel // spec.chunk) * spec.scale_bits // 8 + packed_size(kept, r) + packed_size(kept, spec.bits)
    )
    low, high = rice.unary_bounds(kept, _chunk_counts(spec, numel), r)
    return fixed + low, fixed + high


def _chunk_counts(spec: CodecSpec, numel: int) -> list[tuple[int, int]]:
    """(length, kept) of every chunk, the short last one included."""
    full, rest = divmod(numel, spec.chunk)
    counts = [(spec.chunk, spec.k)] * full
    return counts + [(rest, min(spec.k, rest))] if rest else counts


def topk_kept(spec: CodecSpec, numel: int) -> int:
    """Entries a topk payload of `numel` elements holds: k per full chunk, min(k, rest) in a short last one."""
    full, rest = divmod(numel, spec.chunk)
    return full * spec.k + min(spec.k, rest)


def randk_kept(spec: CodecSpec, numel: int) -> int:
    """Entries a randk payload of `numel` elements holds: k per full chunk, the same density (rounded up) in a
    short last one, so its coordinates are not sent more often than the others'."""
    full, rest = divmod(numel, spec.chunk)
    return full * spec.k + -(-rest * spec.k // spec.chunk)


def compression_ratio(spec: CodecSpec, numel: int) -> float:
    """fp32 bytes over encoded bytes, from the exact payload size."""
    return 4 * numel / payload_size(spec, numel)


# ---------------------------------------------------------------------------------------------------- encoding


def encode(tensor: torch.Tensor, spec: CodecSpec, *, mask: MaskKey | None = None) -> Encoded:
    """Compress a float tensor (as float32) under `spec`; a randk spec needs the push's `mask`.

    Raises:
        ValueError: an empty dimension, non-finite values, values too large for a scale <= MAX_SCALE, or randk
            without a mask.
    """
    shape = [int(d) for d in tensor.shape]
    if any(d <= 0 for d in shape):
        raise ValueError(f"cannot encode a tensor with an empty dimension {shape}")
    flat = tensor.detach().to("cpu", torch.float32).reshape(-1)
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("cannot encode NaN or Inf")
    if spec.codec == "fp32":
        payload = flat.contiguous().numpy().tobytes()
    elif spec.codec in TOPK_CODECS:
        payload = _encode_topk(flat, spec)
    elif spec.codec == "randk":
        if mask is None:
            raise ValueError("randk encodes against a mask (MaskKey)")
        payload = _encode_randk(flat, spec, mask)
    else:
        payload = _encode_blocks(flat, spec)
    header: dict[str, MetaValue] = {**spec.header_fields(), "numel": flat.numel()}
    if spec.codec == "randk" and mask is not None:
        header.update(mask_seed=mask.seed, mask_stratum=mask.stratum)
    header["shape"] = cast("list[MetaScalar]", shape)
    return Encoded(header, payload)


def _scales(absmax: torch.Tensor, levels: float, scale_bits: int) -> torch.Tensor:
    """Scales as stored (rounded to their width): the quantizer uses the stored ones, so decode matches exactly."""
    scale = absmax / levels
    if bool((scale > MAX_SCALE).any()):
        raise ValueError(f"a block max of {float(absmax.max()):.3g} needs a scale above {MAX_SCALE}")
    return scale.to(SCALE_DTYPES[scale_bits])


def _encode_blocks(flat: torch.Tensor, spec: CodecSpec) -> bytes:
    numel, qmax = flat.numel(), _QMAX[spec.codec]
    blocks = torch.nn.functional.pad(flat, (0, (-numel) % spec.block)).view(-1, spec.block)
    stored = _scales(blocks.abs().amax(dim=1), float(qmax), spec.scale_bits)
    scale = stored.float().unsqueeze(1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block has scale 0: q = 0
    q = torch.round(blocks / safe).clamp_(-qmax, qmax).to(torch.int8).reshape(-1)[:numel]
    values = q.view(torch.uint8) if spec.codec == "int8" else _pack_nibbles(q)
    return stored.numpy().tobytes() + values.numpy().tobytes()


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, u.new_full((1,), 8)])  # the pad is a zero value
    pairs = u.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _encode_topk(flat: torch.Tensor, spec: CodecSpec) -> bytes:
    numel, half = flat.numel(), 1 << (spec.bits - 1)
    full = numel - numel % spec.chunk
    parts = [(flat[:full].view(-1, spec.chunk), spec.k)] if full else []
    if full < numel:
        parts.append((flat[full:].unsqueeze(0), min(spec.k, numel - full)))
    scales, indices, values = [], [], []
    for rows, k in parts:
        # sorted=False then sort: strictly increasing indices are the canonical form a receiver checks
        local = rows.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
        kept = rows.gather(1, local)
        stored = _scales(kept.abs().amax(dim=1), float(half), spec.scale_bits)
        scale = stored.float().unsqueeze(1)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.floor(kept / safe).clamp_(-half, half - 1).to(torch.int64) + half  # midrise: (q + 0.5) * s
        scales.append(stored)
        indices.append(local.reshape(-1))
        values.append(q.reshape(-1))
    packed_val = pack_bits(torch.cat(values), spec.bits)
    if spec.codec == "topk_rice":
        r = rice.rice_bits(spec.chunk, spec.k)
        local = torch.cat(indices)
        # k entries per chunk, the short last one too (as the decoder counts them)
        remainders, unary = rice.encode(local, torch.arange(local.numel()) // spec.k, r)
        parts_out = [remainders, packed_val, unary]
    else:
        parts_out = [pack_bits(torch.cat(indices), index_bits(spec.chunk)), packed_val]
    return torch.cat([torch.cat(scales).view(torch.uint8), *parts_out]).numpy().tobytes()


# ---------------------------------------------------------------------------------------------------- decoding


def parse_header(
    header: Mapping[str, object], limits: TensorLimits, *, expect: CodecSpec | None = None
) -> tuple[CodecSpec, tuple[int, ...]]:
    """The codec and shape a peer's header declares, checked against the schema, `limits` and `expect`.

    Allocates nothing. Raises CompressionError (BAD_HEADER, TOO_LARGE, WRONG_CODEC)."""
    codec = header.get("codec")
    if type(codec) is not str or codec not in _HEADER_KEYS:
        raise CompressionError(f"unknown codec {str(codec)[:16]!r}", reason=BAD_HEADER)
    keys = _HEADER_KEYS[codec]
    if set(header) != set(keys) or any(
        type(header[k]) is not int for k in keys if k not in ("codec", "shape")
    ):
        raise CompressionError(f"a {codec} header has exactly the int fields {keys}", reason=BAD_HEADER)
    # ints (checked above); the learner-side fields (feedback_decay, mask_rotate) never travel and keep defaults
    fields: dict[str, Any] = {k: header[k] for k in keys if k not in ("codec", "shape", "numel", *_MASK_KEYS)}
    try:
        spec = CodecSpec(codec=cast(CodecName, codec), **fields)
    except ValueError as e:
        raise CompressionError(str(e), reason=BAD_HEADER) from None
    if expect is not None and spec.header_fields() != expect.header_fields():
        raise CompressionError(
            f"got {spec.header_fields()}, expected {expect.header_fields()}", reason=WRONG_CODEC
        )
    shape = _checked_shape(header["shape"], header["numel"], limits)
    return spec, shape


def _checked_shape(shape: object, numel: object, limits: TensorLimits) -> tuple[int, ...]:
    # float32 is what decode builds, so the receiver's byte cap bounds numel x 4 before anything is allocated
    if type(numel) is int and 4 * numel > limits.max_bytes:
        raise CompressionError(f"{numel} elements > cap {limits.max_bytes // 4}", reason=TOO_LARGE)
    try:
        nbytes = check_spec("float32", shape, limits)
    except TensorPolicyError as e:
        reason = TOO_LARGE if e.reason == "tensor too large" else BAD_HEADER
        raise CompressionError(f"declared shape refused: {e}", reason=reason) from None
    if numel != nbytes // 4:
        raise CompressionError(f"numel {str(numel)[:24]} disagrees with the shape", reason=BAD_HEADER)
    return tuple(cast("Sequence[int]", shape))


def decode(
    header: Mapping[str, object],
    payload: bytes | bytearray | memoryview | torch.Tensor,
    limits: TensorLimits,
    *,
    expect: CodecSpec | None = None,
    mask: MaskKey | None = None,
) -> torch.Tensor:
    """The float32 tensor a peer's (header, payload) encodes, every check done before the output is allocated.

    `payload` may be the uint8 tensor an envelope delivered. Under randk, `mask` is the one the receiver derived
    for this push (None: the header's, checked for range only). Raises CompressionError."""
    spec, shape = parse_header(header, limits, expect=expect)
    numel = math.prod(shape)
    if spec.codec == "randk":
        mask = _header_mask(header, spec, expect=mask)
    data = _payload_bytes(payload)
    low, high = payload_bounds(spec, numel)
    if not low <= data.numel() <= high:
        raise CompressionError(
            f"{data.numel()} payload bytes, the header implies {low} to {high}", reason=WRONG_LENGTH
        )
    if spec.codec == "fp32":
        flat = data.view(torch.float32)
        if not bool(torch.isfinite(flat.sum())) and not bool(torch.isfinite(flat).all()):
            raise CompressionError("fp32 payload holds NaN or Inf", reason=NON_FINITE)
    elif spec.codec in TOPK_CODECS:
        flat = _decode_topk(data, spec, numel)
    elif spec.codec == "randk":
        flat = _decode_randk(data, spec, numel, cast(MaskKey, mask))
    else:
        flat = _decode_blocks(data, spec, numel)
    return flat.reshape(shape)


def _payload_bytes(payload: bytes | bytearray | memoryview | torch.Tensor) -> torch.Tensor:
    """One private, writable uint8 copy (payload-sized, never output-sized)."""
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise CompressionError("a compressed payload is a 1-D uint8 tensor", reason=BAD_HEADER)
        return payload.detach().to("cpu", copy=True).contiguous()
    return (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if len(payload)
        else torch.empty(0, dtype=torch.uint8)
    )


def _read_scales(data: torch.Tensor, count: int, scale_bits: int) -> torch.Tensor:
    stored = data[: count * scale_bits // 8].view(SCALE_DTYPES[scale_bits]).float()
    # one pass: a NaN fails every comparison, so "all in [0, MAX_SCALE]" also refuses NaN and +-Inf
    if not bool(((stored >= 0) & (stored <= MAX_SCALE)).all()):
        raise CompressionError(f"a scale is negative, NaN, Inf or above {MAX_SCALE}", reason=BAD_SCALE)
    return stored


def _decode_blocks(data: torch.Tensor, spec: CodecSpec, numel: int) -> torch.Tensor:
    num_blocks = -(-numel // spec.block)
    scales = _read_scales(data, num_blocks, spec.scale_bits)
    values = data[num_blocks * spec.scale_bits // 8 :]
    if spec.codec == "int8":
        q = values.view(torch.int8)
    else:  # low nibble first; an odd numel's pad nibble is dropped
        q = (torch.stack([values & 0x0F, values >> 4], dim=1).reshape(-1)[:numel].to(torch.int8)) - 8
    out = torch.zeros(num_blocks * spec.block, dtype=torch.float32)
    out[:numel] = q
    out.view(num_blocks, spec.block).mul_(scales.unsqueeze(1))
    return out[:numel]


def _decode_topk(data: torch.Tensor, spec: CodecSpec, numel: int) -> torch.Tensor:
    num_chunks, kept = -(-numel // spec.chunk), topk_kept(spec, numel)
    scales = _read_scales(data, num_chunks, spec.scale_bits)
    start = num_chunks * spec.scale_bits // 8
    chunk_of = torch.arange(kept, dtype=torch.int64) // spec.k  # k entries per chunk, the short last one too
    if spec.codec == "topk_rice":
        r = rice.rice_bits(spec.chunk, spec.k)
        val_start = start + packed_size(kept, r)
        val_end = val_start + packed_size(kept, spec.bits)
        local = rice.decode(data[start:val_start], data[val_end:], chunk_of, r)
    else:
        val_start = start + packed_size(kept, index_bits(spec.chunk))
        local = unpack_bits(data[start:val_start], kept, index_bits(spec.chunk))
    _check_indices(local, chunk_of, spec, numel)
    half = 1 << (spec.bits - 1)
    q = unpack_bits(data[val_start:], kept, spec.bits)
    values = (q - half).float().add_(0.5).mul_(scales[chunk_of])
    out = torch.zeros(numel, dtype=torch.float32)
    out[chunk_of * spec.chunk + local] = values
    return out


def _check_indices(local: torch.Tensor, chunk_of: torch.Tensor, spec: CodecSpec, numel: int) -> None:
    """In range of their chunk (the last may be short) and strictly increasing within it (so never repeated)."""
    limit = torch.full_like(local, spec.chunk)
    limit[chunk_of == numel // spec.chunk] = numel % spec.chunk or spec.chunk
    if bool((local >= limit).any()):
        raise CompressionError("a top-k index is past the end of its chunk", reason=BAD_INDEX)
    rises = local[1:] > local[:-1]
    new_chunk = chunk_of[1:] != chunk_of[:-1]
    if not bool((rises | new_chunk).all()):
        raise CompressionError("top-k indices are not strictly increasing within a chunk", reason=BAD_INDEX)


# ---------------------------------------------------------------------------------------------------- randk
# A shared random mask: per chunk, k positions drawn from a seed both sides know, so no index travels (13x the
# coordinates top-k keeps in the same bytes at 2 bits). Only values and one scale per chunk are sent.


@dataclass(frozen=True, slots=True)
class MaskKey:
    """Which positions a randk push kept: the per-chunk permutations drawn from `seed`, and their `stratum`-th
    run of k (wrapping), so strata 0 .. ceil(chunk / k) - 1 together cover every position."""

    seed: int
    stratum: int = 0


def mask_period(spec: CodecSpec) -> int:
    """Strata in a randk permutation: versions for a rotating mask to cover every coordinate once."""
    return -(-spec.chunk // spec.k)


def mask_for(spec: CodecSpec, *, run_seed: int, fragment: int, version: int) -> MaskKey:
    """The mask of a push of `fragment` on base `version`, derived alike by every learner and the syncer."""

    def seed(*parts: int) -> int:
        text = "hivenode-randk-v1:" + ":".join(str(p) for p in parts)
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & MAX_MASK_SEED

    if spec.mask_rotate:
        return MaskKey(seed(run_seed, fragment), version % mask_period(spec))
    return MaskKey(seed(run_seed, fragment, version), 0)


def _header_mask(header: Mapping[str, object], spec: CodecSpec, *, expect: MaskKey | None) -> MaskKey:
    """The mask a randk header names (ints, checked by parse_header), in range and equal to `expect` if given."""
    seed, stratum = cast(int, header["mask_seed"]), cast(int, header["mask_stratum"])
    if not 0 <= seed <= MAX_MASK_SEED or not 0 <= stratum < mask_period(spec):
        raise CompressionError(f"mask seed {seed} or stratum {stratum} out of range", reason=BAD_HEADER)
    got = MaskKey(seed, stratum)
    if expect is not None and got != expect:
        raise CompressionError(f"mask {got}, expected {expect}", reason=WRONG_MASK)
    return got


def randk_positions(spec: CodecSpec, numel: int, mask: MaskKey) -> torch.Tensor:
    """Flat positions a randk payload of `numel` elements holds (int64, `randk_kept` of them), increasing within
    each chunk, chunk after chunk. Costs one float and one int64 per element (the mask is drawn whole)."""
    generator = torch.Generator().manual_seed(mask.seed)
    full, rest = divmod(numel, spec.chunk)
    parts = []
    for rows, width in ((full, spec.chunk), (1 if rest else 0, rest)):
        if not rows:
            continue
        kept = -(-width * spec.k // spec.chunk)  # k in a full chunk; randk_kept's rounding in a short one
        perm = torch.rand(rows, width, generator=generator).argsort(dim=1)
        cols = (mask.stratum * kept + torch.arange(kept)) % width
        local = perm[:, cols].sort(dim=1).values
        start = 0 if width == spec.chunk else full * spec.chunk
        parts.append((start + torch.arange(rows).unsqueeze(1) * spec.chunk + local).reshape(-1))
    return torch.cat(parts)


# Uniform quantizer steps that minimise the squared error of Gaussian values, in units of their RMS (Max 1960):
# a random subset is no top-k, its values are spread, so the step follows the RMS and outliers are clipped (error
# feedback keeps what clipping lost). 8 bits: the chunk's max / 128, no clipping.
_RANDK_STEP = {1: 1.596, 2: 0.996, 4: 0.335}


def _encode_randk(flat: torch.Tensor, spec: CodecSpec, mask: MaskKey) -> bytes:
    numel, half = flat.numel(), 1 << (spec.bits - 1)
    positions = randk_positions(spec, numel, mask)
    kept = flat[positions]
    chunk_of = positions // spec.chunk
    num_chunks = -(-numel // spec.chunk)
    counts = torch.bincount(chunk_of, minlength=num_chunks).clamp_(min=1).float()
    if spec.bits in _RANDK_STEP:
        rms = (torch.zeros(num_chunks).index_add_(0, chunk_of, kept * kept) / counts).sqrt_()
        stored = _scales(rms * _RANDK_STEP[spec.bits], 1.0, spec.scale_bits)
    else:
        absmax = torch.zeros(num_chunks).scatter_reduce_(0, chunk_of, kept.abs(), "amax")
        stored = _scales(absmax, float(half), spec.scale_bits)
    scale = stored.float()[chunk_of]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.floor(kept / safe).clamp_(-half, half - 1).to(torch.int64) + half  # midrise: (q + 0.5) * s
    return torch.cat([stored.view(torch.uint8), pack_bits(q, spec.bits)]).numpy().tobytes()


def _decode_randk(data: torch.Tensor, spec: CodecSpec, numel: int, mask: MaskKey) -> torch.Tensor:
    num_chunks, kept = -(-numel // spec.chunk), randk_kept(spec, numel)
    scales = _read_scales(data, num_chunks, spec.scale_bits)
    q = unpack_bits(data[num_chunks * spec.scale_bits // 8 :], kept, spec.bits)
    positions = randk_positions(spec, numel, mask)
    half = 1 << (spec.bits - 1)
    out = torch.zeros(numel, dtype=torch.float32)
    out[positions] = (q - half).float().add_(0.5).mul_(scales[positions // spec.chunk])
    return out


# ---------------------------------------------------------------------------------------------------- in a frame

META_PREFIX = "z_"  # the header's keys in an envelope's meta, apart from the frame's own fields


def header_to_meta(header: Mapping[str, MetaValue], prefix: str = META_PREFIX) -> dict[str, MetaValue]:
    return {prefix + key: value for key, value in header.items()}


def header_from_meta(meta: Mapping[str, object], prefix: str = META_PREFIX) -> dict[str, object]:
    """The compression header inside a frame's meta (every key under `prefix`; `parse_header` refuses extras)."""
    return {key[len(prefix) :]: value for key, value in meta.items() if key.startswith(prefix)}
