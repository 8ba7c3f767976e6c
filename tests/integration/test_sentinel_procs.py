"""SENTINEL with real processes on loopback: bootstrap, syncer, 3 stages x 3 replicas, one verifier, each a
`python -m node` process; one middle-stage replica lies (`HIVENODE_UNSAFE_ATTACK`, random in both directions
after its first honest steps). It is banned by the verifier (a spot check recomputes its output on its stage
peers), the signed ban record reaches every honest node through the DHT (each one's `BanWatcher` emits
`ban_enforced`), the verifier routes around it and training goes on.

Slow (12 processes on 2 busy cores, a few minutes): `pytest -m slow tests/integration/test_sentinel_procs.py`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from protocol.identity import NodeIdentity
from tests.integration.procs import PIPELINE_RUN, Node, environment, procs, read_events, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

RUN = replace(PIPELINE_RUN, name="sentinel-procs", num_stages=3, num_layers=3)
STAGE_ENV = "context_timeout_s=30,compute_threads=1"
VERIFIER_ENV = (
    "microbatch_size=4,max_in_flight=4,eval_every_s=10,eval_batches=2,receipt_every_s=5,"
    "retry.hop_timeout_s=10,routing.failure_cooldown_s=30"
)
ATTACK = "random:direction=both,start_after=30"


def test_a_lying_replica_is_banned_on_every_honest_node_and_training_goes_on(tmp_path: Path) -> None:
    run_path = RUN.write_authorizing(tmp_path, syncers=["syncer"], verifiers=["verifier"])
    liar_id = NodeIdentity.load_or_create(tmp_path / "liar" / "identity.key")
    with procs(tmp_path) as group, environment(HIVENODE_STAGE=STAGE_ENV, HIVENODE_VERIFIER=VERIFIER_ENV):
        bootstrap = group.start_bootstrap("--run", str(run_path))
        syncer = group.join_node(bootstrap, "syncer", state="syncer", wait=False)
        honest: dict[str, Node] = {"syncer": syncer}
        for stage in range(3):
            for replica in range(3):
                if stage == 1 and replica == 0:
                    with environment(HIVENODE_UNSAFE_ATTACK=ATTACK):
                        liar = group.join_node(bootstrap, "stage", stage=1, state="liar", wait=False)
                    continue
                name = f"stage{stage}r{replica}"
                honest[name] = group.join_node(bootstrap, "stage", stage=stage, state=name, wait=False)
        verifier = group.join_node(bootstrap, "verifier", state="verifier", wait=False)
        for node in [*honest.values(), liar, verifier]:
            group.wait_node(node, timeout_s=180)

        def banned_by_verifier() -> bool:
            sentinel = verifier.status().get("sentinel") or {}
            return liar_id.peer_id in sentinel.get("banned", [])

        wait_until(banned_by_verifier, 420, what="the verifier bans the liar", interval_s=2.0)
        status = verifier.status()
        completed_at_ban = status["microbatches_completed"]
        ban = next(e for e in read_events(tmp_path / "verifier") if e.get("event") == "sentinel_ban")
        assert ban["offender"] == liar_id.peer_id, ban
        assert status["sentinel"]["banned"] == [liar_id.peer_id]  # nobody else

        # the signed DHT ban record reaches every honest node (stages refuse the liar, the syncer its fragments)
        def everyone_enforces() -> bool:
            return all(
                any(
                    e.get("event") == "ban_enforced" and e.get("offender") == liar_id.peer_id
                    for e in read_events(tmp_path / name)
                )
                for name in [*honest, "verifier"]
            )

        wait_until(everyone_enforces, 120, what="every honest node enforces the ban", interval_s=2.0)

        # traffic reroutes: the middle stage is served by its two honest replicas and training goes on
        wait_until(
            lambda: verifier.status()["microbatches_completed"] >= completed_at_ban + 40,
            240,
            what="40 more microbatches after the ban",
            interval_s=2.0,
        )
        status = verifier.status()
        assert liar_id.peer_id not in status["route"]
        assert status["sentinel"]["banned"] == [liar_id.peer_id]
        assert liar.popen.poll() is None  # banned, not crashed: the swarm routed around it
