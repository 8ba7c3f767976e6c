"""The syncer role: holds the global fragments and their outer Nesterov state, merges learner contributions by
quorum, publishes versions, and hands over to a standby when it dies.

The pieces:

* `SyncerCore` (node.diloco.syncer_core; no sockets, no clock of its own): the global parameters, fragment
  versions and momentum; one open round per fragment; admission of a contribution; the quorum/grace decision;
  the merge, split into a heavy `compute_merge` (run in a worker thread) and a cheap `commit_merge`.
* `lease_action`, `takeover_quorum`, `TakeoverWatch` (node.diloco.lease): the pure lease decisions and the quorum memory.
* `SyncerService` (node.roles.syncer_rpc): the framed, signed RPC routes (`node.diloco.sync_client` names
  them): push a contribution, long-poll the version vector, fetch a fragment version, offer versions signed
  by an earlier syncer, and (syncers only) read the state for mirroring.
* `StateMirror` (node.roles.syncer_mirror): a standby's copy of the active syncer's state.
* `SyncerRole` (`create_role(ctx)`, here): the lease loop (a record in the DHT says which authorized syncer
  is active; the others stand by, mirror the active one, and take over when its lease lapses), membership,
  the merge loop, checkpoints, held-out evaluation and status.

Failover (docs/diloco.md has the full story). The active syncer renews `<run_id>/syncer` every
`renew_every_s` with `lease_until = now + lease_s`, its term and its versions. It never merges while its
own lease has expired (a SIGSTOPped primary that wakes up re-reads the DHT first and steps down if a
higher term took over). A standby that sees no live active lease in two consecutive looks takes over
with term + 1, resuming from the freshest of (a) the latest safetensors checkpoint in its checkpoint
directory (shared with the primary where the operator can arrange it) and (b) its own mirror of the
primary's state, pulled every `mirror_every_s`. For `recovery_s` after a takeover it accepts
contributions and offers but does not merge: learners keep the last version envelope of each fragment
they applied, signed by the syncer that published it, and offer those that are newer than what the new
syncer serves; the new syncer verifies the signature (an authorized syncer, this run, this learner as
receiver) and adopts them, so versions only move forward.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from node.config import component_config
from node.diloco.fragments import FragmentPlan
from node.diloco.learner_ledger import peer_scores
from node.diloco.lease import LeaseView, TakeoverWatch, lease_action
from node.diloco.loss_probe import LossProbe
from node.diloco.merge import NothingToMerge
from node.diloco.quorum import QuorumConfig, counted_holders
from node.diloco.screening import ScreeningConfig
from node.diloco.spill import release_freed_memory
from node.diloco.sync_client import (
    choose_syncer,
    fragment_limits,
    run_fragment_plan,
)
from node.diloco.syncer_core import (
    Admission,
    MergeRecord,
    PreparedMerge,
    Refusal,
    SyncerCore,
    read_in,
    refuse,
)
from node.ml.checkpoint import CheckpointError, CheckpointStore, SyncerSnapshot
from node.roles.syncer_mirror import StateMirror
from node.roles.syncer_rpc import SyncerService, wall_offset
from node.swarm.membership import HEARTBEAT_TTL_PERIODS
from protocol.compress import TOPK_CODECS
from protocol.errors import ConfigError
from protocol.records import BanNotice

if TYPE_CHECKING:
    from node.context import NodeContext

logger = logging.getLogger(__name__)
RECENT_MERGES = 64  # merges kept for /api/status (the JSONL tape keeps them all)

MODES = ("decoupled", "sync", "elastic_sync")
HOLDER_COUNTS = ("auto", "proven", "heartbeats")  # SyncerConfig.count_holders
HOLDER_ROLES = ("learner", "stage")


# ---------------------------------------------------------------------------------------------- config


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncerConfig:
    """Syncer-local settings (node.toml `[syncer]`); run-wide ones (mode, K, H, tau, gamma) are in the manifest."""

    lease_s: float = 6.0  # a lease lasts this long past each renewal
    renew_every_s: float = 2.0  # renewal period (and how often a standby looks at the lease)
    recovery_s: float = 6.0  # after a takeover: collect offers from learners before merging
    checkpoint_every_merges: int = 16  # also on takeover and on shutdown
    checkpoint_dir: str = ""  # "" = <state_dir>/syncer; point primary and standby at one shared dir
    checkpoint_keep: int = (
        3  # newest checkpoints kept (content-addressed; a damaged one falls back to the next)
    )
    mirror_every_s: float = 2.0  # a standby pulls the active syncer's changed fragments this often
    max_steps_per_s: float = 50.0  # cap on claimed inner steps per second of elapsed time
    max_staleness: int = 2  # contributions built on a version older than current - this are refused
    clip_factor: float = 3.0  # outlier clipping at clip_factor x the median delta norm; 0 disables
    max_grace_s: float = 5.0  # absolute cap on the grace window
    max_poll_s: float = 10.0  # longest versions long-poll served
    membership_refresh_s: float = 1.0  # how often the live learner/stage list is re-read
    # which live holders a round waits for. "proven": those with a contribution merged within proven_s (in a fresh
    # run, all of them during a round's first unproven_wait_s); "heartbeats": every live one (a heartbeat is free
    # to fake); "auto": proven in elastic_sync, where one fake heartbeat would stall every round, heartbeats in
    # the other modes, where a newcomer not waited for can miss round after round (decoupled refuses it as late)
    count_holders: str = "auto"
    proven_s: float = 600.0
    unproven_wait_s: float = 30.0
    # A standby takes over only while it sees most of the learners/stages it knew when it last saw the lease
    # (a partition can hide a live lease holder); false: on a lapsed lease alone (liveness over safety).
    takeover_quorum: bool = True
    eval_every_merges: int = 0  # held-out loss of the global model every N merges (0 = never)
    eval_batches: int = 4
    eval_batch_size: int = 8
    max_merged_keys: int = 65536  # remembered (peer, fragment, base, nonce) of merged contributions
    # Frames of the largest fragment that all peers' requests together may hold in flight here: their bytes are
    # reserved chunk by chunk as they arrive and given back once the request was handled or refused; a chunk past
    # the cap refuses its request. Never below 64 MiB (many small fragments) nor one request (a fragment).
    max_fragments_in_flight: int = 2
    # The global parameters (every fragment's current version) in spill files under <state_dir>/syncer-spill, read a
    # tensor or a range at a time, instead of in memory: resident memory ~ the process plus a fragment or two, not
    # the whole model (issue 17; node.diloco.param_store, docs/scale.md). Costs a read of the model per probe pass.
    params_on_disk: bool = False
    # each contribution checked alone before it merges: finite, norm bound, direction; rollback of a bad outer step
    screening: ScreeningConfig = field(default_factory=ScreeningConfig)

    def __post_init__(self) -> None:
        for name in (
            "lease_s",
            "renew_every_s",
            "mirror_every_s",
            "max_steps_per_s",
            "max_poll_s",
            "proven_s",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"syncer.{name} must be a positive number, got {value!r}")
        for name in ("recovery_s", "clip_factor", "max_grace_s", "membership_refresh_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"syncer.{name} must be a number >= 0, got {value!r}")
        if not (isinstance(self.unproven_wait_s, int | float) and self.unproven_wait_s >= 0):
            raise ValueError(
                f"syncer.unproven_wait_s must be a number >= 0 (inf: off), got {self.unproven_wait_s!r}"
            )
        if self.count_holders not in HOLDER_COUNTS:
            raise ValueError(
                f"syncer.count_holders must be one of {', '.join(HOLDER_COUNTS)}, got {self.count_holders!r}"
            )
        if self.renew_every_s * 2 > self.lease_s:
            raise ValueError("syncer.renew_every_s must be at most half of lease_s (a renewal may fail)")
        if 0 < self.clip_factor < 1:
            raise ValueError("syncer.clip_factor must be 0 (off) or >= 1")
        for name in ("checkpoint_every_merges", "max_staleness", "eval_every_merges", "eval_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"syncer.{name} must be an int >= 0, got {value!r}")
        for name in ("eval_batch_size", "max_merged_keys", "checkpoint_keep", "max_fragments_in_flight"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"syncer.{name} must be an int >= 1, got {value!r}")

    def counts_proven(self, mode: str) -> bool:
        """Whether a round in DiLoCo `mode` waits only for proven holders (`count_holders`)."""
        if self.count_holders == "auto":
            return mode == "elastic_sync"
        return self.count_holders == "proven"

    @classmethod
    def from_options(cls, options: Mapping[str, Any], *, heartbeat_period_s: float) -> SyncerConfig:
        """From `NodeConfig.syncer` (node.toml `[syncer]`, `HIVENODE_SYNCER`); lease timing defaults to the run's
        heartbeat period."""
        default = cls(
            renew_every_s=heartbeat_period_s,
            lease_s=3 * heartbeat_period_s,
            recovery_s=3 * heartbeat_period_s,
            mirror_every_s=heartbeat_period_s,
        )
        return component_config(default, options, table="syncer")


def quorum_config(spec: Any, *, max_grace_s: float) -> QuorumConfig:
    """The merge trigger of the manifest's mode (DilocoSpec.mode; see node.diloco.quorum for the baselines)."""
    mode = getattr(spec, "mode", "decoupled")
    if mode == "sync":
        return QuorumConfig.synchronous(spec.sync_learners)
    if mode == "elastic_sync":
        return QuorumConfig.elastic_synchronous()
    gamma = min(spec.grace_gamma, 0.99)
    # tau of the grace formula is at most the tau learners apply a merge at (FragmentSync.create): a wait longer
    # than what they keep computing after a send would stall them (or, decoupled, waste their steps)
    overlap = max(0, min(spec.overlap_steps, spec.sync_every_steps - 1))
    return QuorumConfig.decoupled(
        spec.min_quorum, grace_gamma=gamma, grace_tau=min(spec.grace_tau, overlap), max_grace_s=max_grace_s
    )


