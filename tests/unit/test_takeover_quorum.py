"""The standby's takeover quorum (node.roles.syncer.takeover_quorum, lease_action): a lapsed lease is not enough."""

from __future__ import annotations

from node.diloco.lease import LeaseView, TakeoverWatch, lease_action, takeover_quorum

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


def _watch(enabled: bool = True) -> TakeoverWatch:
    return TakeoverWatch(enabled=enabled, heartbeat_ttl_s=2.0, lease_s=3.0, membership_refresh_s=1.0)


def test_watch_waits_for_fresh_heartbeats_then_refuses_a_minority_once() -> None:
    watch = _watch()
    watch.holders_read(["a", "b", "c", "d"], 100.0)
    watch.lease_seen(101.0)  # the lease was live at 101, then lapsed
    watch.holders_read(["a"], 102.0)  # too soon after the lapse: the others' heartbeats may not have expired
    assert watch.has_quorum() is None
    watch.holders_read(["a"], 104.5)  # a TTL and a refresh later, only one of four is still here
    assert watch.has_quorum() is False and watch.quorum == (1, 4)
    assert watch.first_refusal() and not watch.first_refusal()  # logged once per lapse
    watch.lease_seen(105.0)
    assert watch.first_refusal()  # a new lapse logs again


def test_watch_grants_a_majority_and_the_disabled_check() -> None:
    watch, off = _watch(), _watch(enabled=False)
    for w in (watch, off):
        w.holders_read(["a", "b", "c"], 100.0)
        w.lease_seen(101.0)
        w.holders_read(["a"], 104.5)
    assert watch.has_quorum() is False
    assert off.has_quorum() is True  # negative control: without the check a minority takes over
    watch.holders_read(["a", "b"], 105.0)
    assert watch.has_quorum() is True  # two of three
