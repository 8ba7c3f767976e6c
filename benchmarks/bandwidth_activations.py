"""Compressed boundary activations and gradients (issue 20, part 2): bytes per microbatch and held-out loss at equal
tokens, for each `protocol.boundary_codec` codec against fp32.

One in-process pipeline per codec (`tools.pipeline_harness`: the production stage and driver code, sealing and
opening every frame, through `DirectTransport`), the same seeds, weights and batches, SENTINEL off (its detection
with a codec is `benchmarks/sentinel_table.py --activation-codec`). A counting transport adds up the bytes of every
frame each way (requests and answers: activations, gradients, tokens and targets, headers and signatures);
`boundary_ratio` is the ratio of the boundary tensors alone (payload of an activation or gradient frame).
The held-out loss is measured through the pipeline on the same held-out batches after the last microbatch
(`loss`, `loss_gap`: the trained weights as the pipeline runs them, the evaluation's own forward through the codec
too), and again with the arm's trained stage weights assembled into one model run directly in fp32
(`model_loss`, `loss_gap_model`: what training under the codec did to the weights, the model a user exports; the
fp32 arm's two readings must be equal, `check_fp32_readings`). The goal's rule (`recommended`, `meets_goal`) reads
`loss_gap`, as it always did; `meets_goal_model` is the same rule on `loss_gap_model`. A last
fp32 arm with another batch order (same init) gives the noise floor: the loss gap a harmless change makes. One seed
cannot resolve a gap of 0.5 % (a codec's gap spreads 1-2.5 % per seed, the noise floor's 2-4 %), so every arm runs
under several seeds (init, batch order and every owner's stochastic-rounding stream,
`tools.pipeline_harness.build_arm`; `--seeds`) and each codec's gap is summarized by its mean and spread over them.
Five seeds resolve about 1 % (docs/pipeline.md); 0.5 % needs several times more.

Called by `benchmarks.bandwidth` (its `activation_*` headline keys); alone: `python -m benchmarks.bandwidth_activations`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from protocol.boundary_codec import BOUNDARY_CODECS, BoundaryCodecName, compression_ratio
from tools.pipeline_harness import HarnessConfig, build_arm, drive, model_held_out_loss

NOISE_ARM = "fp32 other batches"
# the goal (issue 20): at least this frame ratio at a mean loss gap of at most GOAL_GAP
GOAL_RATIO, GOAL_GAP = 8.0, 0.005
# recommended: the codec meeting the goal (mean over the seeds) with the smallest mean gap; else FALLBACK (3.8x)
FALLBACK: BoundaryCodecName = "int8"
DEFAULT_SEEDS = (0, 1, 2)
# the fp32 arm's two readings (through the pipeline, the assembled model) run the same float ops in the same order;
# relative difference allowed before the model reading is judged broken
FP32_READINGS_RTOL = 1e-6


class CountingTransport:
    """A `HopTransport` that counts the bytes of every request and answer frame it moves."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.bytes = 0
        self.calls = 0

    async def call(self, peer_id: str, rpc: str, frame: Any, **kwargs: Any) -> Any:
        self.bytes += len(frame)
        self.calls += 1
        answer = await self.inner.call(peer_id, rpc, frame, **kwargs)
        self.bytes += len(answer)
        return answer


def run_arm(
    codec: BoundaryCodecName, microbatches: int, seed: int, lr: float, data_seed: int | None = None
) -> dict[str, Any]:
    config = HarnessConfig(
        replicas=(1, 1, 1), attackers=0, lr=lr, concurrency=1, activation_codec=codec, held_out_batches=8
    )
    arm = build_arm(config, attack=None, verify=False, seed=seed)
    counter = CountingTransport(arm.driver.hops.transport)
    arm.driver.hops.transport = counter
    started = time.perf_counter()
    result = drive(arm, microbatches, seed if data_seed is None else data_seed, eval_every=microbatches)
    elapsed = time.perf_counter() - started
    model_loss = model_held_out_loss(arm)  # after the counter: assembling the model sends no frame
    train_bytes = counter.bytes  # includes the held-out evaluations' forwards: the same count in every arm
    shape = (config.batch_size, int(config.model["context_len"]), int(config.model["width"]))
    return {
        "codec": codec,
        "microbatches": microbatches,
        "completed": result["completed"],
        "tokens": result["tokens"],
        "loss": result["loss"],
        "model_loss": model_loss,
        "frame_bytes": train_bytes,
        "frame_bytes_per_microbatch": train_bytes / max(1, result["completed"]),
        "boundary_ratio": compression_ratio(codec, shape),  # one activation and one gradient
        "seconds": elapsed,
    }