# ---------------------------------------------------------------------------------------------- the role


async def commit(core_free: asyncio.Event, core: SyncerCore, prepared: PreparedMerge) -> MergeRecord:
    """A merge's commit: its new version, when a spill file, read in by a worker thread (0.25-1 GiB at
    llama-1b: on the loop that stalled every route for the read), the rest of the commit on the loop. Atomic for
    the routes: they wait on `core_free` (the role's) before reading the core, and it is set again only once the version is
    published (or the failed read put the old one back)."""
    core_free.clear()
    try:
        prepared = await asyncio.to_thread(read_in, core, prepared)
        return core.commit_merge(prepared, time.monotonic())
    finally:
        core_free.set()


def _set_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


class SyncerRole:
    """The networked syncer; see the module docstring. `is_banned` is the hook SENTINEL bans plug into."""

    name = "syncer"

    def __init__(self, ctx: NodeContext) -> None:
        manifest = ctx.manifest
        if ctx.peer_id not in manifest.authorized_syncers:
            raise ConfigError(
                f"this node's key {ctx.peer_id} is not an authorized syncer of run {manifest.name!r}; the owner "
                f"can add it with `python -m bootstrap --authorize-syncer {ctx.peer_id}`"
            )
        self.ctx = ctx
        self.config = SyncerConfig.from_options(
            ctx.config.syncer, heartbeat_period_s=manifest.heartbeat_period_s
        )
        self.mode = getattr(manifest.diloco, "mode", "decoupled")
        self.is_banned: Callable[[str], bool] = lambda _peer: False
        self.plan = run_fragment_plan(manifest)
        self.limits = fragment_limits(self.plan)
        self.fragment_stage = _fragment_stages(manifest, self.plan)
        directory = (
            Path(self.config.checkpoint_dir).expanduser()
            if self.config.checkpoint_dir
            else ctx.config.state_dir / "syncer"
        )
        self.checkpoints = CheckpointStore(directory, ctx.run_id, keep=self.config.checkpoint_keep)
        self.checkpoint_file: Path | None = None  # the last one written
        from protocol.rpc import PeerStrikes

        self.strikes = PeerStrikes()
        self.core: SyncerCore | None = None
        self.active = False
        self.term = 0
        self.primary: str | None = None
        self.recovering_until = 0.0
        self.fresh: set[tuple[str, int]] = set()  # in recovery: (peer, fragment) that sent a snapshot for us
        self.held_out_loss: float | None = None
        self.last_checkpoint_at: float | None = None
        self.takeover_source = ""
        self.adopted = 0
        self.live: dict[str, Any] = {}
        self._vacant_looks = 0
        self.watch = TakeoverWatch(
            enabled=self.config.takeover_quorum,
            heartbeat_ttl_s=HEARTBEAT_TTL_PERIODS * manifest.heartbeat_period_s,
            lease_s=self.config.lease_s,
            membership_refresh_s=self.config.membership_refresh_s,
        )
        self._lease_expiration = 0.0
        self._lease_until = 0.0
        self.merge_lock = asyncio.Lock()
        self.core_free = _set_event()  # clear while a commit swaps a version in off the loop (`commit`)
        self.wake = asyncio.Event()
        self.published = asyncio.Event()
        self.p2p: Any = None
        self.service = SyncerService(self)  # the RPC routes
        self.mirror = StateMirror(self, self.service.replay)  # a standby's copy of the active syncer's state
        self._eval: Any = None
        self.probe: LossProbe | None = None  # the held-out loss-delta score, once its data is loaded
        self.probe_lock = asyncio.Lock()
        self.ban_outbox: deque[BanNotice] = deque()  # learner bans of the ledger, for the signed gossip
        self._merges_since_checkpoint = 0
        # the last merges with their quorum, grace and weights, for /api/status and so the dashboard of any swarm
        self.recent_merges: deque[dict[str, Any]] = deque(maxlen=RECENT_MERGES)

    # ---- lifecycle ----

    async def run(self, ctx: NodeContext, stop: asyncio.Event) -> None:
        self.core = await asyncio.to_thread(build_core, self)
        self.p2p = await ctx.dht.replicate_p2p()
        await self.service.start(self.p2p, ctx.metrics.count_throttle)
        from node.context import RestartPolicy

        ctx.supervisor.spawn("syncer-lease", partial(self._lease_loop, stop), policy=RestartPolicy())
        ctx.supervisor.spawn("syncer-members", partial(self._membership_loop, stop), policy=RestartPolicy())
        ctx.supervisor.spawn("syncer-merge", partial(self._merge_loop, stop), policy=RestartPolicy())
        ctx.supervisor.spawn("syncer-mirror", partial(self.mirror.run, stop), policy=RestartPolicy())
        screening = self.config.screening
        if screening.enabled and screening.loss_probe:  # contributions are scored once its data is loaded
            ctx.supervisor.spawn("syncer-probe-data", self._load_probe, policy=RestartPolicy())
        if self.config.eval_every_merges:  # optional: load the held-out data after we serve, not before
            ctx.supervisor.spawn("syncer-eval-data", self._load_eval, policy=RestartPolicy())
        from node.swarm.bans import ban_watcher_for  # SENTINEL bans: refuse banned peers' contributions

        bans = ban_watcher_for(ctx, outbox=self.ban_outbox)
        self.is_banned = bans.is_banned
        ctx.supervisor.spawn("syncer-bans", partial(bans.run, stop), policy=RestartPolicy())
        logger.info(
            "syncer ready: mode %s, %d fragments, checkpoints in %s",
            self.mode,
            self.plan.num_fragments,
            self.checkpoints.directory,
        )
        try:
            await stop.wait()
        finally:
            await self._shutdown()

    async def _held_out_shards(self) -> Any:
        """The run's held-out token shards as a memmap stream, when it trains on shards (else None)."""
        from node.roles.shard_data import open_shard_data, uses_shards

        if not uses_shards(self.ctx.manifest):
            return None
        return await (await open_shard_data(self.ctx)).heldout_stream()

    async def _load_eval(self) -> None:
        held = await self._held_out_shards()
        self._eval = await asyncio.to_thread(build_eval, self.ctx, self.config, held)
        if self.active:
            await self._evaluate()  # the loss the run starts (or resumes) from

    async def _load_probe(self) -> None:
        held = await self._held_out_shards()
        self.probe = await asyncio.to_thread(build_probe, self.ctx, self.config.screening, held)
        logger.info("held-out loss probe ready: contributions are scored before they merge")

    async def _shutdown(self) -> None:
        with contextlib.suppress(Exception):
            await self.service.stop()
        if self.active and self.core is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._checkpoint(), 2.0)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._publish_lease(release=True), 2.0)
            self.active = False

    # ---- the lease ----

    async def _lease_loop(self, stop: asyncio.Event) -> None:
        from node.context import wait_or_stop

        while True:
            try:
                await self._lease_tick()
            except asyncio.TimeoutError:
                logger.warning("syncer lease: DHT did not answer in time")
            if await wait_or_stop(stop, self.config.renew_every_s):
                return

    async def _lease_tick(self) -> None:
        records = self.ctx.records
        found = await records.list_syncers()
        now = records.clock()
        authorized = set(self.ctx.manifest.authorized_syncers)
        others = [r for r in found if r.peer_id != self.ctx.peer_id and r.peer_id in authorized]
        live = tuple(r for r in others if r.state.state == "active" and r.state.lease_until > now)
        view = LeaseView(live_active=live, highest_term=max([r.state.term for r in found] + [self.term]))
        self._vacant_looks = 0 if live else self._vacant_looks + 1
        if live or self.active:
            self.watch.lease_seen(time.monotonic())
        action = lease_action(
            me=self.ctx.peer_id,
            active=self.active,
            term=self.term,
            view=view,
            vacant_looks=self._vacant_looks,
            quorum=self.watch.has_quorum(),
        )
        if action == "no_quorum" and self.watch.first_refusal():  # once per lapse
            live_holders, members = self.watch.quorum
            self.ctx.events.emit("takeover_refused", live=live_holders, members=members, term=self.term)
            logger.warning(
                "no live syncer lease, but only %d of the %d learners/stages seen with it are here: not taking "
                "over (the lease holder may be alive on the other side of a partition)",
                live_holders,
                members,
            )
        if action == "renew":
            await self._publish_lease()
        elif action == "step_down":
            winner = choose_syncer(live, now=now, authorized=tuple(authorized))
            await self._step_down(winner.peer_id if winner else None, view.highest_term)
        elif action == "take_over":
            await self._take_over(view.highest_term + 1)
        elif action == "stand_by":
            winner = choose_syncer(live, now=now, authorized=tuple(authorized))
            self.primary = winner.peer_id if winner else None
            self.term = max(self.term, view.highest_term)
            await self._publish_lease()
        else:
            await self._publish_lease()

    async def _publish_lease(self, *, release: bool = False) -> None:
        from protocol.records import SyncerState

        records = self.ctx.records
        now = records.clock()
        assert self.core is not None
        active = self.active and not release
        lease_until = now + self.config.lease_s if active else now
        expiration = max(now + self.config.lease_s, self._lease_expiration + 1e-3)
        state = SyncerState(
            lease_until=lease_until,
            term=self.term,
            versions=tuple(self.core.versions),
            http=self.ctx.http_address,
            state="active" if active else "standby",
            sent_at=now,
        )
        if await records.publish_syncer(state, expiration=expiration):
            self._lease_expiration = expiration
            if active:
                self._lease_until = time.monotonic() + self.config.lease_s
        else:
            logger.warning("syncer lease record was not stored")

    async def _take_over(self, term: int) -> None:
        assert self.core is not None
        async with self.merge_lock:
            source, seen_term = await restore_best(self.core, self.checkpoints, self.mirror.snapshot)
            # terms never go back, even when every lease record has expired: the saved state knows its term
            term = self.term = max(term, seen_term + 1, self.term + 1)
            self.active = True
            self.primary = None
            self.recovering_until = time.monotonic() + self.config.recovery_s
            self.fresh = set()
            self.takeover_source = source
        await self._publish_lease()
        self.ctx.events.emit(
            "syncer_takeover",
            term=term,
            source=source,
            versions=list(self.core.versions),
            seniority=self.core.seniority.status(time.monotonic()),  # restored with the state (issue 18)
        )
        logger.info("took over as the active syncer, term %d, state from %s", term, source)
        await self._checkpoint()
        self.notify()
        if self.config.eval_every_merges:
            await self._evaluate()  # the loss the run resumes from (the seed's, on a fresh run)

    def notify(self) -> None:
        """Wake every versions long-poll; later polls wait on a fresh event."""
        self.published.set()
        self.published = asyncio.Event()

    async def _step_down(self, winner: str | None, term: int) -> None:
        async with self.merge_lock:
            self.active = False
            self.primary = winner
            self.term = max(self.term, term)
            assert self.core is not None
            self.core.rounds.clear()
        self.ctx.events.emit("syncer_step_down", term=self.term, winner=winner)
        logger.warning("another syncer holds a newer lease (term %d); standing by", self.term)
        await self._publish_lease()

    def _lease_valid(self) -> bool:
        return self.active and time.monotonic() < self._lease_until

    # ---- membership ----

    async def _membership_loop(self, stop: asyncio.Event) -> None:
        from node.context import wait_or_stop

        while True:
            await self._refresh_members()
            if await wait_or_stop(stop, max(self.config.membership_refresh_s, 0.1)):
                return

    async def _refresh_members(self) -> None:
        try:
            peers = await self.ctx.records.list_peers()
        except asyncio.TimeoutError:
            return
        self.live = {p.peer_id: p.heartbeat for p in peers if p.heartbeat.role in HOLDER_ROLES}
        self.watch.holders_read(self.live, time.monotonic())

    def holders(self, fragment: int) -> set[str]:
        """Live peers that hold the fragment (every learner, and the replicas of its pipeline stage), not banned,
        that its open round counts as expected (`expected_holders`)."""
        return expected_holders(self, fragment)

    async def check_known(self, peer: str) -> None:
        # the ledger's reason first: `is_banned(peer) or (why := ...)` left `why` unbound on a swarm-wide ban
        why = self.service.ledger.banned(peer, time.time())
        if why is not None or self.is_banned(peer):
            raise refuse("banned", f"{peer[-8:]} is banned: {why or 'swarm-wide ban'}")
        if peer in self.live:
            return
        if time.monotonic() - self.watch.live_read_at > 0.5:
            await self._refresh_members()
        if peer not in self.live:
            raise refuse("unknown peer", f"{peer[-8:]} has no live learner or stage heartbeat")

    # ---- the merge loop ----

    async def _merge_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            timeout = 1.0
            if self._lease_valid() and time.monotonic() >= self.recovering_until:
                assert self.core is not None
                ready, deadline = self.core.due(time.monotonic(), self.holders)
                for fragment in ready:
                    await self._merge(fragment)
                if deadline is not None:
                    timeout = min(timeout, max(0.0, deadline - time.monotonic()))
                if ready:
                    continue
            elif self.active and time.monotonic() < self.recovering_until:
                timeout = min(timeout, self.recovering_until - time.monotonic())
            self.wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), max(timeout, 0.005))

    async def _merge(self, fragment: int) -> None:
        core = self.core
        assert core is not None
        async with self.merge_lock:
            if not self._lease_valid():
                return
            started = time.monotonic()
            taken = core.take_round(fragment, self.holders(fragment), started)
            if taken is None:
                return
            round_, expected, required = taken
            try:
                prepared = await computed(self, core, fragment, taken, started)
            except NothingToMerge as e:
                self.ctx.events.emit("merge_skipped", fragment=fragment, reason=str(e), rejected=e.rejected)
                if self.mode == "decoupled":
                    return  # nobody waits for a round: the next one merges their work
                prepared = core.void_merge(
                    fragment,
                    round_,
                    expected=expected,
                    required=required,
                    started_at=started,
                    rejected=e.rejected,
                )
            record = await commit(self.core_free, core, prepared)
            del (
                prepared,
                round_,
                taken,
            )  # the round's contributions and the merge's temporaries, then freed for good
            release_freed_memory()
        self._merges_since_checkpoint += 1
        event = {
            **record.to_event(),
            "term": self.term,
            "mode": self.mode,
            "tokens_total": core.tokens_merged,
            "tokens_in_model": core.tokens_in_model,
            "merges": core.merges,
            "grace_s": round(core.policy.grace_s(), 4),
            "xi_step_s": round(core.policy.xi_step or 0.0, 4),
        }
        self.recent_merges.append({"t": time.time(), **event})
        self.ctx.events.emit("merge", **event)
        self.notify()
        if (
            self.config.checkpoint_every_merges
            and self._merges_since_checkpoint >= self.config.checkpoint_every_merges
        ):
            await self._checkpoint()
        if self.config.eval_every_merges and core.merges % self.config.eval_every_merges == 0:
            await self._evaluate()

    async def _checkpoint(self) -> None:
        core = self.core
        if core is None:
            return
        async with self.merge_lock:
            snapshot = core.snapshot(self.ctx.run_id, self.term, wall_offset=wall_offset())
        self.checkpoint_file = await asyncio.to_thread(self.checkpoints.save, snapshot)
        self._merges_since_checkpoint = 0
        self.last_checkpoint_at = time.time()
        self.ctx.events.emit(
            "checkpoint",
            path=str(self.checkpoint_file),
            versions=list(snapshot.versions),
            merges=snapshot.merges,
        )

    async def _evaluate(self) -> None:
        await evaluate_global(self)

    # ---- status ----

    def status(self) -> dict[str, Any]:
        return role_status(self)


