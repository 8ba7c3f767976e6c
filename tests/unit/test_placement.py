"""Placement and rebalancing on verifier-measured throughput (issue 18): a stage replica that lies about its
speed in its heartbeat steers neither where a new node goes nor which replicas move. Fake clock, no sockets;
each defence with its negative control (the clamp off: the lie wins)."""

from __future__ import annotations

import math

import pytest

from node.pipeline.routing import (
    Measurement,
    RebalanceConfig,
    Rebalancer,
    ReplicaInfo,
    effective_throughput,
    effective_throughputs,
)
from node.roles.registry import choose_role, measurements_of
from protocol.identity import NodeIdentity
from protocol.manifest import RunManifest
from protocol.records import Heartbeat, MeasuredRecord, MeasuredThroughputs, PeerRecord

NOW = 5_000.0
OFF = math.inf  # measured_slack = inf: the defence off


def test_an_announced_throughput_is_clamped_around_the_median_measured() -> None:
    assert effective_throughput(800.0, [], 4.0) == 800.0  # nobody measured it yet: as announced
    assert effective_throughput(800.0, [300.0], 4.0) == 800.0  # honest: compute-only, inside the band
    assert effective_throughput(30_000.0, [300.0], 4.0) == 1200.0  # a 100x lie: cut to 4x measured
    assert effective_throughput(1.0, [300.0], 4.0) == 75.0  # a deflating lie: raised to measured / 4
    assert effective_throughput(math.nan, [300.0], 4.0) == 75.0
    # the median of the verifiers: one verifier's odd figure moves nothing
    assert effective_throughput(30_000.0, [300.0, 310.0, 1e9], 4.0) == 1240.0
    assert effective_throughput(30_000.0, [300.0, 500.0], 2.0) == 800.0
    # negative control: the clamp off, the lie counts in full
    assert effective_throughput(30_000.0, [300.0], OFF) == 30_000.0


def test_only_fresh_measurements_count() -> None:
    replicas = [
        ReplicaInfo(peer_id="liar", stage=0, throughput=10_000.0),
        ReplicaInfo(peer_id="new", stage=1),
    ]
    old = Measurement(verifier="v1", sent_at=NOW - 121.0, rates={"liar": 100.0})
    assert (
        effective_throughputs(replicas, [old], now=NOW, slack=4.0, max_age_s=120.0)[0].throughput == 10_000.0
    )
    fresh = Measurement(verifier="v2", sent_at=NOW - 5.0, rates={"liar": 100.0})
    ahead = Measurement(verifier="v3", sent_at=NOW + 30.0, rates={"liar": 120.0})  # a clock a little ahead
    out = effective_throughputs(replicas, [old, fresh, ahead], now=NOW, slack=4.0, max_age_s=120.0)
    assert [r.throughput for r in out] == [440.0, 0.0]  # median 110 x 4; the unmeasured newcomer as announced
    assert [r.peer_id for r in out] == ["liar", "new"]


def test_a_replica_nobody_measured_yet_counts_at_most_slack_x_the_measured_ones() -> None:
    """A fresh identity announcing 100x is not measured until a verifier gets to it; meanwhile it counts at most
    slack x the median measured replica of its stage (of the run when its stage has none). Control: the clamp off,
    its announcement counts in full."""
    replicas = [
        ReplicaInfo(peer_id="a", stage=0, throughput=400.0),
        ReplicaInfo(peer_id="b", stage=0, throughput=400.0),
        ReplicaInfo(peer_id="m", stage=1, throughput=200.0),
        ReplicaInfo(peer_id="liar", stage=1, throughput=15_000.0),
        ReplicaInfo(peer_id="new", stage=0, throughput=400.0),
        ReplicaInfo(peer_id="far", stage=2, throughput=1e6),
    ]
    measured = [Measurement(verifier="v", sent_at=NOW, rates={"a": 300.0, "b": 320.0, "m": 150.0})]

    def throughputs(slack: float) -> dict[str, float]:
        out = effective_throughputs(replicas, measured, now=NOW, slack=slack, max_age_s=120.0)
        return {r.peer_id: r.throughput for r in out}

    defended = throughputs(4.0)
    assert defended["liar"] == 600.0  # 4 x stage 1's measured 150
    assert defended["new"] == 400.0  # an honest newcomer inside the band counts as announced
    assert defended["far"] == 1200.0  # stage 2 has no measured replica: 4 x the run's median (300)
    assert throughputs(OFF)["liar"] == 15_000.0  # negative control: the clamp off, the lie counts in full
    # nobody measured at all (a run's start): every announcement stands
    unmeasured = effective_throughputs(replicas, [], now=NOW, slack=4.0, max_age_s=120.0)
    assert [r.throughput for r in unmeasured] == [r.throughput for r in replicas]


