"""When each synced fragment of a `FragmentSync` is next due to be sent.

By the step schedule (`FragmentSchedule`) shifted to the run's clock, so that learners that send a fragment
at the same time land in the same round; or, decoupled, at a wall-clock time anchored on the publication of
the fragment's last round (`SendTimer.anchor`). Pure: the caller passes the time and holds the lock."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from node.diloco.fragments import FragmentSchedule
from node.diloco.sync_types import SyncClientConfig, SyncStats, VersionsView

logger = logging.getLogger(__name__)

# bounds on the step time a versions answer may anchor sends with (the syncer ignores reports above 600 s)
MIN_ANCHOR_STEP_S = 1e-3
MAX_ANCHOR_STEP_S = 600.0


class SendTimer:
    """The send times of the fragments `fragment_ids` (local index i <-> global id `fragment_ids[i]`).

    `offset` shifts our step count to the run's schedule step (`sched_step`); `step_time_s` is our recent
    mean inner-step time (the xi_step we report); `due_at` holds, decoupled, the anchored send times."""

    def __init__(
        self,
        schedule: FragmentSchedule,
        fragment_ids: Sequence[int],
        config: SyncClientConfig,
        stats: SyncStats,
    ) -> None:
        self.schedule = schedule
        self.fragment_ids = tuple(fragment_ids)
        self.config = config
        self.stats = stats
        self.offset = 0
        self.step_time_s = 0.0
        self._last_step_at: float | None = None
        self._votes: list[int] = []  # recent offsets to the run's clock, all of one sign
        # decoupled, per fragment: when its next send is due (our clock) and the version that anchored it; the
        # period is H step times of the run (see `anchor`)
        self.due_at: dict[int, float] = {}
        self._anchored: dict[int, int] = {}
        self._period_s = 0.0

    def sched_step(self, step: int) -> int:
        """Our schedule step (run-aligned) at local inner step `step`."""
        return step + self.offset

    def step_taken(self, now: float) -> None:
        """An inner step ended at `now`: fold its duration into the step-time EMA."""
        if self._last_step_at is not None:
            self._observe_step_time(now - self._last_step_at)
        self._last_step_at = now

    def _observe_step_time(self, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        alpha = self.config.step_time_ema
        prior = self.step_time_s
        self.step_time_s = seconds if prior == 0.0 else (1 - alpha) * prior + alpha * seconds

    def open_round(self, versions: Sequence[int]) -> int:
        """The schedule step at which the earliest unmerged round of a lock-step run opens, minus one.

        In the synchronous modes every round of fragment p merges exactly one send of each learner, so
        version v (`versions[i]`, per local index) means sends 1..v were merged and the next is number v+1."""
        nexts = [
            self.schedule.next_send(i, 0) + versions[i] * self.schedule.sync_every_steps
            for i in range(len(self.fragment_ids))
        ]
        return max(0, min(nexts) - 1)

    def due(self, step: int, now: float) -> list[int]:
        """Fragments due to be sent now: an anchored one once its send time has come (see `anchor`), the
        others by the step schedule shifted to the run's clock."""
        by_schedule = set(self.schedule.due_to_send(self.sched_step(step)))
        due = []
        for index in range(len(self.fragment_ids)):
            due_at = self.due_at.get(index)
            if due_at is None:
                if index in by_schedule:
                    due.append(index)
                continue
            if now < due_at:
                continue
            # the next send one period after this one's due time, not after now: lateness does not pile up
            late_s = now - due_at
            self.due_at[index] = due_at + self._period_s * (1 + int(late_s // self._period_s))
            if late_s >= self._period_s / 2:
                # a stall (SIGSTOP, a long pause) put us a period or more behind: the others sent long ago and
                # a send now would open a round of its own out of phase; wait for the next one (a version
                # that arrives in the meantime re-anchors us)
                self.stats.phase_skips += 1
                continue
            due.append(index)
        return due

    def anchor(self, view: VersionsView, now: float) -> None:
        """Time each fragment's next send from the publication of its current version (decoupled only).

        All learners see the same publications, so sends timed from them fall together on every round, and
        the phase error cannot build up from round to round as with a step count: a learner that steps 5 %
        slower than another drifts by H/20 steps per period on a step schedule, but here sends on time each
        period (in wall time; that is fewer of its own steps). The next send of fragment p is due
        `H - anchor_lead_steps` step times after its version was published (the round's first send came
        about the grace window, ~one step, before), with the step time the syncer reports (one for
        everyone, so that learners do not drift apart either), and every H step times after that until a
        newer version re-anchors it. A version the syncer cannot date (restored, adopted) anchors nothing."""
        if self.config.barrier or not self.config.anchor_rounds or len(view.ages) != len(view.versions):
            return
        xi = view.step_time_s if view.step_time_s > 0 else self.step_time_s
        if not (math.isfinite(xi) and MIN_ANCHOR_STEP_S <= xi <= MAX_ANCHOR_STEP_S):
            return  # unknown, or nonsense that would make the period overflow: keep the anchors we have
        h = self.schedule.sync_every_steps
        self._period_s = h * xi
        lead = min(self.config.anchor_lead_steps, h - 1)
        for index, fid in enumerate(self.fragment_ids):
            version, age = view.versions[fid], view.ages[fid]
            if (
                version <= 0
                or not (math.isfinite(age) and age >= 0)
                or version <= self._anchored.get(index, 0)
            ):
                continue
            due_at = now - age + (h - lead) * xi
            if due_at < now:  # published more than a period ago (a joiner, a long stall): the next period
                due_at = now + (due_at - now) % self._period_s
            self.due_at[index] = due_at
            self._anchored[index] = version
            self.stats.anchored += 1

    def follow(self, clock: int, step: int) -> None:
        """Keep our schedule in phase with the run's `clock` (we are at local step `step`): learners that send
        a fragment at the same time land in the same round (the grace window merges them together) instead
        of overwriting each other's unsent progress with every merge. A gross offset (a restart, a long
        stall) is taken at once; a small one once `align_confirmations` answers in a row agree on its sign,
        by the smallest among them, since the clock estimate jitters."""
        diff = clock - self.sched_step(step)
        gross = abs(diff) >= max(2, self.schedule.sync_every_steps // 2)
        votes = self._votes
        if diff == 0 or (votes and (diff > 0) != (votes[-1] > 0)):
            votes.clear()
        if diff != 0:
            votes.append(diff)
        if gross or len(votes) >= self.config.align_confirmations:
            shift = diff if gross else min(votes, key=abs)
            self.offset += shift
            votes.clear()
            logger.info("schedule re-aligned by %+d steps to the run's clock %d", shift, clock)