def role_status(role: SyncerRole) -> dict[str, Any]:
    """The syncer's /api/status."""
    core = role.core
    if core is None:
        return {"state": "joining", "mode": role.mode}
    policy = core.policy
    return {
        "state": "syncing" if role.active else "standby",
        "mode": role.mode,
        "term": role.term,
        "primary": role.primary,
        "recovering": role.active and time.monotonic() < role.recovering_until,
        # an active syncer whose lease renewals failed for lease_s still answers but merges nothing
        "lease_left_s": round(role._lease_until - time.monotonic(), 3) if role.active else None,
        "takeover_source": role.takeover_source,
        "versions": list(core.versions),
        "merges": core.merges,
        "tokens_merged": core.tokens_merged,
        "inner_step": core.merges,
        "tokens": core.tokens_in_model,
        "tokens_in_model": core.tokens_in_model,
        "loss": role.held_out_loss,
        "held_out_loss": role.held_out_loss,
        "open_rounds": {str(f): len(r.entries) for f, r in core.rounds.items()},
        "live_holders": len(role.live),
        "takeover_quorum": list(role.watch.quorum),
        "lease_vacant_looks": role._vacant_looks,
        "grace_s": round(policy.grace_s(), 4),
        "xi_step_s": policy.xi_step,
        "xi_quorum_s": policy.xi_quorum,
        "xi_sync_s": policy.xi_sync,
        "adopted": role.adopted,
        **role.service.status(),
        "strikes": role.strikes.snapshot(),
        "checkpoint": str(role.checkpoint_file or role.checkpoints.directory),
        "last_checkpoint_at": role.last_checkpoint_at,
        "mirror_versions": list(mirror.versions) if (mirror := role.mirror.snapshot) is not None else None,
        "recent_merges": list(role.recent_merges),
        # per learner: latest evidence factor, held-out slope, merge share, probation trust, banned (for /metrics)
        "scores_by_peer": peer_scores(role.recent_merges, role.service.ledger, time.time()),
        "learner_bans": role.service.ledger.bans,  # learner bans this syncer decided since it started
    }


