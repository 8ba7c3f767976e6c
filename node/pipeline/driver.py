"""The pipeline driver: walks one microbatch through a replica per stage, forward and back, through the boundary tap.

Transport-agnostic (`HopTransport`: framed P2P streams or in process); retries, reroutes, re-runs a lost
forward, and emits signed token receipts (`ReceiptBook`). The verifier role wraps it (node/roles/verifier.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import secrets
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from node.ml.data import Batch
from node.pipeline.routing import (
    HopFailure,
    IdempotencyKey,
    IdempotencyLedger,
    Phase,
    ReplicaInfo,
    ReplicaRouter,
    RetryPolicy,
)
from protocol.envelope import Context, Direction, Kind, Opened, max_frame_bytes, open_envelope, seal
from protocol.errors import ProtocolError, RemoteRefused, StreamClosed
from protocol.identity import NodeIdentity
from protocol.pipeline import (
    ALREADY_APPLIED,
    APPLIED_META,
    BACKWARD_RPC,
    EVAL_META,
    FORWARD_RPC,
    GRAD_OUTPUT,
    LOSS_META,
    NO_CONTEXT,
    NOT_SERVING,
    PIPELINE_REPLAY,
    RECOMPUTE_GRAD_META,
    TARGETS,
    BoundaryShape,
)
from protocol.receipts import TokenReceipt
from protocol.replay import ReplayGuard
from protocol.rpc import PeerStrikes, Route, call_framed
from verification.bans import SignedBoundaryHeader, signed_header_of
from verification.tap import BoundaryTap, Drop, PassThroughTap

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from hivemind.p2p import P2P


class HopTransport(Protocol):
    """Moves one request frame to a replica's handler and returns its answer frame.

    Raises RemoteRefused (the replica refused, with its reason), asyncio.TimeoutError, or a connection error.
    """

    async def call(
        self, peer_id: str, rpc: str, frame: bytes, *, timeout_s: float, max_response_bytes: int
    ) -> bytes | bytearray: ...


class FramedTransport:
    """`HopTransport` over hivemind P2P framed streams; dials a replica's announced addresses on first use."""

    def __init__(self, p2p: P2P, *, connect_timeout_s: float = 5.0) -> None:
        self.p2p = p2p
        self.connect_timeout_s = connect_timeout_s
        self.maddrs: dict[str, tuple[str, ...]] = {}
        self._dialed: set[str] = set()

    def forget(self, peer_id: str) -> None:
        self._dialed.discard(peer_id)

    async def _dial(self, peer_id: str) -> None:
        if peer_id in self._dialed or not self.maddrs.get(peer_id):
            return
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        self._dialed.add(peer_id)
        # hivemind's P2P has no public connect; its daemon client does. Peers usually already know each other
        # through the DHT, so a failure here is only logged: the stream open below is what counts.
        client = self.p2p._client
        try:
            await asyncio.wait_for(
                client.connect(PeerID.from_base58(peer_id), [Multiaddr(m) for m in self.maddrs[peer_id]]),
                self.connect_timeout_s,
            )
        except Exception as e:  # the daemon reports dial errors with several types; the call below decides
            logger.debug("dialing %s failed: %r", peer_id[-8:], e)

    async def call(
        self, peer_id: str, rpc: str, frame: bytes, *, timeout_s: float, max_response_bytes: int
    ) -> bytes | bytearray:
        await self._dial(peer_id)
        return await call_framed(
            self.p2p, peer_id, rpc, frame, max_response_bytes=max_response_bytes, timeout_s=timeout_s
        )


class RouteProvider(Protocol):
    """What serves a replica's RPCs: `StageService` in production, anything with the same routes in tests."""

    def routes(self) -> Mapping[str, Route]: ...


