"""The syncer's RPC service: the framed, signed routes learners and stages call (`node.diloco.sync_client`
names them): push a contribution, long-poll the version vector, fetch a fragment version, offer versions
signed by an earlier syncer, and (syncers only) read the state for mirroring. It decides nothing about
leases or merges: it reads and feeds the role's state (`SyncerHost`), and wakes its merge loop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from node.diloco.claims import CLAIM
from node.diloco.compression import push_limits
from node.diloco.learner_ledger import (
    LearnerBan,
    LearnerLedger,
    ban_evidence_scores,
    contribution_digest,
)
from node.diloco.push_wait import PushWaits
from node.diloco.seniority import seniority_chunks
from node.diloco.spill import release_freed_memory, release_large_blocks_when_freed
from node.diloco.sync_client import (
    FETCH_ROUTE,
    OFFER_PREFIX,
    OFFER_ROUTE,
    PUSH_ROUTE,
    STATE_ROUTE,
    VERSIONS_ROUTE,
    control_limits,
    fragment_limits,
    offer_limits,
    open_version_envelope,
)
from node.diloco.syncer_core import (
    Admission,
    Refusal,
    SyncerCore,
    probe_base,
    probe_context,
    refuse,
    takes_base,
    wire_params,
)
from node.roles.syncer_push import (
    PUSH_SPILL_MIN_BYTES,
    evidence_digest,
    open_push_file,
    push_spill_dir,
)
from protocol.admission import ADMISSION_CAUSES, ADMISSION_META, AdmissionSpec, pays_admission
from protocol.envelope import (
    Context,
    Kind,
    StreamingFrame,
    max_frame_bytes,
    open_envelope,
    seal,
    seal_streaming,
)
from protocol.errors import MalformedFrame, ProtocolError, TensorPolicyError
from protocol.frame_file import FrameFile
from protocol.limits import LimitsConfig
from protocol.receipts import FORGERY_REASONS, parse_receipts_meta, verify_receipts
from protocol.records import BanNotice, Heartbeat
from protocol.replay import ReplayGuard
from protocol.rpc import FramedServer, Route, SpillRoute, StreamConfig, route_limits
from verification.bans import BanEvidence

if TYPE_CHECKING:
    from node.context import NodeContext
    from node.diloco.fragments import FragmentPlan
    from node.diloco.loss_probe import LossProbe, LossScore
    from node.diloco.screening import ScreeningConfig
    from protocol.identity import NodeIdentity
    from protocol.receipts import TokenReceipt
    from protocol.rpc import PeerStrikes

logger = logging.getLogger(__name__)
STATUS_REFUSED_PEERS = 256  # identities refused at admission listed in /api/status (the most recent)
OFFER_MAX_AGE_S = 7 * 86400.0  # a signed version stays offerable this long after it was published


class PollTiming(Protocol):
    """The [syncer] settings the service and the mirror read (node.roles.syncer.SyncerConfig has them)."""

    @property
    def max_poll_s(self) -> float: ...
    @property
    def mirror_every_s(self) -> float: ...
    @property
    def screening(self) -> ScreeningConfig: ...
    @property
    def max_fragments_in_flight(self) -> int: ...


class SyncerHost(Protocol):
    """What the service and the mirror read and feed of the syncer role (node.roles.syncer.SyncerRole)."""

    ctx: NodeContext

    @property
    def config(self) -> PollTiming: ...

    mode: str
    plan: FragmentPlan
    limits: Any
    fragment_stage: list[int]
    strikes: PeerStrikes
    core: SyncerCore | None
    active: bool
    term: int
    primary: str | None
    recovering_until: float
    fresh: set[tuple[str, int]]
    live: dict[str, Any]
    adopted: int
    merge_lock: asyncio.Lock
    core_free: asyncio.Event
    probe: LossProbe | None
    ban_outbox: deque[BanNotice]
    probe_lock: asyncio.Lock
    wake: asyncio.Event
    published: asyncio.Event
    p2p: Any

    def holders(self, fragment: int) -> set[str]: ...
    def check_known(self, peer: str) -> Awaitable[None]: ...
    def notify(self) -> None: ...


def fragment_server_limits(
    routes: Mapping[str, Route], *, fragment_frame_bytes: int, max_fragments_in_flight: int = 2
) -> LimitsConfig:
    """The stream layer's default caps, with room for fragments of any size: one peer may hold one whole request of
    the largest route in flight, and all peers together `max_fragments_in_flight` frames of the largest fragment,
    never less than the default per-peer cap (64 MiB: small fragments keep room) nor than one largest request (a
    push or an offer of one version: about one fragment's frame). Bytes are reserved chunk by chunk as they arrive
    (`protocol.limits.FrameReservation`), so these caps bound the receive buffers."""
    if max_fragments_in_flight < 1:
        raise ValueError(f"max_fragments_in_flight must be >= 1, got {max_fragments_in_flight}")
    base = route_limits(routes, StreamConfig())
    largest_request = max(route.max_request_bytes for route in routes.values())
    per_peer = max(base.max_bytes_in_flight_per_peer, largest_request)
    total = max(base.max_bytes_in_flight_per_peer, max_fragments_in_flight * fragment_frame_bytes, per_peer)
    return dataclasses.replace(base, max_bytes_in_flight_per_peer=per_peer, max_bytes_in_flight_total=total)


def syncer_prefers(role: SyncerHost, peer: str) -> bool:
    """May `peer` use the syncer's reserved stream slots: an authorized syncer, an identity a merge took that is
    neither forgotten nor demoted since (`Seniority.rounds` > 0), or a live learner or stage whose heartbeat
    carries a valid admission proof (`admitted_holder`). Read on every stream opened: two dict lookups, and one
    hash for a peer neither of the first two names."""
    if peer in role.ctx.manifest.authorized_syncers:
        return True
    core = role.core
    if core is not None and core.seniority.rounds(peer, time.monotonic()) > 0:
        return True
    heartbeat = role.live.get(peer)
    return heartbeat is not None and admitted_holder(
        role.ctx.manifest.admission, role.ctx.run_id, peer, heartbeat
    )


def admitted_holder(spec: AdmissionSpec, run_id: str, peer: str, heartbeat: Heartbeat) -> bool:
    """Whether `peer`'s live heartbeat (signed by it, read from the DHT) shows it paid the run's admission cost
    (`protocol.admission.pays_admission`): a newcomer that paid then competes for the reserved stream slots with
    the run's senior contributors, not with free identities. Never in mode open (admission costs nothing there)."""
    return pays_admission(spec, run_id, peer, heartbeat.admission)


def version_answer(
    identity: NodeIdentity, run_id: str, receiver: str, core: SyncerCore, fragment: int, term: int
) -> StreamingFrame:
    """The fragment's current version, sent straight from the published tensors and signed as it streams: no copy
    of the fragment per fetch (a merge publishes new tensors and never writes a published one)."""
    version = core.versions[fragment]
    return seal_streaming(
        identity,
        Context(run_id=run_id, kind=Kind.VERSION, receiver=receiver),
        microbatch=fragment,
        step=version,
        now=time.time(),
        tensors=core.fragment_tensors(fragment),
        meta={"fragment": fragment, "version": version, "term": term},
    )


def in_flight_status(server: FramedServer | None) -> dict[str, int]:
    """Request bytes a server holds in receive buffers now (reserved chunk by chunk as they arrive), the most it
    ever held (all peers, and one peer), and the caps they may not pass."""
    if server is None:
        return {}
    limiter = server.limiter
    stats = limiter.stats()
    return {
        "bytes": stats.bytes_in_flight,
        "peak_bytes": stats.peak_bytes_in_flight,
        "peak_per_peer_bytes": max((p.peak_bytes_in_flight for p in stats.peers.values()), default=0),
        "cap_bytes": limiter.config.max_bytes_in_flight_total,
        "per_peer_cap_bytes": limiter.config.max_bytes_in_flight_per_peer,
    }


class RefusedFrame(TensorPolicyError):
    """A push whose signed frame held tensors the wire policy refuses (NaN/Inf, a bad dtype or shape), with the
    digest of that frame: the learner ledger's evidence, as a contribution's digest is for the screen's refusals."""

    def __init__(self, error: TensorPolicyError, digest: str) -> None:
        super().__init__(str(error), reason=error.reason, blame_sender=error.blame_sender)
        self.digest = digest


async def core_now(role: SyncerHost) -> SyncerCore:
    """The core once no commit is reading a version in (`node.roles.syncer.commit`): the caller reads it before its
    next await, so it never sees a fragment half swapped. A loop: a commit may start again before we resume."""
    while not role.core_free.is_set():
        await role.core_free.wait()
    core = role.core
    assert core is not None
    return core


class SyncerService:
    """The routes of one syncer, and what they refused and verified (for /api/status)."""

    def __init__(self, role: SyncerHost) -> None:
        self.role = role
        # the loss probe scores pushes in a worker thread (`score_push`), whose heap `release_freed_memory` cannot
        # trim: large blocks go back to the kernel as they are freed instead (docs/scale.md, issue 17)
        release_large_blocks_when_freed()
        # a compressed push is one uint8 tensor, not the fragment's float tensors
        self.codec = role.ctx.manifest.outer_codec
        self.push_limits = push_limits(self.codec, role.plan, role.limits)
        self._push_replay = ReplayGuard()
        self._control_replay = ReplayGuard()
        self.push_waits = PushWaits()
        self.refusals: dict[str, int] = {}
        self.receipts_verified = 0
        self.receipts_rejected: dict[str, int] = {}  # by reason
        self.receipt_capped = 0  # stage contributions whose tokens the receipts cut
        screening = role.config.screening
        self.ledger = LearnerLedger(  # refused contributions per learner, with evidence; bans
            ban_after=screening.ban_after,
            forgive_half_life_s=screening.forgive_half_life_s,
            ban_s=screening.ban_s,
        )
        self._server: Any = None
        self.started_at = time.time()  # the admission counts below start here (one core per process)
        for cause in ADMISSION_CAUSES:  # exported at 0 from the start: a scrape sees no refusal, not no data
            role.ctx.metrics.admission_refused.labels(reason=cause)

    @property
    def replay(self) -> ReplayGuard:
        """The replay guard of control answers (the mirror opens the active syncer's with it too)."""
        return self._control_replay

    async def start(self, p2p: Any, on_throttle: Callable[..., Any]) -> None:
        control = max_frame_bytes(control_limits())
        # a push of a fragment is received into a file of the core's spill directory (node.roles.syncer_push)
        spill = SpillRoute(lambda: push_spill_dir(self.role.core), self._handle_push, PUSH_SPILL_MIN_BYTES)
        routes = {
            PUSH_ROUTE: Route(self._handle_push, max_frame_bytes(self.push_limits), spill=spill),
            VERSIONS_ROUTE: Route(self._handle_versions, control),
            FETCH_ROUTE: Route(self._handle_fetch, control),
            OFFER_ROUTE: Route(self._handle_offer, max_frame_bytes(offer_limits(self.role.plan))),
            STATE_ROUTE: Route(self._handle_state, control),
        }
        self._server = FramedServer(
            p2p,
            routes,
            strikes=self.role.strikes,
            on_reject=self._on_reject,
            on_throttle=on_throttle,
            limits=fragment_server_limits(
                routes,
                fragment_frame_bytes=max_frame_bytes(fragment_limits(self.role.plan)),
                max_fragments_in_flight=self.role.config.max_fragments_in_flight,
            ),
        )
        # issue 18: the reserved stream slots are for the run's syncers (a standby's mirror) and learners whose work
        # was merged; anyone else (a fresh identity: heartbeats and streams cost nothing, admission is checked per
        # push) shares the rest at most `max_streams_per_guest` at a time, its versions long-polls included
        self._server.limiter.prefer(functools.partial(syncer_prefers, self.role))
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await asyncio.wait_for(self._server.stop(), 2.0)

    def status(self) -> dict[str, Any]:
        return {
            "refusals": dict(self.refusals),
            "receipts": {
                "verified": self.receipts_verified,
                "rejected": dict(self.receipts_rejected),
                "capped": self.receipt_capped,
            },
            # contribution screen verdicts by tag (rejections also in refusals and, per peer, in strikes)
            "screening": self.role.core.screen.status() if self.role.core is not None else {},
            # the held-out loss-delta probe: contributions scored, seconds per score (the goal: <= 10 % of a round)
            "loss_probe": self.role.probe.status() if self.role.probe is not None else None,
            # per learner: refused contributions by tag, evidence (hash, scores, reason), ban and its reason
            "learners": self.ledger.status(time.time()),
            "refusals_by_peer": self.ledger.refusals(),
            "in_flight": in_flight_status(self._server),
            **sybil_status(self.role.core, self.started_at),
        }

    def _on_reject(self, remote: str, route: str, error: ProtocolError) -> None:
        self.refusals[error.reason] = self.refusals.get(error.reason, 0) + 1
        if isinstance(error, Refusal) and error.reason == "admission":  # /metrics, by cause (issue 18)
            self.role.ctx.metrics.admission_refused.labels(reason=error.cause or "other").inc()
        holder = self.role.live.get(remote)
        learner = holder is not None and holder.role == "learner"
        if route == PUSH_ROUTE and learner and error.blame_sender and not isinstance(error, Refusal):
            # refused before admission (a non-finite or malformed push): a violation of the learner's too; a
            # non-finite one bans at once (learner_ledger.SEVERITY)
            digest = error.digest if isinstance(error, RefusedFrame) else "-"
            self.ban(self.ledger.record(remote, error.reason, str(error), digest, time.time()))

    def _answer(
        self, kind: Any, receiver: str, *, microbatch: int = 0, step: int = 0, **kwargs: Any
    ) -> bytearray:
        context = Context(run_id=self.role.ctx.run_id, kind=kind, receiver=receiver)
        return seal(
            self.role.ctx.identity, context, microbatch=microbatch, step=step, now=time.time(), **kwargs
        )

    def _open(self, frame: bytearray, remote: str, kind: Any, limits: Any, replay: Any, **views: bool) -> Any:
        expect = Context(run_id=self.role.ctx.run_id, kind=kind, receiver=self.role.ctx.peer_id)
        return open_envelope(
            frame, remote_peer=remote, expect=expect, limits=limits, replay=replay, now=time.time(), **views
        )

    def _require_active(self) -> None:
        if not self.role.active:
            raise refuse("standby", "this syncer is on standby")

    async def _handle_push(self, frame: bytearray | FrameFile, remote: str) -> bytes:
        # how long pushes are held before their answer, announced in the versions answers (node.diloco.push_wait)
        token = self.push_waits.started(time.monotonic())
        try:
            answer = await self._accept_push(frame, remote)
        finally:
            self.push_waits.ended(token, time.monotonic())
        # its decoded tensors went with that frame: freed heap back to the kernel, else resident under the next merge
        # (docs/scale.md). A refused push is held by its traceback here: the next accept or merge trims it
        release_freed_memory()
        return answer

    async def _accept_push(self, frame: bytearray | FrameFile, remote: str) -> bytes:
        if (why := self.ledger.banned(remote, time.time())) is not None:  # before decoding anything of it
            raise refuse("banned", f"{remote[-8:]} is banned: {why}")
        opened = self._open_push(frame, remote)
        meta, header = opened.meta, opened.header
        fields = _contribution_fields(meta)
        if fields["fragment"] != header.microbatch or fields["base_version"] != header.step:
            raise MalformedFrame("meta disagrees with the signed header", reason="malformed contribution")
        frames = parse_receipts_meta(meta)
        core = await core_now(self.role)
        # an identity that has not paid the run's admission cost: refused before any screening (one hash)
        core.admit_push(remote, meta.get(ADMISSION_META), time.monotonic())
        # malformed or undecodable: refused and counted first
        params = wire_params(
            core, self.codec, fields["fragment"], fields["base_version"], opened.tensors, meta
        )
        core.check_contribution(fields["fragment"], params)
        self._require_active()
        await self.role.check_known(remote)
        await core_now(self.role)  # (below, up to the next await, the core is read)
        holder = self.role.live.get(remote)
        receipts = None
        if holder is not None and holder.role == "stage":  # verifiers watch stages: weigh them by receipts
            receipts = verified_receipts(self, remote, fields["fragment"], frames)
        recovering = time.monotonic() < self.role.recovering_until
        # learners only: verifiers watch stage replicas (and the ledger's bans are learner bans)
        learner = holder is None or holder.role != "stage"
        key = (remote, fields["fragment"], fields["base_version"], header.nonce)
        scored = learner and takes_base(core, key)
        loss = await score_push(self.role, core, *key[1:3], params) if scored else None
        await core_now(self.role)
        try:
            admission = core.accept(
                remote,
                fields["fragment"],
                params,
                base_version=fields["base_version"],
                steps=fields["steps"],
                tokens=fields["tokens"],
                sched_step=fields["sched_step"],
                step_time_s=fields["step_time_s"],
                nonce=header.nonce,
                now=time.monotonic(),
                receipts=receipts,
                loss=loss,
                trust=self.ledger.trust(remote, time.time()),
            )
        except Refusal as e:
            if e.reason == "ahead of syncer" and recovering:
                raise refuse("recovering", "recovering after a takeover") from None
            work = (fields["fragment"], fields["base_version"])
            self._refused(remote, work, e, params, loss, learner=learner)
            raise
        self._admitted(remote, admission, params, learner=learner)
        if recovering and fields["seen_term"] == self.role.term:
            self._fresh(remote, fields["fragment"])
        self.role.wake.set()
        meta = {"target_version": admission.target_version, "late": admission.late}
        return self._answer(Kind.CONTROL, remote, meta=meta)

    def _refused(
        self,
        remote: str,
        work: tuple[int, int],
        error: Refusal,
        params: Mapping[str, Any],
        loss: LossScore | None,
        *,
        learner: bool,
    ) -> None:
        """A learner's blamed refusal goes into the learner ledger with its evidence, which logs it (the fragment
        named: refusals cluster by fragment, the loss screen's of the embedding's did); a ban it triggers is published
        through the signed ban gossip (and holds here at once). Any other refusal is only logged. `work`: (fragment,
        base version), what the ledger weighs once for the loss screen's refusals (node.diloco.learner_ledger)."""
        fragment = work[0]
        if not (learner and error.blame_sender):
            logger.info(
                "fragment %d: push of %s refused (%s): %s", fragment, remote[-8:], error.reason, error
            )
            return
        scores = {"loss_before": loss.before, "loss_after": loss.after} if loss is not None else {}
        digest = contribution_digest(params)
        reason = f"fragment {fragment}: {error}"
        self.ban(self.ledger.record(remote, error.reason, reason, digest, time.time(), scores, work))

    def _open_push(self, frame: bytearray | FrameFile, remote: str) -> Any:
        try:
            if not isinstance(frame, FrameFile):
                return self._open(
                    frame, remote, Kind.FRAGMENT, self.push_limits, self._push_replay, views=True
                )
            expect = Context(run_id=self.role.ctx.run_id, kind=Kind.FRAGMENT, receiver=self.role.ctx.peer_id)
            return open_push_file(
                frame, remote=remote, expect=expect, limits=self.push_limits, replay=self._push_replay,
                core=self.role.core, codec=self.codec.codec,
            )  # fmt: skip
        except TensorPolicyError as e:  # the signature verified: the signed frame is the evidence
            raise RefusedFrame(e, evidence_digest(frame)) from e

    def _admitted(
        self, remote: str, admission: Admission, params: Mapping[str, Any], *, learner: bool
    ) -> None:
        """Bookkeeping of an accepted push. A learner's claim far above the measured rate
        (node.diloco.claims.ClaimBound.judge) was merged, capped, but is a violation in the learner ledger: its
        trust, so its next weights, fall, and repeated, it bans."""
        self.ledger.accepted(remote)
        if learner and admission.claim_violation is not None:
            reason, numbers = admission.claim_violation
            digest = contribution_digest(params)
            self.ban(self.ledger.record(remote, CLAIM, reason, digest, time.time(), numbers))
        if admission.capped:
            self.role.strikes.record(remote, "counters capped")
        self.receipt_capped += admission.receipt_capped

    def ban(self, ban: LearnerBan | None) -> None:
        if ban is not None:
            self.role.ban_outbox.append(ban_notice(ban, self.role.ctx.peer_id))
            self.role.ctx.events.emit(
                "learner_banned", offender=ban.offender, reason=ban.reason, until=ban.until
            )
            logger.warning("learner %s banned: %s", ban.offender[-8:], ban.reason)

    def _fresh(self, remote: str, fragment: int) -> None:
        """In recovery: `remote` sent the fragment's work snapshotted for us."""
        self.role.fresh.add((remote, fragment))
        if self._every_round_fresh():
            # every live holder sent every fragment's work through the outage, snapshotted once it knew
            # us, so none has a version to offer that we lack (a contribution on a base we lack is
            # deferred) nor progress still to send: waiting out recovery_s would only let their steps
            # since pile up, to be overwritten by the merge
            self.role.recovering_until = time.monotonic()
            logger.info("recovery complete: every live holder sent every fragment's outage work")

    def _every_round_fresh(self) -> bool:
        for fragment in range(self.role.plan.num_fragments):
            holders = self.role.holders(fragment)
            if not holders or any((peer, fragment) not in self.role.fresh for peer in holders):
                return False
        return True

    async def _handle_versions(self, frame: bytearray, remote: str) -> bytes:
        opened = self._open(frame, remote, Kind.CONTROL, control_limits(), self._control_replay)
        self._require_active()
        known, wait_s = opened.meta.get("known"), opened.meta.get("wait_s", 0.0)
        num = self.role.plan.num_fragments
        if not (isinstance(known, list) and len(known) == num and all(type(v) is int for v in known)):
            raise MalformedFrame("known must list one int per fragment")
        if not (type(wait_s) is float and math.isfinite(wait_s)):
            raise MalformedFrame("wait_s must be a float")
        deadline = time.monotonic() + min(max(wait_s, 0.0), self.role.config.max_poll_s)
        core = self.role.core
        assert core is not None
        while self.role.active and not any(v > k for v, k in zip(core.versions, known, strict=True)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.role.published.wait(), remaining)
        self._require_active()
        now = time.monotonic()
        meta = {
            "versions": list(core.versions),
            "term": self.role.term,
            "barrier": self.role.mode != "decoupled",
            "clock": core.clock_estimate(now),
            "ages": core.version_ages(now),
            "step_time_s": float(core.policy.xi_step or 0.0),
            # how long a push waits for its verdict here: the learner's push call waits that long for the answer
            "push_wait_s": float(self.push_waits.announce_s(now)),
        }
        return self._answer(Kind.CONTROL, remote, meta=meta)

    def _fragment_of(self, meta: Mapping[str, Any]) -> int:
        fragment = meta.get("fragment")
        if type(fragment) is not int or not 0 <= fragment < self.role.plan.num_fragments:
            raise MalformedFrame("bad fragment id")
        return fragment

    async def _handle_fetch(self, frame: bytearray, remote: str) -> StreamingFrame:
        opened = self._open(frame, remote, Kind.CONTROL, control_limits(), self._control_replay)
        self._require_active()
        fragment, ctx = self._fragment_of(opened.meta), self.role.ctx
        core = await core_now(self.role)
        return version_answer(ctx.identity, ctx.run_id, remote, core, fragment, self.role.term)

    async def _handle_state(self, frame: bytearray, remote: str) -> bytes:
        opened = self._open(frame, remote, Kind.CONTROL, control_limits(), self._control_replay)
        if remote not in self.role.ctx.manifest.authorized_syncers:
            raise refuse("unauthorized", "only authorized syncers may read the syncer state", blame=True)
        self._require_active()
        fragment = self._fragment_of(opened.meta)
        core = self.role.core
        assert core is not None
        async with self.role.merge_lock:
            # shared: the core never writes a published tensor in place (SyncerCore.snapshot)
            tensors = {f"param/{n}": t for n, t in core.fragment_tensors(fragment).items()}
            tensors.update({f"momentum/{n}": t for n, t in core.fragment_momentum(fragment).items()})
            version = core.versions[fragment]
            ledger = _ledger_json([e for e in core.merged_ledger() if e[1] == fragment])
            published = core.published_wall(fragment, wall_offset())
            seniority = seniority_chunks(core.seniority.export(wall_offset()))  # the most recently merged
        return self._answer(
            Kind.VERSION,
            remote,
            microbatch=fragment,
            step=version,
            tensors=tensors,
            meta={
                "term": self.role.term,
                "merged": ledger,
                "published_wall": published,
                "seniority": seniority,
            },
        )

    async def _handle_offer(self, frame: bytearray, remote: str) -> bytes:
        opened = self._open(frame, remote, Kind.CONTROL, offer_limits(self.role.plan), self._control_replay)
        self._require_active()
        core = self.role.core
        assert core is not None
        adopted = 0
        for name, tensor in opened.tensors.items():
            if not name.startswith(OFFER_PREFIX):
                raise MalformedFrame("offer tensors are named offer/<fragment>")
            try:
                inner = open_version_envelope(
                    tensor.numpy().tobytes(),
                    run_id=self.role.ctx.run_id,
                    receiver=remote,
                    signer_candidates=self.role.ctx.manifest.authorized_syncers,
                    limits=self.role.limits,
                    now=time.time(),
                    max_age_s=OFFER_MAX_AGE_S,
                )
            except ProtocolError as e:
                raise MalformedFrame(
                    f"offered version does not verify: {e.reason}", reason="bad offer"
                ) from None
            fragment = inner.header.microbatch
            if name != f"{OFFER_PREFIX}{fragment}" or not 0 <= fragment < self.role.plan.num_fragments:
                raise MalformedFrame("offered version names another fragment", reason="bad offer")
            # sealed by the old syncer when the learner fetched it, just after its publication
            fetched_at = time.monotonic() - max(0.0, time.time() - inner.header.timestamp)
            async with self.role.merge_lock:
                if core.adopt(
                    fragment, inner.header.step, inner.tensors, time.monotonic(), published_at=fetched_at
                ):
                    adopted += 1
                    self.role.adopted += 1
                    self.role.ctx.events.emit(
                        "adopted",
                        fragment=fragment,
                        version=inner.header.step,
                        signer=inner.header.sender,
                        via=remote,
                    )
        if adopted:
            self.role.notify()
        return self._answer(Kind.CONTROL, remote, meta={"adopted": adopted})


def sybil_status(core: SyncerCore | None, started_at: float) -> dict[str, Any]:
    """The run's admission cost (protocol.admission), who was refused for want of it, and the seniority cap."""
    if core is None:
        return {"admission": {}, "seniority": {}}
    return {
        "admission": {
            "mode": core.gate.spec.mode,
            # the most recent only: a Sybil flood's 65536 identities would outgrow the 1 MiB the bootstrap reads
            "refused_by_peer": dict(list(core.gate.refused.items())[-STATUS_REFUSED_PEERS:]),
            "refused_identities": len(core.gate.refused),
            "refused_by_reason": dict(core.gate.refused_by_cause),
            "counted_since": round(started_at, 3),
        },
        "seniority": core.seniority.status(time.monotonic()),
    }


def verified_receipts(
    service: SyncerService, remote: str, fragment: int, frames: list[bytes]
) -> list[TokenReceipt]:
    """The receipts that verify for `remote` on the fragment's stage; the others are counted (and struck when
    forged), never raised: a bad receipt costs the contribution its credit, not the syncer anything."""
    valid, errors = verify_receipts(
        frames,
        run_id=service.role.ctx.run_id,
        replica=remote,
        stage=service.role.fragment_stage[fragment],
        authorized_verifiers=service.role.ctx.manifest.authorized_verifiers,
        now=time.time(),
    )
    for error in errors:
        service.receipts_rejected[error.reason] = service.receipts_rejected.get(error.reason, 0) + 1
        if error.reason in FORGERY_REASONS:
            service.role.strikes.record(remote, "bad receipt")
        logger.info("receipt from %s rejected: %s: %s", remote[-8:], error.reason, error)
    service.receipts_verified += len(valid)
    return valid


def _ledger_json(entries: list[tuple[str, int, int, int, int]], max_chars: int = 4000) -> str:
    """The ledger as JSON for an envelope's meta (4096 characters at most): the most recent entries first."""
    kept: list[list[object]] = []
    for entry in reversed(entries):
        if len(json.dumps([*kept, list(entry)])) > max_chars:
            break
        kept.append(list(entry))
    return json.dumps(kept)


def _contribution_fields(meta: Mapping[str, Any]) -> dict[str, Any]:
    ints = ("fragment", "base_version", "steps", "tokens", "sched_step")
    out: dict[str, Any] = {}
    for name in ints:
        value = meta.get(name)
        if type(value) is not int or value < 0:
            raise MalformedFrame(
                f"contribution meta {name} must be an int >= 0", reason="malformed contribution"
            )
        out[name] = value
    step_time = meta.get("step_time_s")
    if type(step_time) is not float or not math.isfinite(step_time) or step_time < 0:
        raise MalformedFrame(
            "contribution meta step_time_s must be a float >= 0", reason="malformed contribution"
        )
    out["step_time_s"] = step_time
    seen_term = meta.get("seen_term", 0)  # absent from an older learner: never counts as fresh
    if type(seen_term) is not int or seen_term < 0:
        raise MalformedFrame(
            "contribution meta seen_term must be an int >= 0", reason="malformed contribution"
        )
    out["seen_term"] = seen_term
    return out


def wall_offset() -> float:
    """Wall clock minus the monotonic clock the syncer core runs on: dates versions across syncers."""
    return time.time() - time.monotonic()


def ban_notice(ban: LearnerBan, syncer_id: str) -> BanNotice:
    """The signed-ban gossip notice of a learner ban this syncer decided (evidence kind `contribution`)."""
    last = ban.evidence[-1] if ban.evidence else None
    reason = f"{ban.reason} [{last.digest}]" if last is not None else ban.reason
    evidence = BanEvidence(
        offender=ban.offender,
        verifier=syncer_id,
        kind="contribution",
        reason=reason[:250],
        scores=ban_evidence_scores(ban),
    )
    return BanNotice(
        offender=ban.offender, reason=reason[:250], evidence=evidence.to_bytes(), issued_at=time.time()
    )


async def score_push(
    role: SyncerHost, core: SyncerCore, fragment: int, base_version: int, params: Mapping[str, Any]
) -> LossScore | None:
    """A push's held-out loss score and reverse (node.diloco.loss_probe) in its base context (`probe_context`), one
    at a time off the loop; None: off."""
    probe, config = role.probe, core.screen.config
    if probe is None or not (config.enabled and config.loss_probe):
        return None
    base = probe_base(core, fragment, base_version)
    if base is None:
        return None
    async with role.probe_lock:  # the probe's model is one copy
        # read before the next await: no commit swapping a version in (`core_now`)
        context = probe_context(await core_now(role), fragment, base_version)
        # its spilled versions are read in the probe's thread, a range at a time inside the forward passes
        # and the residual's slope (the contribution less its public part; node.diloco.screening_residual)
        residual = functools.partial(core.screen.public_residual, fragment, base, params)
        return await asyncio.to_thread(
            probe.measure, context, context.versions, base, params, time.perf_counter, True, residual
        )