def build_core(role: SyncerRole) -> SyncerCore:
    """The syncer core at version 0 of the run's model (a checkpoint or a holder's state replaces it later)."""
    from node.ml.model import ModelConfig, SeedParameters, build_model, embedding_param_names

    manifest = role.ctx.manifest
    cfg = ModelConfig.from_dict(manifest.model)
    spill_dir = role.ctx.config.state_dir / "syncer-spill"
    if role.config.params_on_disk:
        # written to their files a tensor at a time: the seed model is never whole in memory
        logger.info("syncer: the global parameters kept on disk (params_on_disk), in %s", spill_dir)
        params: Mapping[str, torch.Tensor] = SeedParameters(cfg, manifest.seed)
    else:
        params = dict(build_model(cfg, manifest.seed).named_parameters())
    return SyncerCore(
        role.plan,
        params,
        quorum=quorum_config(manifest.diloco, max_grace_s=role.config.max_grace_s),
        embedding_names=embedding_param_names(cfg),
        outer_lr=manifest.diloco.outer_lr,
        outer_momentum=manifest.diloco.outer_momentum,
        clip_factor=role.config.clip_factor or None,
        max_staleness=role.config.max_staleness,
        max_steps_per_s=role.config.max_steps_per_s,
        tokens_per_step=manifest.inner.batch_size * cfg.context_len,
        now=time.monotonic(),
        max_merged_keys=role.config.max_merged_keys,
        screening=role.config.screening,
        admission=manifest.admission,
        run_id=role.ctx.run_id,
        # older versions and the outer momentum on disk: resident memory ~ the model (docs/scale.md); a working
        # store, emptied here: a restart resumes from the checkpoint
        spill_dir=spill_dir,
        take_params=True,  # the seed model is ours alone (dropped on return)
        params_on_disk=role.config.params_on_disk,
        sparse_merge=manifest.outer_codec.codec in TOPK_CODECS,
    )


