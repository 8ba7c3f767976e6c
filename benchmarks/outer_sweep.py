"""DiLoCo's outer settings at the quality benchmark's scale, in one process: which H and outer step to run it with.

benchmarks/real_model_quality.py compares a live swarm with one process at equal tokens over a few hundred thousand
tokens, i.e. a few dozen outer rounds. This runs the same algorithm without the network, so what it measures is the
algorithm's own gap, not the system's: M replicas of the quality benchmark's model (llama-20m at context 128, the
trained 8k BPE, the built-in corpus, AdamW with its inner state kept across rounds), each training H steps of its own
batches from the round's global model, then one outer step on the mean of their deltas (node.diloco.outer's
OuterNesterov, the syncer's), evaluated on the same held-out batches as the live run. The reference is one process
at the swarm's global batch (M x batch) with the same optimiser.

Each variant is `H=..,outer_lr=..,momentum=..` (defaults: the quality benchmark's M and batch). The headline gives
each variant's relative gap to the reference at the last evaluation point both reached.
Run: `python -m benchmarks.outer_sweep [--tokens N] [--variants "H=10,outer_lr=0.7,momentum=0.9;..."]`.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import plot_path, write_result
from benchmarks.goodput import interpolate
from benchmarks.real_model_quality import QualityConfig, Setup, train_tokenizer
from node.diloco.outer import OuterNesterov
from node.ml.data import BatchSampler, evaluate
from node.ml.model import build_model

NAME = "outer_sweep"
DEFAULT_VARIANTS = (
    "H=10,outer_lr=0.7,momentum=0.9;H=10,outer_lr=1.0,momentum=0.0;H=5,outer_lr=1.0,momentum=0.0"
)
EVAL_EVERY_TOKENS = 25_000


@dataclass(frozen=True, kw_only=True, slots=True)
class Variant:
    sync_every_steps: int
    outer_lr: float
    momentum: float
    replicas: int

    @property
    def label(self) -> str:
        return f"H={self.sync_every_steps},outer_lr={self.outer_lr},momentum={self.momentum}"


def parse_variant(text: str, replicas: int) -> Variant:
    """'H=5,outer_lr=1.0,momentum=0.0' -> Variant; ValueError naming the valid keys."""
    values: dict[str, str] = dict(part.split("=", 1) for part in text.split(",") if part.strip())
    unknown = set(values) - {"H", "outer_lr", "momentum"}
    if unknown:
        raise ValueError(f"unknown variant keys {sorted(unknown)}; valid: H, outer_lr, momentum")
    return Variant(
        sync_every_steps=int(values.get("H", 10)),
        outer_lr=float(values.get("outer_lr", 0.7)),
        momentum=float(values.get("momentum", 0.9)),
        replicas=replicas,
    )


def train_round(
    replicas: Sequence[torch.nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    samplers: Sequence[BatchSampler],
    global_params: Mapping[str, torch.Tensor],
    steps: int,
) -> int:
    """Each replica starts from `global_params` and takes `steps` inner steps on its own batches; the tokens
    trained, all replicas together."""
    trained = 0
    for replica, optimizer, sampler in zip(replicas, optimizers, samplers, strict=True):
        replica.load_state_dict(global_params, strict=False)
        replica.train()
        for _ in range(steps):
            inputs, targets = sampler.next_batch()
            optimizer.zero_grad(set_to_none=True)
            replica(inputs, targets)[1].backward()
            optimizer.step()
            trained += int(inputs.numel())
    return trained


def run_diloco(
    setup: Setup, variant: Variant, tokens: int, batch_size: int, eval_every_tokens: int = EVAL_EVERY_TOKENS
) -> list[tuple[int, float]]:
    """Held-out loss of the global model against tokens trained, every `eval_every_tokens`. One replica, H = 1 and
    plain averaging is one process (tests/unit/test_outer_sweep.py)."""
    cfg = setup.cfg
    model = build_model(setup.model_cfg, cfg.seed)
    global_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    replicas = [copy.deepcopy(model) for _ in range(variant.replicas)]
    optimizers = [torch.optim.AdamW(r.parameters(), lr=cfg.lr, weight_decay=0.01) for r in replicas]
    samplers = [setup.sampler(cfg.seed + i, batch_size) for i in range(variant.replicas)]
    outer = OuterNesterov(variant.outer_lr, variant.momentum)
    curve, trained, next_eval = [(0, evaluate(model, setup.held))], 0, eval_every_tokens
    while trained < tokens:
        trained += train_round(replicas, optimizers, samplers, global_params, variant.sync_every_steps)
        locals_ = [dict(r.named_parameters()) for r in replicas]
        delta = {
            n: torch.stack([g - p[n].detach() for p in locals_]).mean(dim=0) for n, g in global_params.items()
        }
        global_params.update(outer.step(global_params, delta))
        if trained >= next_eval:
            model.load_state_dict(global_params, strict=False)
            curve.append((trained, evaluate(model, setup.held)))
            next_eval += eval_every_tokens
            print(f"  {variant.label}: {trained:,} tokens, held-out {curve[-1][1]:.4f}", flush=True)
    return curve


def measure(cfg: QualityConfig, variants: list[Variant], tokens: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # variants are compared with each other, not timed
    root = Path(tempfile.mkdtemp(prefix="hivenode-outer-sweep-"))
    try:
        setup = Setup.build(cfg, train_tokenizer(root, cfg.vocab_size))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    reference = Variant(sync_every_steps=1, outer_lr=1.0, momentum=0.0, replicas=1)
    curves = {"one_process": run_diloco(setup, reference, tokens, cfg.batch_size * cfg.learners)}
    for variant in variants:
        started = time.monotonic()
        curves[variant.label] = run_diloco(setup, variant, tokens, cfg.batch_size)
        print(f"  {variant.label}: {time.monotonic() - started:.0f} s", flush=True)
    return {"tokens": tokens, "curves": curves, "gaps": gaps(curves)}


def gaps(curves: dict[str, list[tuple[int, float]]]) -> dict[str, dict[str, float]]:
    """Each variant's loss at the last token count both it and the reference reached, and its relative gap."""
    reference = curves["one_process"]
    out: dict[str, dict[str, float]] = {}
    for label, curve in curves.items():
        if label == "one_process":
            continue
        at = min(curve[-1][0], reference[-1][0])
        loss, ref = interpolate(curve, at) or math.nan, interpolate(reference, at) or math.nan
        out[label] = {
            "tokens": at,
            "loss": round(loss, 4),
            "reference": round(ref, 4),
            "gap": round(loss / ref - 1, 4),
        }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, curve in result["curves"].items():
        ax.plot([t for t, _ in curve], [loss for _, loss in curve], marker=".", label=label)
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title("in-process DiLoCo (4 replicas) against one process at the global batch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=300_000)
    parser.add_argument(
        "--variants", default=DEFAULT_VARIANTS, help="';'-separated H=..,outer_lr=..,momentum=.."
    )
    args = parser.parse_args(argv)
    cfg = QualityConfig()
    variants = [parse_variant(text, cfg.learners) for text in args.variants.split(";") if text.strip()]
    result = measure(cfg, variants, args.tokens)
    best = min(result["gaps"].items(), key=lambda item: item[1]["gap"])
    headline = {"tokens": result["tokens"], "best": best[0], "best_gap": best[1]["gap"]}
    headline.update({f"gap[{label}]": g["gap"] for label, g in result["gaps"].items()})
    print(json.dumps(write_result(NAME, headline, result).name), file=sys.stderr)
    plot(result, plot_path(NAME))
    print(json.dumps(headline, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
