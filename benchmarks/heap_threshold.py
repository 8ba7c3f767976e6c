"""What glibc's fixed 1 MiB mmap and trim thresholds cost in time (issue 17): the syncer sets them
(`node.diloco.spill.release_large_blocks_when_freed`) so a worker thread's freed blocks go back to the kernel, and
from then on every block of 1 MiB or more is a mapping of its own, faulted in page by page and unmapped when freed.

Two workloads of the syncer, each in a fresh process (spawned), under three settings, alternated `--repeats` times
so load drifts hit every arm alike: glibc's dynamic thresholds (`dynamic`), both fixed at 1 MiB (`1M/1M`: the
syncer's setting until 2026-12-07), and the mmap threshold fixed at 32 MiB (the dynamic one's ceiling) with the trim
threshold at 1 MiB (`32M/1M`):

* `probe`: the loss probe's held-out pass (`skeleton_loss`, cut as deployed) on llama-124m, `--rows` sequences of
  `screening.loss_sequence_tokens`;
* `checkpoint`: a spilled tensor file of `--checkpoint-mib` read in the momentum's chunks (`SpilledTensors.chunk`,
  4 MiB) and written to a checkpoint file, fsynced: what `save_checkpoint` does with a momentum on disk.

Reported per arm: the median time and the RSS after the workload; the headline's `*_time_ratio_<arm>` is the arm's
over `dynamic`.
Run: `python -m benchmarks.heap_threshold [--repeats 3] [--rows 8] [--checkpoint-mib 1024]`; writes
`benchmarks/results/heap_threshold.json` and a plot.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import plot_path, write_result

MIB = 1 << 20
CHUNK_VALUES = 1 << 20  # 4 MiB of float32, the spill's read chunk


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _probe(rows: int) -> None:
    import torch

    from node.diloco.screening import ScreeningConfig
    from node.ml.model import ModelConfig, build_model
    from node.roles.syncer import model_skeleton, skeleton_loss
    from protocol.model_spec import resolve_model

    cfg = ModelConfig.from_dict(resolve_model({"preset": "llama-124m", "vocab_size": 32000}))
    params = {n: p.detach() for n, p in build_model(cfg, seed=0).named_parameters()}
    seq = ScreeningConfig().loss_sequence_tokens
    tokens = torch.randint(0, cfg.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(0))
    skeleton_loss(model_skeleton(cfg), params, [(tokens[:, :-1], tokens[:, 1:])])


def _spill(directory: Path, mib: int) -> Any:
    """A spill file of one tensor of `mib` MiB, written (into the page cache) before the clock starts."""
    from node.diloco.spill import SpillDir, SpilledTensors

    spill = SpillDir(directory)
    key = spill.new_key("momentum")
    with open(directory / key, "wb") as handle:
        for _ in range(mib):
            handle.write(bytes(MIB))
    return SpilledTensors(spill, key, where={"m": (0, (mib * MIB // 4,))})


def _checkpoint(directory: Path, source: Any) -> None:
    total = source.shape_of("m")[0]
    with open(directory / "checkpoint.safetensors", "wb") as handle:
        for start in range(0, total, CHUNK_VALUES):
            handle.write(source.chunk("m", start, start + CHUNK_VALUES).numpy().data.cast("B"))
        handle.flush()
        os.fsync(handle.fileno())


ARMS = {"dynamic": (0, 0), "1M/1M": (1 * MIB, 1 * MIB), "32M/1M": (32 * MIB, 1 * MIB)}


def measure(workload: str, arm: str, rows: int, mib: int) -> dict[str, Any]:
    """One arm in this (fresh) process: the workload's time and the RSS after it."""
    import torch

    from node.diloco.spill import release_large_blocks_when_freed

    torch.set_num_threads(2)
    mmap_bytes, trim_bytes = ARMS[arm]
    applied = release_large_blocks_when_freed(mmap_bytes, trim_bytes) if mmap_bytes else False
    with tempfile.TemporaryDirectory() as tmp:
        source = _spill(Path(tmp), mib) if workload == "checkpoint" else None
        started = time.perf_counter()
        if source is None:
            _probe(rows)
        else:
            _checkpoint(Path(tmp), source)
        elapsed = time.perf_counter() - started
    return {"workload": workload, "arm": arm, "set": applied, "s": elapsed, "rss_mib": _rss_mib()}


def run_arm(workload: str, arm: str, rows: int, mib: int) -> dict[str, Any]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure, (workload, arm, rows, mib))


def summary(arms: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for workload in ("probe", "checkpoint"):
        for arm in ARMS:
            mine = [a for a in arms if a["workload"] == workload and a["arm"] == arm]
            out[f"{workload}_s_{arm}"] = round(statistics.median(a["s"] for a in mine), 3)
            out[f"{workload}_rss_after_mib_{arm}"] = round(statistics.median(a["rss_mib"] for a in mine), 1)
        for arm in ARMS:
            if arm != "dynamic":
                ratio = out[f"{workload}_s_{arm}"] / out[f"{workload}_s_dynamic"]
                out[f"{workload}_time_ratio_{arm}"] = round(ratio, 3)
    return out


def plot(headline: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    workloads = ["probe", "checkpoint"]
    for i, arm in enumerate(ARMS):
        ax.bar(
            [w * 4 + i for w in range(len(workloads))],
            [headline[f"{w}_s_{arm}"] for w in workloads],
            label=arm,
        )
    ax.set_xticks([w * 4 + 1 for w in range(len(workloads))], workloads)
    ax.set_ylabel("median seconds")
    ax.set_title("glibc thresholds (mmap/trim)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot_path("heap_threshold"), dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8, help="held-out sequences of the probe pass")
    parser.add_argument(
        "--checkpoint-mib", type=int, default=1024, help="MiB read and written by the checkpoint"
    )
    args = parser.parse_args(argv)
    arms = []
    for _ in range(args.repeats):
        for workload in ("probe", "checkpoint"):
            for name in ARMS:
                arm = run_arm(workload, name, args.rows, args.checkpoint_mib)
                print(arm, flush=True)
                arms.append(arm)
    headline = summary(arms)
    path = write_result("heap_threshold", headline, {"arms": arms, "args": vars(args)})
    plot(headline)
    print(headline)
    print(path)


if __name__ == "__main__":
    main()
