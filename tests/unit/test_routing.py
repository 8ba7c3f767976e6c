"""Pure pipeline decisions on a fake clock: replica choice, cooldowns, retries, the idempotency ledger, placement and
rebalancing with hysteresis."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from node.pipeline.routing import (
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
    assert not policy.retry_elsewhere(HopFailure.DROPPED, 1)  # a dropped gradient: applied where it came from
    # a dropped activation: by default its microbatch is dropped; optionally another replica is asked
    assert not policy.retry_elsewhere(HopFailure.DROPPED, 1, forward=True)
    assert RetryPolicy(retry_dropped_forward=True).retry_elsewhere(HopFailure.DROPPED, 1, forward=True)
    assert policy.ask_same_again(HopFailure.TIMEOUT, 0) and not policy.ask_same_again(HopFailure.TIMEOUT, 1)
    assert not policy.ask_same_again(HopFailure.UNREACHABLE, 0)
    assert not policy.blames_replica(HopFailure.NO_CONTEXT) and policy.blames_replica(HopFailure.BAD_REPLY)
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError):
        RetryPolicy(timeout_growth=0.5)
    with pytest.raises(ValueError):
        RetryPolicy(hop_timeout_s=30.0, max_hop_timeout_s=10.0)


def test_a_timeout_is_slowness_not_death() -> None:
    policy = RetryPolicy(hop_timeout_s=5.0, timeout_growth=2.0, max_hop_timeout_s=30.0)
    router = ReplicaRouter(RoutingConfig(failure_cooldown_s=30.0, timeouts_before_cooldown=3))
    replicas = [replica("slow", throughput=1000), replica("other", throughput=1000)]
    router.record_success("slow", tokens=1000, seconds=1.0)
    router.record_success("other", tokens=1000, seconds=1.0)
    assert router.hop_timeout_s("slow", policy) == 5.0
    assert router.record_timeout("slow", now=0.0) == 0.0  # no cooldown: the only live replica may be this one
    assert not router.is_blocked("slow", 0.1) and not policy.excludes(HopFailure.TIMEOUT)
    assert router.hop_timeout_s("slow", policy) == 10.0  # the next request to it gets longer
    assert choose(router, replicas, now=0.1) == "other"  # but another replica is preferred meanwhile
    assert choose(router, replicas, now=0.1, exclude={"other"}) == "slow"
    router.record_timeout("slow", now=1.0)
    assert router.hop_timeout_s("slow", policy) == 20.0 and not router.is_blocked("slow", 1.1)
    assert router.record_timeout("slow", now=2.0) == 30.0  # three in a row: now it counts as a failure
    assert router.is_blocked("slow", 2.1) and router.hop_timeout_s("slow", policy) == 30.0  # capped
    router.record_success("slow", tokens=100, seconds=1.0)
    assert router.timeouts("slow") == 0 and router.hop_timeout_s("slow", policy) == 5.0
    assert policy.excludes(HopFailure.UNREACHABLE) and policy.excludes(HopFailure.BAD_REPLY)
    assert not policy.excludes(HopFailure.LOST)  # the stream broke: the replica may be fine (asked again)
    assert not policy.blames_replica(HopFailure.TIMEOUT)  # record_timeout decides that


def small_pipeline(
    peers: dict[str, int], transport_cls: type, retry: RetryPolicy, *, blocked: tuple[str, ...] = ()
):  # noqa: ANN201 - (driver, services by name)
    """A 2-stage pipeline in process through the real stage and driver code; replicas named by `peers`."""
    from node.pipeline.driver import PipelineDriver
    from node.roles.stage import StageConfig, StageService, build_core
    from protocol.identity import NodeIdentity
    from protocol.manifest import InnerOptimizerSpec, RunManifest, WireSpec
    from protocol.pipeline import BoundaryShape

    verifier = NodeIdentity.generate()
    model = {"vocab_size": 256, "context_len": 16, "num_layers": 2, "width": 32, "num_heads": 2}
    run = RunManifest(
        model=model,
        num_stages=2,
        inner=InnerOptimizerSpec(batch_size=4),
        wire=WireSpec(max_batch=4),
        authorized_verifiers=(verifier.peer_id,),
    )
    services, names = {}, {}
    for name, stage in peers.items():
        identity = NodeIdentity.generate()
        core = build_core(run, "0" * 40, stage, StageConfig())
        services[identity.peer_id] = StageService(identity, "0" * 40, core, authorized=[verifier.peer_id])
        names[name] = identity.peer_id
    router = ReplicaRouter(RoutingConfig(failure_cooldown_s=30.0))
    for name in blocked:
        router.record_failure(names[name], now=0.0)
    driver = PipelineDriver(
        identity=verifier,
        run_id="0" * 40,
        num_stages=2,
        shape=BoundaryShape.from_manifest(run),
        transport=transport_cls(verifier.peer_id, services, names),
        replicas=lambda: [ReplicaInfo(peer_id=names[n], stage=s) for n, s in peers.items()],
        router=router,
        retry=retry,
        rng=random.Random(0),
        clock=lambda: 1.0,
    )
    return driver, {name: services[peer] for name, peer in names.items()}


def one_microbatch(driver) -> object:  # noqa: ANN001
    import asyncio

    import torch

    window = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: OpenMP's second thread only stalls on a busy machine
    try:
        return asyncio.run(driver.run_microbatch(1, window[:, :-1], window[:, 1:]))
    finally:
        torch.set_num_threads(threads)


BUSY_S = 8.0  # what a request to a loaded replica takes: more than the base hop timeout (5 s)


def scripted_transport(script: dict[tuple[str, str], list[str]]) -> type:
    """A DirectTransport whose named replicas fail as scripted per (name, rpc): "lost" (the stream ended after
    the request went out), "gone" (cannot be reached), "busy" (answers only to a caller that waits BUSY_S)."""
    import asyncio

    from node.pipeline.transport import DirectTransport
    from protocol.errors import StreamClosed

    class Scripted(DirectTransport):
        def __init__(self, caller: str, services: dict, names: dict[str, str]) -> None:
            super().__init__(caller, services)
            self.name_of = {peer: name for name, peer in names.items()}
            self.script = {key: list(steps) for key, steps in script.items()}

        async def call(self, peer_id: str, rpc: str, frame: bytes, *, timeout_s: float, **kw) -> bytes:  # noqa: ANN003
            steps = self.script.get((self.name_of[peer_id], rpc), [])
            step = steps.pop(0) if len(steps) > 1 else (steps[0] if steps else "ok")
            if step == "lost":
                raise StreamClosed("stream ended while reading the answer")
            if step == "gone":
                raise ConnectionError("connection refused")
            if step == "busy" and timeout_s < BUSY_S:  # the answer would come after the caller gave up
                raise asyncio.TimeoutError
            return await super().call(peer_id, rpc, frame, timeout_s=timeout_s, **kw)

    return Scripted


@pytest.mark.parametrize("growth", [2.0, 1.0])
def test_a_loaded_last_replica_that_needs_more_than_the_hop_timeout_still_completes(growth: float) -> None:
    """One live replica per stage (its twin was killed), answering only past the base timeout, as on a loaded box.

    With growing timeouts the microbatch completes; the negative control (growth 1: every try gets the base
    timeout, the behaviour before) abandons it."""
    busy = scripted_transport(
        {(n, rpc): ["busy"] for n in "sl" for rpc in ("stage.forward", "stage.backward")}
    )
    retry = RetryPolicy(max_attempts=3, hop_timeout_s=5.0, timeout_growth=growth)
    driver, services = small_pipeline({"s": 0, "l": 1}, busy, retry)
    outcome = one_microbatch(driver)
    if growth > 1:
        assert outcome.completed and driver.stats.double_applied == 0, outcome
        assert [s.core.counters.microbatches_applied for s in services.values()] == [1, 1]
    else:
        assert not outcome.completed and "no answer in 5 s" in (outcome.reason or ""), outcome


@pytest.mark.parametrize("growth", [2.0, 1.0])
def test_a_killed_holder_then_a_slow_survivor_still_completes_once(growth: float) -> None:
    """The failover test's sequence on a loaded box (tests/integration/test_pipeline.py): the stage-0 replica that
    holds the context is killed while its backward is in flight (answer lost; asked again: gone), the survivor
    rebuilds the context and then needs more than the base timeout to answer the backward.

    Before, the ask-again used up a try and the survivor got no ask-again of its own: the survivor's first timeout
    abandoned the microbatch. Now it completes, applied once, on the survivor. Negative control: growth 1."""
    script = {("victim", "stage.backward"): ["lost", "gone"], ("survivor", "stage.backward"): ["busy"]}
    retry = RetryPolicy(max_attempts=3, hop_timeout_s=5.0, timeout_growth=growth)
    driver, services = small_pipeline(
        {"victim": 0, "survivor": 0, "last": 1}, scripted_transport(script), retry, blocked=("survivor",)
    )
    outcome = one_microbatch(driver)
    if growth == 1:
        assert not outcome.completed, outcome
        return
    assert outcome.completed and driver.stats.double_applied == 0, outcome
    applied = {name: s.core.counters.microbatches_applied for name, s in services.items()}
    assert applied == {"victim": 0, "survivor": 1, "last": 1}
    assert [f["failure"] for f in outcome.failures] == ["answer lost", "unreachable", "timeout"]


@pytest.mark.parametrize("exclude_lost", [False, True])
def test_an_answer_lost_by_the_survivor_as_its_twin_dies_is_asked_again(exclude_lost: bool) -> None:
    """Seen in the failover test under load: the survivor's forward answer is lost (the stream ends) just as its
    twin is killed. Before, a lost answer left the survivor out of the hop's next tries, the dead twin was tried
    (unreachable), and the microbatch was abandoned with tries left. Negative control: a policy that excludes
    replicas after a lost answer, as before."""

    class Before(RetryPolicy):
        def excludes(self, failure: HopFailure) -> bool:
            return failure is not HopFailure.NO_CONTEXT

    script = {("survivor", "stage.forward"): ["lost", "ok"], ("victim", "stage.forward"): ["gone"]}
    retry = (Before if exclude_lost else RetryPolicy)(max_attempts=3, hop_timeout_s=5.0)
    driver, services = small_pipeline(
        {"survivor": 0, "victim": 0, "last": 1}, scripted_transport(script), retry, blocked=("victim",)
    )
    outcome = one_microbatch(driver)
    if exclude_lost:
        assert not outcome.completed and "no usable replica" in (outcome.reason or ""), outcome
        return
    assert outcome.completed and driver.stats.double_applied == 0, outcome
    applied = {name: s.core.counters.microbatches_applied for name, s in services.items()}
    assert applied == {"survivor": 1, "victim": 0, "last": 1}


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
    rebalancer = Rebalancer(RebalanceConfig(dwell_s=0.0, cooldown_s=0.0, empty_dwell_s=0.0), started_at=0.0)
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


def test_a_move_that_barely_changes_the_balance_is_not_made() -> None:
    """2 replicas against 1 on equal stages: moving one gives 1 against 2, about the same balance. At starve ratio
    0.5 this is the border, where a lone replica measured a little slow would set replicas moving back and forth;
    the gain rule asks a move to make the stages `min_gain` times better balanced."""
    rebalancer = Rebalancer(RebalanceConfig(dwell_s=0.0, cooldown_s=0.0), started_at=0.0)
    spans = [(0, 1), (1, 2)]
    for noise in (0.9, 0.95, 0.99):  # the lone replica of stage 1 measured up to 10 % slower: "starved"
        view = [replica("me", 0, 100), replica("p", 0, 100), replica("s", 1, 100 * noise)]
        move = rebalancer.decide(
            now=1.0, me="me", my_stage=0, my_throughput=100.0, replicas=view, spans=spans
        )
        assert move is None and "balance" in rebalancer.last_reason, (noise, rebalancer.last_reason)
    # negative control: without the gain rule (min_gain 1) the same view moves
    plain = Rebalancer(RebalanceConfig(dwell_s=0.0, cooldown_s=0.0, min_gain=1.0), started_at=0.0)
    view = [replica("me", 0, 100), replica("p", 0, 100), replica("s", 1, 90)]
    assert plain.decide(now=1.0, me="me", my_stage=0, my_throughput=100.0, replicas=view, spans=spans)
    # 3 against 1 on equal stages does move (1/3 -> 2/2)
    view = [replica("me", 0, 100), replica("p", 0, 100), replica("q", 0, 100), replica("s", 1, 100)]
    assert rebalancer.decide(now=1.0, me="me", my_stage=0, my_throughput=100.0, replicas=view, spans=spans)


def test_equal_replicas_of_the_donor_move_one_at_a_time() -> None:
    """Three equal replicas see stage 1 emptied: the first by peer id moves after the dwell, the next only a
    stagger later, and not at all once the first shows up on the starved stage (its arrival restarts the dwell)."""
    cfg = RebalanceConfig(dwell_s=5.0, cooldown_s=0.0, stagger_s=10.0)
    spans = [(0, 1), (1, 2)]
    names = ("a", "b", "c")
    rebalancers = {name: Rebalancer(cfg, started_at=0.0) for name in names}
    # measured throughputs jitter within the slow margin: every one of them is a candidate, ordered by id
    speeds = {"a": 101.0, "b": 99.0, "c": 100.0}
    view = [replica(n, 0, speeds[n]) for n in names] + [replica("d", 1, 0.0)]  # d: stage 1's last, just died

    def decide(name: str, now: float, replicas: list[ReplicaInfo]) -> int | None:
        move = rebalancers[name].decide(
            now=now, me=name, my_stage=0, my_throughput=speeds[name], replicas=replicas, spans=spans
        )
        return None if move is None else move.to_stage

    emptied = [r for r in view if r.peer_id != "d"]
    assert [decide(n, 0.0, emptied) for n in names] == [None, None, None]
    assert [decide(n, 5.0, emptied) for n in names] == [1, None, None]  # a first: its dwell is done
    assert "candidate 2" in rebalancers["b"].last_reason
    # a is now joining stage 1 (announced there, its estimate carried over): b and c restart their dwell
    moved = [replica("a", 1, 101.0), replica("b", 0, 99.0), replica("c", 0, 100.0)]
    for now in (6.0, 15.0, 16.0, 40.0):
        assert decide("b", now, moved) is None and decide("c", now, moved) is None
    assert rebalancers["b"].last_reason == "no stage is starved"
    # a newcomer that announces nothing yet restarts the dwell too: it gets `dwell_s` to be measured
    fresh = [replica("n", 1, 0.0), replica("b", 0, 99.0), replica("c", 0, 100.0)]
    rebalancers["b"] = Rebalancer(cfg, started_at=0.0)
    assert decide("b", 50.0, emptied[1:]) is None  # stage 1 empty: starved since 50
    assert decide("b", 54.0, fresh) is None and "starved for 0 s" in rebalancers["b"].last_reason
    assert decide("b", 58.0, fresh) is None  # 4 s since n arrived < dwell 5 s (9 s since stage 1 emptied)
    assert decide("b", 59.0, fresh) == 1  # still nothing measured at n after a full dwell: b goes too


def test_two_replicas_that_joined_one_stage_at_once_fill_the_empty_one_before_any_cooldown() -> None:
    """Two volunteers joining a fresh pipeline at the same moment both see no replica anywhere and both pick stage
    0; nothing flows through a pipeline missing a stage, so every throughput stays 0 and the throughput rule
    never calls stage 1 starved (the negative control below). The empty-stage rule moves the first by peer id
    after `empty_dwell_s`, though both joined (a move, for the cooldown) just now, and only it."""
    cfg = RebalanceConfig(cooldown_s=120.0, dwell_s=30.0, empty_dwell_s=5.0, stagger_s=30.0)
    spans = [(0, 2), (2, 4)]
    joined_at = 100.0
    view = [replica("a", 0, 0.0), replica("b", 0, 0.0)]
    rebalancers = {name: Rebalancer(cfg, started_at=joined_at) for name in ("a", "b")}

    def decide(name: str, now: float, replicas: list[ReplicaInfo] = view) -> int | None:
        move = rebalancers[name].decide(
            now=now, me=name, my_stage=0, my_throughput=0.0, replicas=replicas, spans=spans
        )
        return None if move is None else move.to_stage

    assert [decide(n, 110.0) for n in "ab"] == [None, None]  # stage 1 empty since 110: the dwell runs
    assert "no replica" in rebalancers["a"].last_reason
    assert [decide(n, 115.0) for n in "ab"] == [1, None]  # a goes, 15 s after it joined; b waits a stagger
    assert "candidate 2" in rebalancers["b"].last_reason
    moved = [replica("a", 1, 0.0), replica("b", 0, 0.0)]
    assert decide("b", 150.0, moved) is None  # a arrived: b stays for good
    # the lone replica of a stage never leaves it for an empty one (that would only move the hole)
    alone = Rebalancer(cfg, started_at=0.0)
    assert (
        alone.decide(now=999.0, me="a", my_stage=0, my_throughput=0.0, replicas=view[:1], spans=spans) is None
    )
    # negative control: with a replica on stage 1 that does nothing (as the empty stage would look to the
    # throughput rule), zero against zero is no starvation, so nobody would ever move
    idle = [*view, replica("c", 1, 0.0)]
    control = Rebalancer(cfg, started_at=0.0)
    assert (
        control.decide(now=999.0, me="a", my_stage=0, my_throughput=0.0, replicas=idle, spans=spans) is None
    )
    assert control.last_reason == "no stage is starved"


def test_one_slow_sample_does_not_sink_the_throughput_rebalancing_reads() -> None:
    """A replica that moved starts from its carried-over estimate; its new module's first call is slow (cold).
    Folded in as is, one such sample would cut the announced throughput 16x (the EMA takes a fifth of a 100x
    slower sample) and make the stage it just joined look starved; capped at 4x the estimate, it costs 38 %."""
    import time

    from node.roles.stage import StageConfig, build_core
    from protocol.manifest import RunManifest

    model = {"vocab_size": 256, "context_len": 16, "num_layers": 2, "width": 32, "num_heads": 2}
    core = build_core(RunManifest(model=model, num_stages=2), "0" * 40, 0, StageConfig(throughput_ema=0.2))
    assert core.throughput == 0.0
    core.assume_throughput(1000.0)
    assert core.throughput == pytest.approx(1000.0)
    core._measure(time.perf_counter() - 12.8, 1280, share=1.0)  # 10 ms per token: 100x slower than assumed
    assert core.throughput == pytest.approx(1000.0 / 1.6, rel=0.01)
    for _ in range(20):  # fast samples are taken as they come: the estimate recovers
        core._measure(time.perf_counter(), 1280, share=1.0)
    assert core.throughput > 1000.0


def test_auto_places_volunteers_of_a_pipeline_run_by_throughput_per_layer() -> None:
    from node.roles.registry import choose_role
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


def test_auto_never_puts_a_node_nobody_can_dial_on_a_stage_or_the_syncer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from node.roles.registry import choose_role
    from protocol.errors import ConfigError
    from protocol.identity import NodeIdentity
    from protocol.manifest import RunManifest

    model = {"vocab_size": 256, "context_len": 32, "num_layers": 2, "width": 64, "num_heads": 2}
    verifier, me = NodeIdentity.generate().peer_id, NodeIdentity.generate().peer_id
    run = RunManifest(model=model, num_stages=2, authorized_verifiers=(verifier,), authorized_syncers=(me,))
    pipeline = RunManifest(model=model, num_stages=2, authorized_verifiers=(verifier,))
    # negative control: the same node, dialable, would serve
    assert choose_role("auto", None, me, run, [], 0.0).role == "syncer"
    assert choose_role("auto", None, me, pipeline, [], 0.0).role == "stage"
    with caplog.at_level("INFO", logger="node.roles.registry"):
        as_client = choose_role("auto", None, me, pipeline, [], 0.0, client_mode=True)
    assert (as_client.role, as_client.stage) == ("learner", None)
    assert "client mode" in as_client.reason and "stage" in as_client.reason
    said = [r.getMessage() for r in caplog.records if "client mode" in r.getMessage()]
    assert len(said) == 1, said  # one log line says why
    assert choose_role("auto", None, me, run, [], 0.0, client_mode=True).role == "learner"
    # an explicit request is kept (the owner may run it behind a relay), with a warning
    assert choose_role("stage", 1, me, pipeline, [], 0.0, client_mode=True).stage == 1
    # reached only through a relay's small circuits: auto keeps it a learner too, an explicit stage is kept
    relayed = choose_role("auto", None, me, pipeline, [], 0.0, relayed=True)
    assert relayed.role == "learner" and "relay mode" in relayed.reason
    assert choose_role("stage", 1, me, pipeline, [], 0.0, relayed=True).stage == 1
    # a syncer nobody can dial would hold the lease and stall every learner: refused, saying what to open
    assert choose_role("syncer", None, me, run, [], 0.0).role == "syncer"  # control: dialable
    for undialable in ({"client_mode": True}, {"relayed": True}):
        with pytest.raises(ConfigError, match="--role syncer: peers cannot dial this node directly"):
            choose_role("syncer", None, me, run, [], 0.0, **undialable)


def test_when_a_whole_stage_is_cooling_down_its_untried_replicas_are_still_used() -> None:
    router = ReplicaRouter(RoutingConfig(failure_cooldown_s=30.0))
    replicas = [replica("a", throughput=1000), replica("b", throughput=100)]
    router.record_failure("a", now=0.0)
    router.record_failure("b", now=0.0)
    choice = router.choose(replicas, stage=0, tokens=64, now=1.0, rng=random.Random(0), exclude={"a"})
    assert choice is not None and choice.peer_id == "b" and "cooldown" in choice.reason
    assert choose(router, replicas, now=1.0, exclude={"a", "b"}) is None
    assert RetryPolicy().ask_same_again(HopFailure.LOST, 0)  # an answer lost in transit: ask the same replica


def test_a_replica_that_measured_slow_once_is_measured_again_and_without_the_reprobe_it_starves() -> None:
    def run(reprobe_after_s: float) -> Counter[str]:
        router = ReplicaRouter(RoutingConfig(measurement_weight=1.0, reprobe_after_s=reprobe_after_s))
        replicas = [replica("a", throughput=1000), replica("b", throughput=1000)]
        router.record_success("a", tokens=128, seconds=0.01)  # 12,800 tokens/s
        router.record_success("b", tokens=128, seconds=5.0)  # a cold first call: 26 tokens/s
        picks: Counter[str] = Counter()
        for step in range(120):  # a hop every 0.5 s for a minute, one at a time
            chosen = choose(router, replicas, now=step * 0.5)
            assert chosen is not None
            picks[chosen] += 1
            router.record_success(chosen, tokens=128, seconds=0.01)  # b is as fast as a once warm
        return picks

    with_reprobe = run(20.0)
    assert with_reprobe["b"] >= 20, with_reprobe  # re-measured after 20 s idle, then shares the load
    assert run(math.inf)["b"] == 0  # control: scored on its one slow answer, it never gets a hop again


def test_the_reprobe_skips_a_replica_that_holds_our_hops_and_keeps_its_own_clock() -> None:
    router = ReplicaRouter(RoutingConfig(reprobe_after_s=10.0))
    replicas = [replica("fast", throughput=10_000), replica("slow", throughput=10)]
    assert choose(router, replicas, now=0.0) == "fast"  # both first seen now
    assert choose(router, replicas, now=9.0) == "fast"
    assert choose(router, replicas, now=10.0) == "slow"  # idle 10 s: re-measured
    assert choose(router, replicas, now=11.0) == "fast"  # chosen at 10: its clock restarts
    router.started("slow")
    assert choose(router, replicas, now=25.0) == "fast"  # holds a hop of ours: no second probe meanwhile
    router.finished("slow")
    assert choose(router, replicas, now=25.0) == "slow"
