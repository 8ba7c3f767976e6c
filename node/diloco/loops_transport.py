"""The two background loops of a `FragmentSync`, on the event loop, over a `SyncTransport`: the sender pushes
the ledger's snapshots, the watcher long-polls the syncer's versions and fetches the newer ones (and loads
them all when the holder joins). They share `LoopSignals`, the events by which the inner loop's thread and
each loop wake the others. Part of the sync transport shell (the name's suffix tells the layering test)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Sequence

from node.diloco.compression import ContributionEncoder, WireContribution, push_mask
from node.diloco.fragment_ledger import FragmentLedger
from node.diloco.push_pacer import PushPacer
from node.diloco.sync_types import (
    ContributionRefused,
    FragmentVersion,
    OutgoingContribution,
    SyncClientConfig,
    SyncDeferred,
    SyncStats,
    SyncTransport,
    SyncUnavailable,
    VersionsView,
)

logger = logging.getLogger(__name__)


async def first(event: asyncio.Event, stop: asyncio.Event) -> None:
    """Wait until `event` or `stop` is set."""
    waiters = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(stop.wait())]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def pause(stop: asyncio.Event, wake: asyncio.Event, seconds: float) -> None:
    """Wait `seconds`, less if `stop` or `wake` is set first (`wake` is cleared before waiting)."""
    wake.clear()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(first(wake, stop), seconds)


class LoopSignals:
    """Events on the event loop, made when a loop first runs (`bind`); `wake` may be called from any thread,
    and before that does nothing.

    `outbox_ready`: a snapshot is queued (the sender pushes). `arrived`: a version arrived or a round will not
    come (a barrier re-checks). The failover hand-offs, so that neither loop sits out its backoff while the
    other has found the new syncer: `reconnected`, the watcher saw a new syncer or term (the sender retries
    now); `kick`, the sender got an answer after failures or a deferral (the watcher polls now and offers
    what the syncer lacks)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self.outbox_ready: asyncio.Event | None = None
        self.arrived: asyncio.Event | None = None
        self.reconnected: asyncio.Event | None = None
        self.kick: asyncio.Event | None = None

    def bind(self, *, outbox_waiting: bool) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self.outbox_ready = asyncio.Event()
            self.arrived = asyncio.Event()
            self.reconnected = asyncio.Event()
            self.kick = asyncio.Event()
            if outbox_waiting:
                self.outbox_ready.set()

    def wake(self, event: asyncio.Event | None) -> None:
        loop = self._loop
        if loop is None or event is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            event.set()
        else:
            loop.call_soon_threadsafe(event.set)


