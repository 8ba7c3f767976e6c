"""Which syncer is active: the lease decision of one look at the `syncer` records, and the takeover quorum
a standby needs (a lapsed lease may be a partition hiding a live holder). Pure: the role does the DHT reads."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocol.records import SyncerRecord


@dataclass(frozen=True, kw_only=True, slots=True)
class LeaseView:
    """What one look at the `syncer` records says, from one syncer's point of view."""

    live_active: tuple[SyncerRecord, ...]  # other authorized syncers with an unexpired active lease
    highest_term: int  # over every record seen


def lease_action(
    *, me: str, active: bool, term: int, view: LeaseView, vacant_looks: int, quorum: bool | None = True
) -> str:
    """renew | step_down | stand_by | take_over | no_quorum | wait. A standby takes over only after two looks
    in a row found no live active lease (`vacant_looks` counts them, this one included), so one missed DHT read
    cannot start a second primary, and only with `quorum` (see `takeover_quorum`; None: not known yet): a lapsed
    lease may be a partition hiding a live holder, and the smaller side must not start a second lineage."""
    rivals = [r for r in view.live_active if (r.state.term, me) > (term, r.peer_id)]
    if active:
        return "step_down" if rivals else "renew"
    if view.live_active:
        return "stand_by"
    if vacant_looks < 2 or quorum is None:
        return "wait"
    return "take_over" if quorum else "no_quorum"


def takeover_quorum(
    seen: Mapping[str, float], *, lease_seen_at: float | None, memory_s: float, fresh_after_s: float
) -> tuple[int, int]:
    """(live, members) for a standby deciding to take over; it may when `not members or 2 * live > members`.

    `seen` maps each learner/stage to when this standby last saw its heartbeat (local monotonic time);
    `lease_seen_at` is when it last saw a live lease. Members are the holders seen within `memory_s` before that;
    live are those seen at least `fresh_after_s` (a heartbeat's lifetime) after it, i.e. whose heartbeats were
    stored on this side after the lease vanished from it. A holder cut off with the lease holder can only be seen
    through heartbeats stored before the cut, so a standby with the minority never has a majority; two disjoint
    sides cannot both have one. Never having seen a lease (a fresh run) needs no quorum.
    """
    if lease_seen_at is None:
        return 0, 0
    members = [t for t in seen.values() if t >= lease_seen_at - memory_s]
    return sum(1 for t in members if t >= lease_seen_at + fresh_after_s), len(members)


class TakeoverWatch:
    """A standby's memory for `takeover_quorum`: when (the caller's monotonic clock) it last saw each learner or
    stage and a live lease (ours or not), the last (live, members) count, and whether it already refused a
    takeover during this lapse (so the refusal is logged once)."""

    def __init__(
        self, *, enabled: bool, heartbeat_ttl_s: float, lease_s: float, membership_refresh_s: float
    ) -> None:
        self.enabled = (
            enabled  # off: any lapsed lease may be taken over (the partition test's negative control)
        )
        # heartbeats stored after the lease lapsed can show who is still here only once a full TTL has passed
        self.fresh_after_s = heartbeat_ttl_s + membership_refresh_s
        self.memory_s = lease_s + heartbeat_ttl_s  # sightings older than this before the lease make no member
        self.holders_seen: dict[str, float] = {}
        self.lease_seen_at: float | None = None
        self.live_read_at = -math.inf  # when the live holders were last read
        self.quorum: tuple[int, int] = (0, 0)
        self.refused = False

    def lease_seen(self, now: float) -> None:
        self.lease_seen_at = now
        self.refused = False

    def holders_read(self, peers: Iterable[str], now: float) -> None:
        self.live_read_at = now
        for peer in peers:
            self.holders_seen[peer] = now
        if self.lease_seen_at is not None:  # older sightings can no longer make anyone a member
            horizon = self.lease_seen_at - self.memory_s
            self.holders_seen = {p: t for p, t in self.holders_seen.items() if t >= horizon}

    def has_quorum(self) -> bool | None:
        """Whether a standby may take over now; None until heartbeats stored since the lease lapsed could show."""
        self.quorum = takeover_quorum(
            self.holders_seen,
            lease_seen_at=self.lease_seen_at,
            memory_s=self.memory_s,
            fresh_after_s=self.fresh_after_s,
        )
        live_holders, members = self.quorum
        if not self.enabled or not members or 2 * live_holders > members:
            return True
        assert self.lease_seen_at is not None  # members are only counted relative to a lease seen
        return False if self.live_read_at >= self.lease_seen_at + self.fresh_after_s else None

    def first_refusal(self) -> bool:
        """True the first time a takeover is refused in this lapse."""
        first, self.refused = not self.refused, True
        return first