async def computed(
    role: SyncerRole, core: SyncerCore, fragment: int, taken: tuple[Any, int, int], started: float
) -> PreparedMerge:
    """`compute_merge` in a worker thread; the runs of zero-evidence contributions it found go to the learner
    ledger whether it merged or not (a lone contribution at evidence factor 0 merges nothing)."""
    round_, expected, required = taken
    try:
        return await asyncio.to_thread(
            core.compute_merge,
            fragment,
            round_,
            expected=expected,
            required=required,
            started_at=started,
        )
    finally:
        for streak in core.take_zero_streaks():  # one violation each; repeated, they ban
            role.service.ban(role.service.ledger.no_evidence(streak, time.time()))


async def evaluate_global(role: SyncerRole) -> None:
    """The held-out loss of the global model now (syncer.eval_every_merges), for status and the event tape."""
    core = role.core
    if role._eval is None or core is None:
        return
    model, batches = role._eval
    async with role.merge_lock:
        # shared: the core never writes a published tensor in place (on disk: its files, streamed by the pass)
        state = core.params.view()
        tokens, in_model, merges = core.tokens_merged, core.tokens_in_model, core.merges

    def run() -> float:
        return skeleton_loss(model, state, batches, device=role.ctx.device)

    role.held_out_loss = await asyncio.to_thread(run)
    role.ctx.events.emit(
        "eval",
        loss=round(role.held_out_loss, 5),
        tokens_total=tokens,
        tokens_in_model=in_model,
        merges=merges,
    )


