"""Whole-swarm resume in the lock-step DiLoCo modes (`diloco.mode` "sync" and "elastic_sync"), real processes.

test_resume.py proves the resume for the default decoupled mode; a lock-step round waits for every learner
(sync: `sync_learners` of them; elastic_sync: every one the DHT says is alive), so a resume that left a round
waiting on learners or rounds from before the kill would stop the swarm for good. Here the same scenario runs in
each lock-step mode: a bootstrap, a syncer and two learners train until merges are checkpointed; one learner is
SIGSTOPped so that a round holds the other's contribution and waits, and then every process is SIGKILLed at
once; the owner raises the revision and changes operational settings (inner learning rate, H), and everything
restarts on the same state directories. The run id must not change, the syncer must resume from its last
checkpoint with at least its versions, lock-step rounds must go on with both learners in them, and the
restarted learners must apply the resumed versions.
"""

from __future__ import annotations

import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from protocol.identity import NodeIdentity
from tests.integration.procs import Node, procs, read_events, wait_until
from tests.integration.test_resume import RUN, kill_everything, resumed_from_checkpoint, start_swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

LEARNERS = 2  # start_swarm's; mode "sync" waits for exactly these (sync_learners = M)


def full_rounds_after(root: Path, t: float, learners: set[str]) -> int:
    """Merges since `t` (wall clock) that every one of `learners` took part in: a lock-step round."""
    return sum(
        set(m["participants"]) >= learners for m in read_events(root / "syncer", "merge") if m["t"] > t
    )


@pytest.mark.parametrize("mode", ["sync", "elastic_sync"])
def test_lockstep_whole_swarm_resume(tmp_path: Path, mode: str) -> None:
    syncer_key = tmp_path / "syncer.key"
    peer = NodeIdentity.load_or_create(syncer_key).peer_id
    spec = replace(RUN, mode=mode, sync_learners=LEARNERS, authorized_syncers=(peer,))
    run_path = spec.write_run_toml(tmp_path / "run.toml")
    with procs(tmp_path) as group:
        syncer, learners = start_swarm(group, tmp_path, run_path, syncer_key)
        wait_until(lambda: syncer.try_status().get("merges", 0) >= 4, 60, what="four lock-step merges")
        wait_until(lambda: len(read_events(tmp_path / "syncer", "checkpoint")) >= 3, 20, what="checkpoints")
        # the kill lands mid-round: with one learner stopped, a round holds the other's contribution and waits
        # (sync: for good; elastic_sync: until the stopped one's heartbeat expires, 2 s)
        learners[1].signal(signal.SIGSTOP)
        before = wait_until(
            lambda: (st := syncer.try_status()) and 1 in st.get("open_rounds", {}).values() and st,
            20,
            what="a half-full lock-step round",
            interval_s=0.05,
        )
        assert before["mode"] == mode, before["mode"]
        kill_everything(group)
    committed: dict[str, Any] = read_events(tmp_path / "syncer", "checkpoint")[-1]
    print(f"\n{mode}: killed; last checkpoint holds versions {committed['versions']}")

    run_path.write_text("revision = 1\n" + replace(spec, lr=0.002, sync_every_steps=12).toml())
    with procs(tmp_path) as group:
        restarted_at = time.time()
        syncer, learners = start_swarm(group, tmp_path, run_path, syncer_key)
        resumed = resumed_from_checkpoint(syncer, before["run_id"], committed, timeout_s=40)
        rounds_go_on(tmp_path, syncer, learners, resumed, restarted_at)
        first = min(m["t"] for m in read_events(tmp_path / "syncer", "merge") if m["t"] > restarted_at)
        print(
            f"{mode}: resumed at {resumed['versions']}, first merge {first - restarted_at:.1f} s after restart"
        )
        for learner in learners:
            held = wait_until(
                lambda learner=learner: (
                    (v := learner.try_status().get("versions"))
                    and sum(v.values()) > sum(resumed["versions"])
                    and v
                ),
                30,
                what="restarted learners apply resumed versions",
            )
            assert all(held[str(f)] >= c for f, c in enumerate(committed["versions"])), held


def rounds_go_on(root: Path, syncer: Node, learners: list[Node], resumed: dict[str, Any], t: float) -> None:
    """Versions advance past the resumed ones, in rounds that both restarted learners took part in (a round
    counting a learner from before the kill, or waiting for a round id the learners never reach, stalls here)."""
    ids = {learner.status()["peer_id"] for learner in learners}
    start = sum(resumed["versions"])
    try:
        wait_until(lambda: sum(syncer.try_status()["versions"]) >= start + 4, 60, what="merges after resume")
        wait_until(
            lambda: full_rounds_after(root, t, ids) >= 4, 30, what="lock-step rounds with both learners"
        )
    except AssertionError as e:  # what the syncer and each learner wait on, for the record
        states = [n.try_status().get("sync") for n in learners]
        raise AssertionError(
            f"{e}; syncer {syncer.try_status().get('open_rounds')}, learners {states}"
        ) from e
