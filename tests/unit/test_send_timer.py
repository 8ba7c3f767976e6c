"""The pure parts of FragmentSync, driven directly with a float for a clock: `SendTimer` (when each fragment
is due to be sent) and `FragmentLedger` (the holder's state: snapshots, the tau overlap, push answers)."""

from __future__ import annotations

import pytest
import torch

from node.diloco.fragment_ledger import FragmentLedger
from node.diloco.fragments import FragmentSchedule, SyncFloor, SyncFloorConfig, plan_fragments
from node.diloco.send_timer import SendTimer
from node.diloco.sync_types import (
    FragmentVersion,
    PushReceipt,
    SyncClientConfig,
    SyncStats,
    VersionsView,
)

# P = 2, H = 4: fragment 0 is due at steps 2, 6, 10, ...; fragment 1 at steps 4, 8, 12, ...
SCHEDULE = FragmentSchedule(num_fragments=2, sync_every_steps=4, overlap_steps=1)


def timer(**config: object) -> SendTimer:
    return SendTimer(SCHEDULE, [0, 1], SyncClientConfig(**config), SyncStats())  # type: ignore[arg-type]


def dated(versions: list[int], ages: list[float], xi: float) -> VersionsView:
    return VersionsView(versions=tuple(versions), term=1, syncer="s", ages=tuple(ages), step_time_s=xi)


def test_without_anchors_fragments_follow_the_step_schedule_shifted_to_the_runs_clock() -> None:
    t = timer()
    assert [t.due(step, 0.0) for step in range(1, 6)] == [[], [0], [], [1], []]
    t.offset = 1  # the run is one step ahead of us
    assert [t.due(step, 0.0) for step in range(1, 6)] == [[0], [], [1], [], [0]]
    assert t.sched_step(7) == 8


def test_a_small_lag_moves_the_schedule_only_after_agreeing_answers_by_the_smallest_of_them() -> None:
    t = timer(align_confirmations=3)
    t.follow(11, 10)
    t.follow(9, 10)  # the other sign: the votes start over
    t.follow(11, 10)
    t.follow(11, 10)
    assert t.offset == 0
    t.follow(11, 10)
    assert t.offset == 1
    t.follow(20, 10)  # a gross offset (>= H/2: a restart, a long stall) is taken at once
    assert t.offset == 10


def test_the_step_time_is_an_ema_of_inner_step_durations() -> None:
    t = timer(step_time_ema=0.5)
    t.step_taken(0.0)
    assert t.step_time_s == 0.0  # one step end says nothing yet
    t.step_taken(1.0)
    t.step_taken(3.0)
    assert t.step_time_s == pytest.approx(1.5)
    t.step_taken(2.0)  # a clock that went back: ignored
    assert t.step_time_s == pytest.approx(1.5)


def test_open_round_is_the_earliest_unmerged_send_minus_one() -> None:
    t = timer()
    assert t.open_round([0, 0]) == 1  # fragment 0's first send, at step 2, is next
    assert t.open_round([1, 0]) == 3  # fragment 0's second round (step 6) comes after fragment 1's first
    assert t.open_round([1, 1]) == 5


def test_an_anchored_send_is_due_h_minus_lead_step_times_after_publication_then_every_period() -> None:
    t = timer()
    t.anchor(dated([1, 0], [0.25, -1.0], xi=0.25), now=100.0)  # fragment 1 has no dated round yet
    assert t.due_at == {0: pytest.approx(100.5)}  # 100 - 0.25 + (4 - 1) * 0.25
    assert t.due(1, 100.4) == []
    assert t.due(1, 100.5) == [0]
    assert t.due_at[0] == pytest.approx(101.5)  # one period (H step times) later
    assert t.due(4, 100.6) == [1]  # the unanchored fragment still goes by steps
    assert t.due(1, 102.1) == []  # 0.6 s late, over half a period: a stall, not a send out of phase
    assert (t.stats.phase_skips, t.due_at[0]) == (1, pytest.approx(102.5))
    t.anchor(dated([1, 0], [0.25, -1.0], xi=0.25), now=102.2)  # the same version again: no move
    assert t.due_at[0] == pytest.approx(102.5)
    t.anchor(dated([2, 0], [0.0, -1.0], xi=0.25), now=102.2)  # a newer round re-anchors
    assert t.due_at[0] == pytest.approx(102.95)
    assert t.stats.anchored == 2


def test_lock_step_runs_and_undatable_or_absurd_step_times_anchor_nothing() -> None:
    t = timer(barrier=True)
    t.anchor(dated([1, 1], [0.1, 0.1], xi=0.25), now=0.0)
    assert t.due_at == {}
    t = timer()
    t.anchor(dated([1, 1], [0.1, 0.1], xi=1e-300), now=0.0)
    t.anchor(dated([1, 1], [0.1, 0.1], xi=0.0), now=0.0)  # unknown, and we have not stepped yet
    assert t.due_at == {}


