"""The demo report: figures computed from a swarm history, the text, report.json and the plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from node.status.swarm_view import SwarmHistory, ViewConfig
from tools.report import (
    PLOT_NAMES,
    ReportInputs,
    build_report,
    fault_summary,
    held_out_summary,
    render_text,
    throughput_summary,
    write_plots,
    write_report,
)

T0 = 1000.0


def learner(peer_id: str, tokens: int, loss: float, now: float) -> dict[str, Any]:
    return {
        "peer_id": peer_id,
        "role": "learner",
        "stage": None,
        "state": "training",
        "throughput": 100.0,
        "tokens": tokens,
        "loss": loss,
        "sent_at": now,
    }


def simulated_history(merge_tokens: int | None = None) -> tuple[SwarmHistory, list[dict[str, Any]]]:
    """Two learners at 100 tok/s for 60 s; B is killed at 20 s and back at 30 s; merges every 5 s (described
    by the syncer with `merge_tokens` each when given); B banned for a while is not part of this run. Held-out
    loss falls from 5.5 to 3.0."""
    history = SwarmHistory(ViewConfig(sample_period_s=1.0))
    tokens = {"A": 0, "B": 0}
    versions = [0, 0]
    tape: list[dict[str, Any]] = []
    faults = [{"t": T0 + 20.0, "action": "kill", "target": "learner2", "peer": "B", "role": "learner"}]
    for i in range(61):
        now = T0 + i
        down = 20 <= i < 30
        tokens["A"] += 100 if i else 0
        if not down:
            tokens["B"] = 0 if i == 30 else tokens["B"] + (100 if i else 0)
        peers = [learner("A", tokens["A"], 5.0 - i / 30, now)]
        if not down:
            peers.append(learner("B", tokens["B"], 5.0 - i / 30, now))
        if i and i % 5 == 0:
            versions[i % 2] += 1
            if merge_tokens is not None:
                tape.append({"fragment": i % 2, "version": versions[i % 2], "tokens": merge_tokens})
        syncer = [{"peer_id": "SYNC", "versions": list(versions), "state": "active", "term": 0}]
        status = {"recent_merges": list(tape)}
        history.observe(
            {"time": now, "peers": peers, "bans": [], "syncer": syncer, "syncer_status": status}, now
        )
        if i % 10 == 0:
            history.add_eval(now, 5.5 - 2.5 * i / 60)
    return history, faults


def inputs(history: SwarmHistory, faults: list[dict[str, Any]], **overrides: Any) -> ReportInputs:
    values: dict[str, Any] = {
        "run": {"learners": 2, "chaos": True},
        "started_at": T0,
        "ended_at": T0 + 60.0,
        "history": history.history_json(),
        "events": history.events_json(),
        "faults": faults,
        "planned_workers": 2,
        "processes": {"started": 9, "peak_alive": 12, "left_behind": 0},
        "cpu": {"cores": 2, "cpu_s": 60.0, "wall_s": 60.0},
    }
    values.update(overrides)
    return ReportInputs(**values)


def test_held_out_summary() -> None:
    points = [{"t": T0 + t, "loss": loss} for t, loss in [(0, 5.5), (10, 5.2), (20, 4.9), (30, 4.0)]]
    summary = held_out_summary(points, T0, fall_nats=0.5)
    assert (summary["start"], summary["end"], summary["drop"]) == (5.5, 4.0, 1.5)
    assert summary["time_to_fall_s"] == 20.0 and summary["fell"]
    assert held_out_summary([], T0, 0.5)["start"] is None


def test_report_figures_from_a_simulated_run() -> None:
    history, faults = simulated_history()
    report = build_report(inputs(history, faults))
    loss = report["held_out_loss"]
    assert loss["start"] == 5.5 and loss["end"] == 3.0 and loss["time_to_fall_s"] == 20.0
    throughput = report["throughput"]
    assert throughput["tokens"] == 100 * 60 + 100 * 49  # B: down from 20 s, back at 30 s with a fresh counter
    assert throughput["healthy_tokens_per_s_per_peer"] == 100.0
    # 10,900 tokens over 60 s against 2 x 100 tok/s: the peers worked, but the syncer described no merge, so
    # goodput is unknown (never the tokens the heartbeats report)
    assert throughput["working_fraction"] == pytest.approx(10900 / 12000, abs=0.01)
    assert throughput["goodput_fraction"] is None and throughput["mean_goodput_tokens_per_s"] is None
    assert throughput["goodput_source"] == "merges not described"
    faults_out = report["faults"]
    assert faults_out["injected"] == 1 and faults_out["survived"] == 1
    assert faults_out["faults"][0]["t"] == 20.0 and faults_out["faults"][0]["came_back"]
    assert report["merges"]["count"] == 12
    assert report["cpu"]["mean_utilisation"] == 0.5
    assert report["duration_s"] == 60.0
    json.dumps(report)  # serializable as is


def test_a_fault_the_swarm_did_not_come_back_from_is_not_survived() -> None:
    faults = [
        {"t": 10.0, "action": "kill", "peer": "B"},
        {"t": 12.0, "action": "stall", "peer": "C"},
        {"t": 14.0, "action": "stall", "peer": "D"},
        {"t": 40.0, "action": "kill", "peer": "B"},
    ]
    merges = [{"t": 11.0, "fragment": 0}, {"t": 30.0, "fragment": 1}]
    events = [
        {"t": 12.5, "kind": "left", "peer": "B"},
        {"t": 20.0, "kind": "joined", "peer": "B"},
        {"t": 15.0, "kind": "straggling", "peer": "C"},  # C never recovers; D never showed the stall
    ]
    summary = fault_summary(faults, merges, events)
    assert [f["came_back"] for f in summary["faults"]] == [True, False, True, True]
    assert [f["survived"] for f in summary["faults"]] == [True, False, True, False]  # no merge after 40 s
    assert summary["by_action"] == {"kill": 2, "stall": 2}


def test_goodput_is_the_merged_tokens_and_zero_without_merges() -> None:
    history, faults = simulated_history(merge_tokens=1200)
    throughput = build_report(inputs(history, faults))["throughput"]
    # 12 merges of 1,200 tokens into one of 2 fragments each: 7,200 tokens against 12,000
    assert throughput["goodput_source"] == "syncer" and throughput["committed_tokens"] == 7200
    assert throughput["goodput_fraction"] == pytest.approx(7200 / 12000, abs=0.01)
    assert "tokens merged into the global model" in render_text(build_report(inputs(history, faults)))
    idle = {"t": [0.0, 1.0, 2.0], "throughput": [None, 500.0, 500.0], "goodput": [None, 0.0, 0.0]}
    summary = throughput_summary({**idle, "workers": [0, 1, 1], "goodput_source": "no merges yet"}, 1)
    assert summary["goodput_fraction"] == 0.0 and summary["mean_goodput_tokens_per_s"] == 0.0


def test_throughput_summary_without_any_work() -> None:
    summary = throughput_summary({"t": [0.0, 1.0], "throughput": [None, 0.0], "goodput": [None, 0.0]}, 2)
    assert summary["goodput_fraction"] is None and summary["mean_tokens_per_s"] is None


def test_text_json_and_plots(tmp_path: Path) -> None:
    history, faults = simulated_history()
    report = build_report(inputs(history, faults))
    text = render_text(report)
    assert "held-out loss      5.500 -> 3.000" in text
    assert "faults             1/1 survived" in text
    path = write_report(tmp_path, report)
    assert json.loads(path.read_text())["held_out_loss"]["end"] == 3.0
    paths = write_plots(report, history.history_json(), tmp_path, T0)
    assert sorted(p.name for p in paths) == sorted(PLOT_NAMES)
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_inputs_are_checked() -> None:
    history, faults = simulated_history()
    with pytest.raises(ValueError, match="ended_at"):
        inputs(history, faults, ended_at=T0 - 1)
