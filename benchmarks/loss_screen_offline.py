"""The syncer's held-out loss screen on a real model, offline: the scores honest and sign-flipped contributions get.

`benchmarks.real_model_quality --screen-check` showed the screen refusing honest llama-20m learners (and banning
three of four at ~257k tokens). This measures why, in one process and without the network: M replicas of the
quality benchmark's model (llama-20m at context 128, the trained 8k BPE, the built-in corpus, AdamW, H steps a
round, every replica in every round: the live run's K = M; replica i on shard i of the learner's `num_shards`, as
learners on the built-in corpus each train on one shard), and each round, for each fragment (the embedding and
the rest, as the live run's fragment plan) and each replica, the probe's score as the syncer computes it
(node.diloco.loss_probe: held-out loss after the fragment's delta applied to the global model, minus before, on
`loss_batches` x `loss_batch_size` private held-out windows), for the honest delta and its sign flip (the
poisoning benchmark's ascent attack), each applied alone at weight 1 (today's probe) and at its share of the merge,
1/M. Then how often each rule (the floor `loss_tolerance` x loss, on either scale) refuses honest work and passes
flips, over the run and in its last third.

    python -m benchmarks.loss_screen_offline [--tokens 300000] [--replicas 4] [--score-every 2] [--shards 16]
    python -m benchmarks.loss_screen_offline --rescore [--shards 0]   # the headline again from the rounds

Writes benchmarks/results/loss_screen_offline.json (`--shards 0`, every replica on the whole split:
loss_screen_offline_iid.json) with a `headline` (per rule, honest refusal and flip pass rates, over the run and
its last third) and a plot of the scores against tokens.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, plot_path, write_result
from benchmarks.outer_sweep import train_round
from benchmarks.real_model_quality import QualityConfig, Setup, train_tokenizer
from node.diloco.screening import ScreeningConfig
from node.ml.data import Batch, BatchSampler, evaluate
from node.ml.model import build_model
from node.roles.learner import LearnerConfig

NAME = "loss_screen_offline"
KINDS = ("honest@1", "honest@1/M", "flip@1", "flip@1/M")


def probe_batches(setup: Setup, screening: ScreeningConfig, seed: int) -> list[Batch]:
    """Held-out windows at random offsets, as node.roles.syncer.build_probe draws them (seeded here)."""
    stream = setup.corpus.validation_stream()
    context = setup.cfg.context_len
    gen = torch.Generator().manual_seed(seed)
    last = stream.num_starts(context) - 1
    starts = torch.randint(0, last + 1, (screening.loss_batches, screening.loss_batch_size), generator=gen)
    return [stream.windows(row, context) for row in starts]


def fragments(names: Sequence[str]) -> dict[str, list[str]]:
    """The live run's plan at num_fragments = 1: the embedding, and every other tensor."""
    embedding = [n for n in names if "embed" in n]
    return {"embedding": embedding, "body": [n for n in names if n not in embedding]}


def score_round(
    probe: torch.nn.Module,
    batches: list[Batch],
    global_params: Mapping[str, torch.Tensor],
    deltas: list[dict[str, torch.Tensor]],
    plan: Mapping[str, list[str]],
) -> dict[str, Any]:
    """Every replica's scores (KINDS) per fragment: loss with the fragment's delta applied alone, minus before."""

    def loss_with(changes: Mapping[str, torch.Tensor]) -> float:
        probe.load_state_dict({**global_params, **changes}, strict=False)
        return evaluate(probe, batches)

    before = loss_with({})
    scales = {
        "honest@1": -1.0,
        "honest@1/M": -1.0 / len(deltas),
        "flip@1": 1.0,
        "flip@1/M": 1.0 / len(deltas),
    }
    scores: dict[str, dict[str, list[float]]] = {f: {k: [] for k in KINDS} for f in plan}
    for delta in deltas:
        for fragment, names in plan.items():
            for kind, scale in scales.items():
                # delta = global - local: honest work moves the global model by -delta
                changed = {n: global_params[n] + scale * delta[n] for n in names}
                scores[fragment][kind].append(loss_with(changed) - before)
    return {"before": before, "scores": scores}