# ---------------------------------------------------------------------------------------------- the ledger

SIZES = {"a": 2, "b": 3}
PLAN = plan_fragments(SIZES, 2, ())


def ledger(now: list[float], **config: object) -> FragmentLedger:
    params = {name: torch.zeros(size) for name, size in SIZES.items()}
    floor = SyncFloor(SyncFloorConfig(min_interval_s=0.0))
    return FragmentLedger(
        params,
        PLAN,
        SCHEDULE,
        floor,
        config=SyncClientConfig(**config),  # type: ignore[arg-type]
        clock=lambda: now[0],
        stats=SyncStats(),
    )


def merged(fragment: int, version: int, value: float) -> FragmentVersion:
    names = PLAN.fragments[fragment].names
    return FragmentVersion(
        fragment=fragment, version=version, params={n: torch.full((SIZES[n],), value) for n in names}
    )


def test_a_due_fragment_is_snapshotted_and_its_merge_applied_tau_steps_after_the_send() -> None:
    now = [0.0]
    book = ledger(now)
    assert not book.after_inner_step(1, tokens=10)
    assert book.after_inner_step(2, tokens=10)  # fragment 0 is due at step 2
    sent = book.outbox[0]
    assert (sent.base_version, sent.steps, sent.tokens, sent.sent_step) == (0, 2, 20, 2)
    assert book.outbox_batch() == [(0, sent)]
    assert not book.acked(0, sent, PushReceipt(target_version=1, term=1))
    assert book.outbox_empty() and book.pending[0].target_version == 1
    book.store(0, merged(0, 1, 1.0))  # the round's version arrives at once
    assert book.blocked_at(2) == [] and book.blocked_at(3) == [0]
    assert book.apply_arrived(2) == 0  # tau = 1: not before step 3
    assert book.apply_arrived(3) == 1
    name = PLAN.fragments[0].names[0]
    assert torch.equal(book.params[name], torch.ones(SIZES[name]))
    assert book.held_versions() == {0: 1, 1: 0} and book.counters[0].steps == 0 and not book.pending


def test_a_refused_contribution_holds_no_round_and_an_old_version_is_dropped() -> None:
    now = [0.0]
    book = ledger(now)
    book.after_inner_step(1, tokens=1)
    book.after_inner_step(2, tokens=1)
    book.refused(0, book.outbox[0])
    assert book.outbox_empty() and book.blocked_at(10) == []
    book.store(1, merged(1, 2, 5.0))
    book.store(1, merged(1, 1, 9.0))  # older than what the inbox has: not kept
    assert book.inbox[1].version == 2
    assert book.apply_arrived(3) == 1 and book.versions == [0, 2]


def test_a_rejoin_on_versions_fetched_before_our_send_does_not_send_that_fragment_again_to_the_next_round() -> (
    None
):
    """Lock-step: the watcher fetches the current versions for a rejoin (a contribution of ours was late), and
    before the inner loop applies them we send fragment 0 to its open round. Realigned on those versions as if
    that round were still ours to send, the schedule went back to the send we had made; once the round's
    version came we sent fragment 0 again, on it: to its next round, ahead of fragment 1's, which waits for
    us, while we waited at the barrier for fragment 0's (CI's elastic straggler deadlock)."""
    now = [0.0]
    book = ledger(now, barrier=True)
    current = [merged(0, 5, 1.0), merged(1, 5, 1.0)]  # rounds 1..5 of both fragments merged
    view = VersionsView(versions=(5, 5), term=1, syncer="s", barrier=True)
    book.load(current)
    assert book.join(view) == 21  # fragment 0's round 6 (step 22) is the earliest open one
    assert book.after_inner_step(1, tokens=1)
    sent = book.outbox[0]
    assert (sent.fragment, sent.base_version, sent.sched_step) == (0, 5, 22)
    book.acked(0, sent, PushReceipt(target_version=6, term=1))
    # then waits at the barrier (schedule step 23) for that round
    assert not book.after_inner_step(2, tokens=1)
    book.rejoin(current)  # fetched before that send, handed over after it
    book.apply_arrived(2)
    assert book.stats.rejoins == 1 and book.blocked_at(2) == [0]  # the round we sent to is still ours
    book.store(0, merged(0, 6, 2.0))
    assert book.apply_arrived(2) == 1 and book.blocked_at(2) == []
    step = 2
    while book.outbox_empty():
        step += 1
        book.after_inner_step(step, tokens=1)
    (index, following), *_ = book.outbox_batch()
    # the earliest open round: fragment 1's round 6 at schedule step 24, on version 5 and with all our steps on
    # it (a rejoin re-loads no version we hold); not fragment 0 on version 6 (its round 7, at step 26)
    assert (following.fragment, following.base_version, following.sched_step) == (1, 5, 24)
    assert following.steps == step
