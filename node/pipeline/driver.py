"""The pipeline driver: walks one microbatch through a replica per stage, forward and back, through the boundary tap.

`PipelineDriver` holds the walk and its retry policy: it retries a failed hop elsewhere, asks the same replica
again when only the answer was lost, and re-runs a lost forward when the replica holding a microbatch's context
is gone. Its parts: `ReplicaPicker` (node/pipeline/picker.py) chooses the replica of each hop; `HopClient`
(hops.py) seals, sends through a `HopTransport` (transport.py: framed P2P streams or in process) and opens;
`AnswerChecks` (checks.py) checks each answer, through the tap and its spot checks; `Accounting` (accounting.py)
counts outcomes and credits verified tokens to signed receipts (`ReceiptBook`). The verifier role wraps it
(node/roles/verifier.py).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from node.ml.data import Batch
from node.pipeline.accounting import (
    Accounting,
    HopError,
    MicrobatchAbandoned,
    MicrobatchOutcome,
    ReceiptBook,
)
from node.pipeline.checks import AnswerChecks
from node.pipeline.hops import HopClient, one_tensor
from node.pipeline.ids import MicrobatchIds
from node.pipeline.picker import ReplicaPicker
from node.pipeline.routing import HopFailure, ReplicaInfo, ReplicaRouter, RetryPolicy
from node.pipeline.transport import HopTransport
from protocol.envelope import Direction, Kind
from protocol.identity import NodeIdentity
from protocol.pipeline import (
    ALREADY_APPLIED,
    APPLIED_META,
    EVAL_META,
    FORWARD_RPC,
    LOSS_META,
    TARGETS,
    BoundaryShape,
)
from verification.tap import BoundaryTap, PassThroughTap

logger = logging.getLogger(__name__)


class PipelineDriver:
    """Walks microbatches through the stages (see the module docstring). One driver per verifier; its
    `run_microbatch` may be awaited concurrently from one event loop. `ids`: the verifier's microbatch counter
    (its training microbatches take their ids from it too); `disguised_spot_checks`: send spot-check
    recomputations as ordinary training requests (node/pipeline/checks.py), else marked as checks."""

    def __init__(
        self,
        *,
        identity: NodeIdentity,
        run_id: str,
        num_stages: int,
        shape: BoundaryShape,
        transport: HopTransport,
        replicas: Callable[[], Sequence[ReplicaInfo]],
        router: ReplicaRouter | None = None,
        retry: RetryPolicy | None = None,
        tap: BoundaryTap | None = None,
        receipts: ReceiptBook | None = None,
        banned: Callable[[], Collection[str]] = frozenset,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        ids: MicrobatchIds | None = None,
        disguised_spot_checks: bool = True,
    ) -> None:
        self.identity = identity
        self.run_id = run_id
        self.num_stages = num_stages
        self.shape = shape
        self.router = router or ReplicaRouter()
        self.retry = retry or RetryPolicy()
        self.accounting = Accounting(run_id, identity.peer_id, receipts or ReceiptBook(identity, run_id))
        self.receipts = self.accounting.receipts
        self.stats = self.accounting.stats
        self.picker = ReplicaPicker(
            num_stages=num_stages,
            replicas=replicas,
            router=self.router,
            banned=banned,
            rng=rng or random.Random(),
            clock=clock,
        )
        self.last_route = self.picker.last_route
        self.hops = HopClient(
            identity=identity,
            run_id=run_id,
            limits=shape.limits,
            transport=transport,
            router=self.router,
            retry=self.retry,
            stats=self.stats,
            clock=clock,
            wall_clock=wall_clock,
            codec=shape.codec,
            vocab_size=shape.vocab_size,
        )
        self.strikes = self.hops.strikes
        self.ids = ids or MicrobatchIds.from_clock(wall_clock)
        self.checks = self._answer_checks(tap or PassThroughTap(), disguised=disguised_spot_checks)
        # microbatch -> the replica holding its context at each stage passed so far (their backward is due there)
        self._holders: dict[int, list[str]] = {}
        self.on_failure: Callable[[int, int, str, HopError], None] | None = None

    def _answer_checks(self, tap: BoundaryTap, *, disguised: bool) -> AnswerChecks:
        return AnswerChecks(
            hops=self.hops,
            picker=self.picker,
            tap=tap,
            retry=self.retry,
            stats=self.stats,
            width=self.shape.width,
            ids=self.ids,
            disguised=disguised,
        )

    # ---- the parts' settings, kept settable here (the verifier stamps `step`; tests swap taps and transports)

    @property
    def step(self) -> int:
        """The verifier's step (sequences driven / inner batch), stamped on requests."""
        return self.hops.step

    @step.setter
    def step(self, step: int) -> None:
        self.hops.step = step

    @property
    def transport(self) -> HopTransport:
        return self.hops.transport

    @transport.setter
    def transport(self, transport: HopTransport) -> None:
        self.hops.transport = transport

    @property
    def tap(self) -> BoundaryTap:
        return self.checks.tap

    @tap.setter
    def tap(self, tap: BoundaryTap) -> None:
        self.checks.tap = tap

    @property
    def replicas(self) -> Callable[[], Sequence[ReplicaInfo]]:
        return self.picker.replicas

    @replicas.setter
    def replicas(self, replicas: Callable[[], Sequence[ReplicaInfo]]) -> None:
        self.picker.replicas = replicas

    @property
    def rng(self) -> random.Random:
        return self.picker.rng

    @rng.setter
    def rng(self, rng: random.Random) -> None:
        self.picker.rng = rng

    # ---- readiness

    def holding(self, peer_id: str) -> int:
        """Training microbatches in flight whose context `peer_id` holds: their backward is due there."""
        return sum(holders.count(peer_id) for holders in self._holders.values())

    def context_holders(self, microbatch: int) -> list[str]:
        """The replicas holding `microbatch`'s stage contexts so far, stage 0 first (empty once it ended)."""
        return list(self._holders.get(microbatch, ()))

    def missing_stages(self, now: float | None = None) -> list[int]:
        """Stages with no usable replica right now (nothing can be driven until each has one)."""
        return self.picker.missing_stages(now)

    # ---- one microbatch

    async def run_microbatch(
        self, microbatch: int, tokens: torch.Tensor, targets: torch.Tensor
    ) -> MicrobatchOutcome:
        """Forward through every stage, loss at the last, backward to stage 0; retries included."""
        outcome = MicrobatchOutcome(microbatch=microbatch, completed=False, replicas=[None] * self.num_stages)
        last = self.num_stages - 1
        count = int(tokens.numel())
        inputs: list[torch.Tensor] = [tokens]
        holders: list[str] = []
        self._holders[microbatch] = holders
        try:
            for stage in range(last):
                holder, out = await self._forward(microbatch, stage, inputs[stage], outcome, tried=set())
                holders.append(holder)
                inputs.append(out)
            replica, loss, grad = await self._loss(microbatch, inputs[last], targets, outcome)
            outcome.replicas[last] = replica
            self.accounting.applied(microbatch, last, replica, tokens=count)
            for stage in range(last - 1, -1, -1):
                assert grad is not None
                replica, grad = await self._backward(
                    microbatch, stage, grad, inputs[stage], holders[stage], outcome
                )
                outcome.replicas[stage] = replica
                self.accounting.applied(microbatch, stage, replica, tokens=count)
        except MicrobatchAbandoned as e:
            self.accounting.abandoned(outcome, e)
            return outcome
        finally:
            self._holders.pop(microbatch, None)
        self.accounting.completed(outcome, loss=loss, tokens=count)
        return outcome

    async def _forward(
        self, microbatch: int, stage: int, x: torch.Tensor, outcome: MicrobatchOutcome, *, tried: set[str]
    ) -> tuple[str, torch.Tensor]:
        attempt = 0
        while True:
            replica = self._choose(stage, x, tried)
            attempt += 1
            try:
                opened = await self.hops.training_forward(replica, stage, microbatch, x)
                return replica, await self.checks.activation(opened, replica, stage, microbatch, x)
            except HopError as e:
                self._failed(microbatch, stage, replica, e, outcome)
                if self.retry.excludes(e.failure):  # a timed-out replica may be tried again, with more time
                    tried.add(replica)
                if not self.retry.retry_elsewhere(e.failure, attempt, forward=True):
                    raise MicrobatchAbandoned(f"forward at stage {stage}: {e}") from None
                outcome.retries += 1

    async def _loss(
        self, microbatch: int, x: torch.Tensor, targets: torch.Tensor, outcome: MicrobatchOutcome
    ) -> tuple[str, float, torch.Tensor | None]:
        stage = self.num_stages - 1
        tried: set[str] = set()
        attempt, same_tries = 0, 0
        replica = self._choose(stage, x, tried)
        while True:
            attempt += 1
            try:
                opened = await self.hops.training_loss(replica, stage, microbatch, x, targets)
                loss = opened.meta.get(LOSS_META)
                if type(loss) is not float or not math.isfinite(loss):
                    raise HopError(HopFailure.BAD_REPLY, "answer lacks a finite loss")
                grad = None
                if stage > 0:
                    grad = await self.checks.gradient(opened, replica, stage, microbatch, x, None, targets)
                return replica, loss, grad
            except HopError as e:
                if self.retry.ask_same_again(e.failure, same_tries):
                    same_tries += 1
                    attempt -= 1  # the same try asked again (answered from cache if applied): not another try
                    self._asked_again(microbatch, stage, replica, e, outcome)
                    continue
                self._failed(microbatch, stage, replica, e, outcome)
                if self.retry.excludes(e.failure):
                    tried.add(replica)
                if not self.retry.retry_elsewhere(e.failure, attempt):
                    raise MicrobatchAbandoned(f"loss at stage {stage}: {e}") from None
                outcome.retries += 1
                left, (replica, same_tries) = replica, (self._choose(stage, x, tried), 0)
                self._note_move(outcome, stage, e, left, replica)

    async def _backward(
        self,
        microbatch: int,
        stage: int,
        grad: torch.Tensor,
        x: torch.Tensor,
        holder: str,
        outcome: MicrobatchOutcome,
    ) -> tuple[str, torch.Tensor | None]:
        replica, tried = holder, set()
        attempt, same_tries = 0, 0
        while True:
            attempt += 1
            try:
                opened = await self.hops.training_backward(replica, stage, microbatch, grad, x)
                if stage == 0:
                    if opened.meta.get(APPLIED_META) is not True or opened.tensors:
                        raise HopError(HopFailure.BAD_REPLY, "stage 0 did not confirm the backward")
                    return replica, None
                return replica, await self.checks.gradient(opened, replica, stage, microbatch, x, grad)
            except HopError as e:
                if e.failure is HopFailure.REFUSED and e.detail == ALREADY_APPLIED and stage == 0:
                    return replica, None  # applied there before; stage 0 has nothing to send back
                if self.retry.ask_same_again(e.failure, same_tries):
                    same_tries += 1
                    attempt -= 1  # the same try asked again (answered from cache if applied): not another try
                    self._asked_again(microbatch, stage, replica, e, outcome)
                    continue
                self._failed(microbatch, stage, replica, e, outcome)
                if self.retry.excludes(e.failure):  # a lost context may be rebuilt on the same replica
                    tried.add(replica)
                if not self.retry.retry_elsewhere(e.failure, attempt):
                    raise MicrobatchAbandoned(f"backward at stage {stage}: {e}") from None
                outcome.retries += 1
                # The context lived on the failed replica: rebuild it on another one from the input we kept.
                left, (replica, _) = replica, await self._forward(microbatch, stage, x, outcome, tried=tried)
                self._note_move(outcome, stage, e, left, replica)
                same_tries = 0  # a new holder: its answer, too, may be asked again once
                self.accounting.recomputed(outcome)

    # ---- held-out loss

    async def evaluate(self, batches: Sequence[Batch], first_id: int) -> float:
        """Mean held-out loss through the pipeline (forward only, no context, no ledger)."""
        total = 0.0
        for index, (inputs, targets) in enumerate(batches):
            microbatch = first_id + index
            x = inputs
            for stage in range(self.num_stages - 1):
                x = await self._eval_hop(microbatch, stage, x, None)
            total += await self._eval_hop(microbatch, self.num_stages - 1, x, targets)
        return total / len(batches)

    async def _eval_hop(
        self, microbatch: int, stage: int, x: torch.Tensor, targets: torch.Tensor | None
    ) -> Any:
        tried: set[str] = set()
        for _ in range(self.retry.max_attempts):
            replica = self._choose(stage, x, tried)
            tensors = {"": x} if targets is None else {"": x, TARGETS: targets}
            kind = Kind.ACTIVATION if targets is None else Kind.LOSS
            try:
                opened = await self.hops.call(
                    replica,
                    FORWARD_RPC,
                    stage,
                    Direction.FORWARD,
                    microbatch,
                    tensors,
                    kind,
                    x,
                    meta={EVAL_META: True},
                )
                if targets is not None:
                    loss = opened.meta.get(LOSS_META)
                    if type(loss) is not float:
                        raise HopError(HopFailure.BAD_REPLY, "no loss")
                    return loss
                return one_tensor(opened, replica)
            except HopError as e:
                tried.add(replica)
                if self.retry.blames_replica(e.failure):
                    self.picker.blame(replica)
        raise MicrobatchAbandoned(f"evaluation hop at stage {stage} failed on {len(tried)} replica(s)")

    # ---- choosing, and after a failed hop

    def _choose(self, stage: int, x: torch.Tensor, tried: set[str]) -> str:
        return self.picker.choose(stage, int(x.shape[0] * x.shape[1]), tried)

    def _note_move(self, outcome: MicrobatchOutcome, stage: int, error: HopError, left: str, to: str) -> None:
        if error.failure in (HopFailure.TIMEOUT, HopFailure.LOST) and to != left:
            self.accounting.moved_on(outcome, stage, left, to)

    def _asked_again(
        self, microbatch: int, stage: int, replica: str, error: HopError, outcome: MicrobatchOutcome
    ) -> None:
        """The answer was lost: the same replica is asked again (it answers from cache if it applied it)."""
        self.accounting.asked_again(outcome, stage, replica, error)
        if self.on_failure is not None:
            self.on_failure(microbatch, stage, replica, error)

    def _failed(
        self, microbatch: int, stage: int, replica: str, error: HopError, outcome: MicrobatchOutcome
    ) -> None:
        if self.retry.blames_replica(error.failure) and error.failure is not HopFailure.DROPPED:
            cooldown = self.picker.blame(replica)
        else:
            cooldown = 0.0
        if error.failure is HopFailure.UNREACHABLE:
            self.hops.forget(replica)
        self.accounting.failed(outcome, stage, replica, error, cooldown=cooldown)
        if self.on_failure is not None:
            self.on_failure(microbatch, stage, replica, error)