class DirectTransport:
    """`HopTransport` that calls `StageService` handlers in this process (no network), as a FramedServer would:
    a `ProtocolError` of the handler becomes a `RemoteRefused` with its reason."""

    def __init__(self, caller: str, services: Mapping[str, RouteProvider]) -> None:
        self.caller = caller
        self.services = services

    async def call(
        self, peer_id: str, rpc: str, frame: bytes, *, timeout_s: float, max_response_bytes: int
    ) -> bytes | bytearray:
        service = self.services.get(peer_id)
        if service is None:
            raise ConnectionError(f"no replica {peer_id[-8:]} in this process")
        handler = service.routes()[rpc].handler
        try:
            answer = await asyncio.wait_for(handler(bytearray(frame), self.caller), timeout_s)
        except ProtocolError as e:
            raise RemoteRefused(f"{peer_id[-8:]} refused {rpc}: {e.reason}", reason=e.reason) from None
        answer = answer or b""
        if len(answer) > max_response_bytes:
            raise ProtocolError("answer over the cap")
        return answer


@dataclass(slots=True)
class _Credit:
    stage: int
    tokens: int = 0
    microbatches: int = 0
    last_microbatch: int = 0
    sequence: int = 0
    receipted_tokens: int = 0  # tokens covered by the latest receipt emitted


class ReceiptBook:
    """Verified tokens per stage replica for one verifier session, and the receipts that state them."""

    def __init__(self, identity: NodeIdentity, run_id: str, *, session: str | None = None) -> None:
        self.identity = identity
        self.run_id = run_id
        self.session = session or secrets.token_hex(8)
        self._credits: dict[str, _Credit] = {}
        self.latest: dict[str, TokenReceipt] = {}

    def credit(self, replica: str, stage: int, *, tokens: int, microbatch: int) -> None:
        """A replica's part of a microbatch was verified and applied (its backward answered and checked)."""
        c = self._credits.get(replica)
        if c is None or c.stage != stage:  # a replica that moved stages starts a new count
            c = self._credits[replica] = _Credit(stage=stage)
        c.tokens += tokens
        c.microbatches += 1
        c.last_microbatch = max(c.last_microbatch, microbatch)

    def due(self, now: float) -> list[tuple[TokenReceipt, bytearray]]:
        """A fresh signed receipt for every replica whose verified tokens grew since its last receipt."""
        out = []
        for replica, c in self._credits.items():
            if c.tokens == c.receipted_tokens:
                continue
            c.sequence += 1
            c.receipted_tokens = c.tokens
            receipt = TokenReceipt(
                verifier=self.identity.peer_id,
                replica=replica,
                stage=c.stage,
                session=self.session,
                sequence=c.sequence,
                tokens=c.tokens,
                microbatches=c.microbatches,
                last_microbatch=c.last_microbatch,
                issued_at=now,
            )
            self.latest[replica] = receipt
            out.append((receipt, receipt.seal(self.identity, self.run_id)))
        return out

    def tokens_by_replica(self) -> dict[str, int]:
        return {replica: c.tokens for replica, c in self._credits.items()}


class HopError(Exception):
    """One request to one replica failed; `failure` is what the retry policy decides on."""

    def __init__(self, failure: HopFailure, detail: str = "") -> None:
        super().__init__(f"{failure.value}: {detail}" if detail else failure.value)
        self.failure = failure
        self.detail = detail


class MicrobatchAbandoned(Exception):  # noqa: N818 - reads as the outcome
    """A hop ran out of replicas or retries, or a boundary check dropped the microbatch."""


@dataclass(slots=True)
class MicrobatchOutcome:
    microbatch: int
    completed: bool
    loss: float | None = None
    tokens: int = 0
    retries: int = 0  # hops tried again (elsewhere, or the same replica after a lost answer)
    recomputed: int = 0  # forwards re-run because the context holder was gone
    replicas: list[str | None] = field(default_factory=list)  # per stage, the replica that applied it
    failures: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""


