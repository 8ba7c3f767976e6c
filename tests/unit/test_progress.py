"""The join's progress (node.status.progress) and its view (node.status.progress_view): phases in order, training
figures from the node's own status, an error with what to do next, a live line on a terminal and plain log lines
otherwise."""

from __future__ import annotations

import io
import logging

import pytest

from node.config import load_node_config
from node.status.progress import (
    DEFAULT_HINT,
    FAILED,
    PHASES,
    JoinProgress,
    merges_applied,
    next_hint,
    render_line,
)
from node.status.progress_view import ProgressView
from protocol.identity import NodeIdentity

MADDR = f"/ip4/127.0.0.1/tcp/4000/p2p/{NodeIdentity.generate().peer_id}"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_phases_go_forward_only() -> None:
    clock = Clock()
    progress = JoinProgress(clock)
    assert progress.snapshot().phase == "connecting" and progress.snapshot().step_index == 1
    progress.enter("manifest", "reached the swarm (relay)")
    progress.enter("connecting")  # a late report of an earlier phase changes nothing
    snap = progress.snapshot()
    assert (snap.phase, snap.step_index, snap.detail) == ("manifest", 2, "reached the swarm (relay)")
    assert render_line(snap).startswith("[2/5 manifest] reached the swarm (relay)")
    with pytest.raises(ValueError):
        progress.enter("downloading everything")
    assert PHASES == ("connecting", "manifest", "tokenizer/data", "state load", "training")


def test_the_node_status_moves_it_to_training_with_steps_per_second_tokens_loss_and_merges() -> None:
    clock = Clock()
    progress = JoinProgress(clock)
    progress.enter("tokenizer/data")
    progress.observe({"role": "learner", "state": "joining", "inner_step": 0})
    assert progress.snapshot().phase == "state load"
    status = {
        "role": "learner",
        "state": "training",
        "inner_step": 10,
        "tokens": 12_800,
        "loss": 3.25,
        "versions": {"0": 2, "1": 1},
        "connectivity": {"mode": "relay", "reason": "not reachable, using relay"},
    }
    clock.now += 10
    progress.observe(status)
    clock.now += 5
    progress.observe({**status, "inner_step": 20})  # 10 steps in 5 s
    snap = progress.snapshot()
    assert snap.phase == "training" and snap.step_index == 5
    assert snap.steps_per_s is not None and 0.5 < snap.steps_per_s <= 2.0
    assert (snap.tokens, snap.loss, snap.merges, snap.connectivity) == (12_800, 3.25, 3, "relay")
    line = render_line(snap)
    for part in (
        "[5/5 training]",
        "step 20",
        "steps/s",
        "12.8k tokens",
        "loss 3.250",
        "3 merges applied",
        "relay",
    ):
        assert part in line, line


def test_merges_of_a_stage_come_from_its_diloco_section() -> None:
    assert merges_applied({"diloco": {"versions": {"0": 4}}}) == 4
    assert merges_applied({"state": "training"}) is None


def test_an_error_says_what_to_do_next() -> None:
    progress = JoinProgress(Clock())
    progress.enter("manifest")
    progress.fail(
        "cannot reach the swarm: no entry point answered (/ip4/1.2.3.4/tcp/1/p2p/x); is the bootstrap running"
    )
    snap = progress.snapshot()
    assert snap.phase == FAILED and "bootstrap is running" in snap.next
    line = render_line(snap)
    assert line.startswith("join failed at manifest: cannot reach the swarm") and "| next: " in line


@pytest.mark.parametrize(
    ("message", "words"),
    [
        ("reached the DHT but found no run manifest within 30 s", "hivenode bootstrap"),
        ("run 'x' (abc) is pinned to owner 12D3KooWA, not 12D3KooWB", "trust forget"),
        ("this node's key 12D3KooW is not an authorized syncer of run 'x'", "authorize your key"),
        ("identity file /x/identity.key is in use by another process", "--state-dir"),
        ("something nobody foresaw", DEFAULT_HINT),
    ],
)
def test_hints(message: str, words: str) -> None:
    assert words in next_hint(message)


def test_the_plain_view_logs_one_line_per_phase_then_every_period_while_training(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    progress = JoinProgress(clock)
    view = ProgressView(progress, stream=io.StringIO(), log_every_s=30, clock=clock)
    assert view.tty is False  # a StringIO is no terminal
    with caplog.at_level(logging.INFO, logger="node.progress"):
        view.refresh()
        view.refresh()  # nothing changed: nothing logged
        progress.enter("manifest")  # logged at once, without waiting for the next redraw
        progress.observe({"role": "learner", "state": "training", "inner_step": 1})
        view.refresh()  # nothing new
        clock.now += 10
        view.refresh()  # training, but within the period
        clock.now += 25
        view.refresh()
        progress.fail("cannot reach the swarm: no entry point answered")
        view.close()
    assert [line.split("]")[0] for line in view.lines[:3]] == [
        "[1/5 connecting",
        "[2/5 manifest",
        "[5/5 training",
    ]
    assert len(view.lines) == 5 and view.lines[-1].startswith("join failed")
    assert any(r.levelno == logging.ERROR and "next:" in r.getMessage() for r in caplog.records)


def test_the_terminal_view_draws_one_live_line() -> None:
    clock = Clock()
    progress = JoinProgress(clock)
    stream = io.StringIO()
    view = ProgressView(progress, stream=stream, tty=True, clock=clock)
    view.refresh()
    progress.enter("tokenizer/data", "the run's tokenizer")
    view.refresh()
    view.close()
    text = stream.getvalue()
    assert "[3/5 tokenizer/data] the run's tokenizer" in text and view.lines == []


def test_quiet_turns_it_off() -> None:
    assert load_node_config(["--join", MADDR]).progress is True
    assert load_node_config(["--join", MADDR, "--quiet"]).progress is False


def test_the_terminal_view_shows_a_failure_in_full() -> None:
    progress = JoinProgress(Clock())
    stream = io.StringIO()
    view = ProgressView(progress, stream=stream, tty=True)
    view.refresh()
    progress.fail("cannot reach the swarm: no entry point answered (" + "x" * 200 + ")")
    view.close()
    assert "next: check that the bootstrap is running" in " ".join(stream.getvalue().split())
