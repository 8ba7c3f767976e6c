"""Placement on verifier-measured throughput with real processes on loopback (issue 18).

A bootstrap, a verifier, two replicas of stage 0 ("honest-a", "honest-b") and one of stage 1 ("liar", which
announces 100x its throughput through `HIVENODE_UNSAFE_ANNOUNCE_FACTOR`). One replica against two on stages of one
layer each: stage 1 is the weaker, by the announcements and by the measurements alike (the last stage, with the
vocabulary head and the loss, is also the slower per replica here), so a new replica helps most there. Once the
verifier has measured the replicas and published its signed `measured` record, a node joins with `--role stage`
and no `--stage`:

* with the defence (the default `rebalance.measured_slack` = 2), the liar counts at no more than twice what the
  verifier measured of it, and the newcomer goes to stage 1, where it belongs;
* negative control: the same swarm, the newcomer's clamp off (`measured_slack = inf`): it believes the lie and
  goes to stage 0.

The first newcomer leaves (SIGTERM announces it) before the second joins, so both see the same swarm.
"""

from __future__ import annotations

import math
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from node.pipeline.routing import effective_throughput
from tests.integration.procs import (
    PIPELINE_RUN,
    Node,
    Procs,
    environment,
    procs,
    read_events,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

RUN = replace(PIPELINE_RUN, name="placement-test")
# no moves: the defence would (rightly) send an honest stage-0 replica to the starved stage 1 after the cooldown,
# changing the swarm under the newcomers (the rebalancer's use of the clamp is tests/unit/test_placement.py's)
STAGE_ENV = "context_timeout_s=30,compute_threads=1,join_timeout_s=20,rebalance_enabled=false"
VERIFIER_ENV = "microbatch_size=4,max_in_flight=2,eval_every_s=60,receipt_every_s=5,retry.hop_timeout_s=5"
LIE = 100.0


def seen_by(verifier: Node) -> dict[str, list[dict[str, Any]]] | None:
    """Each stage's replicas as the verifier sees them, once all three announce, the liar is measured, and the
    verifier has published records since."""
    status = verifier.try_status()
    replicas = status.get("replicas") or {}
    if [len(replicas.get(s, [])) for s in ("0", "1")] != [2, 1] or status.get("measured_published", 0) < 2:
        return None
    everyone = replicas["0"] + replicas["1"]
    ready = all(r["announced_throughput"] > 0 for r in everyone) and replicas["1"][0]["measured_throughput"]
    return replicas if ready else None


def stage_sum(replicas: list[dict[str, Any]], slack: float) -> float:
    """A stage's throughput as placement counts it (one layer per stage: per layer too)."""
    return sum(
        effective_throughput(r["announced_throughput"], [m] if (m := r["measured_throughput"]) else [], slack)
        for r in replicas
    )


def newcomer(group: Procs, bootstrap: Any, name: str) -> tuple[int, str]:
    """Join `--role stage` without `--stage`; the stage it was placed on and why (it then leaves)."""
    node = group.wait_node(group.join_node(bootstrap, "stage", state=name, wait=False), timeout_s=120)
    stage = int(node.status()["stage"])
    node.signal(signal.SIGTERM)
    assert node.wait_exit(60) == 0
    (joined,) = read_events(group.root / name, "joined")
    assert joined["stage"] == stage
    return stage, joined["why"]


def test_a_replica_lying_about_its_throughput_does_not_steer_newcomers(tmp_path: Path) -> None:
    run_path = RUN.write_authorizing(tmp_path, verifiers=["verifier"])
    with procs(tmp_path) as group, environment(HIVENODE_STAGE=STAGE_ENV, HIVENODE_VERIFIER=VERIFIER_ENV):
        bootstrap = group.start_bootstrap("--run", str(run_path))
        honest = [
            group.join_node(bootstrap, "stage", stage=0, state=n, wait=False)
            for n in ("honest-a", "honest-b")
        ]
        with environment(HIVENODE_UNSAFE_ANNOUNCE_FACTOR=str(LIE)):
            liar = group.join_node(bootstrap, "stage", stage=1, state="liar", wait=False)
        verifier = group.join_node(bootstrap, "verifier", state="verifier", wait=False)
        for node in (*honest, liar, verifier):
            group.wait_node(node, timeout_s=120)
        seen = wait_until(
            lambda: seen_by(verifier), 150, what="the replicas measured and published", interval_s=1
        )

        # the scenario is the one described: stage 1 really is the weaker, the lie says otherwise, the clamp holds
        figures = "; ".join(
            f"{r['peer_id'][-6:]} (stage {s}) announces {r['announced_throughput']:.0f}, measured "
            f"{r['measured_throughput'] or 0:.0f}"
            for s, rs in sorted(seen.items())
            for r in rs
        )
        print(f"\n{figures}")
        liar_claim = seen["1"][0]["announced_throughput"]
        assert liar_claim / LIE < stage_sum(seen["0"], math.inf) < liar_claim, figures
        assert stage_sum(seen["1"], 2.0) < stage_sum(seen["0"], 2.0), figures

        defended, why = newcomer(group, bootstrap, "fair")
        with environment(HIVENODE_STAGE=f"{STAGE_ENV},rebalance.measured_slack={math.inf}"):
            fooled, why_fooled = newcomer(group, bootstrap, "fooled")
        print(f"defence on: {why}\ndefence off: {why_fooled}")
        assert defended == 1, f"with the defence the newcomer went to stage {defended} ({why}): {figures}"
        assert fooled == 0, (
            f"negative control: without the clamp the lie should win ({why_fooled}): {figures}"
        )


# quick checks, no hole-filling (a heartbeat missed on a loaded box must not look like an empty stage)
REBALANCE_ENV = (
    "context_timeout_s=30,compute_threads=1,join_timeout_s=20,rebalance.check_period_s=1,rebalance.dwell_s=4,"
    "rebalance.stagger_s=3,rebalance.cooldown_s=5,rebalance.empty_dwell_s=600"
)


def test_a_replica_lying_about_its_throughput_does_not_hide_a_starved_stage(tmp_path: Path) -> None:
    """The same swarm, with rebalancing on. Stage 1's lone replica lies 100x; by the measurements it is starved
    (under half of stage 0's throughput per layer), so one of stage 0's two replicas should move there. "clamped"
    counts the liar at most twice its measured throughput and moves; negative control, in the same swarm:
    "believer" (its clamp off) sees no starved stage and stays, whatever the measurements say."""
    run_path = RUN.write_authorizing(tmp_path, verifiers=["verifier"])
    with procs(tmp_path) as group, environment(HIVENODE_STAGE=REBALANCE_ENV, HIVENODE_VERIFIER=VERIFIER_ENV):
        bootstrap = group.start_bootstrap("--run", str(run_path))
        with environment(HIVENODE_STAGE=f"{REBALANCE_ENV},rebalance.measured_slack={math.inf}"):
            believer = group.join_node(bootstrap, "stage", stage=0, state="believer", wait=False)
        clamped = group.join_node(bootstrap, "stage", stage=0, state="clamped", wait=False)
        with environment(HIVENODE_UNSAFE_ANNOUNCE_FACTOR=str(LIE)):
            liar = group.join_node(bootstrap, "stage", stage=1, state="liar", wait=False)
        verifier = group.join_node(bootstrap, "verifier", state="verifier", wait=False)
        for node in (believer, clamped, liar, verifier):
            group.wait_node(node, timeout_s=120)

        believed: list[str] = []  # the believer's reasons while the clamped replica had not moved yet
        reasons: list[str] = []  # and the clamped one's, for a failure's message

        def clamped_moved() -> bool:
            status = clamped.try_status()
            if status.get("moves", 0) >= 1:
                return True
            believed.append(str(believer.try_status().get("rebalance", "")))
            reasons.append(str(status.get("rebalance", "")))
            return False

        # 150 s timed out once in a fresh-clone CI run (2 loaded cores; SENTINEL flagged the clamped replica's
        # forwards all along as the two stage-0 replicas drifted apart, which lowers its measured throughput)
        try:
            wait_until(
                clamped_moved, 210, what="the clamped replica moving to the starved stage 1", interval_s=1
            )
        except AssertionError as e:
            raise AssertionError(f"{e}; its reasons meanwhile: {sorted(set(reasons))}") from None
        (move,) = read_events(tmp_path / "clamped", "stage_moved")
        assert (move["from_stage"], move["to_stage"]) == (0, 1), move
        assert believer.status()["moves"] == 0
        assert "no stage is starved" in believed, believed  # the lie hid the starvation from it
        print(f"\nclamped moved: {move['why']}; the believer's reasons meanwhile: {sorted(set(believed))}")