@dataclass(slots=True)
class DriverStats:
    completed: int = 0
    abandoned: int = 0
    tokens: int = 0
    retries: int = 0
    recomputed: int = 0
    recovered: int = 0  # completed microbatches that needed at least one retry
    double_applied: int = 0  # a backward acknowledged twice for one (microbatch, stage): must stay 0
    bad_replies: int = 0
    spot_checks: int = 0  # spot-check recomputations concluded (see SentinelTap for their outcomes)
    failures: dict[str, int] = field(default_factory=dict)
    applied_per_stage: dict[int, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=lambda: {"seal_s": 0.0, "open_s": 0.0, "call_s": 0.0})


class PipelineDriver:
    """Walks microbatches through the stages (see the module docstring). One driver per verifier; its
    `run_microbatch` may be awaited concurrently from one event loop."""

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
    ) -> None:
        self.identity = identity
        self.run_id = run_id
        self.num_stages = num_stages
        self.shape = shape
        self.limits = shape.limits
        self.transport = transport
        self.replicas = replicas
        self.router = router or ReplicaRouter()
        self.retry = retry or RetryPolicy()
        self.tap: BoundaryTap = tap or PassThroughTap()
        self.receipts = receipts or ReceiptBook(identity, run_id)
        self.banned = banned
        self.rng = rng or random.Random()
        self.clock = clock
        self.wall_clock = wall_clock
        self.ledger = IdempotencyLedger()
        self.replay = ReplayGuard(PIPELINE_REPLAY)
        self.strikes = PeerStrikes()
        self.stats = DriverStats()
        self.step = 0  # the verifier's step (sequences driven / inner batch), stamped on requests
        self.last_route: list[str | None] = [None] * num_stages
        # microbatch -> the replica holding its context at each stage passed so far (their backward is due there)
        self._holders: dict[int, list[str]] = {}
        self.on_failure: Callable[[int, int, str, HopError], None] | None = None
        # (microbatch, stage, direction) -> the signed header of the answer just opened, for the tap (evidence,
        # equivocation); popped by the tap call that follows the hop without an await in between.
        self._signed: dict[tuple[int, int, str], SignedBoundaryHeader] = {}

    def holding(self, peer_id: str) -> int:
        """Training microbatches in flight whose context `peer_id` holds: their backward is due there."""
        return sum(holders.count(peer_id) for holders in self._holders.values())

    # ---- readiness

    def missing_stages(self, now: float | None = None) -> list[int]:
        """Stages with no usable replica right now (nothing can be driven until each has one)."""
        now = self.clock() if now is None else now
        banned = set(self.banned())
        usable = {
            r.stage
            for r in self.replicas()
            if r.peer_id not in banned and not self.router.is_blocked(r.peer_id, now)
        }
        return [s for s in range(self.num_stages) if s not in usable]

    # ---- one microbatch

    async def run_microbatch(
        self, microbatch: int, tokens: torch.Tensor, targets: torch.Tensor
    ) -> MicrobatchOutcome:
        """Forward through every stage, loss at the last, backward to stage 0; retries included."""
        outcome = MicrobatchOutcome(microbatch=microbatch, completed=False, replicas=[None] * self.num_stages)
        last = self.num_stages - 1
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
            self._applied(microbatch, last, replica, tokens)
            for stage in range(last - 1, -1, -1):
                assert grad is not None
                replica, grad = await self._backward(
                    microbatch, stage, grad, inputs[stage], holders[stage], outcome
                )
                outcome.replicas[stage] = replica
                self._applied(microbatch, stage, replica, tokens)
        except MicrobatchAbandoned as e:
            outcome.reason = str(e)
            self.stats.abandoned += 1
            logger.info("microbatch %d abandoned: %s", microbatch, e)
            return outcome
        finally:
            self._holders.pop(microbatch, None)
        outcome.completed = True
        outcome.loss = loss
        outcome.tokens = int(tokens.numel())
        self.stats.completed += 1
        self.stats.tokens += outcome.tokens
        if outcome.retries:
            self.stats.recovered += 1
        return outcome

    def _applied(self, microbatch: int, stage: int, replica: str, tokens: torch.Tensor) -> None:
        key = IdempotencyKey(self.run_id, self.identity.peer_id, microbatch, stage, Phase.BACKWARD)
        if not self.ledger.mark_applied(key):
            self.stats.double_applied += 1
            logger.error("microbatch %d was acknowledged twice at stage %d", microbatch, stage)
            return
        per_stage = self.stats.applied_per_stage
        per_stage[stage] = per_stage.get(stage, 0) + 1
        self.receipts.credit(replica, stage, tokens=int(tokens.numel()), microbatch=microbatch)

    async def _forward(
        self, microbatch: int, stage: int, x: torch.Tensor, outcome: MicrobatchOutcome, *, tried: set[str]
    ) -> tuple[str, torch.Tensor]:
        attempt = 0
        while True:
            replica = self._choose(stage, x, tried)
            attempt += 1
            try:
                opened = await self._hop(
                    replica, FORWARD_RPC, stage, Direction.FORWARD, microbatch, {"": x}, Kind.ACTIVATION, x
                )
                out = self._one_tensor(opened, replica)
                expected = (x.shape[0], x.shape[1], self.shape.width)
                if out.dtype != torch.float32 or tuple(out.shape) != expected:
                    raise HopError(HopFailure.BAD_REPLY, f"activation {tuple(out.shape)} != {expected}")
                checked = self._tap_check(
                    stage, Direction.FORWARD, replica, microbatch, out, opened, x if stage > 0 else None
                )
                checked = await self._spot_check(
                    stage, Direction.FORWARD, replica, microbatch, out, checked, x
                )
                if isinstance(checked, Drop):
                    raise HopError(HopFailure.DROPPED, checked.reason)
                return replica, checked
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
        kind = Kind.TOKENS if stage == 0 else Kind.ACTIVATION
        answer_kind = Kind.LOSS if stage == 0 else Kind.GRADIENT
        tried: set[str] = set()
        attempt, same_tries = 0, 0
        replica = self._choose(stage, x, tried)
        while True:
            attempt += 1
            try:
                opened = await self._hop(
                    replica,
                    FORWARD_RPC,
                    stage,
                    Direction.BACKWARD,
                    microbatch,
                    {"": x, TARGETS: targets},
                    answer_kind,
                    x,
                    request_kind=kind,
                    request_direction=Direction.FORWARD,
                )
                loss = opened.meta.get(LOSS_META)
                if type(loss) is not float or not math.isfinite(loss):
                    raise HopError(HopFailure.BAD_REPLY, "answer lacks a finite loss")
                grad = None
                if stage > 0:
                    grad = await self._checked_grad(opened, replica, stage, microbatch, x, None, targets)
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
                replica, same_tries = self._choose(stage, x, tried), 0

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
        answer_kind = Kind.CONTROL if stage == 0 else Kind.GRADIENT
        while True:
            attempt += 1
            try:
                opened = await self._hop(
                    replica, BACKWARD_RPC, stage, Direction.BACKWARD, microbatch, {"": grad}, answer_kind, x
                )
                if stage == 0:
                    if opened.meta.get(APPLIED_META) is not True or opened.tensors:
                        raise HopError(HopFailure.BAD_REPLY, "stage 0 did not confirm the backward")
                    return replica, None
                return replica, await self._checked_grad(opened, replica, stage, microbatch, x, grad)
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
                replica, _ = await self._forward(microbatch, stage, x, outcome, tried=tried)
                same_tries = 0  # a new holder: its answer, too, may be asked again once
                outcome.recomputed += 1
                self.stats.recomputed += 1

    async def _checked_grad(
        self,
        opened: Opened,
        replica: str,
        stage: int,
        microbatch: int,
        x: torch.Tensor,
        given: torch.Tensor | None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        grad = self._one_tensor(opened, replica)
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
        peers = self._spot_peers(stage, replica)
        outputs: list[tuple[str, torch.Tensor]] = []
        verdict = None
        while peers and len(outputs) < 2:
            peer = peers.pop(self.rng.randrange(len(peers)))
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

    def _spot_peers(self, stage: int, replica: str) -> list[str]:
        banned = set(self.banned())
        now = self.clock()
        return [
            r.peer_id
            for r in self.replicas()
            if r.stage == stage
            and r.peer_id != replica
            and r.peer_id not in banned
            and not self.router.is_blocked(r.peer_id, now)
        ]

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
            opened = await self._hop(
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
            out = self._one_tensor(opened, peer)
        except HopError as e:
            if self.retry.blames_replica(e.failure):
                self.router.record_failure(peer, self.clock())
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
        signed = self._signed.pop((microbatch, stage, direction.value), None)
        return self.tap.check(
            stage, direction, replica, microbatch, tensor, opened.header, context=context, signed=signed
        )

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
                opened = await self._hop(
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
                return self._one_tensor(opened, replica)
            except HopError as e:
                tried.add(replica)
                if self.retry.blames_replica(e.failure):
                    self.router.record_failure(replica, self.clock())
        raise MicrobatchAbandoned(f"evaluation hop at stage {stage} failed on {len(tried)} replica(s)")

    # ---- one hop

    def _choose(self, stage: int, x: torch.Tensor, tried: set[str]) -> str:
        choice = self.router.choose(
            self.replicas(),
            stage=stage,
            tokens=int(x.shape[0] * x.shape[1]),
            now=self.clock(),
            rng=self.rng,
            exclude=tried,
            banned=self.banned(),
        )
        if choice is None:
            raise MicrobatchAbandoned(f"no usable replica for stage {stage} (tried {len(tried)})")
        self.last_route[stage] = choice.peer_id
        return choice.peer_id

    async def _hop(
        self,
        replica: str,
        rpc: str,
        stage: int,
        answer_direction: Direction,
        microbatch: int,
        tensors: dict[str, torch.Tensor],
        answer_kind: Kind,
        x: torch.Tensor,
        *,
        request_kind: Kind | None = None,
        request_direction: Direction | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Opened:
        """Seal a request for `replica`, send it, and open its answer; every failure becomes a HopError."""
        if request_kind is None:
            request_kind = _request_kind(rpc, stage)
        timings = self.stats.timings
        started = time.perf_counter()
        request = Context(
            run_id=self.run_id,
            kind=request_kind,
            receiver=replica,
            stage=stage,
            direction=request_direction or answer_direction,
        )
        frame = seal(
            self.identity,
            request,
            microbatch=microbatch,
            step=self.step,
            now=self.wall_clock(),
            tensors=tensors if len(tensors) > 1 else None,
            tensor=tensors[""] if len(tensors) == 1 else None,
            meta=meta,
        )
        sent = time.perf_counter()
        timings["seal_s"] += sent - started
        raw = await self._send(replica, rpc, frame)
        answered = time.perf_counter()
        timings["call_s"] += answered - sent
        answer = Context(
            run_id=self.run_id,
            kind=answer_kind,
            receiver=self.identity.peer_id,
            stage=stage,
            direction=answer_direction,
        )
        try:
            opened = self._open_answer(raw, replica, answer, microbatch)
        finally:
            timings["open_s"] += time.perf_counter() - answered
        self.router.record_success(replica, tokens=int(x.shape[0] * x.shape[1]), seconds=answered - started)
        return opened

    async def _send(self, replica: str, rpc: str, frame: bytes | bytearray) -> bytes | bytearray:
        timeout_s = self.router.hop_timeout_s(replica, self.retry)  # longer after timeouts in a row
        self.router.started(replica)
        try:
            return await self.transport.call(
                replica,
                rpc,
                frame,
                timeout_s=timeout_s,
                max_response_bytes=max_frame_bytes(self.limits),
            )
        except RemoteRefused as e:
            failure = HopFailure.NO_CONTEXT if e.reason in (NO_CONTEXT, NOT_SERVING) else HopFailure.REFUSED
            raise HopError(failure, e.reason) from None
        except asyncio.TimeoutError:
            self.router.record_timeout(replica, self.clock(), slowdown=self.retry.timeout_growth)
            raise HopError(HopFailure.TIMEOUT, f"no answer in {timeout_s:g} s") from None
        except StreamClosed as e:  # the request went out; its answer did not come back whole
            raise HopError(HopFailure.LOST, str(e)) from None
        except ProtocolError as e:
            self.strikes.record(replica, e.reason)
            raise HopError(HopFailure.BAD_REPLY, e.reason) from None
        except Exception as e:  # dial/stream failures arrive as P2PDaemonError, ConnectionError, OSError...
            if isinstance(e, (AssertionError, TypeError, NameError, AttributeError)):
                raise
            raise HopError(HopFailure.UNREACHABLE, f"{type(e).__name__}: {e}") from None
        finally:
            self.router.finished(replica)

    def _open_answer(self, raw: bytes | bytearray, replica: str, expect: Context, microbatch: int) -> Opened:
        try:
            opened = open_envelope(
                raw,
                remote_peer=replica,
                expect=expect,
                limits=self.limits,
                replay=self.replay,
                now=self.wall_clock(),
            )
        except ProtocolError as e:
            # signed by someone else than the replica we asked, tampered, replayed, wrong context...
            self.strikes.record(replica, e.reason)
            self.stats.bad_replies += 1
            raise HopError(HopFailure.BAD_REPLY, e.reason) from None
        if opened.header.microbatch != microbatch:
            raise HopError(HopFailure.BAD_REPLY, "answer for another microbatch")
        if opened.tensors and opened.meta.get(EVAL_META) is not True:
            signed = signed_header_of(raw)
            if len(self._signed) > 4096:  # answers whose tap call never came (a failed shape check)
                self._signed.clear()
            if signed is not None:
                self._signed[(microbatch, expect.stage, expect.direction.value)] = signed
        return opened

    def _one_tensor(self, opened: Opened, replica: str) -> torch.Tensor:
        if list(opened.tensors) != [""]:
            raise HopError(
                HopFailure.BAD_REPLY, f"{replica[-8:]} answered tensors {sorted(opened.tensors)[:3]}"
            )
        return opened.tensors[""]

    def _asked_again(
        self, microbatch: int, stage: int, replica: str, error: HopError, outcome: MicrobatchOutcome
    ) -> None:
        """The answer was lost: the same replica is asked again (it answers from cache if it applied it)."""
        outcome.retries += 1
        self.stats.retries += 1
        outcome.failures.append(
            {"stage": stage, "replica": replica, "failure": error.failure.value, "detail": "asked again"}
        )
        logger.info(
            "microbatch %d: answer of %s at stage %d lost (%s); asking again",
            microbatch,
            replica[-8:],
            stage,
            error,
        )
        if self.on_failure is not None:
            self.on_failure(microbatch, stage, replica, error)

    def _failed(
        self, microbatch: int, stage: int, replica: str, error: HopError, outcome: MicrobatchOutcome
    ) -> None:
        failures = self.stats.failures
        failures[error.failure.value] = failures.get(error.failure.value, 0) + 1
        self.stats.retries += 1
        if self.retry.blames_replica(error.failure) and error.failure is not HopFailure.DROPPED:
            cooldown = self.router.record_failure(replica, self.clock())
        else:
            cooldown = 0.0
        if isinstance(self.transport, FramedTransport) and error.failure is HopFailure.UNREACHABLE:
            self.transport.forget(replica)
        outcome.failures.append(
            {"stage": stage, "replica": replica, "failure": error.failure.value, "detail": error.detail[:200]}
        )
        logger.info(
            "microbatch %d: hop at stage %d on %s failed (%s)%s",
            microbatch,
            stage,
            replica[-8:],
            error,
            f"; cooldown {cooldown:.0f} s" if cooldown else "",
        )
        if self.on_failure is not None:
            self.on_failure(microbatch, stage, replica, error)


def _request_kind(rpc: str, stage: int) -> Kind:
    if rpc == BACKWARD_RPC:
        return Kind.GRADIENT
    return Kind.TOKENS if stage == 0 else Kind.ACTIVATION
