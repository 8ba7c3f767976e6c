"""benchmarks/scale.py's `--only-1b` reruns one 1B configuration into the committed results JSON: the keys of that
configuration (`core_1b_p4`, headline `*_p4`) are replaced, every other key (the P = 16 headline, the rounds, the
core, llama-350m's keys) is kept as it was. The 1B core itself (minutes of CPU, GiB of RAM) is replaced by a fake
result; what is under test is the merge into the file."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from benchmarks import scale
from benchmarks.common import RESULTS_DIR

COMMITTED = RESULTS_DIR / "scale.json"


def fake_part_1b(peak: int) -> Any:
    def part_1b(args: argparse.Namespace, fragments: int = scale.FRAGMENTS_1B) -> dict[str, Any]:
        size = scale.sizes(scale.manifest("llama-1b", num_fragments=fragments))
        return {
            **size,
            "fragments_per_stage": fragments,
            "peak_rss": peak,
            "fragments_merged": size["num_fragments"],
            "phase_peak_rss": {"push": peak // 2, "accept": peak // 2, "merge": peak},
        }

    return part_1b


def rerun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fragments: int, peak: int) -> tuple[dict, dict]:
    shutil.copy(COMMITTED, tmp_path / "scale.json")
    before = json.loads((tmp_path / "scale.json").read_text())
    monkeypatch.setattr(scale, "part_1b", fake_part_1b(peak))
    argv = ["--only-1b", "--fragments-1b", str(fragments), "--out", str(tmp_path)]
    assert scale.main(argv) == 0
    return before, json.loads((tmp_path / "scale.json").read_text())


def changed(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    """Top-level and headline keys whose value differs (or that appeared or went)."""
    keys = {k for k in before.keys() | after.keys() if k != "headline" and before.get(k) != after.get(k)}
    head_b, head_a = before["headline"], after["headline"]
    return keys | {f"headline.{k}" for k in head_b.keys() | head_a.keys() if head_b.get(k) != head_a.get(k)}


def test_a_p4_rerun_replaces_the_p4_keys_and_keeps_every_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before, after = rerun(tmp_path, monkeypatch, 4, peak=5 << 30)
    diff = changed(before, after)
    assert diff, "the fake result must change something"
    # only the P = 4 configuration's keys moved
    assert all(k.endswith("_p4") for k in diff), sorted(diff)
    assert after["core_1b_p4"]["peak_rss"] == 5 << 30
    assert after["headline"]["syncer_peak_gib_1b_p4"] == 5.0
    assert after["headline"]["syncer_peak_phase_1b_p4"] == "merge"
    assert after["core_1b"] == before["core_1b"] and after["round"] == before["round"]
    for key in (
        "syncer_rss_ratio_1b",
        "syncer_peak_gib_1b",
        "syncer_peak_gib_llama-350m",
        "state_transfer_s_124m",
    ):
        assert after["headline"][key] == before["headline"][key]
    assert (tmp_path / "scale.png").stat().st_size > 0


def test_negative_control_a_p16_rerun_moves_the_headline_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the check above can see a change: the default fragment count writes the unsuffixed keys, not the P = 4 ones
    before, after = rerun(tmp_path, monkeypatch, scale.FRAGMENTS_1B, peak=5 << 30)
    diff = changed(before, after)
    assert "core_1b" in diff and "headline.syncer_peak_gib_1b" in diff
    assert not any(k.endswith("_p4") for k in diff)
    assert after["core_1b_p4"] == before["core_1b_p4"]


def test_record_keeps_every_run_of_a_key_and_the_files_other_keys(tmp_path: Path) -> None:
    # `--core llama-1b --record FILE KEY`: the run under runs[KEY] with its ratio; a repeat under KEY_2, the first kept
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"name": "probe", "note": "kept", "runs": {"other": {"peak_rss": 1}}}))
    size = scale.sizes(scale.manifest("llama-1b", num_fragments=16))
    goal = size["model_bytes"] + 2 * size["fragment_bytes"]
    for peak in (goal, goal // 2):
        scale.record_core(path, "run", {"peak_rss": peak}, 16, "python -m benchmarks.scale", "start")
    payload = json.loads(path.read_text())
    assert payload["note"] == "kept" and payload["runs"]["other"] == {"peak_rss": 1}
    assert payload["runs"]["run"]["syncer_rss_ratio_1b"] == 1.0
    assert payload["runs"]["run_2"]["syncer_rss_ratio_1b"] == 0.5
    assert payload["runs"]["run"]["goal_bytes"] == goal
