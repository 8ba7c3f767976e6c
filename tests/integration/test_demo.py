"""`python -m node demo --duration`: a real swarm trains (the held-out loss of the global model falls), exits 0 with
report.json and plots, and leaves no process behind; with and without `--chaos`."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from protocol.identity import NodeIdentity
from protocol.manifest import parse_run_toml
from tests.integration.procs import Procs, _kill_if_ours, procs, run_cli, settle, wait_until
from tools.demo import ATTACK_START_AFTER, DemoConfig, attack_line, attack_outcome, plan_nodes, run_toml
from tools.proctree import descendants

pytestmark = pytest.mark.integration

# Startup (cold torch + hivemind imports of 5-6 processes on 2 busy cores) and shutdown come on top of --duration.
DEMO_BOUND_S = 300.0
JOIN_BOUND_S = 150.0  # the printed join line, run as a volunteer would: cold imports, join, 3 steps, leave


# ---- the plan (no processes) ----


def test_the_demo_run_authorizes_its_trusted_keys_and_plans_one_liar(tmp_path: Path) -> None:
    config = DemoConfig(out_dir=tmp_path, learners=1, stages=2, replicas=3, attack="random", chaos=True)
    nodes = plan_nodes(config)
    assert [n.name for n in nodes] == [
        "syncer1",
        "syncer2",
        "learner1",
        "stage0r1",
        "stage0r2",
        "stage0r3",
        "stage1r1",
        "stage1r2",
        "stage1r3",
        "verifier1",
    ]
    assert [n.name for n in nodes if n.attack] == ["stage0r3"] == [config.attacker]
    syncers = [NodeIdentity.generate().peer_id for _ in range(2)]
    verifier = NodeIdentity.generate().peer_id
    manifest = parse_run_toml(run_toml(config, syncers, [verifier]))
    assert set(manifest.authorized_syncers) == set(syncers) and manifest.authorized_verifiers == (verifier,)
    assert (manifest.num_stages, manifest.model["num_layers"], manifest.heartbeat_period_s) == (2, 2, 2.0)
    assert config.planned_workers == 4


def test_the_demo_says_whether_the_liar_was_banned(tmp_path: Path) -> None:
    config = DemoConfig(out_dir=tmp_path, stages=2, replicas=3, attack="random", learners=0)
    nodes = {"stage0r3": {"role": "stage", "stage": 0, "peer_id": "12D3KooWLiar"}}
    ban = {"offender": "12D3KooWLiar", "in_effect": True, "first_seen_s": 42.0, "reasons": ["spot check"]}
    other = {"offender": "12D3KooWHonest", "in_effect": True, "first_seen_s": 50.0, "reasons": ["flags"]}
    caught = attack_outcome(config, nodes, [ban])
    assert caught["banned"] and caught["first_seen_s"] == 42.0 and caught["honest_banned"] == []
    assert "BANNED 42 s into the run" in attack_line(caught) and "stage0r3" in attack_line(caught)
    missed = attack_outcome(config, nodes, [other])
    assert not missed["banned"] and missed["honest_banned"] == ["12D3KooWHonest"]
    line = attack_line(missed)
    assert (
        "NOT banned" in line
        and f"{ATTACK_START_AFTER} honest steps" in line
        and "honest replicas banned: 1" in line
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"learners": 0}, "nothing to train"),
        ({"stages": 1, "verifiers": 0}, "verifier"),
        ({"stages": 2, "replicas": 1, "attack": "random"}, "at least 3 replicas"),
        # 2 replicas: the per-stage ban cap (never below 2 working replicas) would make the liar unbannable
        ({"stages": 2, "replicas": 2, "attack": "random"}, "--replicas 3"),
        ({"duration_s": 0.0}, "--duration"),
    ],
)
def test_demo_config_rejects_what_cannot_run(tmp_path: Path, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DemoConfig(out_dir=tmp_path, **overrides)


# ---- real swarms ----


def run_demo(tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = tmp_path / "run"
    result = run_cli(
        "node", "demo", "--no-live", "--out", str(out), *args, root=tmp_path, timeout_s=DEMO_BOUND_S
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    report = json.loads((out / "report.json").read_text())
    for name in ("loss.png", "throughput.png", "merges.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "held-out loss" in result.stdout and "dashboard: http://127.0.0.1:" in result.stdout
    return report, result.stdout


def check_trained(report: dict) -> None:
    loss = report["held_out_loss"]
    # the seed model sits at about ln(256) = 5.5 nats; a minute of training takes it well below 4
    assert loss["start"] > 5.0, loss
    assert loss["end"] < loss["start"] - 1.0, loss
    assert report["merges"]["count"] > 0
    assert report["throughput"]["tokens"] > 0
    assert report["processes"]["left_behind"] == 0, report["processes"]


@pytest.mark.timeout(DEMO_BOUND_S + 30)
def test_demo_trains_and_reports(tmp_path: Path) -> None:
    report, stdout = run_demo(tmp_path, "--duration", "60", "--learners", "2")
    check_trained(report)
    assert report["run"]["learners"] == 2 and not report["run"]["chaos"]
    assert report["faults"]["injected"] == 0
    assert report["throughput"]["goodput_fraction"] is not None
    events = [json.loads(line) for line in (tmp_path / "run" / "swarm-events.jsonl").read_text().splitlines()]
    assert {"joined", "merge"} <= {e["kind"] for e in events}


@pytest.mark.timeout(DEMO_BOUND_S + 30)
def test_demo_with_chaos_survives_its_faults(tmp_path: Path) -> None:
    report, stdout = run_demo(tmp_path, "--duration", "75", "--chaos", "--seed", "3")
    check_trained(report)
    faults = report["faults"]
    assert faults["injected"] >= 2, faults
    assert faults["survived"] == faults["injected"], faults
    # each fault was said on the console as it happened (time, kind, target), and so was its recovery
    started = re.findall(r"^\[ *\d+ s\] fault: (kill|stall|kill the active syncer) (\S+) \(", stdout, re.M)
    ended = re.findall(r"^\[ *\d+ s\] recovery: (\S+) (restarted|resumed)", stdout, re.M)
    assert len(started) == len(ended) == faults["injected"], stdout
    assert {t for _, t in started} == {t for t, _ in ended}
    # ... and on the dashboard: the bootstrap's own events (what /api/swarm serves) carry them
    events_path = tmp_path / "run" / "state" / "bootstrap" / "swarm-events.jsonl"
    events = [json.loads(line) for line in events_path.read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds.count("fault") == kinds.count("recovery") == faults["injected"], kinds


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_long_chaos_run(tmp_path: Path) -> None:
    report, _ = run_demo(tmp_path, "--duration", "300", "--chaos", "--learners", "3")
    check_trained(report)
    assert report["faults"]["survived"] == report["faults"]["injected"] >= 6


@pytest.mark.timeout(DEMO_BOUND_S + JOIN_BOUND_S)
def test_ctrl_c_stops_the_demo_cleanly(tmp_path: Path) -> None:
    """Also: the "join this swarm" line it prints works as printed from a fresh shell (no venv activated, no
    PYTHONPATH, another directory), and the volunteer's clean leave is a `left` event in the bootstrap's events."""
    with procs(tmp_path) as group:
        demo = _start_demo(group, tmp_path)
        join = demo.wait_line(r"^join this swarm: (.+)$", timeout_s=180).group(1)
        demo.wait_line(r"^swarm up", timeout_s=180)
        peer_id = _join_as_a_volunteer(join, tmp_path / "volunteer")
        events_path = tmp_path / "run" / "state" / "bootstrap" / "swarm-events.jsonl"

        def departure() -> dict | None:
            events = [json.loads(line) for line in events_path.read_text().splitlines()]
            return next(
                (e for e in events if e.get("peer") == peer_id and e["kind"] in ("left", "lost")), None
            )

        gone = wait_until(departure, 30, what="the volunteer's departure in the bootstrap's events")
        assert (gone["kind"], gone["text"].endswith("left: announced leaving")) == ("left", True), gone
        demo.wait_line(r"held-out", timeout_s=60)  # the first progress line: the swarm is training
        demo.signal(signal.SIGINT)
        assert demo.wait_exit(90) == 0, demo.stderr()
        wait_until(lambda: any("report:" in line for line in demo.lines), 5, what="the report line")
    assert (tmp_path / "run" / "report.json").exists()


def _join_as_a_volunteer(printed: str, home: Path) -> str:
    """Run the printed join line (plus a few steps' bound) the way a newcomer would, in a fresh shell: a bare
    environment, its own home, another working directory; return its peer id once it has exited 0."""
    home.mkdir(parents=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "XDG_STATE_HOME": str(home / "state")}
    argv = [*shlex.split(printed), "--role", "learner", "--max-steps", "3", "--http", "127.0.0.1:0"]
    with (home / "stdout").open("w") as out, (home / "stderr").open("w") as err:
        popen = subprocess.Popen(
            argv, cwd=home, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
        )
    forked: set[int] = set()
    deadline = time.monotonic() + JOIN_BOUND_S
    while popen.poll() is None:  # poll, so we learn what it forks before it can orphan anything
        forked.update(descendants(popen.pid))
        if time.monotonic() > deadline:
            for pid in [popen.pid, *forked]:
                _kill_if_ours(pid, popen.pid)
            popen.wait()
            raise AssertionError(f"`{printed}` did not finish within {JOIN_BOUND_S} s")
        time.sleep(0.05)
    settle(forked)
    log = (home / "stderr").read_text()
    assert popen.returncode == 0, log[-3000:]
    assert "reached --max-steps 3" in log and "announced leaving" in log, log[-3000:]
    return NodeIdentity.load(home / "state" / "hivenode" / "node" / "identity.key").peer_id


def _start_demo(group: Procs, tmp_path: Path):
    from tests.integration.procs import PYTHON, Proc

    argv = [PYTHON, "-m", "node", "demo", "--no-live", "--out", str(tmp_path / "run"), "--learners", "1"]
    return group._spawn(Proc, "demo", argv)
