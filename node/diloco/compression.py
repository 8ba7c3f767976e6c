"""Learner-side error feedback for compressed outer gradients (issue 20; SparseLoCo's error feedback).

A lossy codec (top-k above all) drops most of every pseudo-gradient. Without feedback the small coordinates never
reach the syncer: each round they are dropped again. With it, the learner keeps what the codec lost in a residual
per fragment and adds it to the next delta before encoding::

    corrected = delta + residual
    encoded   = encode(corrected)
    residual  = corrected - decode(encoded)

so the decoded updates sum to the true deltas minus the current residual, which stays bounded (the codec keeps
each chunk's largest entries, so a coordinate cannot grow without being sent). With the codec's
`feedback_decay` below 1 (SparseLoCo's beta) the residual is scaled by it once committed: a coordinate the codec
keeps dropping fades rather than arriving many rounds late. Pure: no I/O, no clock.

A contribution the syncer refuses for good carried work that never arrived: `forget` drops the residual of that
fragment (the next delta, measured from the version the learner then loads, already holds the lost progress as
far as the learner still has it); a contribution merely deferred is re-sent as encoded, so the residual stands.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from node.diloco import chunked
from node.diloco.fragments import FragmentPlan
from protocol.codec import TensorLimits
from protocol.compress import (
    BAD_HEADER,
    META_PREFIX,
    CodecSpec,
    Encoded,
    MaskKey,
    decode,
    encode,
    header_from_meta,
    header_to_meta,
    mask_for,
    payload_size,
)
from protocol.envelope import MetaValue
from protocol.errors import CompressionError

DELTA_TENSOR = "delta"  # the one tensor of a compressed contribution: the encoded payload, uint8


class ErrorFeedback:
    """The residuals of one learner, one flat float32 tensor per fragment, for one codec."""

    def __init__(self, spec: CodecSpec, *, enabled: bool = True) -> None:
        self.spec = spec
        # fp32 is lossless, so a residual would stay zero: skip the decode and the copy
        self.enabled = enabled and spec.codec != "fp32"
        self._residuals: dict[int, torch.Tensor] = {}

    def encode(self, fragment: int, delta: torch.Tensor, *, mask: MaskKey | None = None) -> Encoded:
        """Encode `delta + residual` for `fragment` and keep what the codec lost as its new residual.

        A delta of another shape than the residual (a new plan) starts the fragment afresh."""
        encoded, residual = self.prepare(fragment, delta, mask=mask)
        self.commit(fragment, residual)
        return encoded

    def prepare(
        self, fragment: int, delta: torch.Tensor, *, mask: MaskKey | None = None
    ) -> tuple[Encoded, torch.Tensor | None]:
        """Encode `delta + residual` without touching the residual: the caller commits the returned one once the
        syncer took the contribution. Until then a newer snapshot of the fragment may replace this one, and its
        delta must be corrected by the residual of what did arrive, not of what never did."""
        corrected = delta.detach().to("cpu", torch.float32)
        residual = self._residuals.get(fragment)
        if residual is not None and residual.shape == corrected.shape:
            corrected = corrected + residual
        encoded = encode(corrected, self.spec, mask=mask)
        if not self.enabled:
            return encoded, None
        return encoded, corrected - decode(encoded.header, encoded.payload, _own_limits(corrected), mask=mask)

    def commit(self, fragment: int, residual: torch.Tensor | None) -> None:
        """Keep `residual` (from `prepare`) as what the codec still owes the syncer for `fragment`, times the
        codec's `feedback_decay` (in place: `prepare` made it for us alone)."""
        if residual is not None:
            if self.spec.feedback_decay != 1.0:
                residual.mul_(self.spec.feedback_decay)
            self._residuals[fragment] = residual

    def residual(self, fragment: int) -> torch.Tensor | None:
        return self._residuals.get(fragment)

    def residual_norm(self, fragment: int) -> float:
        residual = self._residuals.get(fragment)
        return 0.0 if residual is None else float(residual.norm())

    def forget(self, fragment: int) -> None:
        """Drop the residual of `fragment` (its contribution was refused for good, or the learner reloaded)."""
        self._residuals.pop(fragment, None)

    def total_bytes(self) -> int:
        """Memory the residuals hold (one float32 copy of every fragment sent with a lossy codec)."""
        return sum(4 * r.numel() for r in self._residuals.values())


def _own_limits(tensor: torch.Tensor) -> TensorLimits:
    """Limits for decoding what we just encoded ourselves: exactly its size (the checks still run, cheaply)."""
    return TensorLimits(max_bytes=max(4 * tensor.numel(), 1), max_rank=max(tensor.dim(), 1), max_dim=1 << 62)


def relative_error(decoded: torch.Tensor, reference: torch.Tensor) -> float:
    """||decoded - reference|| / ||reference|| (0 for a zero reference that was decoded exactly)."""
    ref = float(reference.norm())
    err = float((decoded - reference).norm())
    return err / ref if ref > 0 else (0.0 if err == 0 else math.inf)


# ---- a fragment as one vector: what a compressed contribution would carry (see the report of issue 20 part 1)


