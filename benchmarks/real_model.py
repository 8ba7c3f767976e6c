"""Overhead of our model path against a plain transformers + AdamW loop, on the same model, in one process.

Three arms per preset, interleaved round by round (so machine load hits them alike), same batches:

* plain: `AutoModelForCausalLM.from_config(...)` + AdamW, loss from transformers' own `labels` path;
* ours: `node.ml.model.build_model` (transformers' decoder layers under our stage glue) + AdamW;
* learner: the learner role's `_inner_step` itself (schedule, clipping and accumulation code included) on our
  model, with the DiLoCo sync bookkeeping stubbed out: what a learner process spends per step on compute.

Byte vocabulary (256), context 256 for the larger presets. Headline: tokens/s ratios against plain (goal
>= 0.95). What this does NOT measure: a whole learner process (DHT, sync pushes, the asyncio loop).

`--quality`: also the swarm against one process at equal tokens with a trained BPE (benchmarks/
real_model_quality.py; headline `loss_gap_swarm`, goal <= 3 %, and the plot real_model.png); `--presets ""
--quality` runs only that and keeps the overhead figures already in real_model.json; without `--quality` the
comparison already there is kept (its headline recomputed from its detail).

Run: `python -m benchmarks.real_model [--presets llama-tiny,llama-20m,llama-124m] [--rounds 3] [--steps 3]
[--quality [--quality-tokens N]]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, plot_path, write_result
from benchmarks.real_model_quality import QualityConfig
from benchmarks.real_model_quality import measure as measure_quality
from benchmarks.real_model_quality import plot as plot_quality
from node.ml.model import ModelConfig, build_model, count_parameters, hf_config
from node.roles.learner import LearnerRole
from protocol.manifest import InnerOptimizerSpec

NAME = "real_model"
SHAPES = {"llama-tiny": (128, 8), "llama-20m": (256, 4), "llama-124m": (256, 2)}  # context, batch


def _batches(cfg: ModelConfig, batch: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        w = torch.randint(0, cfg.vocab_size, (batch, cfg.context_len + 1), generator=gen)
        out.append((w[:, :-1], w[:, 1:]))
    return out


def _arms(cfg: ModelConfig, inner: InnerOptimizerSpec) -> dict[str, Callable[[Any], None]]:
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(hf_config(cfg))
    plain.load_state_dict(build_model(cfg, 0).state_dict())
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=inner.lr, weight_decay=inner.weight_decay)
    ours = build_model(cfg, 0)
    ours_opt = torch.optim.AdamW(ours.parameters(), lr=inner.lr, weight_decay=inner.weight_decay)
    learner_model = build_model(cfg, 0)
    feed = SimpleNamespace(batch=None)
    learner: Any = SimpleNamespace(
        _model=learner_model,
        _optimizer=torch.optim.AdamW(
            learner_model.parameters(), lr=inner.lr, weight_decay=inner.weight_decay
        ),
        _sampler=SimpleNamespace(next_batch=lambda: feed.batch),
        sync=SimpleNamespace(after_inner_step=lambda step, tokens: None),
        ctx=SimpleNamespace(manifest=SimpleNamespace(inner=inner), device="cpu"),
    )

    def plain_step(batch: Any) -> None:
        plain_opt.zero_grad(set_to_none=True)
        plain(input_ids=batch[0], labels=batch[0]).loss.backward()
        plain_opt.step()

    def ours_step(batch: Any) -> None:
        ours_opt.zero_grad(set_to_none=True)
        ours(*batch)[1].backward()
        ours_opt.step()

    def learner_step(batch: Any) -> None:
        feed.batch = batch
        LearnerRole._inner_step(learner, 1)

    return {"plain": plain_step, "ours": ours_step, "learner": learner_step}


def measure(preset: str, rounds: int, steps: int) -> dict[str, Any]:
    context, batch = SHAPES[preset]
    cfg = ModelConfig.from_dict({"preset": preset, "context_len": context})
    inner = InnerOptimizerSpec(batch_size=batch)
    arms = _arms(cfg, inner)
    data = _batches(cfg, batch, steps)
    for step in arms.values():  # warm-up: allocator, kernels, AdamW state
        step(data[0])
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, step in arms.items():
            started = time.perf_counter()
            for b in data:
                step(b)
            rates[name].append(steps * batch * context / (time.perf_counter() - started))
    medians = {name: statistics.median(r) for name, r in rates.items()}
    result = {
        "preset": preset,
        "parameters": count_parameters(build_model(cfg, 0)),
        "context_len": context,
        "batch_size": batch,
        "tokens_per_s": medians,
        "rounds": rates,
        "ratio_ours": medians["ours"] / medians["plain"],
        "ratio_learner": medians["learner"] / medians["plain"],
    }
    print(
        f"{preset}: plain {medians['plain']:,.0f} tok/s, ours {result['ratio_ours']:.3f}x, "
        f"learner step {result['ratio_learner']:.3f}x",
        flush=True,
    )
    return result


OVERHEAD_KEYS = ("device", "goal", "overhead_ratio_", "model_ratio_")


def keep_earlier(results: list[dict[str, Any]], quality: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(headline, detail) to start from: what real_model.json holds of the halves not run now (the overhead
    presets when none ran, the quality comparison without --quality), so that each half can be rerun alone."""
    path = RESULTS_DIR / f"{NAME}.json"
    earlier = json.loads(path.read_text()) if path.exists() else {}
    headline: dict[str, Any] = {"device": "cpu", "goal": 0.95}
    detail: dict[str, Any] = {"results": results}
    if not results and earlier:
        headline = {k: v for k, v in earlier["headline"].items() if k.startswith(OVERHEAD_KEYS)}
        detail["results"] = earlier["results"]
    if not quality and "quality" in earlier:
        headline.update(quality_headline(earlier["quality"]))
        detail["quality"] = earlier["quality"]
    return headline, detail


def quality_headline(quality: dict[str, Any]) -> dict[str, Any]:
    swarm = quality["swarm"]
    trained = swarm.get("trained_tokens") or 0
    return {
        "loss_gap_swarm": quality["loss_gap_swarm"],
        "loss_gap_swarm_small_batch": quality["loss_gap_swarm_small_batch"],
        "quality_mode": quality["config"]["mode"],
        "quality_goal": 0.03,
        # tokens in the model over tokens the learners trained: the rest was refused (missed rounds) or overwritten
        "quality_compute_share": round(quality["tokens_compared"] / trained, 3) if trained else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="llama-tiny,llama-20m,llama-124m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quality", action="store_true", help="also the swarm against one process")
    parser.add_argument("--quality-tokens", type=int, default=QualityConfig().tokens)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one core per arm: a shared 2-core box oversubscribed by 2 threads is all noise
    results = [measure(p, args.rounds, args.steps) for p in filter(None, args.presets.split(","))]
    headline, detail = keep_earlier(results, args.quality)
    for r in results:
        key = r["preset"].removeprefix("llama-")
        headline[f"overhead_ratio_{key}"] = round(r["ratio_learner"], 3)
        headline[f"model_ratio_{key}"] = round(r["ratio_ours"], 3)
    if args.quality:
        quality = measure_quality(QualityConfig(tokens=args.quality_tokens))
        headline.update(quality_headline(quality))
        detail["quality"] = quality
        plot_quality(quality, plot_path(NAME))
    path = write_result(NAME, headline, detail)
    print(f"headline {headline}\nwrote {path}")


if __name__ == "__main__":
    main()
