"""benchmarks/data_scale.py (issue 17's data figures) on tiny inputs: prepare with both tokenizers, a download from
the bootstrap's shard routes in a child process, every shard verified into the cache; and the budget part's
summary and sizing, which are pure. The budget part itself (a memory cgroup, a 3 GiB dataset) is the benchmark's."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.data_scale import (
    PAGE,
    DataScaleConfig,
    MiB,
    batches_to_touch,
    headline,
    plot,
    run,
    summarize_budget,
)
from node.ml.shards import INDEX_FILENAME, file_sha256, parse_index, shard_path

pytestmark = pytest.mark.timeout(120)


def test_prepare_and_download_on_tiny_inputs(tmp_path: Path) -> None:
    config = DataScaleConfig(
        text_mib=2, bpe_text_mib=1, bpe_vocab=300, shard_tokens=2**18, bpe_shard_tokens=2**15, cgroup=False
    )
    data = run(config, tmp_path)
    head = headline(data)
    assert data["prepare_bytes"]["tokens"] >= 2 * MiB  # one token per byte (the byte tokenizer)
    assert data["prepare_bpe"]["tokens"] < MiB  # the BPE merges bytes into fewer tokens
    assert head["data_prepare_mib_s"] > 0 and head["data_prepare_tokens_s_bpe"] > 0
    index = parse_index((tmp_path / "prepared" / INDEX_FILENAME).read_bytes())
    assert data["download"]["shards"] == len(index.shards) >= 8
    for entry in index.shards:  # fetched over HTTP and verified, byte for byte the prepared shard
        assert file_sha256(shard_path(tmp_path / "cache", entry.name)) == entry.name
    assert head["data_download_mib_s"] > 0
    assert head["data_budget_skipped"] == "not asked (--no-budget)"
    plot(data, tmp_path / "data.png")
    assert (tmp_path / "data.png").stat().st_size > 0


def _sample(batch: int, anon_mib: float, read_mib: float) -> dict[str, int]:
    return {
        "batch": batch,
        "RssAnon": int(anon_mib * MiB),
        "RssFile": 0,
        "read_bytes": int(read_mib * MiB),
        "cgroup": int(anon_mib * MiB),
    }


def test_the_budget_summary_reads_growth_after_warm_up_and_the_controls_end() -> None:
    stream = [_sample(0, 100, 0), _sample(10, 140, 50), _sample(20, 141, 400), _sample(30, 143, 900)]
    part = {
        "budget_bytes": 256 * MiB,
        "dataset_bytes": 1024 * MiB,
        "stream": {"samples": stream, "returncode": 0, "killed": False, "cgroup_peak": 256 * MiB},
        "whole": {"samples": [{"loaded": 0}, {"loaded": 90 * MiB}], "returncode": -9, "killed": True},
    }
    summary = summarize_budget(part)
    assert summary["data_rss_anon_growth_mib"] == 3.0  # from the warm sample (the imports are not growth)
    assert summary["data_read_from_storage_mib"] == 900.0
    assert summary["data_reader_survived"] is True and summary["data_whole_read_killed"] is True
    assert summary["data_whole_read_loaded_mib"] == 90.0
    assert summarize_budget({"skipped": "no cgroup"}) == {"data_budget_skipped": "no cgroup"}


def test_enough_batches_to_touch_twice_the_budget() -> None:
    config = DataScaleConfig(budget_mib=768, window_tokens=1024, batch_rows=64, touch_factor=2.0)
    batches = batches_to_touch(config)
    pages = ((1024 + 1) * 2 / PAGE + 1) * 64 * batches
    assert 2 * 768 * MiB <= pages * PAGE * 1.001 and pages * PAGE <= 2 * 768 * MiB + 64 * 2 * PAGE
