"""benchmarks/scale.py's quick mode on a tiny model (the real run is llama-124m and llama-1b, docs/scale.md): the
syncer, learner and late-joiner processes go through a full merge round over loopback and the JSON holds the
headline the issue asks for (`merged_1b`, `syncer_rss_ratio_1b`, `state_transfer_s_124m`), the 1B part skipped with
its reason, and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.scale import main

pytestmark = pytest.mark.timeout(300)


def test_quick_mode_writes_the_headline_and_the_plot(tmp_path: Path) -> None:
    assert main(["--quick", "--model", "llama-tiny", "--max-steps", "40", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "scale.json").read_text())
    head = result["headline"]
    for key in (
        "merged_1b",
        "syncer_rss_ratio_1b",
        "state_transfer_s_124m",
        "syncer_peak_gib",
        "learner_peak_gib",
    ):
        assert key in head
    assert head["merged_1b"] is False and head["syncer_rss_ratio_1b"] is None  # quick: no 1B part
    assert "quick" in head["skipped_1b"]
    assert head["round_merged"] is True  # every fragment pushed, merged and applied back by the learner
    assert result["round"]["syncer"]["merges"] >= result["round"]["syncer"]["versions"].__len__()
    assert result["round"]["syncer"]["refusals"] == {}
    assert result["round"]["joiner"]["joined"] and head["state_transfer_s"] > 0
    assert head["syncer_peak_gib"] > 0 and head["learner_peak_gib"] > 0
    assert head["stage_slice_gib_1b"] > 0.5  # a quarter of a 1.1B model
    assert (tmp_path / "scale.png").stat().st_size > 0
    core = result["core"]  # the syncer core's round, peak RSS per phase (what holds the memory at its peak)
    assert set(core["phase_peak_rss"]) == {"push", "accept", "merge", "checkpoint"}
    assert core["peak_rss"] >= max(core["phase_peak_rss"].values())
    assert 0 < core["process_rss"] < core["setup_peak_rss"]
