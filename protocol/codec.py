"""Tensor <-> bytes for the wire: a dtype allow-list, shape and size caps checked before any allocation, raw bytes.

A tensor travels as (dtype name, shape, raw little-endian bytes). Nothing is ever unpickled and no numpy object array
is built: the receiver checks the declared dtype and shape against `TensorLimits` (which come from the run manifest,
never from the peer), checks that the byte count is exactly numel x itemsize, copies the bytes once into a writable
buffer and wraps it with `torch.frombuffer`. Non-finite floats are refused by default.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

import torch

from protocol.errors import SizeMismatch, TensorPolicyError

# The wire names are ours, so a peer cannot smuggle numpy/torch dtype strings ("object", "V8", "O") past the lookup.
WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "uint16": torch.uint16,  # token ids of a vocabulary up to 65536 (`protocol.token_wire`)
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in WIRE_DTYPES.items()}
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16"})
DEFAULT_DTYPES = frozenset({"float32", "float16", "bfloat16", "int64"})

NonFinitePolicy = Literal["reject", "allow"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorLimits:
    """What a receiver accepts for one frame; built from the run manifest (expected shapes), never from the peer."""

    max_bytes: int  # total payload bytes of one frame (all its tensors together)
    max_rank: int = 8
    max_dim: int = 1 << 31  # largest single dimension
    max_tensors: int = 1  # named tensors in one frame (a DiLoCo fragment needs more)
    allowed_dtypes: frozenset[str] = field(default=DEFAULT_DTYPES)
    nonfinite: NonFinitePolicy = "reject"  # NaN/Inf in float tensors

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {self.max_bytes}")
        if self.max_rank < 0 or self.max_dim <= 0 or self.max_tensors <= 0:
            raise ValueError("max_rank must be >= 0, max_dim and max_tensors > 0")
        unknown = set(self.allowed_dtypes) - set(WIRE_DTYPES)
        if unknown:
            raise ValueError(f"dtypes {sorted(unknown)} are not wire dtypes {sorted(WIRE_DTYPES)}")
        if self.nonfinite not in ("reject", "allow"):
            raise ValueError(f"nonfinite must be 'reject' or 'allow', got {self.nonfinite!r}")


def _require_little_endian() -> None:
    # The wire format is little-endian raw bytes; a big-endian host would need byte swaps we do not implement.
    if sys.byteorder != "little":
        raise RuntimeError("the hivenode wire codec supports little-endian hosts only")


def dtype_name(tensor: torch.Tensor) -> str:
    """The wire name of `tensor.dtype`; raises TensorPolicyError for dtypes that never travel."""
    try:
        return DTYPE_NAMES[tensor.dtype]
    except KeyError:
        raise TensorPolicyError(
            f"dtype {tensor.dtype} is not a wire dtype", reason="dtype not allowed"
        ) from None


def itemsize(dtype: str) -> int:
    return WIRE_DTYPES[dtype].itemsize


def check_spec(dtype: object, shape: object, limits: TensorLimits) -> int:
    """Validate a peer-declared (dtype, shape) against `limits` and return its byte count; allocates nothing.

    Raises:
        TensorPolicyError: unknown or disallowed dtype, a shape that is not a list of positive ints, rank or a
            dimension or the byte count over the caps.
    """
    if not isinstance(dtype, str) or dtype not in WIRE_DTYPES or dtype not in limits.allowed_dtypes:
        raise TensorPolicyError(f"dtype {str(dtype)[:32]!r} is not allowed", reason="dtype not allowed")
    if not isinstance(shape, (list, tuple)):
        raise TensorPolicyError("shape is not a list", reason="bad shape")
    if len(shape) > limits.max_rank:
        raise TensorPolicyError(f"rank {len(shape)} > {limits.max_rank}", reason="bad shape")
    numel = 1
    for dim in shape:
        # bool is an int subclass; a dim of True is a type confusion, not a 1.
        if type(dim) is not int or dim <= 0 or dim > limits.max_dim:
            raise TensorPolicyError(
                f"dimension {str(dim)[:24]} is not in [1, {limits.max_dim}]", reason="bad shape"
            )
        numel *= dim  # Python ints: no overflow, and the rank cap bounds the work
    nbytes = numel * itemsize(dtype)
    if nbytes > limits.max_bytes:
        raise TensorPolicyError(
            f"tensor of {nbytes} bytes > cap {limits.max_bytes}", reason="tensor too large"
        )
    return nbytes


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A read-only byte view of `tensor` (copied only if it is not contiguous on the CPU)."""
    _require_little_endian()
    dtype_name(tensor)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    # numpy has no bfloat16, so view every dtype as uint8 first; the view shares memory with `flat`.
    return flat.view(torch.uint8).numpy().data.toreadonly()


def tensor_spec(tensor: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """(wire dtype name, shape) of a tensor about to be sent; refuses shapes a receiver would refuse."""
    shape = tuple(int(d) for d in tensor.shape)
    if any(d <= 0 for d in shape):
        raise TensorPolicyError(f"cannot send a tensor with an empty dimension {shape}", reason="bad shape")
    return dtype_name(tensor), shape


def encode_tensor(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype name, shape, raw bytes) of `tensor`."""
    dtype, shape = tensor_spec(tensor)
    return dtype, shape, bytes(tensor_bytes(tensor))


def decode_tensor(
    dtype: object, shape: object, data: bytes | bytearray | memoryview, limits: TensorLimits
) -> torch.Tensor:
    """Build a tensor from peer-supplied (dtype, shape, bytes), checking everything first.

    Raises:
        TensorPolicyError: see `check_spec`, or non-finite values under the "reject" policy.
        SizeMismatch: `len(data)` is not numel x itemsize.
    """
    _require_little_endian()
    nbytes = check_spec(dtype, shape, limits)
    # check_spec returned, so dtype is a wire dtype name and shape a list or tuple of positive ints.
    checked_dtype, checked_shape = cast(str, dtype), cast("Sequence[int]", shape)
    if len(data) != nbytes:
        raise SizeMismatch(f"{len(data)} bytes for {checked_dtype}{list(checked_shape)} which needs {nbytes}")
    return build_tensor(checked_dtype, checked_shape, data, limits)


def build_tensor(
    dtype: str,
    shape: Sequence[int],
    data: bytes | bytearray | memoryview,
    limits: TensorLimits,
    *,
    copy: bool = True,
) -> torch.Tensor:
    """Wrap already-checked bytes (one private copy; with `copy=False` a view over `data`, which must be writable
    and aligned to the dtype: the caller's buffer is then the tensor's) and apply the finite-value policy."""
    buffer = bytearray(data) if copy else data
    tensor = torch.frombuffer(buffer, dtype=WIRE_DTYPES[dtype]).reshape(tuple(shape))
    if limits.nonfinite == "reject" and dtype in FLOAT_DTYPES and not all_finite(tensor):
        raise TensorPolicyError("tensor holds NaN or Inf", reason="non-finite values")
    return tensor


def all_finite(tensor: torch.Tensor) -> bool:
    """Exact, and fast when the answer is yes.

    In IEEE arithmetic a sum that meets a NaN or an Inf stays NaN or Inf, so a finite sum proves every element
    finite; only a sum that overflowed on finite values needs the element-wise check. The sum runs at memory speed,
    `isfinite(t).all()` about 25x slower (0.6 ms against 15 ms for 16 MiB of float32 on one core here).
    """
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())