def measure_seed(
    microbatches: int, seed: int, lr: float, codecs: Sequence[BoundaryCodecName], noise_arm: bool = True
) -> dict[str, Any]:
    """Every arm under one seed, gaps against this seed's fp32 arm (`noise_arm`: and the noise floor's)."""
    arms: dict[str, dict[str, Any]] = {}
    for name in ("fp32", *codecs, *((NOISE_ARM,) if noise_arm else ())):
        # the noise floor: fp32 again with another batch order, same init (how far a harmless change moves the loss)
        noise = name == NOISE_ARM
        arm = run_arm(
            "fp32" if noise else name, microbatches, seed, lr, data_seed=seed + 1000 if noise else None
        )
        if name == "fp32":
            check_fp32_readings(arm)
        base = arms.get("fp32", arm)
        arm["frame_ratio"] = base["frame_bytes_per_microbatch"] / arm["frame_bytes_per_microbatch"]
        arm["loss_gap"] = (arm["loss"] - base["loss"]) / base["loss"]
        arm["loss_gap_model"] = (arm["model_loss"] - base["model_loss"]) / base["model_loss"]
        arms[name] = arm
        print(
            f"seed {seed} {name}: {arm['frame_ratio']:.2f}x, loss {arm['loss']:.4f} ({arm['loss_gap']:+.2%}), "
            f"model {arm['model_loss']:.4f} ({arm['loss_gap_model']:+.2%}), "
            f"{arm['seconds']:.0f} s, load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    return arms


def check_fp32_readings(arm: dict[str, Any]) -> None:
    """Refuse a run whose fp32 arm reads differently through the pipeline and as the assembled model: the two
    readings of every other arm are then not comparable (a wrong assembly, other held-out batches)."""
    loss, model_loss = arm["loss"], arm["model_loss"]
    if abs(loss - model_loss) > FP32_READINGS_RTOL * abs(loss):
        raise RuntimeError(f"fp32 arm: pipeline loss {loss!r} != assembled model's {model_loss!r}")


def gap_stats(gaps: list[float], suffix: str = "") -> dict[str, Any]:
    """`loss_gaps<suffix>` and their mean, spread and range under `loss_gap<suffix>_*` keys."""
    return {
        f"loss_gaps{suffix}": gaps,
        f"loss_gap{suffix}_mean": statistics.fmean(gaps),
        f"loss_gap{suffix}_std": statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
        f"loss_gap{suffix}_min": min(gaps),
        f"loss_gap{suffix}_max": max(gaps),
    }


def summarize(runs: dict[int, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per arm over the seeds: frame ratio (the same in every seed) and both loss gaps' mean, spread and range."""
    summary: dict[str, dict[str, Any]] = {}
    for name in next(iter(runs.values())):
        arms = [arms_of_seed[name] for arms_of_seed in runs.values()]
        summary[name] = {
            "frame_ratio": statistics.fmean(a["frame_ratio"] for a in arms),
            "frame_bytes_per_microbatch": statistics.fmean(a["frame_bytes_per_microbatch"] for a in arms),
            "boundary_ratio": arms[0]["boundary_ratio"],
            **gap_stats([a["loss_gap"] for a in arms]),
            **gap_stats([a["loss_gap_model"] for a in arms], "_model"),
        }
    return summary


def meets_goal(arm: dict[str, Any], reading: str = "loss_gap") -> bool:
    """The goal on one reading: `loss_gap` (through the codec, the benchmark's rule) or `loss_gap_model`."""
    return bool(arm["frame_ratio"] >= GOAL_RATIO and arm[f"{reading}_mean"] <= GOAL_GAP)


class SeedProgress:
    """Each finished seed's arms kept in a JSON file, so that a long run cut short (or rerun with fewer or more
    seeds) measures only the seeds it lacks: an arm is deterministic in its seed (`build_arm`), so a kept seed is
    the same measurement. Kept seeds are used only for the same microbatches, learning rate and arms."""

    def __init__(self, path: Path | None, microbatches: int, lr: float, arms: Sequence[str]) -> None:
        self.path = path
        self.key = {"microbatches": microbatches, "lr": lr, "arms": list(arms)}
        self.runs: dict[str, dict[str, Any]] = {}
        if path is not None and path.exists():
            kept = json.loads(path.read_text())
            if {k: kept.get(k) for k in self.key} == self.key:
                self.runs = kept["runs"]

    def get(self, seed: int) -> dict[str, Any] | None:
        return self.runs.get(str(seed))

    def add(self, seed: int, arms: dict[str, Any]) -> None:
        self.runs[str(seed)] = arms
        if self.path is not None:
            self.path.write_text(json.dumps({**self.key, "runs": self.runs}, indent=1) + "\n")


def measure(
    microbatches: int,
    seeds: Sequence[int] = DEFAULT_SEEDS,
    lr: float = 3e-3,
    codecs: Sequence[BoundaryCodecName] = BOUNDARY_CODECS,
    progress: Path | None = None,
    noise_arm: bool = True,
) -> dict[str, Any]:
    """`noise_arm` False: no noise floor arm (its gaps are deterministic in the seed: an earlier run's hold)."""
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    lossy = [c for c in codecs if c != "fp32"]
    kept = SeedProgress(progress, microbatches, lr, ["fp32", *lossy, *((NOISE_ARM,) if noise_arm else ())])
    reused = [seed for seed in seeds if kept.get(seed) is not None]
    runs: dict[int, dict[str, Any]] = {}
    for seed in seeds:
        runs[seed] = kept.get(seed) or measure_seed(microbatches, seed, lr, lossy, noise_arm)
        kept.add(seed, runs[seed])
    summary = summarize(runs)
    meeting = sorted(
        (summary[c]["loss_gap_mean"], c) for c in codecs if c != "fp32" and meets_goal(summary[c])
    )
    recommended = meeting[0][1] if meeting else FALLBACK
    if recommended not in summary:  # a subset without the fallback: fp32 is the honest recommendation
        recommended = "fp32"
    meeting_model = sorted(
        (summary[c]["loss_gap_model_mean"], c)
        for c in codecs
        if c != "fp32" and meets_goal(summary[c], "loss_gap_model")
    )
    return {
        "recommended": recommended,
        "meets_goal": [c for _, c in meeting],
        # the same goal on the assembled model's reading: informs, never changes `recommended`
        "meets_goal_model": [c for _, c in meeting_model],
        "goal": {"frame_ratio": GOAL_RATIO, "loss_gap_mean": GOAL_GAP},
        "microbatches": microbatches,
        "seeds": list(seeds),
        "lr": lr,
        "summary": summary,
        "runs": {str(seed): arms for seed, arms in runs.items()},
        "seeds_from_progress": reused,  # measured by an earlier invocation (same code path, `SeedProgress`)
        "load_average_start": load,
        "load_average_end": os.getloadavg()[0],
        "setup": "tools.pipeline_harness, 3 stages x 1 replica, model "
        + json.dumps(dataclasses.asdict(HarnessConfig())["model"])
        + ", batch 8, SENTINEL off",
    }


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The recommended codec's figures (`activation_*`) and every other codec's (`activation_<codec>_*`)."""
    summary = result["summary"]
    best = summary[result["recommended"]]
    keys: dict[str, Any] = {
        "activation_codec": result["recommended"],
        "activation_goal_met": result["recommended"] in result["meets_goal"],
        "activation_compression": round(best["frame_ratio"], 2),
        "activation_boundary_compression": round(best["boundary_ratio"], 2),
        "activation_loss_gap": round(best["loss_gap_mean"], 4),
        "activation_loss_gap_std": round(best["loss_gap_std"], 4),
        "activation_model_loss_gap": round(best["loss_gap_model_mean"], 4),
        "activation_model_loss_gap_std": round(best["loss_gap_model_std"], 4),
        # any codec >= 8x at a mean gap <= 0.5 % of the assembled model's loss (not the rule of `recommended`)
        "activation_goal_met_model": bool(result["meets_goal_model"]),
        "activation_codecs_meeting_goal_model": list(result["meets_goal_model"]),
        "activation_seeds": len(result["seeds"]),
    }
    for name, arm in summary.items():
        if name in ("fp32", result["recommended"]):
            continue
        key = "activation_noise" if name == NOISE_ARM else f"activation_{name}"
        if name != NOISE_ARM:
            keys[f"{key}_compression"] = round(arm["frame_ratio"], 2)
        keys[f"{key}_loss_gap"] = round(arm["loss_gap_mean"], 4)
        keys[f"{key}_loss_gap_std"] = round(arm["loss_gap_std"], 4)
        keys[f"{key}_model_loss_gap"] = round(arm["loss_gap_model_mean"], 4)
        keys[f"{key}_model_loss_gap_std"] = round(arm["loss_gap_model_std"], 4)
    return keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, default=600)
    parser.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)), help="comma-separated seeds")
    parser.add_argument(
        "--codecs", default=",".join(BOUNDARY_CODECS), help="comma-separated subset (fp32 always)"
    )
    parser.add_argument("--progress", type=Path, help="JSON file of finished seeds, reused when rerun")
    args = parser.parse_args()
    codecs = [c for c in args.codecs.split(",") if c]
    unknown = set(codecs) - set(BOUNDARY_CODECS)
    if unknown:
        parser.error(f"unknown codecs {sorted(unknown)}: one of {BOUNDARY_CODECS}")
    seeds = [int(s) for s in args.seeds.split(",")]
    result = measure(args.microbatches, seeds, codecs=codecs, progress=args.progress)  # type: ignore[arg-type]
    for name, arm in result["summary"].items():
        gaps = ", ".join(f"{g:+.2%}" for g in arm["loss_gaps"])
        model_gaps = ", ".join(f"{g:+.2%}" for g in arm["loss_gaps_model"])
        print(
            f"{name}: {arm['frame_bytes_per_microbatch'] / 1024:.1f} KiB/microbatch ({arm['frame_ratio']:.2f}x), "
            f"loss gap {arm['loss_gap_mean']:+.2%} +- {arm['loss_gap_std']:.2%} ({gaps}); "
            f"model {arm['loss_gap_model_mean']:+.2%} +- {arm['loss_gap_model_std']:.2%} ({model_gaps})"
        )
    print(f"load average {result['load_average_start']:.1f} -> {result['load_average_end']:.1f}")
    print(json.dumps(headline(result), indent=1))


if __name__ == "__main__":
    main()
