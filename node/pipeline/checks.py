"""What the driver checks in every training answer before it uses it (`AnswerChecks`): its dtype and shape,
then the boundary tap (once per answer), then, when the tap draws one, a spot check: the same request
recomputed on other replicas of the stage and judged by the tap.

Disguised spot checks (the default; docs/sentinel.md, "Disguised spot checks"): the recomputation is sent as an
ordinary training request under a fresh microbatch id from the verifier's own counter (`MicrobatchIds`), built
by the same `HopClient` methods as the driver's walk, so a checker cannot tell a check from training traffic
and cannot answer checks alone falsely (to clear a colluding partner or to frame an honest replica). What that
costs the checker is what an abandoned microbatch costs it: a forward check leaves a context that its timeout
drops (no backward comes, nothing is applied); a backward check is a forward and a backward (a middle stage) or
a last-stage forward, which the checker applies as a training microbatch: one duplicated microbatch per
backward check, counted in `DriverStats.duplicate_gradients` and credited to nobody. The marked path
(`EVAL_META`, `RECOMPUTE_GRAD_META`, the original's id: nothing kept or applied, but recognisable) stays for
`disguised=False`."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

import torch

from node.pipeline.accounting import DriverStats, HopError
from node.pipeline.hops import HopClient, one_tensor
from node.pipeline.ids import MicrobatchIds
from node.pipeline.picker import ReplicaPicker
from node.pipeline.routing import HopFailure, RetryPolicy
from protocol.envelope import Direction, Kind, Opened
from protocol.pipeline import EVAL_META, FORWARD_RPC, GRAD_OUTPUT, RECOMPUTE_GRAD_META, TARGETS
from verification.tap import BoundaryTap, Drop

logger = logging.getLogger(__name__)

# A disguised middle-stage backward check waits between its forward and its backward as long as the checked
# microbatch's own backward came after its forward at that stage (a checker timing that gap would otherwise see a
# backward one round trip after its forward, sooner than any training microbatch's); at most this long.
MAX_CHECK_GAP_S = 30.0
_FORWARD_TIMES = 4096  # forward answers whose time is kept for that gap (popped by their backward's check)


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
        ids: MicrobatchIds | None = None,
        disguised: bool = True,
    ) -> None:
        """`ids`: the verifier's microbatch counter, which disguised checks take their ids from (the same as its
        training microbatches); `disguised`: send recomputations as ordinary training requests (see the module
        docstring), else marked as checks."""
        self.ids = ids or MicrobatchIds.from_clock()
        self.disguised = disguised
        self._forwarded_at: OrderedDict[tuple[int, int], float] = OrderedDict()  # (microbatch, stage) -> time
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
        if stage > 0:  # stage 0 answers no gradient, so no backward check there needs the gap
            self._forwarded_at[(microbatch, stage)] = self.hops.clock()
            while len(self._forwarded_at) > _FORWARD_TIMES:  # abandoned microbatches' forwards
                self._forwarded_at.popitem(last=False)
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
        forwarded_at = self._forwarded_at.pop((microbatch, stage), None)
        gap_s = 0.0 if forwarded_at is None else self.hops.clock() - forwarded_at
        checked = await self._spot_check(
            stage,
            Direction.BACKWARD,
            replica,
            microbatch,
            grad,
            checked,
            x,
            given=given,
            targets=targets,
            gap_s=gap_s,
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
        gap_s: float = 0.0,
    ) -> torch.Tensor | Drop:
        """If the tap draws a spot check of `replica`'s `original`, recompute it on a random other replica of
        the stage (and a third after a mismatch) and let the tap judge. Returns what to use: a Drop when the
        original was convicted; the original itself when the recomputation cleared a flagged tensor (the
        statistics were wrong); otherwise `checked` as the tap returned it. `gap_s`: how long after its forward at
        this stage the checked backward came (`MAX_CHECK_GAP_S`)."""
        if not self.tap.spot_check_due(stage, direction, replica):
            return checked
        trusted, suspects = self._checkers(stage, replica)
        outputs: list[tuple[str, torch.Tensor]] = []
        verdict = None
        while (trusted or suspects) and len(outputs) < 2:
            peer = self.picker.draw(trusted or suspects)
            out = await self._recompute(peer, stage, direction, microbatch, x, given, targets, gap_s)
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

    def _checkers(self, stage: int, replica: str) -> tuple[list[str], list[str]]:
        """The peers that may recompute `replica`'s answer: those the tap does not suspect, drawn first, and its
        suspects (`SpotCheckConfig.unsuspected_checkers_first`: attackers that cannot tell a check from
        training lie on it, and identical lies agree)."""
        peers = self.picker.others(stage, replica)
        suspect = getattr(self.tap, "spot_suspect", None)
        if suspect is None:
            return peers, []
        suspects = [p for p in peers if suspect(p)]
        return [p for p in peers if p not in suspects], suspects

    async def _recompute(
        self,
        peer: str,
        stage: int,
        direction: Direction,
        microbatch: int,
        x: torch.Tensor,
        given: torch.Tensor | None,
        targets: torch.Tensor | None,
        gap_s: float = 0.0,
    ) -> torch.Tensor | None:
        """`peer`'s answer to the same request: its output activation (forward), or the gradient of its input
        (backward: for the output gradient `given`, or the loss on `targets` at the last stage). None if it
        failed (the spot check is then not concluded)."""
        if direction is Direction.BACKWARD and (given if given is not None else targets) is None:
            return None
        try:
            if self.disguised:
                out = await self._disguised(peer, stage, direction, x, given, targets, gap_s)
            else:
                out = await self._marked(peer, stage, direction, microbatch, x, given, targets)
        except HopError as e:
            if self.retry.blames_replica(e.failure):
                self.picker.blame(peer)
            logger.info("spot-check recomputation on %s failed: %s", peer[-8:], e)
            return None
        if out.dtype != torch.float32 or out.shape[0] != x.shape[0]:
            return None
        return out

    async def _disguised(
        self,
        peer: str,
        stage: int,
        direction: Direction,
        x: torch.Tensor,
        given: torch.Tensor | None,
        targets: torch.Tensor | None,
        gap_s: float,
    ) -> torch.Tensor:
        """The recomputation as an ordinary training request under a fresh id (see the module docstring). Its
        signed answer is not kept as evidence (popped at once): the checker is judged by the adjudication."""
        microbatch = self.ids.take()
        self.stats.disguised_checks += 1
        if direction is Direction.FORWARD:
            opened = await self.hops.training_forward(peer, stage, microbatch, x)
        elif given is None:  # the last stage: its forward is its backward
            assert targets is not None
            self.stats.duplicate_gradients += 1
            opened = await self.hops.training_loss(peer, stage, microbatch, x, targets)
        else:
            forward = await self.hops.training_forward(peer, stage, microbatch, x)
            self.hops.pop_signed(microbatch, stage, Direction.FORWARD)
            one_tensor(forward, peer)
            if gap_s > 0:
                await asyncio.sleep(min(gap_s, MAX_CHECK_GAP_S))
            self.stats.duplicate_gradients += 1
            opened = await self.hops.training_backward(peer, stage, microbatch, given, x)
        self.hops.pop_signed(microbatch, stage, direction)
        return one_tensor(opened, peer)

    async def _marked(
        self,
        peer: str,
        stage: int,
        direction: Direction,
        microbatch: int,
        x: torch.Tensor,
        given: torch.Tensor | None,
        targets: torch.Tensor | None,
    ) -> torch.Tensor:
        """The recomputation marked as one (`EVAL_META`, the original's id): nothing kept or applied, but the
        checker knows it is a check."""
        meta: dict[str, Any] = {EVAL_META: True}
        if direction is Direction.FORWARD:
            tensors, answer_kind, answer_direction = {"": x}, Kind.ACTIVATION, Direction.FORWARD
        else:
            extra = {TARGETS: targets} if given is None else {GRAD_OUTPUT: given}
            tensors = {"": x, **extra}  # type: ignore[dict-item]
            answer_kind, answer_direction = Kind.GRADIENT, Direction.BACKWARD
            meta[RECOMPUTE_GRAD_META] = True
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
        return one_tensor(opened, peer)

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
