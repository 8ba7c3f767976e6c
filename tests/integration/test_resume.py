"""Whole-swarm resume across a change of operational settings, with real processes on loopback.

A bootstrap, a syncer and two learners train until several merges are checkpointed; then every process is
SIGKILLed at once. The owner raises the run's revision and changes operational settings (inner learning rate,
H); everything is restarted on the same state directories. The run id must not change, the syncer must resume
from its last checkpoint (no committed merge lost: a merge is committed once a checkpoint holding it is on disk),
and training must go on from there, the restarted learners applying the resumed versions.
"""

from __future__ import annotations

import signal
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from protocol.identity import NodeIdentity
from tests.integration.procs import (
    QUIET_LEARNER,
    Node,
    Procs,
    RunSpec,
    procs,
    read_events,
    run_cli,
    settle,
    wait_until,
    write_node_toml,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RUN = RunSpec(name="resume-test", seed=11)
LEARNER = {**QUIET_LEARNER, "min_step_s": 0.1, "join_timeout_s": 20.0}
SYNCER = {"recovery_s": 1.0, "checkpoint_every_merges": 1}
MAX_STEPS = 100_000


def start_swarm(group: Procs, root: Path, run_path: Path, syncer_key: Path) -> tuple[Node, list[Node]]:
    node_toml = write_node_toml(root / "node.toml", learner=LEARNER, syncer=SYNCER)
    bootstrap = group.start_bootstrap("--run", str(run_path), state="bootstrap")
    join = partial(group.join_node, bootstrap, config=node_toml, max_steps=MAX_STEPS)
    syncer = join("syncer", identity=syncer_key, state="syncer")
    learners = [join("learner", state=f"learner{i}", wait=False) for i in range(2)]
    for learner in learners:
        group.wait_node(learner)
    return syncer, learners


def kill_everything(group: Procs) -> None:
    pids = set()
    for proc in group.started:
        pids.add(proc.pid)
        proc.signal(signal.SIGKILL)
    settle(pids)


def resumed_from_checkpoint(
    syncer: Node, run_id: str, committed: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """The restarted syncer's status once it syncs, checked: same run, resumed from its checkpoint, and nothing
    committed lost (it serves at least what the last checkpoint held, fragment by fragment)."""
    resumed: dict[str, Any] = wait_until(
        lambda: (st := syncer.try_status()).get("state") == "syncing" and st.get("takeover_source") and st,
        timeout_s,
        what="the syncer resumes",
    )
    assert resumed["run_id"] == run_id  # the settings change kept the run and its checkpoints
    assert resumed["takeover_source"] == "checkpoint", resumed["takeover_source"]
    assert all(v >= c for v, c in zip(resumed["versions"], committed["versions"], strict=True)), (
        resumed["versions"],
        committed["versions"],
    )
    return resumed


def test_whole_swarm_resume_after_a_settings_change(tmp_path: Path) -> None:
    syncer_key = tmp_path / "syncer.key"
    spec = replace(RUN, authorized_syncers=(NodeIdentity.load_or_create(syncer_key).peer_id,))
    run_path = spec.write_run_toml(tmp_path / "run.toml")
    with procs(tmp_path) as group:
        syncer, _ = start_swarm(group, tmp_path, run_path, syncer_key)
        wait_until(lambda: syncer.try_status().get("merges", 0) >= 6, 120, what="six merges")
        wait_until(lambda: len(read_events(tmp_path / "syncer", "checkpoint")) >= 4, 30, what="checkpoints")
        run_id = syncer.status()["run_id"]
        kill_everything(group)
    committed: dict[str, Any] = read_events(tmp_path / "syncer", "checkpoint")[-1]
    merged_before = read_events(tmp_path / "syncer", "merge")
    print(
        f"\nkilled after {len(merged_before)} merges; last checkpoint holds versions {committed['versions']}"
    )

    changed = replace(spec, lr=0.002, sync_every_steps=12)
    run_path.write_text("revision = 1\n" + changed.toml())
    with procs(tmp_path) as group:
        syncer, learners = start_swarm(group, tmp_path, run_path, syncer_key)
        resumed = resumed_from_checkpoint(syncer, run_id, committed, timeout_s=60)
        start = sum(resumed["versions"])
        wait_until(lambda: sum(syncer.try_status()["versions"]) >= start + 4, 120, what="merges after resume")
        for learner in learners:
            held = wait_until(
                lambda learner=learner: (
                    (v := learner.try_status().get("versions")) and sum(v.values()) > start and v
                ),
                60,
                what="restarted learners apply resumed versions",
            )
            assert all(held[str(f)] >= c for f, c in enumerate(committed["versions"])), held
        export_the_running_syncer(tmp_path, syncer, learners[0], run_id)


def export_the_running_syncer(root: Path, syncer: Node, learner: Node, run_id: str) -> None:
    """`python -m node export --from URL` on the live syncer gives a folder transformers loads; a learner's URL
    has no checkpoint to give and says so."""
    base = syncer.status_url.removesuffix("/api/status")
    done = run_cli("node", "export", "--from", base, "--out", str(root / "hf"), root=root, timeout_s=120)
    assert done.returncode == 0, done.stderr
    assert f"run {run_id[:16]}" in done.stdout and "checkpoint syncer-" in done.stdout, done.stdout
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "hf")
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()
    refused = run_cli(
        "node", "export", "--from", learner.status_url.removesuffix("/api/status"), "--out",
        str(root / "none"), root=root, timeout_s=60,
    )  # fmt: skip
    assert refused.returncode != 0 and "not a syncer" in refused.stderr, refused.stderr