def expected_holders(role: SyncerRole, fragment: int) -> set[str]:
    """`SyncerRole.holders`: not banned ones (a banned peer keeps its heartbeat, but its pushes never enter a
    round: counted as expected, it made every round wait out its grace window for it), and of the rest those
    `counted_holders` counts (the proven ones; in a fresh run, anyone early on: a heartbeat is free to fake)."""
    stage = role.fragment_stage[fragment]
    wall, ledger = time.time(), role.service.ledger
    live = {
        peer
        for peer, hb in role.live.items()
        if (hb.role == "learner" or hb.stage == stage)
        and ledger.banned(peer, wall) is None
        and not role.is_banned(peer)
    }
    core = role.core
    if core is None or not role.config.counts_proven(role.mode):
        return live
    round_ = core.rounds.get(fragment)
    return counted_holders(
        live,
        core.seniority.last_merged,
        round_opened_at=None if round_ is None else round_.opened_at,
        now=time.monotonic(),
        proven_s=role.config.proven_s,
        unproven_wait_s=role.config.unproven_wait_s,
    )


async def restore_best(
    core: SyncerCore, checkpoints: CheckpointStore, mirror: SyncerSnapshot | None
) -> tuple[str, int]:
    """Resume from the freshest of the newest whole checkpoint and the mirror (by total version count)."""
    candidates: list[tuple[int, str, SyncerSnapshot]] = []
    try:
        snapshot = await asyncio.to_thread(
            partial(checkpoints.load_latest, expected=core.shapes, num_fragments=core.plan.num_fragments)
        )
        candidates.append((sum(snapshot.versions), "checkpoint", snapshot))
    except FileNotFoundError:
        pass
    except CheckpointError as e:
        logger.warning("ignoring checkpoint: %s", e)
    if mirror is not None:
        candidates.append((sum(mirror.versions), "mirror", mirror))
    current = sum(core.versions)
    seen_term = max((c[2].term for c in candidates), default=0)
    best = max(candidates, key=lambda c: (c[0], c[1] == "checkpoint"), default=None)
    if best is None or best[0] < current:
        return ("memory" if current else "seed"), seen_term
    core.restore(best[2], time.monotonic(), wall_offset=wall_offset())
    return best[1], seen_term


