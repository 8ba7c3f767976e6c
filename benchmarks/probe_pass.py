"""The syncer's held-out loss pass at full context (issue 17): what one no-grad evaluation of the global model (the
loss probe's, and `evaluate_global`'s) holds beyond the model, whole against cut (`node.ml.model.loss_pass_shape`:
a few rows per pass, each layer's MLP and the logits run a few hundred positions at a time; `node.roles.syncer.skeleton_loss`).

Each arm runs in a fresh process: the model's parameters are built (a 32k vocabulary), the skeleton made, the
process's peak RSS reset (`/proc/self/clear_refs`, 5) and `skeleton_loss` run once on `--rows` random sequences
at the model's full context; the pass's memory is the peak after minus the RSS before. The two arms must give the
same loss (the cut is exact up to float summation order).

A third arm, `probe`, is the loss probe as deployed: the cut pass on sequences of `screening.loss_sequence_tokens`
(256), not the full context (`--probe-only` runs it alone and merges it into the existing JSON).

Run: `python -m benchmarks.probe_pass [--presets llama-124m,llama-1b] [--rows 8,8] [--probe-only]` (one rows value per
preset; llama-1b at 8 rows takes 2-4 minutes per arm on 2 cores, and 9 GiB whole); writes
`benchmarks/results/probe_pass.json` and a plot.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import re
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, plot_path, write_result

GIB = 1 << 30
WHOLE = 1 << 50  # a budget no pass reaches: one pass, whole logits (the syncer before the cut)


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1))


def measure(preset: str, rows: int, pass_bytes: int | None, seq: int | None = None) -> dict[str, Any]:
    """One arm, in this process: the pass's peak memory beyond the model, its time and loss, on `rows` sequences of
    `seq` tokens (None: the model's context)."""
    import torch

    from node.ml.model import ModelConfig, build_model, loss_pass_shape
    from node.roles.syncer import model_skeleton, skeleton_loss
    from protocol.model_spec import resolve_model

    torch.set_num_threads(2)
    cfg = ModelConfig.from_dict(resolve_model({"preset": preset, "vocab_size": 32000}))
    params = {n: p.detach() for n, p in build_model(cfg, seed=0).named_parameters()}
    skeleton = model_skeleton(cfg)
    seq = cfg.context_len if seq is None else seq
    tokens = torch.randint(0, cfg.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(0))
    batches = [(tokens[:, :-1], tokens[:, 1:])]
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS (VmHWM) starts again from now
    before = _status_kib("VmRSS")
    started = time.perf_counter()
    loss = skeleton_loss(skeleton, params, batches, pass_bytes=pass_bytes)
    elapsed = time.perf_counter() - started
    peak = _status_kib("VmHWM")
    cut = loss_pass_shape(cfg, rows, seq, *(() if pass_bytes is None else (pass_bytes,)))
    model_bytes = sum(p.numel() * 4 for p in params.values())
    return {
        "preset": preset,
        "arm": "whole" if pass_bytes == WHOLE else "cut" if seq == cfg.context_len else "probe",
        "rows": rows,
        "seq": seq,
        "pass_rows": cut.rows,
        "logit_positions": cut.positions,
        "model_gib": round(model_bytes / GIB, 3),
        "rss_before_gib": round(before * 1024 / GIB, 3),
        "pass_gib": round((peak - before) * 1024 / GIB, 3),
        "pass_s": round(elapsed, 1),
        "loss": loss,
    }


def run_arm(preset: str, rows: int, pass_bytes: int | None, seq: int | None = None) -> dict[str, Any]:
    """`measure` in a fresh process (spawned: no memory of an earlier arm's)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure, (preset, rows, pass_bytes, seq))


def headline(arms: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for preset in dict.fromkeys(a["preset"] for a in arms):
        whole = next(a for a in arms if a["preset"] == preset and a["arm"] == "whole")
        cut = next(a for a in arms if a["preset"] == preset and a["arm"] == "cut")
        key = preset.replace("llama-", "")
        out[f"pass_gib_whole_{key}"] = whole["pass_gib"]
        out[f"pass_gib_cut_{key}"] = cut["pass_gib"]
        out[f"rows_{key}"] = whole["rows"]
        out[f"time_ratio_cut_{key}"] = round(cut["pass_s"] / max(whole["pass_s"], 1e-9), 3)
        out[f"loss_rel_diff_{key}"] = abs(cut["loss"] - whole["loss"]) / abs(whole["loss"])
        probe = next((a for a in arms if a["preset"] == preset and a["arm"] == "probe"), None)
        if probe is not None:
            out[f"pass_gib_probe_{key}"] = probe["pass_gib"]
            out[f"probe_seq_{key}"] = probe["seq"]
            out[f"time_ratio_probe_{key}"] = round(probe["pass_s"] / max(whole["pass_s"], 1e-9), 3)
    return out


def plot(arms: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{a['preset']}\n{a['rows']} rows x {a['seq']}, {a['arm']}" for a in arms]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(
        labels,
        [a["pass_gib"] for a in arms],
        color=["tab:red" if a["arm"] == "whole" else "tab:green" for a in arms],
    )
    ax.set_ylabel("peak beyond the model (GiB)")
    ax.set_title("held-out loss pass, 32k vocabulary")
    fig.tight_layout()
    fig.savefig(plot_path("probe_pass"), dpi=120)


def main(argv: list[str] | None = None) -> None:
    from node.diloco.screening import ScreeningConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="llama-124m,llama-1b")
    parser.add_argument("--rows", default="8,8", help="held-out rows per preset (the syncer's batch is 8)")
    parser.add_argument(
        "--probe-only", action="store_true", help="only the probe arms, merged into the existing JSON's arms"
    )
    args = parser.parse_args(argv)
    presets, rows = args.presets.split(","), [int(r) for r in args.rows.split(",")]
    if len(presets) != len(rows):
        parser.error("--rows needs one value per preset")
    arms = json.loads((RESULTS_DIR / "probe_pass.json").read_text())["arms"] if args.probe_only else []
    arms = [a for a in arms if a["arm"] != "probe"]
    probe_seq = ScreeningConfig().loss_sequence_tokens or None  # 0: the context
    for preset, count in zip(presets, rows, strict=True):
        shapes = [] if args.probe_only else [(WHOLE, None), (None, None)]
        for pass_bytes, seq in [*shapes, (None, probe_seq)]:
            arm = run_arm(preset, count, pass_bytes, seq)
            print(arm, flush=True)
            arms.append(arm)
    path = write_result("probe_pass", headline(arms), {"arms": arms})
    plot(arms)
    print(path)


if __name__ == "__main__":
    main()
