"""Quorum and grace-window policy on a fake clock, and the synchronous baselines it expresses."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.diloco.quorum import QuorumConfig, QuorumPolicy, counted_holders
from node.diloco.seniority import Seniority
from node.roles.syncer import SyncerConfig


def warmed(
    config: QuorumConfig, *, step: float = 1.0, quorum: float = 0.2, sync: float = 0.1
) -> QuorumPolicy:
    policy = QuorumPolicy(config)
    policy.observe_step(step)
    policy.observe_quorum(quorum)
    policy.observe_sync(sync)
    return policy


def test_waits_for_quorum_without_a_deadline() -> None:
    policy = warmed(QuorumConfig(min_quorum=2))
    decision = policy.decide(
        now=5.0, round_opened_at=4.0, num_received=1, num_expected=4, quorum_reached_at=None
    )
    assert decision.action == "wait" and decision.deadline is None
    assert "1/2" in decision.reason


def test_grace_window_formula_and_cap() -> None:
    # slack = 2 * 1.0 - 0.2 - 0.1 = 1.7; grace = 0.8 * 1.7 = 1.36, capped at one step.
    assert warmed(QuorumConfig()).grace_s() == pytest.approx(1.0)
    assert warmed(QuorumConfig(max_grace_steps=5.0)).grace_s() == pytest.approx(1.36)
    assert warmed(QuorumConfig(max_grace_steps=5.0, max_grace_s=0.5)).grace_s() == pytest.approx(0.5)
    # No slack left: no grace.
    assert warmed(QuorumConfig(), step=1.0, quorum=1.5, sync=0.6).grace_s() == 0.0
    # No step time observed yet: waiting cannot be shown to be free.
    assert QuorumPolicy(QuorumConfig()).grace_s() == 0.0
    assert warmed(QuorumConfig(grace_gamma=0.0)).grace_s() == 0.0


def test_grace_window_is_waited_and_never_exceeded() -> None:
    policy = warmed(QuorumConfig(max_grace_steps=5.0))
    opened, quorum_at = 100.0, 100.3
    grace = policy.grace_s()
    now, merged_at = quorum_at, None
    while merged_at is None:  # a fake clock stepping 10 ms at a time
        decision = policy.decide(now, opened, num_received=1, num_expected=4, quorum_reached_at=quorum_at)
        if decision.action == "merge":
            merged_at = now
        else:
            assert decision.deadline == pytest.approx(quorum_at + grace)
            now = round(now + 0.01, 10)
    assert quorum_at + grace <= merged_at < quorum_at + grace + 0.01 + 1e-9


def test_merges_at_once_when_everyone_expected_is_in() -> None:
    policy = warmed(QuorumConfig())
    decision = policy.decide(
        now=10.0, round_opened_at=9.0, num_received=4, num_expected=4, quorum_reached_at=9.5
    )
    assert decision.action == "merge" and "all 4" in decision.reason


def test_merges_at_quorum_when_no_grace() -> None:
    policy = QuorumPolicy(QuorumConfig())  # no EMA yet
    decision = policy.decide(
        now=3.0, round_opened_at=2.0, num_received=1, num_expected=8, quorum_reached_at=3.0
    )
    assert decision.action == "merge"


def test_synchronous_waits_for_every_registered_learner_even_dead_ones() -> None:
    policy = warmed(QuorumConfig.synchronous(4))
    # One of four learners is dead; membership says 3 alive and all 3 are in: still wait.
    decision = policy.decide(
        now=50.0, round_opened_at=0.0, num_received=3, num_expected=3, quorum_reached_at=None
    )
    assert decision.action == "wait" and decision.deadline is None
    decision = policy.decide(
        now=60.0, round_opened_at=0.0, num_received=4, num_expected=4, quorum_reached_at=60.0
    )
    assert decision.action == "merge"


def test_elastic_synchronous_waits_for_the_alive_set() -> None:
    policy = warmed(QuorumConfig.elastic_synchronous())
    assert policy.decide(5.0, 0.0, num_received=2, num_expected=3, quorum_reached_at=None).action == "wait"
    # The failure detector dropped the dead learner from the alive set: the three in are everyone.
    assert policy.decide(9.0, 0.0, num_received=2, num_expected=2, quorum_reached_at=9.0).action == "merge"
    assert policy.required(0) == 1


def test_ema() -> None:
    policy = QuorumPolicy(QuorumConfig(ema_alpha=0.5))
    assert policy.xi_step is None
    policy.observe_step(1.0)
    policy.observe_step(3.0)
    assert policy.xi_step == pytest.approx(2.0)
    with pytest.raises(ValueError):
        policy.observe_sync(-1.0)


def test_validation() -> None:
    with pytest.raises(ValueError):
        QuorumConfig(grace_gamma=1.0)
    with pytest.raises(ValueError):
        QuorumConfig(min_quorum=0)
    with pytest.raises(ValueError):
        QuorumConfig(ema_alpha=0.0)
    with pytest.raises(ValueError):
        QuorumConfig(wait_for_all_expected=True, ignore_expected=True)
    policy = warmed(QuorumConfig())
    with pytest.raises(ValueError, match="quorum_reached_at"):
        policy.decide(1.0, 0.0, num_received=1, num_expected=3, quorum_reached_at=None)
    with pytest.raises(ValueError, match="before"):
        policy.decide(1.0, 2.0, num_received=0, num_expected=3, quorum_reached_at=None)


@settings(max_examples=100, deadline=None)
@given(
    step=st.floats(0.001, 100.0),
    quorum=st.floats(0.0, 100.0),
    sync=st.floats(0.0, 100.0),
    gamma=st.floats(0.0, 0.99),
    cap_steps=st.floats(0.0, 3.0),
)
def test_grace_is_bounded_by_its_caps(
    step: float, quorum: float, sync: float, gamma: float, cap_steps: float
) -> None:
    policy = warmed(
        QuorumConfig(grace_gamma=gamma, max_grace_steps=cap_steps), step=step, quorum=quorum, sync=sync
    )
    grace = policy.grace_s()
    assert 0.0 <= grace <= cap_steps * step + 1e-12
    assert grace <= gamma * max(0.0, 2.0 * step - quorum - sync) + 1e-12


# ---- who counts as expected: proven holders, or anyone early in the round -------------------------------------


def _elastic_decision(counted: set[str], in_round: set[str], now: float, opened_at: float) -> str:
    """What an elastic synchronous round decides with `counted` live holders expected (as `_num_expected`)."""
    policy = QuorumPolicy(QuorumConfig.elastic_synchronous())
    num_expected = len(in_round) + len(counted - in_round)
    required = policy.required(num_expected)
    reached = opened_at if len(in_round) >= required else None
    return policy.decide(now, opened_at, len(in_round), num_expected, reached).action


def test_a_heartbeat_only_holder_is_not_waited_for_once_others_are_proven() -> None:
    merged_at = {"a": 0.0, "b": 1.0}  # the ghost heartbeats but never had a contribution merged
    live = {"a", "b", "ghost"}
    counted = counted_holders(
        live, merged_at.get, round_opened_at=10.0, now=10.5, proven_s=600.0, unproven_wait_s=30.0
    )
    assert counted == {"a", "b"}
    assert _elastic_decision(counted, {"a", "b"}, 10.5, 10.0) == "merge"
    # control: every live heartbeat counted (the behaviour before), the ghost stalls the round for good
    assert _elastic_decision(live, {"a", "b"}, 10_000.0, 10.0) == "wait"


def test_in_a_fresh_run_everyone_counts_for_unproven_wait_s_then_nobody() -> None:
    live = {"a", "b", "ghost"}

    def counted(now: float, wait_s: float) -> set[str]:
        return counted_holders(
            live, lambda _p: None, round_opened_at=10.0, now=now, proven_s=600.0, unproven_wait_s=wait_s
        )

    assert counted(12.0, 5.0) == live  # the first round waits for the learners starting with it
    assert _elastic_decision(counted(12.0, 5.0), {"a", "b"}, 12.0, 10.0) == "wait"
    assert counted(15.0, 5.0) == set()  # then merges what it holds
    assert _elastic_decision(counted(15.0, 5.0), {"a", "b"}, 15.0, 10.0) == "merge"
    assert counted(10_000.0, math.inf) == live  # inf: the ghost stalls a fresh run for good


def test_proof_expires_after_proven_s_and_no_round_means_everyone() -> None:
    merged_at = {"old": 0.0, "recent": 900.0}
    live = {"old", "recent"}
    late = counted_holders(
        live, merged_at.get, round_opened_at=950.0, now=1000.0, proven_s=600.0, unproven_wait_s=30.0
    )
    assert late == {"recent"}
    assert (
        counted_holders(
            live, lambda _p: None, round_opened_at=None, now=1000.0, proven_s=1.0, unproven_wait_s=0.0
        )
        == live
    )


def test_a_demoted_identity_has_no_merge_to_prove_itself_with() -> None:
    seniority = Seniority()
    seniority.observe_merge(["a", "b"], 5.0)
    seniority.demote("b", 6.0)
    assert seniority.last_merged("a") == 5.0 and seniority.last_merged("b") is None
    counted = counted_holders(
        {"a", "b"}, seniority.last_merged, round_opened_at=7.0, now=8.0, proven_s=600.0, unproven_wait_s=30.0
    )
    assert counted == {"a"}


def test_rounds_count_proven_holders_by_default_only_in_elastic_runs() -> None:
    auto = SyncerConfig()
    assert auto.count_holders == "auto"
    assert auto.counts_proven("elastic_sync")
    assert not auto.counts_proven("decoupled") and not auto.counts_proven("sync")
    assert SyncerConfig(count_holders="proven").counts_proven("decoupled")
    assert not SyncerConfig(count_holders="heartbeats").counts_proven("elastic_sync")
    with pytest.raises(ValueError, match="count_holders must be one of auto, proven, heartbeats"):
        SyncerConfig(count_holders="yes")