class SyncSender:
    """Pushes the ledger's snapshots, newest per fragment wins; retries with backoff while the syncer is away."""

    def __init__(
        self,
        ledger: FragmentLedger,
        transport: SyncTransport,
        signals: LoopSignals,
        *,
        config: SyncClientConfig,
        stats: SyncStats,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        receipts: Callable[[], Sequence[bytes]] | None = None,
        encoder: ContributionEncoder | None = None,
    ) -> None:
        self.ledger = ledger
        self.transport = transport
        self.signals = signals
        self.config = config
        self.stats = stats
        self.clock = clock
        # paces pushes the syncer's limiter throttled (config.pace_throttles; off: the fixed deferred_retry_s)
        self.pacer = PushPacer(config, rng)
        self.receipts = receipts
        self.encoder = encoder  # a lossy outer codec; None: the parameters travel as they are

    async def run(self, stop: asyncio.Event) -> None:
        """Push snapshots until `stop`. A contribution the syncer defers (`SyncDeferred`) does not hold back
        the other fragments' ones, and is re-sent after `deferred_retry_s`: after a takeover the new syncer
        defers a contribution built on a version it has yet to adopt, and its recovery window is short. A push
        the syncer's limiter throttles ends the batch (the next would meet the same cap), and no push starts
        before the `PushPacer` allows it: so the learner never counts as flooding."""
        signals = self.signals
        signals.bind(outbox_waiting=not self.ledger.outbox_empty())
        assert signals.outbox_ready is not None and signals.reconnected is not None
        backoff = self.config.retry_min_s
        while not stop.is_set():
            batch = self.ledger.outbox_batch()
            if not batch:
                signals.outbox_ready.clear()
                if self.ledger.outbox_empty():
                    await first(signals.outbox_ready, stop)
                continue
            if (paced_s := self.pacer.wait_s(self.clock())) > 0:
                await pause(stop, signals.reconnected, paced_s)
                continue
            outcomes = await self._push_batch(batch, stop)
            if outcomes is None:
                return
            if "unreachable" in outcomes:
                self.stats.retries += 1
                await pause(stop, signals.reconnected, backoff)
                backoff = min(backoff * 2, self.config.retry_max_s)
                continue
            if backoff > self.config.retry_min_s or "deferred" in outcomes:
                # a syncer answers again, or lacks a version we hold: the watcher polls and offers now (not on a
                # throttle: that is load, which a poll only adds to)
                signals.wake(signals.kick)
            backoff = self.config.retry_min_s
            if "deferred" in outcomes or "throttled" in outcomes:
                self.stats.retries += 1
                wait_s = self.pacer.wait_s(self.clock())
                if "deferred" in outcomes:
                    wait_s = max(wait_s, self.config.deferred_retry_s)
                await pause(stop, signals.reconnected, wait_s)

    async def _push_batch(
        self, batch: Sequence[tuple[int, OutgoingContribution]], stop: asyncio.Event
    ) -> list[str] | None:
        """Push a batch in order until one finds no syncer or is throttled; None if `stop` came first."""
        outcomes = []
        for index, contribution in batch:
            if stop.is_set():
                return None
            outcome = await self._push_one(index, contribution)
            outcomes.append(outcome)
            if outcome in ("unreachable", "throttled"):
                break
        return outcomes

    async def _push_one(self, index: int, contribution: OutgoingContribution) -> str:
        """The outcome: settled (acked, or refused for good), deferred (the syncer said not now), throttled (its
        limiter refused the push for load; paced) or unreachable (no syncer answered)."""
        self.stats.sent += 1
        # the syncer derives the run's schedule clock from what senders report: say where we are now, not
        # where we were when the snapshot was taken (a retried or re-sent one may be seconds old)
        now_step = self.ledger.sched_step_now()
        wire = dataclasses.replace(contribution, sched_step=now_step, receipts=self._receipts_now())
        plain_bytes = sum(4 * t.numel() for t in contribution.params.values())
        try:
            sent = await self._encoded(contribution)
            if sent is not None:
                wire = dataclasses.replace(wire, params=sent.tensors, codec_meta=sent.meta)
            receipt = await self.transport.push(wire)
        except ContributionRefused as e:
            self.pacer.answered()
            self.ledger.refused(index, contribution)
            self.stats.refused += 1
            self.stats.refusals[e.reason] = self.stats.refusals.get(e.reason, 0) + 1
            logger.info("fragment %d contribution refused: %s", contribution.fragment, e)
            self.signals.wake(self.signals.arrived)
            return "settled"
        except SyncUnavailable as e:
            self.stats.last_error = str(e)[:200]
            logger.debug("fragment %d push deferred: %s", contribution.fragment, e)
            if not isinstance(e, SyncDeferred):
                self.stats.unanswered += 1
                return "unreachable"
            return self._throttled(e) if e.throttled and self.config.pace_throttles else "deferred"
        self.pacer.answered()
        if self.ledger.acked(index, contribution, receipt):
            self.signals.wake(self.signals.kick)
        if sent is not None and self.encoder is not None:
            self.encoder.commit(contribution.fragment, sent)
        self.stats.acked += 1
        self.stats.push_bytes += sent.nbytes if sent is not None else plain_bytes
        self.stats.push_bytes_fp32 += plain_bytes
        return "settled"

    def _throttled(self, refusal: SyncDeferred) -> str:
        assert refusal.retry_after_s is not None
        self.stats.throttled += 1
        delay_s = self.pacer.throttled(self.clock(), refusal.retry_after_s)
        logger.debug(
            "push throttled (%s, %d in a row): next push in %.2f s",
            refusal.reason,
            self.pacer.in_a_row,
            delay_s,
        )
        return "throttled"

    async def _encoded(self, contribution: OutgoingContribution) -> WireContribution | None:
        """The contribution's delta under the lossy codec (in a worker thread: top-k over a large fragment takes
        a while), or None to send the parameters. A delta the codec cannot carry (a scale beyond what a receiver
        accepts: no training update) is refused here as the syncer would refuse it."""
        if self.encoder is None or contribution.base is None:
            return None
        try:
            mask = push_mask(self.encoder.spec, contribution.fragment, contribution.base_version)
            return await asyncio.to_thread(
                self.encoder.encode, contribution.fragment, contribution.base, contribution.params, mask=mask
            )
        except ValueError as e:
            raise ContributionRefused(f"cannot encode the delta: {e}", reason="encode failed") from None

    def _receipts_now(self) -> tuple[bytes, ...]:
        if self.receipts is None:
            return ()
        try:
            return tuple(bytes(f) for f in self.receipts())
        except Exception as e:  # a broken provider costs this push its receipts, not the push
            logger.warning("receipts provider failed: %s: %s", type(e).__name__, e)
            return ()


