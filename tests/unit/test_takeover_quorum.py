"""The standby's takeover quorum (node.roles.syncer.takeover_quorum, lease_action): a lapsed lease is not enough."""

from __future__ import annotations

from node.roles.syncer import LeaseView, lease_action, takeover_quorum

EMPTY = LeaseView(live_active=(), highest_term=1)


def _quorum(seen: dict[str, float], lease_seen_at: float | None) -> tuple[int, int]:
    return takeover_quorum(seen, lease_seen_at=lease_seen_at, memory_s=5.0, fresh_after_s=3.0)


def test_a_fresh_run_needs_no_quorum() -> None:
    assert _quorum({"a": 1.0}, None) == (0, 0)


def test_the_minority_side_of_a_partition_has_no_majority() -> None:
    # cut at t=100; the lease was last seen at 102 (its record outlived the cut); l0/l1 were last seen through
    # heartbeats stored before the cut, l2/l3 keep heart-beating on our side
    seen = {"l0": 101.5, "l1": 101.0, "l2": 110.0, "l3": 110.0}
    live, members = _quorum(seen, 102.0)
    assert (live, members) == (2, 4) and not 2 * live > members


def test_a_crashed_primary_with_every_learner_here_has_a_majority() -> None:
    seen = {"l0": 110.0, "l1": 110.0, "l2": 110.0}
    live, members = _quorum(seen, 102.0)
    assert (live, members) == (3, 3)


def test_stale_sightings_are_not_live_and_long_gone_peers_are_not_members() -> None:
    seen = {"recent": 104.0, "gone": 90.0, "here": 106.0}  # 104 < 102 + 3: stored before the lapse could show
    assert _quorum(seen, 102.0) == (1, 2)


def test_lease_action_waits_for_a_known_quorum_and_refuses_without_one() -> None:
    act = lease_action
    assert act(me="b", active=False, term=1, view=EMPTY, vacant_looks=2, quorum=None) == "wait"
    assert act(me="b", active=False, term=1, view=EMPTY, vacant_looks=2, quorum=False) == "no_quorum"
    assert act(me="b", active=False, term=1, view=EMPTY, vacant_looks=1, quorum=True) == "wait"
    assert act(me="b", active=False, term=1, view=EMPTY, vacant_looks=2, quorum=True) == "take_over"
    assert act(me="b", active=True, term=1, view=EMPTY, vacant_looks=2, quorum=False) == "renew"