def samplers_of(setup: Setup, replicas: int, num_shards: int) -> list[BatchSampler]:
    """Replica i trains on shard i of `num_shards` of the training split, as a learner on the built-in corpus
    takes one shard of the learner's `num_shards` (by peer id there); 0: every replica on the whole split."""
    cfg = setup.cfg
    return [
        BatchSampler(
            setup.corpus.train_stream(i % num_shards, num_shards)
            if num_shards
            else setup.corpus.train_stream(),
            batch_size=cfg.batch_size,
            context_len=cfg.context_len,
            generator=torch.Generator().manual_seed(cfg.seed + i),
        )
        for i in range(replicas)
    ]


def run(
    setup: Setup,
    replicas: int,
    tokens: int,
    screening: ScreeningConfig,
    score_every: int = 1,
    num_shards: int = 0,
) -> list[dict[str, Any]]:
    """Synchronous DiLoCo at outer lr 1 without momentum (the quality run's), scored every `score_every` rounds."""
    cfg = setup.cfg
    model = build_model(setup.model_cfg, cfg.seed)
    probe = copy.deepcopy(model)
    global_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan = fragments(list(global_params))
    locals_ = [copy.deepcopy(model) for _ in range(replicas)]
    optimizers = [torch.optim.AdamW(r.parameters(), lr=cfg.lr, weight_decay=0.01) for r in locals_]
    samplers = samplers_of(setup, replicas, num_shards)
    batches = probe_batches(setup, screening, cfg.seed + 1000)
    rounds, trained, index = [], 0, 0
    while trained < tokens:
        index += 1
        trained += train_round(locals_, optimizers, samplers, global_params, cfg.sync_every_steps)
        params = [dict(r.named_parameters()) for r in locals_]
        deltas = [{n: g - p[n].detach() for n, g in global_params.items()} for p in params]
        scored = index == 1 or index % score_every == 0
        record = score_round(probe, batches, global_params, deltas, plan) if scored else None
        for n in global_params:
            global_params[n] = global_params[n] - torch.stack([d[n] for d in deltas]).mean(dim=0)
        if record is None:
            continue
        rounds.append({"tokens": trained, **record})
        body = record["scores"]["body"]
        print(
            f"  {trained:,} tokens, probe loss {record['before']:.3f}, body honest@1 "
            f"{max(body['honest@1']):+.3f} max, flip@1/M {min(body['flip@1/M']):+.3f} min",
            flush=True,
        )
    return rounds


def rates(rounds: list[dict[str, Any]], tolerance: float) -> dict[str, dict[str, float]]:
    """Per probe scale: the share of honest scores over the floor (`tolerance` x loss before: refused) and of
    flipped ones under it (passed), over every fragment and replica of `rounds`."""
    out: dict[str, dict[str, float]] = {}
    for scale in ("1", "1/M"):
        honest = flips = refused = passed = 0
        for r in rounds:
            floor = tolerance * abs(r["before"])
            for per_kind in r["scores"].values():
                honest += len(per_kind[f"honest@{scale}"])
                refused += sum(s > floor for s in per_kind[f"honest@{scale}"])
                flips += len(per_kind[f"flip@{scale}"])
                passed += sum(s <= floor for s in per_kind[f"flip@{scale}"])
        out[scale] = {
            "honest_refused": round(refused / max(1, honest), 4),
            "flip_passed": round(passed / max(1, flips), 4),
        }
    out["1, reverse"] = descent_rates(rounds, tolerance, ScreeningConfig().loss_reverse_tolerance)
    return out


