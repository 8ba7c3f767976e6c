"""Ban watching, run by every role: polls live peers' DHT ban records, aggregates them into a `BanList`
(`verification.bans.decide_bans`), publishes this node's queued notices, reports over-accusing verifiers.

A round reads at most `max_poll_peers` peers' records, in DHT reads of `poll_batch` peers, each batch on its own
deadline within the round's: under a heartbeat flood (thousands of fake peers) a round still folds in what the
batches it finished found, and the next round goes on from where it stopped (`poll_order`), where one read of
every peer at once timed out and kept nothing, round after round (issue 18 item 4).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from protocol.records import BanNotice
from verification.bans import (
    BanDecision,
    BanList,
    BanVote,
    decide_bans,
    suspicious_verifiers,
)
from verification.tap import EventSink

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from node.context import NodeContext


@dataclass(frozen=True, kw_only=True, slots=True)
class BanWatchConfig:
    poll_every_s: float = 5.0  # DHT ban reads this often
    ban_ttl_s: float = 3600.0  # expiration of the notices this node publishes
    timeout_s: float = 10.0  # one DHT round
    max_poll_peers: int = 512  # peers whose ban records one round reads (the others in the next rounds)
    poll_batch: int = 32  # peers per DHT read; a read that times out loses only its batch

    def __post_init__(self) -> None:
        for name in ("poll_every_s", "ban_ttl_s", "timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("max_poll_peers", "poll_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def poll_order(peers: Iterable[str], first: Iterable[str], after: str, limit: int) -> list[str]:
    """The peers one round reads, in order: `first` (the offenders we publish against), then the others in
    rotation, starting after `after` (where the previous round stopped), at most `limit` in all."""
    head = sorted(set(first))
    rest = sorted(set(peers) - set(head))
    start = bisect.bisect_right(rest, after)
    return (head + rest[start:] + rest[:start])[:limit]


class BanWatcher:
    """Every role's view of swarm-wide bans (see the module docstring); `is_banned` is the hook roles call."""

    def __init__(
        self,
        records: Any,  # protocol.dht_io.SwarmRecords
        *,
        authorized_verifiers: Collection[str],
        bans_required: int,
        run_id: str,
        config: BanWatchConfig | None = None,
        emit: EventSink | None = None,
        outbox: deque[BanNotice] | None = None,
        clock: Callable[[], float] = time.time,
        authorized_syncers: Collection[str] = (),
    ) -> None:
        self.records = records
        self.authorized = frozenset(authorized_verifiers)
        self.syncers = frozenset(authorized_syncers)  # they sign learner bans (evidence kind "contribution")
        self.required = bans_required
        self.run_id = run_id
        self.config = config or BanWatchConfig()
        self.emit = emit or (lambda event, **fields: None)
        self.outbox = outbox if outbox is not None else deque()
        self.clock = clock
        self.bans = BanList()
        self.published: dict[str, BanNotice] = {}
        self._published_at: dict[str, float] = {}  # offender -> when our notice was first queued
        self._suspicious: set[str] = set()
        self._cursor = ""  # the last peer the previous round read (rotation, see poll_order)
        self.batches_timed_out = 0

    def is_banned(self, peer_id: str) -> bool:
        return self.bans.is_banned(peer_id, self.clock())

    def active(self) -> frozenset[str]:
        return self.bans.active(self.clock())

    async def publish_pending(self) -> None:
        """Publish queued notices, and re-publish ours (a DHT node that lost the record gets it again) until
        `ban_ttl_s` after they were queued: the ban expires then, instead of being renewed for good."""
        now = self.clock()
        while self.outbox:
            notice = self.outbox.popleft()
            self.published[notice.offender] = notice
            self._published_at[notice.offender] = now
        for offender, at in list(self._published_at.items()):
            if now >= at + self.config.ban_ttl_s:
                del self._published_at[offender]
                self.published.pop(offender, None)
        for notice in list(self.published.values()):
            expiration = self._published_at[notice.offender] + self.config.ban_ttl_s
            try:
                ok = await asyncio.wait_for(
                    self.records.publish_ban(notice, expiration=expiration), self.config.timeout_s
                )
            except (asyncio.TimeoutError, OSError) as e:
                ok = False
                logger.warning("publishing the ban of %s failed: %r", notice.offender[-8:], e)
            if ok:
                logger.info("published ban notice against %s", notice.offender[-8:])

    async def _read(self, peers: Iterable[str]) -> Mapping[str, list[Any]]:
        """This round's ban records: batch by batch (`poll_order`) until the round's deadline."""
        config = self.config
        order = poll_order(peers, self.published, self._cursor, config.max_poll_peers)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.timeout_s
        found: dict[str, list[Any]] = {}
        for i in range(0, len(order), config.poll_batch):
            batch = order[i : i + config.poll_batch]
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                found.update(await asyncio.wait_for(self.records.list_bans(batch), left))
            except asyncio.TimeoutError:
                self.batches_timed_out += 1
                logger.warning("reading ban records of %d peers timed out; keeping the rest", len(batch))
                break
            finally:
                self._cursor = batch[-1] if batch[-1] not in self.published else self._cursor
        return found

    async def poll(self, peers: Iterable[str]) -> list[BanDecision]:
        """Read ban records of `peers` (a bounded part of them per round, see `_read`), fold the bans in effect
        into the list; returns the new ones."""
        found = await self._read(peers)
        votes = [
            BanVote(
                verifier=r.verifier,
                offender=offender,
                reason=r.notice.reason,
                evidence=r.notice.evidence,
                expires_at=r.expires_at,
                stage=r.notice.stage,
            )
            for offender, rows in found.items()
            for r in rows
        ]
        now = self.clock()
        decisions = decide_bans(
            votes,
            authorized=self.authorized,
            required=self.required,
            run_id=self.run_id,
            now=now,
            syncers=self.syncers,
        )
        fresh = self.bans.update(decisions, now)
        for d in fresh:
            logger.warning("peer %s is banned swarm-wide: %s", d.offender[-8:], d.reason)
            self.emit(
                "ban_enforced",
                offender=d.offender,
                verifiers=sorted(d.verifiers),
                reason=d.reason,
                proof=d.proof,
            )
        accusations = [v for v in votes if v.verifier in self.authorized]  # syncers' learner bans stand alone
        for verifier, count in suspicious_verifiers(accusations, required=self.required).items():
            if verifier not in self._suspicious:
                self._suspicious.add(verifier)
                self.emit("verifier_suspicious", verifier=verifier, lone_notices=count)
        return fresh

    async def run(self, stop: asyncio.Event, peers: Callable[[], Iterable[str]] | None = None) -> None:
        """Publish and poll until `stop`; `peers` gives the ids to check (default: the run's live peers)."""
        while not stop.is_set():
            try:
                await self.publish_pending()
                ids = list(peers()) if peers is not None else await self._live_peers()
                await self.poll(ids)
            except Exception as e:  # a failed round is retried next period; the supervisor logs crashes
                if isinstance(e, (AssertionError, TypeError, NameError, AttributeError)):
                    raise
                logger.warning("ban watch round failed: %r", e)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.poll_every_s)

    async def _live_peers(self) -> list[str]:
        try:
            return [p.peer_id for p in await self.records.list_peers(include_leaving=True)]
        except asyncio.TimeoutError:
            return []


def ban_watcher_for(ctx: NodeContext, *, outbox: deque[BanNotice] | None = None) -> BanWatcher:
    """A BanWatcher wired to a node's context (records, manifest, events)."""
    manifest = ctx.manifest
    return BanWatcher(
        ctx.records,
        authorized_verifiers=manifest.authorized_verifiers,
        authorized_syncers=manifest.authorized_syncers,
        bans_required=manifest.ban_quorum,
        run_id=ctx.run_id,
        emit=ctx.events.emit,
        outbox=outbox,
    )