def build_eval(ctx: NodeContext, config: SyncerConfig, held: Any = None) -> tuple[Any, list[Any]]:
    """The syncer's held-out set and the model's skeleton (`model_skeleton`) the global parameters are evaluated
    in. `held`: the run's held-out token shards; None: the held-out split of the corpus."""
    from node.ml.data import load_corpus, validation_batches
    from node.ml.model import ModelConfig

    manifest = ctx.manifest
    cfg = ModelConfig.from_dict(manifest.model)
    if held is None:
        held = load_corpus(ctx.config.data or _data_spec(manifest)).with_encoder(ctx.encode)
    batches = validation_batches(
        held,
        batch_size=config.eval_batch_size,
        context_len=cfg.context_len,
        num_batches=config.eval_batches,
    )
    return model_skeleton(cfg, ctx.device), batches


def model_skeleton(cfg: Any, device: str = "cpu") -> Any:
    """The model's modules in eval mode with their parameters on the meta device (no memory) and real rotary
    tables on `device`: the parameters come in at each call (`skeleton_loss`), the syncer core's own tensors,
    shared. The probe and the evaluation used to copy the global model into a model of their own: one more model
    in memory each (the syncer's memory at scale, docs/scale.md)."""
    from node.ml.model import CausalLM

    with torch.device("meta"):
        model = CausalLM(cfg)
    model.reset_buffers()  # outside the meta device: the non-persistent rotary tables, computed on the CPU
    meta = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if meta:
        raise RuntimeError(f"model skeleton: buffers left on the meta device: {meta[:3]}")
    for module in model.modules():  # the buffers alone: a meta parameter cannot be copied anywhere
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(device)
    return model.eval()


