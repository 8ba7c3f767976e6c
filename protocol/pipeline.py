"""The pipeline's wire: RPC names, meta keys, refusal reasons, replay window and boundary-tensor caps.

Stages serve these and verifiers call them; both sides import them from here (docs/pipeline.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from protocol import token_wire
from protocol.boundary_codec import BoundaryCodecSpec
from protocol.codec import TensorLimits
from protocol.envelope import Kind, Opened
from protocol.errors import ProtocolError, TensorPolicyError
from protocol.manifest import RunManifest
from protocol.replay import ReplayConfig

if TYPE_CHECKING:
    pass


FORWARD_RPC = "stage.forward"


BACKWARD_RPC = "stage.backward"


RECEIPT_RPC = "stage.receipt"


TARGETS = "targets"  # name of the targets tensor beside the input ("") in a last-stage request


EVAL_META = "eval"  # meta flag: forward only, no context, no ledger (held-out loss)


# With EVAL_META: answer the gradient of the input instead (marked SENTINEL spot checks; by default checks are
# disguised as training requests, node/pipeline/checks.py), for the output gradient in GRAD_OUTPUT (or the loss on
# the targets at the last stage); nothing is kept or applied.
RECOMPUTE_GRAD_META = "recompute_grad"


GRAD_OUTPUT = "grad_output"


LOSS_META = "loss"


APPLIED_META = "applied"


MAX_CONTROL_BYTES = 64 * 1024


# Refusal reasons a verifier acts on (RemoteRefused.reason on its side).
UNAUTHORIZED = "not an authorized verifier"


ALREADY_APPLIED = "already applied"


STALE_MICROBATCH = "stale microbatch"


NO_CONTEXT = "no context"


NOT_SERVING = "not serving this stage"


# On pipeline frames the header's step is informational (the verifier's step on requests, the replica's inner step
# on answers) and restarts at 0 when either restarts; a step window would lock a restarted peer out. What stops
# replays here is the nonce seen-set and the timestamp window, and what stops double application is the
# idempotency ledger. The seen-set is sized for ~250 frames/s per peer over the 60 s skew window.
PIPELINE_REPLAY = ReplayConfig(window_steps=1 << 62, max_seen_per_sender=16384)


class UnauthorizedCaller(ProtocolError):
    """The caller is not an authorized verifier of this run: stages work for verifiers only."""

    reason = UNAUTHORIZED


class StageRefusal(ProtocolError):
    """A well-formed request this stage will not serve (a retry it must not apply, a lost context...).

    Never blamed on the caller: an honest verifier retrying after a lost answer gets exactly these."""

    blame_sender = False

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message, reason=reason, blame_sender=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class BoundaryShape:
    """What boundary tensors of this run must look like (from the manifest, never from the peer)."""

    max_batch: int
    context_len: int
    width: int
    vocab_size: int
    codec: BoundaryCodecSpec = BoundaryCodecSpec()  # how activations and gradients travel between stages

    @classmethod
    def from_manifest(cls, manifest: RunManifest) -> BoundaryShape:
        m = manifest.model
        return cls(
            max_batch=manifest.wire.max_batch,
            context_len=m["context_len"],
            width=m["width"],
            vocab_size=m["vocab_size"],
            codec=manifest.activation_codec,
        )

    @property
    def limits(self) -> TensorLimits:
        """Caps of one pipeline frame: an activation or gradient plus, to the last stage, int64 targets; a
        spot check's backward recomputation carries an activation and a gradient (hence two). With a boundary
        codec, the encoded payload (uint8) travels instead of an activation or gradient, and decodes under the same
        caps (`boundary_codec.decode_opened`)."""
        activation = self.max_batch * self.context_len * self.width * 4
        tokens = self.max_batch * self.context_len * 8
        return TensorLimits(
            max_bytes=2 * activation + tokens,
            max_rank=3,
            max_tensors=2,
            allowed_dtypes=frozenset(
                {
                    "float32",
                    "int64",
                    token_wire.token_dtype_name(self.vocab_size),
                    *(("uint8",) if self.codec.enabled else ()),
                }
            ),
        )

    def widen_tokens(self, opened: Opened) -> Opened:
        """`opened` with the token ids it carries (its input at the first stage, its targets) back in int64
        (`protocol.token_wire`: they travel in the vocabulary's narrowest dtype)."""
        names = (TARGETS, "") if opened.header.kind is Kind.TOKENS else (TARGETS,)
        return token_wire.widen(opened, names, self.vocab_size)

    def check_tokens(self, tokens: torch.Tensor, what: str = "tokens") -> None:
        ok = (
            tokens.dtype == torch.int64
            and tokens.dim() == 2
            and 1 <= tokens.shape[0] <= self.max_batch
            and 1 <= tokens.shape[1] <= self.context_len
        )
        if not ok:
            raise TensorPolicyError(f"{what} must be int64 [B<={self.max_batch}, T<={self.context_len}]")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
            raise TensorPolicyError(f"{what} outside [0, {self.vocab_size})", reason="bad tokens")

    def check_activation(self, x: torch.Tensor, what: str = "activation") -> None:
        ok = (
            x.dtype == torch.float32
            and x.dim() == 3
            and 1 <= x.shape[0] <= self.max_batch
            and 1 <= x.shape[1] <= self.context_len
            and x.shape[2] == self.width
        )
        if not ok:
            raise TensorPolicyError(f"{what} must be float32 [B, T, {self.width}], got {tuple(x.shape)}")


INPUT_DIGEST_META = "input_digest"  # hex digest of the request an output answers
