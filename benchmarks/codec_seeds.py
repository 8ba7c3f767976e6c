"""Outer-gradient codecs over many seeds, paired (issue 20): is any codec at >= 150x within 1 % of fp32?

`benchmarks.codec_sweep` runs each arm once; one arm's held-out loss swings by a few per cent from seed to seed, so a
single gap cannot resolve 1 %. Here every seed s runs an fp32 arm and every codec arm from the same initialization
(`init = s`) and the same data order (`seed = s`), so each codec's gap is paired with its own seed's fp32 arm:

    gap[arm, s] = loss[arm, s] / loss[fp32, s] - 1     (the held-out loss after the last round, same tokens)

and the figure is the mean over seeds with its sample std, standard error (std / sqrt n) and the one-sided 95 %
upper bound (mean + t(0.95, n - 1) x s.e.): an arm meets the goal when that bound is <= 1 %, and its mean alone
says only where it sits. `gap_last5` is the same on the mean of the last 5 rounds' losses. The noise floor is an
fp32 arm with the seed's initialization and another data order (`seed = 100 + s`), against the same fp32 arm.

Every arm of every seed is appended to a progress file as it finishes (one JSON line: seed, label, curve), and a
rerun with the same file skips what it holds, so a run can be resumed or extended by an arm (the arms are
deterministic: one CPU thread, seeded generators; the fp32 arm of a seed is bit-identical across runs).
Run: `python -m benchmarks.codec_seeds --seeds 0-7 [--variants "codec=topk,k=32,..."] [--progress P] [--write]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import textwrap
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.codec_sweep import Setup, Variant, build_setup, parse_variant, ratio, run
from benchmarks.common import plot_path, write_result

NAME = "codec_seeds"
DEFAULT_VARIANTS = (
    "codec=topk,k=32,bits=2,scale_bits=16,decay=0.9;codec=topk,k=56,bits=2,scale_bits=16,decay=0.9;"
    "codec=topk_rice,k=43,bits=2,scale_bits=16,decay=0.9;codec=topk_rice,k=86,bits=2,scale_bits=16,decay=0.9"
)
NOISE_LABEL = "fp32, other data order (noise floor)"
NOISE_SEED = 100  # the noise arm's data seeds: 100 + s, never one of the arms' own
GOAL_GAP = 0.01
GOAL_RATIO = 150.0
TAIL = 5  # rounds evaluated (the last): the gaps read the last round and the mean of these

Curve = list[tuple[int, float]]
Arms = dict[tuple[int, str], dict[str, Any]]  # (seed, label) -> {"curve": Curve, "bytes": mean payload bytes}


def parse_seeds(text: str) -> list[int]:
    """'0-3,7' -> [0, 1, 2, 3, 7]."""
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        seeds.extend(range(int(low), int(high or low) + 1))
    return seeds


def load_progress(path: Path | None) -> Arms:
    if path is None or not path.exists():
        return {}
    done = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        curve = [(int(t), float(v)) for t, v in row["curve"]]
        done[(int(row["seed"]), str(row["label"]))] = {"curve": curve, "bytes": row.get("bytes")}
    return done


def seed_arms(variants: list[Variant], seed: int, noise: bool = True) -> list[Variant]:
    """The fp32 arm, the noise arm (if `noise`) and every codec arm of one seed (each variant's outer step kept)."""
    fp32 = Variant(label="fp32", seed=seed, init=seed)
    floor = [Variant(label=NOISE_LABEL, seed=NOISE_SEED + seed, init=seed)] if noise else []
    return [fp32, *floor, *(dataclasses.replace(v, seed=seed, init=seed) for v in variants)]


def measure(
    setup: Setup,
    variants: list[Variant],
    seeds: list[int],
    rounds: int,
    progress: Path | None,
    noise: bool = True,
) -> Arms:
    """Every arm of every seed, seed by seed (so a cut-off run leaves whole seeds), resuming from `progress`."""
    done = load_progress(progress)
    for seed in seeds:
        for arm in seed_arms(variants, seed, noise):
            if (seed, arm.label) in done:
                continue
            if arm.outer_lr != 0.7 or arm.momentum != 0.9:
                raise ValueError(f"{arm.label}: paired arms share the fp32 arm's default outer step")
            started, sent = time.monotonic(), []
            curve = run(setup, arm, rounds, sent, eval_last=TAIL)
            row = {"curve": curve, "bytes": statistics.fmean(sent) if sent else None}
            done[(seed, arm.label)] = row
            if progress is not None:
                with progress.open("a") as f:
                    f.write(json.dumps({"seed": seed, "label": arm.label, **row}) + "\n")
            print(
                f"seed {seed} {arm.label}: {curve[-1][1]:.4f} ({time.monotonic() - started:.0f} s)",
                flush=True,
            )
    return done


def summarize(gaps: list[float]) -> dict[str, float]:
    """Mean, sample std, s.e. and the one-sided 95 % bounds (t with n - 1 degrees of freedom) of paired gaps."""
    from scipy.stats import t as student_t

    n = len(gaps)
    mean = statistics.fmean(gaps)
    std = statistics.stdev(gaps) if n > 1 else math.nan
    se = std / math.sqrt(n)
    t95 = float(student_t.ppf(0.95, n - 1)) if n > 1 else math.nan
    return {
        "mean": mean,
        "std": std,
        "se": se,
        "upper95": mean + t95 * se,
        "lower95": mean - t95 * se,
        "n": n,
    }


def _tail(curve: Curve, last: int = TAIL) -> float:
    return statistics.fmean(loss for _, loss in curve[-last:])


def table(
    setup: Setup, variants: list[Variant], seeds: list[int], done: Arms, noise: bool = True
) -> dict[str, Any]:
    """Per arm: its ratio (the codec's worst case, and as measured: fp32 bytes over the mean push's), per-seed
    gaps (last round and last 5) and their summaries, and the summary of its last-round gaps against the first
    codec arm of the same seed (`vs_first`: codecs compared with each other, the fp32 arm's swing cancelled);
    only complete seeds."""
    labels = [*([NOISE_LABEL] if noise else []), *(v.label for v in variants)]
    specs = {NOISE_LABEL: None, **{v.label: v.spec for v in variants}}
    complete = [s for s in seeds if all((s, x) in done for x in ["fp32", *labels])]
    rows: dict[str, Any] = {}
    first = [done[(s, variants[0].label)]["curve"][-1][1] for s in complete] if variants else []
    for label in labels:
        ref = [done[(s, "fp32")]["curve"] for s in complete]
        arm = [done[(s, label)]["curve"] for s in complete]
        gaps = [a[-1][1] / r[-1][1] - 1 for a, r in zip(arm, ref, strict=True)]
        gaps5 = [_tail(a) / _tail(r) - 1 for a, r in zip(arm, ref, strict=True)]
        spec = specs[label]
        rows[label] = {
            "ratio": 1.0 if spec is None else round(ratio(spec, setup.plan), 1),
            "ratio_measured": _measured_ratio(setup, [done[(s, label)]["bytes"] for s in complete]),
            "gaps": [round(g, 5) for g in gaps],
            "gap": {k: round(v, 5) for k, v in summarize(gaps).items()},
            "gaps_last5": [round(g, 5) for g in gaps5],
            "gap_last5": {k: round(v, 5) for k, v in summarize(gaps5).items()},
            "vs_first": {
                k: round(v, 5)
                for k, v in summarize([a[-1][1] / f - 1 for a, f in zip(arm, first, strict=True)]).items()
            },
        }
    fp32 = [round(done[(s, "fp32")]["curve"][-1][1], 5) for s in complete]
    return {"seeds": complete, "fp32_losses": fp32, **rows}


def _measured_ratio(setup: Setup, mean_bytes: list[float | None]) -> float:
    """fp32 bytes of the mean push (every fragment pushed equally often) over the arms' mean payload bytes."""
    sent = [b for b in mean_bytes if b is not None]
    if not sent:
        return 1.0
    fp32 = statistics.fmean(4 * f.num_params for f in setup.plan.fragments)
    return round(fp32 / statistics.fmean(sent), 1)


def headline(result: dict[str, Any], variants: list[Variant], rounds: int) -> dict[str, Any]:
    """The goal's verdict per arm at >= 150x: `meets` when the one-sided 95 % upper bound is <= 1 %."""
    out: dict[str, Any] = {"rounds": rounds, "seeds": len(result["seeds"])}
    for v in variants:
        row = result[v.label]
        out[f"gap[{v.label}]"] = row["gap"]["mean"]
        out[f"gap_se[{v.label}]"] = row["gap"]["se"]
        out[f"gap_upper95[{v.label}]"] = row["gap"]["upper95"]
        out[f"ratio[{v.label}]"] = row["ratio"]
    if NOISE_LABEL in result:
        noise = result[NOISE_LABEL]["gap"]
        out["noise_gap"], out["noise_gap_se"] = noise["mean"], noise["se"]
    eligible = [v.label for v in variants if result[v.label]["ratio"] >= GOAL_RATIO]
    out["mean_within_goal"] = [x for x in eligible if result[x]["gap"]["mean"] <= GOAL_GAP]
    out["goal_met"] = [x for x in eligible if result[x]["gap"]["upper95"] <= GOAL_GAP]
    return out


def plot(result: dict[str, Any], labels: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for i, label in enumerate(labels):
        row = result[label]
        ax.scatter([i] * len(row["gaps"]), [100 * g for g in row["gaps"]], s=12, alpha=0.5)
        mean, se = 100 * row["gap"]["mean"], 100 * row["gap"]["se"]
        ax.errorbar([i + 0.15], [mean], yerr=[[1.96 * se], [1.96 * se]], fmt="ko", capsize=4)
    ax.axhline(100 * GOAL_GAP, color="r", ls="--", lw=1, label="goal: 1 %")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(range(len(labels)))
    names = ["\n".join(textwrap.wrap(x.replace("codec=", "").replace(",", ", "), 24)) for x in labels]
    ax.set_xticklabels(
        [f"{n}\n{result[x]['ratio']}x" for n, x in zip(names, labels, strict=True)], fontsize=6
    )
    ax.set_ylabel("held-out loss gap vs fp32, same seed (%)")
    ax.set_title(f"outer codecs, {len(result['seeds'])} paired seeds (dots), mean ± 1.96 s.e.")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-7", help="e.g. 0-7 or 0,2,5")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--eval-batches", type=int, default=64)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--no-noise", action="store_true", help="leave out the noise arm (fp32, other data)")
    parser.add_argument("--progress", type=Path, help="append every finished arm here; resume from it")
    parser.add_argument(
        "--write", action="store_true", help="write benchmarks/results/<name>.json and a plot"
    )
    parser.add_argument("--name", default=NAME)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    setup = build_setup(args.eval_batches)
    variants = [parse_variant(t) for t in args.variants.split(";") if t.strip()]
    seeds = parse_seeds(args.seeds)
    noise = not args.no_noise
    done = measure(setup, variants, seeds, args.rounds, args.progress, noise)
    result = table(setup, variants, seeds, done, noise)
    summary = headline(result, variants, args.rounds)
    print(json.dumps(summary, indent=1))
    if args.write:
        curves = {f"{s}/{label}": a["curve"] for (s, label), a in done.items() if s in result["seeds"]}
        write_result(args.name, summary, {"arms": result, "curves": curves})
        plot(
            result,
            [x for x in [NOISE_LABEL, *(v.label for v in variants)] if x in result],
            plot_path(args.name),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