def skeleton_loss(
    model: Any,
    params: Mapping[str, torch.Tensor],
    batches: list[Any],
    *,
    device: str = "cpu",
    pass_bytes: int | None = None,
) -> float:
    """Mean held-out loss of `params` (every parameter of the model, by name) run through the skeleton on
    `device` (the skeleton's, `model_skeleton`). The master copy stays where the syncer core keeps it, on the
    CPU in fp32 (the outer step's precision; the global model and its momentum on an accelerator would cost its
    memory twice over for what is a few forward passes per merge): the device only computes, on a transient
    copy. fp32 there too, no bf16 autocast: the probe's score is the difference of two losses, and bf16's
    rounding would be noise of the size of an honest contribution's gain. Tensors `params` streams (the probe's
    contribution applied, node.diloco.loss_probe.Applied) are computed a block at a time inside the pass
    (node.ml.streamed_forward), never held whole. A batch is cut into passes of a few rows with their MLPs and
    logits run a few positions at a time (`node.ml.model.loss_pass_shape`, `pass_bytes`, default `LOSS_PASS_BYTES`): at
    llama-1b one full-context row's logits are 0.25 GiB."""
    from torch.func import functional_call

    from node.ml.data import evaluate
    from node.ml.model import LOSS_PASS_BYTES, loss_pass_shape
    from node.ml.streamed_forward import streamed_names, streaming

    # computed a block at a time inside the pass (the probe's applied fragment), never moved whole
    streamed = streamed_names(params)
    tensors = {name: params[name].to(device) for name in params if name not in streamed}  # shared on the CPU

    def loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows, seq = inputs.shape
        cut = loss_pass_shape(model.cfg, rows, seq, LOSS_PASS_BYTES if pass_bytes is None else pass_bytes)
        if cut.rows >= rows and cut.positions >= seq:  # a small model: one pass, whole
            return functional_call(model, tensors, (inputs.to(device), targets.to(device)))
        total = torch.zeros((), dtype=torch.float32)
        for start in range(0, rows, cut.rows):  # equal-length rows: the passes' means, weighted by their rows
            part = slice(start, start + cut.rows)
            args = (inputs[part].to(device), targets[part].to(device))
            piece = functional_call(model, tensors, args, {"loss_positions": cut.positions})
            total += piece.float().cpu() * (min(rows, start + cut.rows) - start)
        return total / rows

    with torch.no_grad(), streaming(model, params, device):
        return evaluate(loss, batches)


def build_probe(ctx: NodeContext, screening: ScreeningConfig, held: Any = None) -> LossProbe:
    """The held-out loss-delta probe: the model's skeleton the scored parameters run through (no copy of the
    model: `model_skeleton`), and private held-out batches (validation windows at offsets drawn from OS
    randomness, so no learner knows which it is scored on)."""
    import secrets

    from node.ml.data import load_corpus
    from node.ml.model import ModelConfig

    manifest = ctx.manifest
    cfg = ModelConfig.from_dict(manifest.model)
    stream = (
        held
        or load_corpus(ctx.config.data or _data_spec(manifest)).with_encoder(ctx.encode).validation_stream()
    )
    tokens = probe_sequence_tokens(screening, cfg.context_len)
    stream.check_fits(tokens)
    gen = torch.Generator().manual_seed(secrets.randbits(63))
    last_start = stream.num_starts(tokens) - 1
    starts = torch.randint(
        0, last_start + 1, (screening.loss_batches, screening.loss_batch_size), generator=gen
    )
    batches = [stream.windows(row, tokens) for row in starts]
    return LossProbe(
        partial(skeleton_loss, model_skeleton(cfg, ctx.device), batches=batches, device=ctx.device)
    )


def probe_sequence_tokens(screening: ScreeningConfig, context_len: int) -> int:
    """Tokens per held-out sequence of the loss probe: `loss_sequence_tokens`, at most the model's context."""
    wanted = screening.loss_sequence_tokens
    return context_len if wanted == 0 else min(wanted, context_len)


def _fragment_stages(manifest: Any, plan: FragmentPlan) -> list[int]:
    """The pipeline stage whose span holds each fragment (run_fragment_plan numbers them stage by stage)."""
    from node.ml.model import ModelConfig, StageModule, stage_spans

    cfg = ModelConfig.from_dict(manifest.model)
    spans = stage_spans(cfg.num_layers, manifest.num_stages)
    owner: dict[str, int] = {}
    for index, span in enumerate(spans):
        with torch.device("meta"):
            stage = StageModule(cfg, span, is_first=index == 0, is_last=index == len(spans) - 1)
        for name, _ in stage.named_parameters():
            owner[name] = index
    return [owner[f.names[0]] for f in plan.fragments]


def _data_spec(manifest: Any) -> str | None:
    source = manifest.data.get("source", "builtin")
    return None if source == "builtin" else str(source)


def create_role(ctx: NodeContext) -> SyncerRole:
    return SyncerRole(ctx)


__all__ = [
    "MODES",
    "Admission",
    "LeaseView",
    "MergeRecord",
    "Refusal",
    "SyncerConfig",
    "SyncerCore",
    "SyncerRole",
    "create_role",
    "lease_action",
    "quorum_config",
]