MODEL = {"vocab_size": 256, "context_len": 32, "num_layers": 2, "width": 64, "num_heads": 2}
VERIFIER = NodeIdentity.generate().peer_id
RUN = RunManifest(model=MODEL, num_stages=2, authorized_verifiers=(VERIFIER,))  # one layer per stage


def stage_peer(peer_id: str, stage: int, throughput: float) -> PeerRecord:
    hb = Heartbeat(role="stage", stage=stage, throughput=throughput, state="serving")
    return PeerRecord(peer_id=peer_id, heartbeat=hb, expires_at=NOW + 10)


def test_a_lying_replica_does_not_send_newcomers_away_from_its_stage() -> None:
    """Stage 0 serves 400 tokens/s; the lone replica of stage 1 serves 150 but announces 100x that. The newcomer
    belongs on stage 1 (the bottleneck); the lie would send it to stage 0."""
    peers = [stage_peer("honest", 0, 400.0), stage_peer("liar", 1, 15_000.0)]
    record = MeasuredRecord(
        verifier=VERIFIER,
        measured=MeasuredThroughputs(rates={"honest": 300.0, "liar": 150.0}, sent_at=NOW - 3.0),
        expires_at=NOW + 10,
    )
    measured = measurements_of([record])
    defended = choose_role("stage", None, "me", RUN, peers, NOW, measured=measured)
    assert defended.stage == 1, defended.reason
    assert choose_role("auto", None, "me", RUN, peers, NOW, measured=measured).stage == 1
    # negative control: the clamp off (or no measurement at all), the lie steers the newcomer to stage 0
    off = RebalanceConfig(measured_slack=OFF)
    assert choose_role("stage", None, "me", RUN, peers, NOW, measured=measured, placement=off).stage == 0
    assert choose_role("stage", None, "me", RUN, peers, NOW).stage == 0
    # the bound: a lie inside the band still counts (slack 4 lets the liar count at 600 > 400)
    loose = RebalanceConfig(measured_slack=4.0)
    assert choose_role("stage", None, "me", RUN, peers, NOW, measured=measured, placement=loose).stage == 0


def test_a_lying_replica_does_not_hide_that_its_stage_is_starved() -> None:
    """Two replicas serve stage 0 at 1000 tokens/s; stage 1's one replica does 100 and announces 10,000. With the
    clamp, stage 1 is starved and one of stage 0's replicas moves; without it, nobody ever moves."""
    spans = [(0, 1), (1, 2)]
    announced = [
        ReplicaInfo(peer_id="me", stage=0, throughput=1000.0),
        ReplicaInfo(peer_id="p", stage=0, throughput=1000.0),
        ReplicaInfo(peer_id="liar", stage=1, throughput=10_000.0),
    ]
    measured = [Measurement(verifier=VERIFIER, sent_at=NOW, rates={"me": 800.0, "p": 800.0, "liar": 100.0})]

    def decide(slack: float) -> int | None:
        cfg = RebalanceConfig(dwell_s=0.0, cooldown_s=0.0, measured_slack=slack)
        *others, me = effective_throughputs(
            [*announced[1:], announced[0]], measured, now=NOW, slack=slack, max_age_s=cfg.measured_max_age_s
        )
        rebalancer = Rebalancer(cfg, started_at=0.0)
        move = rebalancer.decide(
            now=NOW, me="me", my_stage=0, my_throughput=me.throughput, replicas=[*others, me], spans=spans
        )
        return None if move is None else move.to_stage

    assert decide(4.0) == 1
    assert decide(OFF) is None  # negative control: the lie keeps honest capacity away from the bottleneck


def test_the_slack_is_at_least_one() -> None:
    with pytest.raises(ValueError, match="measured_slack"):
        RebalanceConfig(measured_slack=0.5)
    with pytest.raises(ValueError, match="measured_slack"):
        RebalanceConfig(measured_slack=math.nan)
    with pytest.raises(ValueError, match="measured_max_age_s"):
        RebalanceConfig(measured_max_age_s=0.0)


def test_the_announce_attack_is_only_ever_set_by_its_loud_variable(caplog: pytest.LogCaptureFixture) -> None:
    from verification.attacks import UNSAFE_ANNOUNCE_ENV, announce_factor_from_env

    assert announce_factor_from_env({}) == 1.0
    with caplog.at_level("WARNING", logger="verification.attacks"):
        assert announce_factor_from_env({UNSAFE_ANNOUNCE_ENV: "100"}) == 100.0
    assert "UNSAFE" in caplog.text
    for bad in ("0", "-2", "nan", "inf", "x"):
        with pytest.raises(ValueError):
            announce_factor_from_env({UNSAFE_ANNOUNCE_ENV: bad})