class SyncWatcher:
    """Long-polls the syncer's versions, fetches every newer fragment version into the ledger's inbox, and
    after a syncer failover re-sends what it never answered and offers the signed versions we hold."""

    def __init__(
        self,
        ledger: FragmentLedger,
        transport: SyncTransport,
        signals: LoopSignals,
        *,
        config: SyncClientConfig,
        stats: SyncStats,
        clock: Callable[[], float],
    ) -> None:
        self.ledger = ledger
        self.transport = transport
        self.signals = signals
        self.config = config
        self.stats = stats
        self.clock = clock

    async def run(self, stop: asyncio.Event) -> None:
        """Watch until `stop`. After a failed poll the next one does not wait: the syncer may have changed,
        and a new one that lacks a version we hold would otherwise keep the poll open (nothing newer than
        ours) while its recovery window, in which it adopts offered versions, runs out."""
        self.signals.bind(outbox_waiting=not self.ledger.outbox_empty())
        assert self.signals.kick is not None
        backoff = self.config.retry_min_s
        wait_s = self.config.poll_wait_s
        while not stop.is_set():
            try:
                if self.ledger.rejoin_due:
                    await self._rejoin()
                view = await self.transport.versions(self.ledger.known(), wait_s)
                wait_s = self.config.poll_wait_s
                await self.absorb(view)
                backoff = self.config.retry_min_s
                await asyncio.sleep(0)  # a transport that answers without suspending must not starve the loop
            except SyncUnavailable as e:
                self.stats.last_error = str(e)[:200]
                wait_s = 0.0
                await pause(stop, self.signals.kick, backoff)
                backoff = min(backoff * 2, self.config.retry_max_s)

    async def _fetch_current(self) -> tuple[VersionsView, list[FragmentVersion]]:
        """The syncer's versions and its current version of every synced fragment past version 0."""
        ledger = self.ledger
        view = await self.transport.versions([0] * ledger.plan.num_fragments, 0.0)
        fetched = [await self.transport.fetch(fid) for fid in ledger.fragment_ids if view.versions[fid] > 0]
        return view, fetched

    async def _rejoin(self) -> None:
        """Lock-step modes, after the syncer said a contribution of ours was late (its round merged without
        us, say while we were stopped and our heartbeat expired): load every current version and realign the
        schedule to the earliest open round, as a restarted learner does. Waiting for our fragment's next
        round instead deadlocks: the others send to it only after rounds of other fragments that wait for us.
        What we computed since our last overwrites is dropped; the late contributions are merged."""
        _, fetched = await self._fetch_current()
        self.ledger.rejoin(fetched)
        self.signals.wake(self.signals.arrived)

    async def absorb(self, view: VersionsView) -> None:
        """Take one versions answer: fetch what is newer, hand a new syncer what it lacks."""
        ledger = self.ledger
        if len(view.versions) != ledger.plan.num_fragments:
            raise SyncUnavailable(
                f"syncer reports {len(view.versions)} fragments, the plan has {ledger.plan.num_fragments}"
            )
        previous = ledger.observe(view)
        if previous is not None and (previous.syncer, previous.term) != (view.syncer, view.term):
            self._resend_unanswered(view)
            self.signals.wake(self.signals.reconnected)
        known = ledger.known()
        newer = [fid for fid in ledger.fragment_ids if view.versions[fid] > known[fid]]
        behind = [fid for fid in ledger.fragment_ids if view.versions[fid] < known[fid]]
        for fid in newer:
            version = await self.transport.fetch(fid)
            self.stats.fetched += 1
            ledger.store(fid, version)
        if newer:
            self.signals.wake(self.signals.arrived)
        if behind:
            await self._offer(view, behind)

    def _resend_unanswered(self, view: VersionsView) -> None:
        fresh, requeued = self.ledger.resend_unanswered(view)
        if fresh or requeued:
            logger.info(
                "syncer changed to %s (term %d): sending %d fresh snapshots, re-sending %d contributions",
                view.syncer[-8:],
                view.term,
                fresh,
                requeued,
            )
            self.signals.wake(self.signals.outbox_ready)

    async def _offer(self, view: VersionsView, behind: Sequence[int]) -> None:
        offers = self.ledger.offers(view, behind)
        if not offers:
            return
        adopted = await self.transport.offer(offers)
        self.stats.offered += len(offers)
        self.stats.adopted_by_syncer += adopted
        logger.info(
            "offered %d held versions to syncer %s, %d adopted", len(offers), view.syncer[-8:], adopted
        )

    async def _load_current(self, loaded: set[tuple[int, int]]) -> VersionsView:
        """The syncer's versions, and its current version of every synced fragment past version 0 loaded into the
        parameters as it arrives. One at a time: gathered first and loaded together, a joiner held every fetched
        version's tensors and signed frame at once beside its model (3 models at its peak, measured: 4.7 GiB for
        llama-350m's 1.4 GiB); now the model, the frames it keeps to offer (`HeldVersions`) and one version in
        flight. A version loaded by an earlier try (the syncer went away half-way) is not fetched again."""
        ledger = self.ledger
        view = await self.transport.versions([0] * ledger.plan.num_fragments, 0.0)
        for fid in ledger.fragment_ids:
            if view.versions[fid] > 0 and (fid, view.versions[fid]) not in loaded:
                version = await self.transport.fetch(fid)
                if ledger.load([version]):
                    loaded.add((fid, version.version))
                del version  # its tensors are in the model now: not held through the next fetch
        return view

    async def join(self, stop: asyncio.Event, timeout_s: float | None = None) -> bool:
        """Load the current global value of every synced fragment; False if no syncer answered in time."""
        self.signals.bind(outbox_waiting=not self.ledger.outbox_empty())
        deadline = self.clock() + (self.config.join_timeout_s if timeout_s is None else timeout_s)
        backoff = self.config.retry_min_s
        loaded: set[tuple[int, int]] = set()  # (fragment, version) loaded by an earlier try of this join
        while not stop.is_set():
            try:
                view = await self._load_current(loaded)
            except SyncUnavailable as e:
                self.stats.last_error = str(e)[:200]
                if self.clock() + backoff > deadline:
                    logger.warning("no syncer answered within the join timeout; starting from the seed")
                    return False
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff)
                backoff = min(backoff * 2, self.config.retry_max_s)
                continue
            clock = self.ledger.join(view)
            logger.info(
                "loaded %d global fragments from syncer %s (term %d), schedule clock %d",
                len(loaded),
                view.syncer[-8:],
                view.term,
                clock,
            )
            return True
        return False
