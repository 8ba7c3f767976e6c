"""Pure pipeline decisions on a fake clock: replica choice, cooldowns, retries, the idempotency ledger, placement and
rebalancing with hysteresis."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from node.routing import (
    HopFailure,
    IdempotencyKey,
    IdempotencyLedger,
    LedgerConfig,
    Phase,
    RebalanceConfig,
    Rebalancer,
    ReplicaInfo,
    ReplicaRouter,
    RetryPolicy,
    RoutingConfig,
    StageLoad,
    Verdict,
    choose_stage,
    stage_loads,
)


def replica(peer: str, stage: int = 0, throughput: float = 0.0, queue: float = 0.0) -> ReplicaInfo:
    return ReplicaInfo(peer_id=peer, stage=stage, throughput=throughput, queue=queue)


def choose(router: ReplicaRouter, replicas: list[ReplicaInfo], now: float = 0.0, **kwargs) -> str | None:  # noqa: ANN003
    choice = router.choose(
        replicas, stage=kwargs.pop("stage", 0), tokens=128, now=now, rng=random.Random(0), **kwargs
    )
    return None if choice is None else choice.peer_id


# ---------------------------------------------------------------------------------------------------- replica choice


def test_the_faster_and_less_queued_replica_is_chosen() -> None:
    router = ReplicaRouter()
    assert choose(router, [replica("slow", throughput=100), replica("fast", throughput=1000)]) == "fast"
    # a 10x faster replica with 20 microbatches queued finishes later than an idle slow one
    assert (
        choose(router, [replica("slow", throughput=100), replica("fast", throughput=1000, queue=20)])
        == "slow"
    )
    assert choose(router, [replica("a", stage=1, throughput=5)], stage=0) is None  # wrong stage only


def test_our_own_measurement_beats_the_announcement_and_in_flight_work_counts() -> None:
    router = ReplicaRouter(RoutingConfig(measurement_weight=1.0))
    replicas = [replica("liar", throughput=1e6), replica("honest", throughput=1000)]
    assert choose(router, replicas) == "liar"
    router.record_success("liar", tokens=100, seconds=1.0)  # measured: 100 tokens/s, not a million
    assert choose(router, replicas) == "honest"
    for _ in range(30):
        router.started("honest")
    assert choose(router, replicas) == "liar"  # 31 of ours queued at 1000/s vs 1 at 100/s
    for _ in range(30):
        router.finished("honest")
    assert router.in_flight("honest") == 0 and choose(router, replicas) == "honest"


def test_equal_replicas_share_the_load() -> None:
    router = ReplicaRouter()
    replicas = [replica(p, throughput=500) for p in "abc"]
    rng = random.Random(1)
    picks = Counter(router.choose(replicas, stage=0, tokens=64, now=0.0, rng=rng).peer_id for _ in range(300))  # type: ignore[union-attr]
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 60


def test_failed_replicas_sit_out_a_doubling_cooldown_and_success_clears_it() -> None:
    router = ReplicaRouter(RoutingConfig(failure_cooldown_s=2.0, max_cooldown_s=5.0))
    replicas = [replica("a", throughput=1000), replica("b", throughput=10)]
    assert router.record_failure("a", now=100.0) == 2.0
    assert choose(router, replicas, now=101.9) == "b"
    assert choose(router, replicas, now=102.0) == "a"
    assert router.record_failure("a", now=102.0) == 4.0
    assert router.record_failure("a", now=102.0) == 5.0  # capped
    assert router.is_blocked("a", 106.9) and not router.is_blocked("a", 107.0)
    router.record_success("a", tokens=1, seconds=1.0)
    assert router.record_failure("a", now=200.0) == 2.0  # a success resets the doubling


def test_excluded_and_banned_replicas_are_skipped() -> None:
    router = ReplicaRouter()
    replicas = [replica("a", throughput=1000), replica("b", throughput=100), replica("c", throughput=10)]
    assert choose(router, replicas, exclude={"a"}) == "b"
    assert choose(router, replicas, exclude={"a"}, banned={"b"}) == "c"
    assert choose(router, replicas, exclude={"a", "c"}, banned={"b"}) is None


def test_unmeasured_silent_replicas_get_the_prior() -> None:
    router = ReplicaRouter(RoutingConfig(prior_throughput=300.0))
    new = replica("new", throughput=0.0)
    assert router.throughput(new) == 300.0
    assert choose(router, [new, replica("known", throughput=200.0)]) == "new"


# ---------------------------------------------------------------------------------------------------- retries


def test_retry_policy() -> None:
    policy = RetryPolicy(max_attempts=3, same_replica_retries=1)
    assert policy.retry_elsewhere(HopFailure.UNREACHABLE, 1) and policy.retry_elsewhere(HopFailure.TIMEOUT, 2)
    assert not policy.retry_elsewhere(HopFailure.UNREACHABLE, 3)
    assert not policy.retry_elsewhere(HopFailure.DROPPED, 1)  # a flagged activation is not re-sent elsewhere
    assert policy.ask_same_again(HopFailure.TIMEOUT, 0) and not policy.ask_same_again(HopFailure.TIMEOUT, 1)
    assert not policy.ask_same_again(HopFailure.UNREACHABLE, 0)
    assert not policy.blames_replica(HopFailure.NO_CONTEXT) and policy.blames_replica(HopFailure.BAD_REPLY)
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


# ---------------------------------------------------------------------------------------------------- idempotency


def key(mb: int, stage: int = 0, sender: str = "v", phase: Phase = Phase.BACKWARD) -> IdempotencyKey:
    return IdempotencyKey("run", sender, mb, stage, phase)


def test_a_key_is_applied_once_and_its_answer_cached() -> None:
    ledger = IdempotencyLedger()
    assert ledger.check(key(1)) is Verdict.NEW
    assert ledger.mark_applied(key(1), result="grad-1")
    assert ledger.check(key(1)) is Verdict.APPLIED and ledger.cached(key(1)) == "grad-1"
    assert not ledger.mark_applied(key(1), result="other") and ledger.cached(key(1)) == "grad-1"
    assert ledger.duplicates == 1
    # the same microbatch at another stage, direction or from another verifier is another key
    for other in (key(1, stage=1), key(1, phase=Phase.FORWARD), key(1, sender="w")):
        assert ledger.check(other) is Verdict.NEW


def test_eviction_never_reopens_a_double_application() -> None:
    ledger = IdempotencyLedger(LedgerConfig(capacity=3, max_cached_results=2))
    for mb in range(1, 6):
        assert ledger.mark_applied(key(mb), result=mb)
    assert len(ledger) == 3
    assert ledger.check(key(1)) is Verdict.STALE and ledger.check(key(2)) is Verdict.STALE  # evicted: floor
    assert not ledger.mark_applied(key(2))
    assert ledger.check(key(3)) is Verdict.APPLIED and ledger.cached(key(3)) is None  # result evicted first
    assert ledger.cached(key(5)) == 5
    assert ledger.check(key(6)) is Verdict.NEW
    assert ledger.check(key(1, sender="w")) is Verdict.NEW  # floors are per sender
    assert [k.microbatch for k in ledger.recent(2)] == [4, 5]


# ---------------------------------------------------------------------------------------------------- placement


SPANS = [(0, 1), (1, 4)]  # stage 1 holds three times the layers of stage 0


def test_a_new_node_goes_where_throughput_per_layer_is_least() -> None:
    replicas = [replica("a", 0, throughput=1000), replica("b", 1, throughput=2000)]
    loads = stage_loads(replicas, SPANS)
    assert [round(s.per_layer) for s in loads] == [1000, 667]
    assert choose_stage(loads)[0] == 1  # more total throughput, but less per layer
    empty = stage_loads([], SPANS)
    assert choose_stage(empty)[0] == 0  # ties: fewest replicas, then lowest index
    assert (
        choose_stage(
            [
                StageLoad(stage=0, num_layers=1, throughput=0, replicas=2),
                StageLoad(stage=1, num_layers=1, throughput=0, replicas=1),
            ]
        )[0]
        == 1
    )


def test_rebalancing_waits_out_the_dwell_and_the_cooldown() -> None:
    cfg = RebalanceConfig(check_period_s=1.0, starve_ratio=0.5, dwell_s=10.0, cooldown_s=30.0)
    rebalancer = Rebalancer(cfg, started_at=0.0)
    spans = [(0, 2), (2, 4)]
    crowded = [replica("me", 0, 1000), replica("p", 0, 1000), replica("q", 0, 1000), replica("s", 1, 100)]

    def decide(now: float, replicas: list[ReplicaInfo] = crowded) -> int | None:
        move = rebalancer.decide(
            now=now, me="me", my_stage=0, my_throughput=1000.0, replicas=replicas, spans=spans
        )
        return None if move is None else move.to_stage

    assert decide(20.0) is None and "dwell" in rebalancer.last_reason
    assert decide(29.9) is None
    assert decide(30.0) == 1  # starved since 20 s, dwell 10 s, cooldown since start 30 s
    rebalancer.moved(30.0)
    assert decide(45.0) is None and "dwell" in rebalancer.last_reason
    assert decide(55.0) is None and "cooldown" in rebalancer.last_reason


def test_the_imbalance_must_hold_continuously() -> None:
    rebalancer = Rebalancer(RebalanceConfig(dwell_s=10.0, cooldown_s=0.0), started_at=0.0)
    spans = [(0, 1), (1, 2)]
    starved = [replica("me", 0, 100), replica("p", 0, 100), replica("s", 1, 10)]
    fine = [replica("me", 0, 100), replica("p", 0, 100), replica("s", 1, 150)]

    def decide(now: float, replicas: list[ReplicaInfo]) -> bool:
        return (
            rebalancer.decide(
                now=now, me="me", my_stage=0, my_throughput=100.0, replicas=replicas, spans=spans
            )
            is not None
        )

    assert not decide(0.0, starved)
    assert not decide(8.0, fine)  # the starvation ended: its clock restarts
    assert not decide(9.0, starved) and not decide(18.0, starved)
    assert decide(19.0, starved)


def test_no_move_that_would_starve_the_donor_or_empty_a_stage() -> None:
    rebalancer = Rebalancer(RebalanceConfig(dwell_s=0.0, cooldown_s=0.0), started_at=0.0)
    spans = [(0, 1), (1, 2)]

    def reason(replicas: list[ReplicaInfo], me: str = "me", mine: float = 100.0) -> str | None:
        move = rebalancer.decide(
            now=1.0, me=me, my_stage=0, my_throughput=mine, replicas=replicas, spans=spans
        )
        return None if move is None else rebalancer.last_reason

    assert reason([replica("me", 0, 100), replica("s", 1, 0)]) is None  # the only replica of stage 0 stays
    assert "left with" in rebalancer.last_reason
    # 200 against 40 per layer: after a move, 100 against 140 is better balanced and nobody is starved
    assert reason([replica("me", 0, 100), replica("p", 0, 100), replica("s", 1, 40)]) is not None
    # stage 0 has 4 layers: it keeps 25 tokens/s/layer, stage 1 gets 120: the move would just flip the starvation
    long_first = [(0, 4), (4, 5)]
    move = rebalancer.decide(
        now=1.0,
        me="me",
        my_stage=0,
        my_throughput=100.0,
        spans=long_first,
        replicas=[replica("me", 0, 100), replica("p", 0, 100), replica("s", 1, 20)],
    )
    assert move is None and "starve stage 0" in rebalancer.last_reason
    # only the slowest replica of the donor stage moves, so replicas seeing the same view do not all jump
    three = [replica("me", 0, 100), replica("p", 0, 50), replica("q", 0, 100), replica("s", 1, 0)]
    assert reason(three) is None and "slower replica" in rebalancer.last_reason
    assert reason(three, me="p", mine=50.0) is not None
    assert reason([replica("me", 0, 100), replica("p", 0, 100)]) is not None  # an empty stage is starved


def test_auto_places_volunteers_of_a_pipeline_run_by_throughput_per_layer() -> None:
    from node.roles import choose_role
    from protocol.identity import NodeIdentity
    from protocol.manifest import RunManifest
    from protocol.records import Heartbeat, PeerRecord

    now = 1000.0
    model = {"vocab_size": 256, "context_len": 32, "num_layers": 3, "width": 64, "num_heads": 2}
    verifier = NodeIdentity.generate().peer_id
    run = RunManifest(model=model, num_stages=2, authorized_verifiers=(verifier,))  # spans: 2 layers, 1 layer

    def stage_peer(stage: int, throughput: float) -> PeerRecord:
        hb = Heartbeat(role="stage", stage=stage, throughput=throughput, state="serving")
        return PeerRecord(peer_id=NodeIdentity.generate().peer_id, heartbeat=hb, expires_at=now + 4)

    peers = [stage_peer(0, 150.0), stage_peer(1, 100.0)]  # 75 vs 100 tokens/s per layer
    choice = choose_role("auto", None, "me", run, peers, now)
    assert (choice.role, choice.stage) == ("stage", 0) and "per layer" in choice.reason
    assert choose_role("stage", None, "me", run, peers, now).stage == 0
    no_verifier = RunManifest(model=model, num_stages=2)
    assert choose_role("auto", None, "me", no_verifier, peers, now).role == "learner"


def test_when_a_whole_stage_is_cooling_down_its_untried_replicas_are_still_used() -> None:
    router = ReplicaRouter(RoutingConfig(failure_cooldown_s=30.0))
    replicas = [replica("a", throughput=1000), replica("b", throughput=100)]
    router.record_failure("a", now=0.0)
    router.record_failure("b", now=0.0)
    choice = router.choose(replicas, stage=0, tokens=64, now=1.0, rng=random.Random(0), exclude={"a"})
    assert choice is not None and choice.peer_id == "b" and "cooldown" in choice.reason
    assert choose(router, replicas, now=1.0, exclude={"a", "b"}) is None
    assert RetryPolicy().ask_same_again(HopFailure.LOST, 0)  # an answer lost in transit: ask the same replica
