"""Which syncer is active: the lease decision of one look at the `syncer` records, and the takeover quorum
a standby needs (a lapsed lease may be a partition hiding a live holder). Pure: the role does the DHT reads."""

from __future__ import annotations

from collections.abc import Mapping
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
