"""What the driver checks in every training answer before it uses it (`AnswerChecks`): its dtype and shape,
then the boundary tap (once per answer), then, when the tap draws one, a spot check: the same request
recomputed on other replicas of the stage and judged by the tap."""

from __future__ import annotations

import logging
from typing import Any

import torch

from node.pipeline.accounting import DriverStats, HopError
from node.pipeline.hops import HopClient, one_tensor
from node.pipeline.picker import ReplicaPicker
from node.pipeline.routing import HopFailure, RetryPolicy
from protocol.envelope import Direction, Kind, Opened
from protocol.pipeline import EVAL_META, FORWARD_RPC, GRAD_OUTPUT, RECOMPUTE_GRAD_META, TARGETS
from verification.tap import BoundaryTap, Drop

logger = logging.getLogger(__name__)


class AnswerChecks:
    """Turns an opened training answer into the tensor to use, or a HopError (BAD_REPLY for a malformed one,
    DROPPED for one the tap or a spot check refused). `width` is the boundary activations' last dimension."""

    def __init__(
        self,
        *,
        hops: HopClient,
        picker: ReplicaPicker,
        tap: BoundaryTap,
        retry: RetryPolicy,
        stats: DriverStats,
        width: int,
    ) -> None:
        self.hops = hops
        self.picker = picker
        self.tap = tap
        self.retry = retry
        self.stats = stats
        self.width = width

    async def activation(
        self, opened: Opened, replica: str, stage: int, microbatch: int, x: torch.Tensor
    ) -> torch.Tensor:
        """The activation `replica` computed at `stage` from input `x`, checked."""
        out = one_tensor(opened, replica)
        expected = (x.shape[0], x.shape[1], self.width)
        if out.dtype != torch.float32 or tuple(out.shape) != expected:
            raise HopError(HopFailure.BAD_REPLY, f"activation {tuple(out.shape)} != {expected}")
        checked = self._tap_check(
            stage, Direction.FORWARD, replica, microbatch, out, opened, x if stage > 0 else None
        )
        checked = await self._spot_check(stage, Direction.FORWARD, replica, microbatch, out, checked, x)
        if isinstance(checked, Drop):
            raise HopError(HopFailure.DROPPED, checked.reason)
        return checked

    async def gradient(
        self,
        opened: Opened,
        replica: str,
        stage: int,
        microbatch: int,
        x: torch.Tensor,
        given: torch.Tensor | None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The gradient of `replica`'s input `x` at `stage` (for the output gradient `given`, or the loss on
        `targets` at the last stage), checked."""
        grad = one_tensor(opened, replica)
        if grad.dtype != torch.float32 or tuple(grad.shape) != tuple(x.shape):
            raise HopError(HopFailure.BAD_REPLY, f"gradient {tuple(grad.shape)} != input {tuple(x.shape)}")
        checked = self._tap_check(stage, Direction.BACKWARD, replica, microbatch, grad, opened, given)
        checked = await self._spot_check(
            stage, Direction.BACKWARD, replica, microbatch, grad, checked, x, given=given, targets=targets
        )
        if isinstance(checked, Drop):
            raise HopError(HopFailure.DROPPED, checked.reason)
        return checked

    # ---- spot checks

    async def _spot_check(
        self,
        stage: int,
        direction: Direction,
        replica: str,
        microbatch: int,
        original: torch.Tensor,
        checked: torch.Tensor | Drop,
        x: torch.Tensor,
        *,
        given: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor | Drop:
        """If the tap draws a spot check of `replica`'s `original`, recompute it on a random other replica of
        the stage (and a third after a mismatch) and let the tap judge. Returns what to use: a Drop when the
        original was convicted; the original itself when the recomputation cleared a flagged tensor (the
        statistics were wrong); otherwise `checked` as the tap returned it."""
        if not self.tap.spot_check_due(stage, direction, replica):
            return checked
        peers = self.picker.others(stage, replica)
        outputs: list[tuple[str, torch.Tensor]] = []
        verdict = None
        while peers and len(outputs) < 2:
            peer = self.picker.draw(peers)
            out = await self._recompute(peer, stage, direction, microbatch, x, given, targets)
            if out is None:
                continue
            outputs.append((peer, out))
            checker, checker_out = outputs[0]
            third, third_out = outputs[1] if len(outputs) > 1 else (None, None)
            verdict = self.tap.spot_check(
                stage, direction, replica, microbatch, original, checker, checker_out,
                third=third, third_output=third_out,
            )  # fmt: skip
            if verdict.outcome != "need_third":
                break
        if verdict is None:
            return checked
        self.stats.spot_checks += 1
        if verdict.culprit == "original":
            return Drop(f"spot check convicted {replica[-8:]} at stage {stage}: {verdict.reason}")
        cleared = getattr(self.tap, "spot_cleared", None)
        if checked is not original and cleared is not None and cleared(replica, microbatch):
            return original  # the flag was taken back: use the tensor after all (not a drop or the EMA)
        return checked

    async def _recompute(
        self,
        peer: str,
        stage: int,
        direction: Direction,
        microbatch: int,
        x: torch.Tensor,
        given: torch.Tensor | None,
        targets: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """`peer`'s answer to the same request, computed without context, ledger or weight update: its output
        activation (forward), or the gradient of its input (backward: for the output gradient `given`, or the
        loss on `targets` at the last stage). None if it failed (the spot check is then not concluded)."""
        meta: dict[str, Any] = {EVAL_META: True}
        if direction is Direction.FORWARD:
            tensors, answer_kind, answer_direction = {"": x}, Kind.ACTIVATION, Direction.FORWARD
        else:
            extra = {TARGETS: targets} if given is None and targets is not None else {GRAD_OUTPUT: given}
            if any(t is None for t in extra.values()):
                return None
            tensors = {"": x, **extra}  # type: ignore[dict-item]
            answer_kind, answer_direction = Kind.GRADIENT, Direction.BACKWARD
            meta[RECOMPUTE_GRAD_META] = True
        try:
            opened = await self.hops.call(
                peer,
                FORWARD_RPC,
                stage,
                answer_direction,
                microbatch,
                tensors,
                answer_kind,
                x,
                request_direction=Direction.FORWARD,
                meta=meta,
            )
            out = one_tensor(opened, peer)
        except HopError as e:
            if self.retry.blames_replica(e.failure):
                self.picker.blame(peer)
            logger.info("spot-check recomputation on %s failed: %s", peer[-8:], e)
            return None
        if out.dtype != torch.float32 or out.shape[0] != x.shape[0]:
            return None
        return out

    def _tap_check(
        self,
        stage: int,
        direction: Direction,
        replica: str,
        microbatch: int,
        tensor: torch.Tensor,
        opened: Opened,
        context: torch.Tensor | None,
    ) -> torch.Tensor | Drop:
        signed = self.hops.pop_signed(microbatch, stage, direction)
        return self.tap.check(
            stage, direction, replica, microbatch, tensor, opened.header, context=context, signed=signed
        )