def flatten_fragment(tensors: Mapping[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    """The fragment's tensors as one float32 vector, in plan order: one codec header per fragment, and chunks
    and blocks that run across tensor boundaries (so no tensor pays for a short last chunk)."""
    return torch.cat([tensors[name].detach().to("cpu", torch.float32).reshape(-1) for name in names])


def unflatten_fragment(
    flat: torch.Tensor, shapes: Mapping[str, tuple[int, ...]], names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """Inverse of `flatten_fragment`; ValueError when `flat` does not have exactly the fragment's size."""
    sizes = [math.prod(shapes[name]) for name in names]
    if flat.dim() != 1 or flat.numel() != sum(sizes):
        raise ValueError(f"a vector of {flat.numel()} elements for a fragment of {sum(sizes)}")
    out, offset = {}, 0
    for name, size in zip(names, sizes, strict=True):
        out[name] = flat[offset : offset + size].reshape(shapes[name])
        offset += size
    return out


def fragment_delta(
    base: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], names: Sequence[str]
) -> torch.Tensor:
    """base - params, flat: the merge's sign (`merge._deltas`), so the syncer's params are base - decoded."""
    return flatten_fragment(base, names) - flatten_fragment(params, names)


def params_from_delta(
    base: Mapping[str, torch.Tensor], delta: torch.Tensor, names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """The learner's params as the syncer sees them: its copy of the base version minus the decoded delta."""
    shapes = {name: tuple(base[name].shape) for name in names}
    return unflatten_fragment(flatten_fragment(base, names) - delta, shapes, names)


# ---- a contribution on the wire: the learner's encoded delta, the syncer's params rebuilt from it


@dataclass(frozen=True, slots=True)
class WireContribution:
    """What a learner's push carries for one fragment under a lossy codec, and the residual to commit once the
    syncer took it."""

    tensors: dict[str, torch.Tensor]  # {DELTA_TENSOR: uint8 payload}
    meta: dict[str, MetaValue]  # the codec header, under META_PREFIX
    residual: torch.Tensor | None
    nbytes: int  # payload bytes (what the codec saves is against 4 bytes per element)


def encode_contribution(
    feedback: ErrorFeedback,
    fragment: int,
    base: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    names: Sequence[str],
    *,
    mask: MaskKey | None = None,
) -> WireContribution:
    """The outer gradient `base - params` of one fragment, error-corrected and encoded; the residual uncommitted.
    A randk codec needs the push's `mask` (`protocol.compress.mask_for`)."""
    encoded, residual = feedback.prepare(fragment, fragment_delta(base, params, names), mask=mask)
    return WireContribution(
        tensors={DELTA_TENSOR: encoded.payload_tensor()},
        meta=header_to_meta(encoded.header, META_PREFIX),
        residual=residual,
        nbytes=encoded.nbytes,
    )


class ContributionEncoder:
    """A learner's side of a lossy outer codec: its error feedback, and the fragments' names in plan order."""

    def __init__(self, spec: CodecSpec, plan: FragmentPlan) -> None:
        self.spec = spec
        self.plan = plan
        self.feedback = ErrorFeedback(spec)

    def encode(
        self,
        fragment: int,
        base: Mapping[str, torch.Tensor],
        params: Mapping[str, torch.Tensor],
        *,
        mask: MaskKey | None = None,
    ) -> WireContribution:
        names = self.plan.fragments[fragment].names
        return encode_contribution(self.feedback, fragment, base, params, names, mask=mask)

    def commit(self, fragment: int, sent: WireContribution) -> None:
        """The syncer took `sent`: what its codec dropped is owed from now on."""
        self.feedback.commit(fragment, sent.residual)


# The mask needs agreement, not secrecy (the base version it follows is public): one seed for every run.
MASK_RUN_SEED = 0


def push_mask(spec: CodecSpec, fragment: int, base_version: int) -> MaskKey | None:
    """The mask of a randk push of `fragment` on `base_version` (the version its header names), derived alike
    by the learner and the syncer; None under every other codec."""
    if spec.codec != "randk":
        return None
    return mask_for(spec, run_seed=MASK_RUN_SEED, fragment=fragment, version=base_version)


def contribution_limits(spec: CodecSpec, largest_fragment: int) -> TensorLimits:
    """Envelope caps for a compressed push: one uint8 tensor, at most the largest fragment's encoded size."""
    size = max(payload_size(spec, largest_fragment), 1)
    return TensorLimits(
        max_bytes=size, max_tensors=1, max_rank=1, max_dim=size, allowed_dtypes=frozenset({"uint8"})
    )


def push_limits(spec: CodecSpec, plan: FragmentPlan, plain: TensorLimits) -> TensorLimits:
    """What a syncer admits in a push: `plain` (the fragment's float tensors) under fp32, else one payload."""
    if spec.codec == "fp32":
        return plain
    return contribution_limits(spec, max(f.num_params for f in plan.fragments))


def decode_contribution(
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, object],
    *,
    spec: CodecSpec,
    base: Mapping[str, torch.Tensor],
    names: Sequence[str],
    mask: MaskKey | None = None,
) -> dict[str, torch.Tensor]:
    """The params a compressed contribution stands for: `base - decoded delta`, every check of the decoder done
    before anything fragment-sized is allocated (the declared size may be at most the fragment's). Under randk,
    `mask` is the one the syncer derived for the push (a header naming another is refused). Raises
    CompressionError."""
    if set(tensors) != {DELTA_TENSOR}:
        raise CompressionError(
            f"a {spec.codec} contribution carries exactly one {DELTA_TENSOR!r} tensor, got {sorted(tensors)[:4]}",
            reason=BAD_HEADER,
        )
    numel = sum(math.prod(chunked.shape(base, name)) for name in names)
    limits = TensorLimits(max_bytes=max(4 * numel, 1), max_rank=1, max_dim=max(numel, 1))
    delta = decode(header_from_meta(meta), tensors[DELTA_TENSOR], limits, expect=spec, mask=mask)
    if delta.numel() != numel:
        raise CompressionError(
            f"a delta of {delta.numel()} elements for a fragment of {numel}", reason=BAD_HEADER
        )
    return params_from_delta(base, delta.reshape(-1), names)
