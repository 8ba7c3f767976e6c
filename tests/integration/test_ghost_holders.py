"""Quorums count contributions, not heartbeats (issue 18, network findings): in an elastic synchronous run a
round waits for every live holder, and a heartbeat costs an identity nothing. A "ghost" learner heartbeats and
pushes honest work without the run's proof-of-work (`HIVENODE_UNSAFE_LEARNER_ATTACK=no_admission`), so none of
its pushes is ever taken. With the defence (the syncer's `counted_holders`: once a holder is proven by a merged
contribution, unproven ones are not waited for; the default, `count_holders = "auto"`, in elastic runs) the two
honest learners keep merging in lock-step. Negative control: the same swarm with the heartbeats counted for the
round's whole life (`count_holders = "heartbeats"`): once the ghost is seen, the rounds stall."""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from protocol.identity import NodeIdentity
from tests.integration.procs import (
    QUIET_LEARNER,
    Node,
    RunSpec,
    environment,
    procs,
    read_events,
    wait_until,
    write_node_toml,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RUN = RunSpec(name="ghost-test", seed=5, mode="elastic_sync")
LEARNER = {**QUIET_LEARNER, "min_step_s": 0.1, "join_timeout_s": 20.0}
SYNCER = {"recovery_s": 1.0, "unproven_wait_s": 3.0}
WINDOW_S = 20.0  # how long merges are counted once the ghost is seen and refused


def _refused(syncer: Node) -> int:
    return int((syncer.try_status().get("refusals") or {}).get("admission", 0))


def _ghost_run(root: Path, syncer_config: dict[str, Any]) -> tuple[int, set[str], str]:
    """Merges in the WINDOW_S after the ghost is live at the syncer and refused twice; every participant of
    those merges; the ghost's peer id."""
    key = root / "syncer.key"
    run = replace(RUN, authorized_syncers=(NodeIdentity.load_or_create(key).peer_id,))
    run_path = run.write_run_toml(root / "run.toml")
    node_toml = write_node_toml(root / "node.toml", learner=LEARNER, syncer=syncer_config)
    with procs(root) as group:
        bootstrap = group.start_bootstrap("--run", str(run_path))
        join = partial(group.join_node, bootstrap, config=node_toml, max_steps=100_000)
        syncer = join("syncer", identity=key, state="syncer")
        honest = [join("learner", state=f"l{i}", wait=False) for i in range(2)]
        with environment(HIVENODE_UNSAFE_LEARNER_ATTACK="no_admission"):
            ghost = join("learner", state="ghost", wait=False)
        for node in (*honest, ghost):
            group.wait_node(node)
        ghost_id = ghost.try_status()["peer_id"]
        wait_until(
            lambda: syncer.try_status()["live_holders"] >= 3 and _refused(syncer) >= 2 or None,
            90,
            what="the ghost live at the syncer, its pushes refused",
        )
        seen_at = time.time()
        time.sleep(WINDOW_S)  # a window to count merges in: what is measured is their absence or presence
        merges = [e for e in read_events(root / "syncer", "merge") if e["t"] > seen_at]
        assert syncer.try_status()["live_holders"] >= 3, "the ghost's heartbeat lapsed: nothing was tested"
    return len(merges), {p for m in merges for p in m["participants"]}, ghost_id


def test_a_heartbeat_only_learner_does_not_stall_elastic_rounds(tmp_path: Path) -> None:
    merges, participants, ghost = _ghost_run(tmp_path / "defended", SYNCER)
    print(f"\ndefended: {merges} merges in {WINDOW_S:g} s after the ghost was seen")
    assert merges >= 4 and ghost not in participants and len(participants) == 2

    control = {**SYNCER, "count_holders": "heartbeats"}
    stalled, _, _ = _ghost_run(tmp_path / "control", control)
    print(f"control (heartbeats counted): {stalled} merges in {WINDOW_S:g} s")
    assert stalled <= 1  # a round that opened before the ghost was seen may still close
