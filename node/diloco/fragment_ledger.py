"""The holder's side of every fragment a `FragmentSync` syncs: parameters, counters and versions held, the
outbox of snapshots for the sender, the inbox of fetched versions, the contributions in flight.

Each method is one transition of that state, under one lock, so that the inner loop's thread (a step) and
the event loop's background loops (a push answered, a version fetched) never see it half-done. Pure: no
I/O, the clock is passed in; `FragmentSync` (node.diloco.sync_client) wires it to the network."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from node.diloco.counters import CounterBank
from node.diloco.fragments import FragmentPlan, FragmentSchedule, SyncFloor, covered_fragments
from node.diloco.send_timer import SendTimer
from node.diloco.sync_types import (
    FragmentVersion,
    OutgoingContribution,
    PushReceipt,
    SyncClientConfig,
    SyncStats,
    VersionsView,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Pending:
    """A contribution in flight: its merged version is applied at `apply_at` (send step + tau)."""

    base_version: int
    apply_at: int
    target_version: int | None = None  # known once the syncer acknowledged
    contribution: OutgoingContribution | None = None  # kept until answered, to re-send to a new syncer
    term: int | None = None  # term of the syncer that acknowledged it


def scheduled_fragments(
    plan: FragmentPlan, params: Mapping[str, torch.Tensor], schedule: FragmentSchedule
) -> list[int]:
    """The plan's fragments `params` cover, one per fragment of `schedule`; ValueError if they disagree."""
    fragment_ids = covered_fragments(plan, params)
    if not fragment_ids:
        raise ValueError("the parameters cover no fragment of the plan")
    if schedule.num_fragments != len(fragment_ids):
        raise ValueError(
            f"schedule has {schedule.num_fragments} fragments, the parameters cover {len(fragment_ids)}"
        )
    return fragment_ids


class HeldVersions:
    """The signed versions last applied, per local fragment, kept to offer a successor syncer that lacks
    them after a failover, and which of them were already offered to which syncer."""

    def __init__(self) -> None:
        self._held: dict[int, FragmentVersion] = {}
        self._offered: set[tuple[str, int, int]] = set()  # (syncer, fragment, version) already offered

    def keep(self, index: int, version: FragmentVersion) -> None:
        """Keep `version`'s signed frame (not its tensors: they are in the model now, and the frame holds them
        too: kept both, a learner held the model twice more beside its own)."""
        if version.envelope is not None:
            self._held[index] = replace(version, params={})

    def to_offer(self, view: VersionsView, fragments: Sequence[tuple[int, int]]) -> list[FragmentVersion]:
        """For each (global id, local index) in `fragments`, the version we hold, if another syncer (or
        term) published it and it was not offered to the syncer of `view` yet; marks them offered."""
        offers = []
        for fid, index in fragments:
            held = self._held.get(index)
            key = (view.syncer, fid, held.version if held is not None else -1)
            published_elsewhere = held is not None and (held.signer, held.term) != (view.syncer, view.term)
            if held is not None and published_elsewhere and key not in self._offered:
                offers.append(held)
                self._offered.add(key)
        return offers


