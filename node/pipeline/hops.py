"""One hop: the driver's request to one stage replica, sealed, sent through a `HopTransport`, and its answer
opened and checked against what was asked (`HopClient`); every failure on the way becomes a `HopError`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import torch

from node.pipeline.accounting import DriverStats, HopError
from node.pipeline.routing import HopFailure, ReplicaRouter, RetryPolicy
from node.pipeline.transport import FramedTransport, HopTransport
from protocol import boundary_codec, token_wire
from protocol.boundary_codec import BoundaryCodecSpec
from protocol.codec import TensorLimits
from protocol.envelope import (
    Context,
    Direction,
    Kind,
    Opened,
    StreamingFrame,
    max_frame_bytes,
    open_envelope,
    seal_streaming,
)
from protocol.errors import ProtocolError, RemoteRefused, StreamClosed
from protocol.identity import NodeIdentity
from protocol.pipeline import (
    BACKWARD_RPC,
    EVAL_META,
    FORWARD_RPC,
    INPUT_DIGEST_META,
    NO_CONTEXT,
    NOT_SERVING,
    PIPELINE_REPLAY,
    TARGETS,
)
from protocol.replay import ReplayGuard
from protocol.rpc import PeerStrikes
from verification.bans import SignedBoundaryHeader, signed_header_of


class HopClient:
    """Sends the driver's requests and opens their answers. Keeps what that needs across hops: the replay
    window, strikes against replicas that answered badly, time spent sealing/calling/opening (`stats.timings`),
    and the signed header of each training answer until the tap judges it (`pop_signed`). `step` is the
    verifier's step stamped on every request."""

    def __init__(
        self,
        *,
        identity: NodeIdentity,
        run_id: str,
        limits: TensorLimits,
        transport: HopTransport,
        router: ReplicaRouter,
        retry: RetryPolicy,
        stats: DriverStats,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        codec: BoundaryCodecSpec | None = None,
        rounding: torch.Generator | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.identity = identity
        # the run's vocabulary: token ids travel in its narrowest dtype (`protocol.token_wire`); None: as int64
        self.vocab_size = vocab_size
        self.codec = codec or BoundaryCodecSpec()  # the manifest's: requests encoded with it, answers decoded
        # this client's own noise for the codec's stochastic rounding of gradients (`rounding_generator`: why one
        # per owner); default seeded from os.urandom
        self.rounding = rounding or boundary_codec.rounding_generator()
        self.run_id = run_id
        self.limits = limits
        self.transport = transport
        self.router = router
        self.retry = retry
        self.stats = stats
        self.clock = clock
        self.wall_clock = wall_clock
        self.step = 0
        self.replay = ReplayGuard(PIPELINE_REPLAY)
        self.strikes = PeerStrikes()
        # an answer must name the digest of the request it answers (the tap's slots and equivocation proofs key on
        # it); off only for the negative control of the test that shows why
        self.check_input_digest = True
        # an answer must carry the eval flag its request had (a training answer flagged eval keeps its signed header
        # out of the evidence a ban needs); off only for the negative control of the test that shows why
        self.check_eval_flag = True
        # (microbatch, stage, direction) -> the signed header of the answer just opened, for the tap (evidence,
        # equivocation); popped by the tap call that follows the hop without an await in between.
        self._signed: dict[tuple[int, int, str], SignedBoundaryHeader] = {}

    async def call(
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
        eval_request = meta is not None and meta.get(EVAL_META) is True
        tensors, meta = self._encoded(request_kind, tensors, meta)
        # signed while it streams: the payload is hashed as it is sent, the head signed after it (`seal_streaming`)
        frame = seal_streaming(
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
            opened = self._open_answer(raw, replica, answer, microbatch, eval_request)
            self._check_input_digest(opened, replica, frame.sent_digest)
        finally:
            timings["open_s"] += time.perf_counter() - answered
        self.router.record_success(replica, tokens=int(x.shape[0] * x.shape[1]), seconds=answered - started)
        return opened

    # ---- the three training requests. Built here, and only here, for the driver's walk and for disguised spot
    # checks alike (`AnswerChecks`): a check then cannot differ from ordinary traffic by how it was built.

    async def training_forward(self, replica: str, stage: int, microbatch: int, x: torch.Tensor) -> Opened:
        """A training forward of a non-last stage: the replica keeps a context awaiting the backward."""
        return await self.call(
            replica, FORWARD_RPC, stage, Direction.FORWARD, microbatch, {"": x}, Kind.ACTIVATION, x
        )

    async def training_loss(
        self, replica: str, stage: int, microbatch: int, x: torch.Tensor, targets: torch.Tensor
    ) -> Opened:
        """The last stage's forward: loss, backward and accumulation at once (the loss, and the input gradient
        unless the last stage is also the first)."""
        return await self.call(
            replica,
            FORWARD_RPC,
            stage,
            Direction.BACKWARD,
            microbatch,
            {"": x, TARGETS: targets},
            Kind.LOSS if stage == 0 else Kind.GRADIENT,
            x,
            request_kind=Kind.TOKENS if stage == 0 else Kind.ACTIVATION,
            request_direction=Direction.FORWARD,
        )

    async def training_backward(
        self, replica: str, stage: int, microbatch: int, grad: torch.Tensor, x: torch.Tensor
    ) -> Opened:
        """The backward of a held context: the replica applies it and answers its input gradient (stage 0: an
        acknowledgement)."""
        answer_kind = Kind.CONTROL if stage == 0 else Kind.GRADIENT
        return await self.call(
            replica, BACKWARD_RPC, stage, Direction.BACKWARD, microbatch, {"": grad}, answer_kind, x
        )

    def _encoded(
        self, kind: Kind, tensors: dict[str, torch.Tensor], meta: dict[str, Any] | None
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """A boundary activation or gradient as the run's codec sends it (the input "" only); token ids (the input of
        a tokens request, targets) in the vocabulary's narrowest dtype."""
        vocab = self.vocab_size
        if vocab is not None:
            names = (TARGETS, "") if kind is Kind.TOKENS else (TARGETS,)
            tensors = {
                name: token_wire.narrow(t, vocab) if name in names else t for name, t in tensors.items()
            }
        if kind not in (Kind.ACTIVATION, Kind.GRADIENT) or "" not in tensors or not self.codec.enabled:
            return tensors, meta
        encoded, extra = boundary_codec.encode(
            tensors[""], self.codec, gradient=kind is Kind.GRADIENT, rounding=self.rounding
        )
        return {**tensors, "": encoded}, {**(meta or {}), **extra}

    def pop_signed(self, microbatch: int, stage: int, direction: Direction) -> SignedBoundaryHeader | None:
        """The signed header of the answer just opened for (microbatch, stage, direction), once."""
        return self._signed.pop((microbatch, stage, direction.value), None)

    def forget(self, replica: str) -> None:
        """`replica` was unreachable: dial its announced addresses again before the next request."""
        if isinstance(self.transport, FramedTransport):
            self.transport.forget(replica)

    async def _send(self, replica: str, rpc: str, frame: StreamingFrame) -> bytes | bytearray:
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

    def _check_input_digest(self, opened: Opened, replica: str, sent: bytes | None) -> None:
        """Which request an answer answers is ours to say, not the replica's: a liar naming another input digest in
        each answer would never have two answers for one (microbatch, input) slot, so no equivocation proof."""
        if not self.check_input_digest or sent is None:
            return
        if opened.meta.get(INPUT_DIGEST_META) != sent.hex():
            self.strikes.record(replica, "input digest mismatch")
            self.stats.bad_replies += 1
            raise HopError(HopFailure.BAD_REPLY, "answer names another request's digest")

    def _open_answer(
        self, raw: bytes | bytearray, replica: str, expect: Context, microbatch: int, eval_request: bool
    ) -> Opened:
        try:
            opened = open_envelope(
                raw,
                remote_peer=replica,
                expect=expect,
                limits=self.limits,
                replay=self.replay,
                now=self.wall_clock(),
            )
            opened = boundary_codec.decode_opened(opened, self.codec, self.limits)  # before any check sees it
        except ProtocolError as e:
            # signed by someone else than the replica we asked, tampered, replayed, wrong context...
            self.strikes.record(replica, e.reason)
            self.stats.bad_replies += 1
            raise HopError(HopFailure.BAD_REPLY, e.reason) from None
        if opened.header.microbatch != microbatch:
            raise HopError(HopFailure.BAD_REPLY, "answer for another microbatch")
        # whether an answer is an evaluation (no evidence kept, no training effect) is ours to say, not the
        # replica's: a liar flagging its training answers "eval" would keep its signed headers out of evidence
        flagged = opened.meta.get(EVAL_META) is True
        if self.check_eval_flag and opened.tensors and flagged != eval_request:  # a loss carries none
            self.strikes.record(replica, "eval flag mismatch")
            self.stats.bad_replies += 1
            raise HopError(HopFailure.BAD_REPLY, "answer's eval flag differs from the request's")
        if opened.tensors and not eval_request:
            signed = signed_header_of(raw)
            if len(self._signed) > 4096:  # answers whose tap call never came (a failed shape check)
                self._signed.clear()
            if signed is not None:
                self._signed[(microbatch, expect.stage, expect.direction.value)] = signed
        return opened


def one_tensor(opened: Opened, replica: str) -> torch.Tensor:
    """The answer's single tensor; a BAD_REPLY HopError if it carries other ones."""
    if list(opened.tensors) != [""]:
        raise HopError(HopFailure.BAD_REPLY, f"{replica[-8:]} answered tensors {sorted(opened.tensors)[:3]}")
    return opened.tensors[""]


def _request_kind(rpc: str, stage: int) -> Kind:
    if rpc == BACKWARD_RPC:
        return Kind.GRADIENT
    return Kind.TOKENS if stage == 0 else Kind.ACTIVATION