def descent_rates(
    rounds: list[dict[str, Any]], tolerance: float, reverse_tolerance: float
) -> dict[str, float]:
    """The screen as it is now, at weight 1 (node.diloco.loss_probe.LossBound.check on the floor): refused when
    the loss is higher than with the delta reversed by more than `reverse_tolerance` x loss, or when it rises over
    the floor without being lower than its reverse by more than that. A flip's reverse is the honest delta."""

    def refused(rise: float, reverse_rise: float, before: float) -> bool:
        descent = reverse_rise - rise
        floor = tolerance * abs(before)
        margin = reverse_tolerance * abs(before)
        return descent < -margin or (rise > floor and descent <= margin)

    count = honest_refused = flip_passed = 0
    for r in rounds:
        for per_kind in r["scores"].values():
            for honest, flip in zip(per_kind["honest@1"], per_kind["flip@1"], strict=True):
                count += 1
                honest_refused += refused(honest, flip, r["before"])
                flip_passed += not refused(flip, honest, r["before"])
    return {
        "honest_refused": round(honest_refused / max(1, count), 4),
        "flip_passed": round(flip_passed / max(1, count), 4),
    }


def plot(rounds: list[dict[str, Any]], tolerance: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    for ax, fragment in zip(axes, ("body", "embedding"), strict=True):
        for kind in KINDS:
            xs = [r["tokens"] for r in rounds for _ in r["scores"][fragment][kind]]
            ys = [s for r in rounds for s in r["scores"][fragment][kind]]
            ax.scatter(xs, ys, s=6, label=kind)
        ax.plot(
            [r["tokens"] for r in rounds], [tolerance * r["before"] for r in rounds], "k--", label="floor"
        )
        ax.axhline(0.0, color="grey", lw=0.5)
        ax.set_title(f"fragment: {fragment}")
        ax.set_xlabel("tokens trained")
        ax.set_ylabel("held-out loss delta (nats)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def headline_of(rounds: list[dict[str, Any]], tolerance: float) -> dict[str, Any]:
    late = rounds[len(rounds) * 2 // 3 :]
    return {
        "loss_tolerance": tolerance,
        "rates": rates(rounds, tolerance),
        "rates_last_third": rates(late, tolerance),
    }


def rescore(name: str) -> int:
    """The headline again from the rounds already measured (after a change to the rules compared here)."""
    path = RESULTS_DIR / f"{name}.json"
    result = json.loads(path.read_text())
    rounds = result["rounds"]
    headline = {**result["headline"], **headline_of(rounds, result["headline"]["loss_tolerance"])}
    print(headline)
    write_result(name, headline, {"rounds": rounds})
    plot(rounds, headline["loss_tolerance"], plot_path(name))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=300_000)
    parser.add_argument("--replicas", type=int, default=QualityConfig().learners)
    parser.add_argument("--score-every", type=int, default=2, help="rounds between scored rounds (CPU)")
    parser.add_argument(
        "--shards",
        type=int,
        default=LearnerConfig().num_shards,
        help="replica i trains on shard i of this many (the learner's num_shards); 0: the whole split each",
    )
    parser.add_argument("--rescore", action="store_true", help="recompute the headline from the results file")
    args = parser.parse_args(argv)
    name = NAME if args.shards else f"{NAME}_iid"
    if args.rescore:
        return rescore(name)
    torch.set_num_threads(1)
    cfg, screening = QualityConfig(), ScreeningConfig()
    root = Path(tempfile.mkdtemp(prefix="hivenode-loss-screen-"))
    try:
        setup = Setup.build(cfg, train_tokenizer(root, cfg.vocab_size))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    started = time.monotonic()
    rounds = run(setup, args.replicas, args.tokens, screening, args.score_every, args.shards)
    headline = {
        "tokens": args.tokens,
        "replicas": args.replicas,
        "scored_rounds": len(rounds),
        "shards": args.shards,
        **headline_of(rounds, screening.loss_tolerance),
        "seconds": round(time.monotonic() - started, 1),
    }
    print(headline)
    write_result(name, headline, {"rounds": rounds})
    plot(rounds, screening.loss_tolerance, plot_path(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