class FragmentLedger:
    """State of the fragments `params` covers (local index i <-> global id `fragment_ids[i]`).

    Thread-safe: every public method takes `lock`; read the attributes under it."""

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        plan: FragmentPlan,
        schedule: FragmentSchedule,
        floor: SyncFloor,
        *,
        config: SyncClientConfig,
        clock: Callable[[], float],
        stats: SyncStats,
        keep_bases: bool = False,
    ) -> None:
        self.params = dict(params)
        self.plan = plan
        self.fragment_ids = scheduled_fragments(plan, self.params, schedule)
        self.schedule = schedule
        self.floor = floor
        self.config = config
        self.clock = clock
        self.stats = stats
        self.timer = SendTimer(schedule, self.fragment_ids, config, stats)
        self.local = {fid: i for i, fid in enumerate(self.fragment_ids)}
        self._names = [plan.fragments[fid].names for fid in self.fragment_ids]
        self.lock = threading.Lock()
        self.counters = CounterBank(len(self.fragment_ids))
        self.versions = [0] * len(self.fragment_ids)
        self.outbox: dict[int, OutgoingContribution] = {}
        self.pending: dict[int, Pending] = {}
        self.inbox: dict[int, FragmentVersion] = {}
        self._overwritten_at: dict[int, int] = {}  # fragment -> step a version overwrote unsent progress
        self.held = HeldVersions()
        # under a lossy outer codec, each fragment as its version last overwrote it: what a delta is taken from
        self.bases: dict[int, dict[str, torch.Tensor]] | None = (
            {i: self._copy(names) for i, names in enumerate(self._names)} if keep_bases else None
        )
        self.step = 0
        self.view: VersionsView | None = None  # the syncer's last versions answer
        self.rejoin_due = False  # lock-step modes: a round merged without us; the watcher realigns us
        # what the watcher fetched for a rejoin, applied on the inner loop's side (see `rejoin`)
        self.rejoin_with: list[FragmentVersion] | None = None

    # ---- the inner loop's side ----

    def after_inner_step(self, step: int, tokens: int) -> bool:
        """Count the step, apply due versions, snapshot due fragments; True if a snapshot was queued."""
        now = self.clock()
        with self.lock:
            self.timer.step_taken(now)
            self.step = step
            self.counters.record_step(tokens)
            self._apply_due(step)
            return self._snapshot_due(step, now)

    def apply_arrived(self, step: int) -> int:
        """Apply versions that arrived and are due at `step`; returns how many."""
        with self.lock:
            return self._apply_due(step)

    def blocked_at(self, step: int) -> list[int]:
        """Global ids of fragments whose round version is due by `step` but has not been applied."""
        with self.lock:
            return [self.fragment_ids[i] for i, p in self.pending.items() if p.apply_at <= step]

    def load(self, versions: Sequence[FragmentVersion], *, clock: int = 0) -> int:
        """Overwrite with global versions (counters reset), shift the schedule to the run's `clock`; returns
        how many were loaded."""
        loaded = 0
        with self.lock:
            for version in versions:
                index = self.local.get(version.fragment)
                if index is None or not self.fits(version):
                    continue
                self._overwrite(index, version)
                self.pending.pop(index, None)
                loaded += 1
            self.timer.offset = max(0, clock - self.step)
        return loaded

    def open_round(self) -> int:
        """`SendTimer.open_round` for the versions we hold."""
        with self.lock:
            return self.timer.open_round(self.versions)

    def held_versions(self) -> dict[int, int]:
        """Global fragment id -> version held."""
        with self.lock:
            return {fid: self.versions[i] for i, fid in enumerate(self.fragment_ids)}

    # ---- the watcher's side ----

    def join(self, view: VersionsView) -> int:
        """Put the schedule in phase with the run's versions (loaded first, `load`); returns the clock used."""
        with self.lock:
            self.view = view
        clock = self.open_round() if view.barrier else view.clock
        with self.lock:
            self.timer.offset = max(0, clock - self.step)
            self.timer.anchor(view, self.clock())  # in phase with the rounds from our first send
        return clock

    def observe(self, view: VersionsView) -> VersionsView | None:
        """Take a versions answer: anchor sends on its rounds, follow its clock; returns the previous one."""
        with self.lock:
            previous, self.view = self.view, view
            self.timer.anchor(view, self.clock())
            if not self.config.barrier and view.clock > 0:
                self.timer.follow(view.clock, self.step)
        return previous

    def known(self) -> list[int]:
        """What we already hold or have fetched, as a run-wide vector (unsynced fragments: the syncer's)."""
        with self.lock:
            view = self.view
            known = list(view.versions) if view is not None else [0] * self.plan.num_fragments
            for index, fid in enumerate(self.fragment_ids):
                inbox = self.inbox.get(index)
                known[fid] = max(self.versions[index], inbox.version if inbox is not None else 0)
        return known

    def store(self, fid: int, version: FragmentVersion) -> None:
        """Put a fetched version of fragment `fid` in the inbox, unless it is not newer than what we have."""
        if not self.fits(version):
            return
        with self.lock:
            index = self.local[fid]
            current = self.inbox.get(index)
            if version.version > self.versions[index] and (
                current is None or version.version > current.version
            ):
                self.inbox[index] = version

    def fits(self, version: FragmentVersion) -> bool:
        """Whether a version carries exactly our tensors of that fragment, with our shapes."""
        index = self.local.get(version.fragment)
        if index is None:
            return False
        names = self._names[index]
        ok = set(version.params) == set(names) and all(
            tuple(version.params[n].shape) == tuple(self.params[n].shape) for n in names
        )
        if not ok:
            logger.warning(
                "ignoring a version of fragment %d that does not fit our tensors", version.fragment
            )
        return ok

    def rejoin(self, fetched: Sequence[FragmentVersion]) -> None:
        """Lock-step modes, after a late contribution: load the fetched current versions and realign. The
        watcher calls this; the parameters are written by the inner loop's side at its next `after_inner_step`
        or `apply_arrived` (written here, a step's backward in flight failed: 'modified by an inplace
        operation', and the learner stopped)."""
        fitting = [v for v in fetched if self.fits(v)]
        with self.lock:
            self.rejoin_with = fitting
            self.rejoin_due = False

    def _rejoin_now(self, fetched: Sequence[FragmentVersion]) -> None:
        # `fetched` may be older than what we applied since the watcher fetched it (the inner loop went on
        # meanwhile): a version we hold is not loaded again (the steps since are for its open round), and a
        # newer one in the inbox is applied after this, by `_apply_due`
        for version in fetched:
            index = self.local[version.fragment]
            if version.version > self.versions[index]:
                self._overwrite(index, version)
        self._realign(self.step, "a contribution of ours was late")

    def resend_unanswered(self, view: VersionsView) -> tuple[int, int]:
        """A new syncer does not have the rounds of the old one. Decoupled: queue a fresh snapshot of every
        fragment we made progress on (all of it since our last overwrite, the outage included; a snapshot
        queued at a due time in the outage, or one the old syncer took and never answered, lacks the steps
        since, which the merge's overwrite would then discard). Else, and for a fragment without progress,
        queue again what the old syncer acknowledged but never answered (unless a newer snapshot is queued).
        Returns (fresh snapshots, re-queued contributions)."""
        fresh = requeued = 0
        with self.lock:
            now = self.clock()
            for index in range(len(self.fragment_ids)):
                if not self.config.barrier and self.counters[index].steps > 0:
                    self._snapshot(index, self.step, self.timer.sched_step(self.step), now)
                    fresh += 1
                    continue
                pending = self.pending.get(index)
                if pending is None or pending.contribution is None or pending.term == view.term:
                    continue
                if index in self.outbox:
                    continue
                self.outbox[index] = pending.contribution
                pending.target_version = None
                requeued += 1
        return fresh, requeued

    def offers(self, view: VersionsView, behind: Sequence[int]) -> list[FragmentVersion]:
        """`HeldVersions.to_offer` for the fragments (global ids) `behind`."""
        with self.lock:
            return self.held.to_offer(view, [(fid, self.local[fid]) for fid in behind])

    # ---- the sender's side ----

    def outbox_batch(self) -> list[tuple[int, OutgoingContribution]]:
        """The queued snapshots, oldest first."""
        with self.lock:
            return sorted(self.outbox.items(), key=lambda kv: kv[1].sent_step)

    def outbox_empty(self) -> bool:
        with self.lock:
            return not self.outbox

    def sched_step_now(self) -> int:
        with self.lock:
            return self.timer.sched_step(self.step)

    def refused(self, index: int, contribution: OutgoingContribution) -> None:
        """The syncer refused `contribution` for good: drop it, and the round we waited on for it."""
        with self.lock:
            if self.outbox.get(index) is contribution:
                del self.outbox[index]
            pending = self.pending.get(index)
            if pending is not None and pending.base_version == contribution.base_version:
                del self.pending[index]  # no round will answer it: never hold a barrier on it

    def acked(self, index: int, contribution: OutgoingContribution, receipt: PushReceipt) -> bool:
        """The syncer took `contribution`: note the version that will answer it. True if it said the
        contribution was late in a lock-step run (the watcher is to rejoin us to the open round)."""
        with self.lock:
            if self.outbox.get(index) is contribution:
                del self.outbox[index]
            late = receipt.late and self.config.barrier
            if late:
                self.rejoin_due = True
            pending = self.pending.get(index)
            if pending is not None and pending.base_version == contribution.base_version:
                pending.target_version = receipt.target_version
                pending.contribution = contribution
                # the term of the syncer that took it, not the one the watcher last saw: after a takeover the
                # sender may reach the new syncer first, and what it took must not be re-sent on the switch
                view = self.view
                pending.term = receipt.term if receipt.term is not None else (view.term if view else None)
        return late

    # ---- internals under the lock ----

    def _apply_due(self, step: int) -> int:
        if self.rejoin_with is not None:
            fetched, self.rejoin_with = self.rejoin_with, None
            self._rejoin_now(fetched)
        applied = 0
        missed = False
        for index in list(self.inbox):
            version = self.inbox[index]
            if version.version <= self.versions[index]:
                del self.inbox[index]  # older than what we hold: versions only move forward
                continue
            pending = self.pending.get(index)
            if pending is not None and step < pending.apply_at:
                continue  # tau overlap: the merged version is applied tau steps after the send
            del self.inbox[index]
            if pending is None and not self.config.barrier and self.counters[index].steps > 0:
                # we were behind the learners of that round (the paper's weight 0): our steps since our last
                # overwrite are lost; do not follow up with a near-empty send that would start another round
                self._overwritten_at[index] = step
            missed |= pending is None and self.config.barrier
            self._overwrite(index, version)
            applied += 1
            if pending is not None and (
                pending.target_version is None or version.version >= pending.target_version
            ):
                del self.pending[index]
        if missed and not self.pending:
            # lock-step: a round merged without us while we had nothing in flight (we were stopped and our
            # heartbeat expired); our place in the fragment cycle is now off the others', who wait on a round
            # that needs us while we would wait on another that needs them
            self._realign(step, "a round merged without us")
        return applied

    def _realign(self, step: int, why: str) -> None:
        """Lock-step modes: drop what was built on versions we have since replaced (each would be late in
        turn) and move our schedule to the earliest open round we have not sent to (the held versions and the
        rounds in flight say which), as a restarted learner does."""
        for index in list(self.pending):
            if self.pending[index].base_version < self.versions[index]:
                del self.pending[index]
        for index in list(self.outbox):
            if self.outbox[index].base_version < self.versions[index]:
                del self.outbox[index]
        # a round we sent to on the version we hold is not open for us any more. Counted open, a realign on versions
        # fetched before such a send put our schedule back before it; once the round's version came we sent the
        # fragment again, on that version: to its next round, ahead of another fragment's round that waited for
        # us while we waited at the barrier for ours (the elastic straggler deadlock)
        owed = [version + (index in self.pending) for index, version in enumerate(self.versions)]
        clock = self.timer.open_round(owed)
        self.timer.offset = clock - step  # the next step is the open round's send, either way
        self.stats.rejoins += 1
        logger.info("%s: schedule realigned to the earliest open round (step %d)", why, clock + 1)

    def _overwrite(self, index: int, version: FragmentVersion) -> None:
        with torch.no_grad():
            for name in self._names[index]:
                target = self.params[name]
                target.copy_(version.params[name].to(device=target.device, dtype=target.dtype))
        self.versions[index] = version.version
        self.counters.reset(index)
        if self.bases is not None:
            self.bases[index] = self._copy(self._names[index])
        self.held.keep(index, version)
        self.stats.applied += 1

    def _snapshot_due(self, step: int, now: float) -> bool:
        queued = False
        sched_step = self.timer.sched_step(step)
        for index in self.timer.due(step, now):
            overwritten = self._overwritten_at.pop(index, None)
            if overwritten is not None and step - overwritten < self.schedule.sync_every_steps // 2:
                self.stats.skipped += 1
                continue  # a few steps since a round we were late for: not worth a round of their own
            counters = self.counters[index]
            if counters.steps == 0 or not self.floor.may_send(index, now):
                continue  # nothing new to contribute, or too soon: counters keep growing until next time
            self._snapshot(index, step, sched_step, now)
            queued = True
        return queued

    def _snapshot(self, index: int, step: int, sched_step: int, now: float) -> None:
        counters = self.counters[index]
        self.floor.mark_sent(index, now)
        params = self._copy(self._names[index])
        self.outbox[index] = OutgoingContribution(
            fragment=self.fragment_ids[index],
            params=params,
            base_version=self.versions[index],
            steps=counters.steps,
            tokens=counters.tokens,
            sent_step=step,
            sched_step=sched_step,
            step_time_s=self.timer.step_time_s,
            seen_term=self.view.term if self.view is not None else 0,
            base=self.bases[index] if self.bases is not None else None,
        )
        self.pending[index] = Pending(
            base_version=self.versions[index], apply_at=self.schedule.apply_at(step)
        )

    def _copy(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {n: self.params[n].detach().to("cpu", copy=True) for n in names}

    # ---- reporting ----

    def status(self) -> dict[str, Any]:
        with self.lock:
            view = self.view
            return {
                "versions": {str(fid): self.versions[i] for i, fid in enumerate(self.fragment_ids)},
                **self.stats.counts(),
                "in_flight": len(self.outbox),
                "pending": len(self.pending),
                # per fragment: [base version, inner step it is applied at, version that answers it]
                "pending_rounds": {
                    str(self.fragment_ids[i]): [p.base_version, p.apply_at, p.target_version]
                    for i, p in self.pending.items()
                },
                "step": self.step,
                "sched_step": self.timer.sched_step(self.step),
                "syncer": view.syncer if view is not None else None,
                "syncer_term": view.term if view is not None else None,
                "step_time_s": round(self.timer.step_time_s, 4),
                "last_error": self.stats.last_error,
            }
