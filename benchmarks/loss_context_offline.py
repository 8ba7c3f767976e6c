"""The held-out loss screen's false positives on the poisoning benchmark's model, offline: where honest work is
scored (today's global model or its base context) and how many held-out batches it is scored on.

One process, no network: the poisoning benchmark's tiny model (vocab 256, context 32, 2 layers, width 32) on the
built-in corpus, 4 learners (AdamW lr 3e-3, batch 4, learner i on shard 3i of 16), streaming DiLoCo as the live
run's plan has it (3 fragments: the head's with half the body, the other half, the token embedding), each fragment
synced every 8 steps, staggered (steps 0, 3 and 6 mod 8), every round the mean of the 4 learners' deltas at outer
Nesterov 0.7 / 0.9. Every delta is scored as node.diloco.loss_probe does (loss with the delta applied alone, with
it reversed, before), in today's global model and in its base context (the whole model as that fragment's base was
published: node.diloco.syncer_core.probe_context), and so is its sign flip; a score is refused as
LossBound.check's floor and reverse rules have it (descent below -`loss_reverse_tolerance` x loss, or a rise over
`loss_tolerance` x loss without a descent above that margin; the learned MAD bound is left out).

    python -m benchmarks.loss_context_offline [--steps 240] [--probe-seeds 1000,2000,3000] [--batches 2,4]

Writes benchmarks/results/loss_context_offline.json: per (context, batches), honest scores refused and flipped
ones passed, over the run and per fragment.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Mapping
from typing import Any

import torch

from benchmarks.common import write_result
from node.diloco.screening import ScreeningConfig
from node.diloco.sync_client import run_fragment_plan
from node.ml.data import Batch, BatchSampler, evaluate, load_corpus
from node.ml.model import ModelConfig, build_model
from protocol.manifest import DilocoSpec, RunManifest

NAME = "loss_context_offline"
MODEL = {"vocab_size": 256, "context_len": 32, "num_layers": 2, "width": 32, "num_heads": 2}
LEARNERS, H = 4, 8
SLOTS = {0: 0, 3: 1, 6: 2}  # step mod H -> the fragment synced then (staggered, as the live learners send)
Tensors = dict[str, torch.Tensor]


def verdict(before: float, after: float, opposite: float, screening: ScreeningConfig) -> bool:
    """Whether LossBound.check (floor only) refuses the score."""
    descent = opposite - after
    margin = screening.loss_reverse_tolerance * abs(before)
    floor = screening.loss_tolerance * abs(before)
    return descent < -margin or (after - before > floor and not descent > margin)


class Run:
    """The learners, the global model, its outer momentum, and each fragment's base context."""

    def __init__(self, probe_seed: int, batches: int) -> None:
        torch.manual_seed(0)
        self.cfg = ModelConfig.from_dict(MODEL)
        manifest = RunManifest(model=dict(MODEL), num_stages=1, diloco=DilocoSpec(num_fragments=2))
        self.fragments = [list(f.names) for f in run_fragment_plan(manifest).fragments]
        corpus = load_corpus(None)
        held = corpus.validation_stream()
        starts = torch.randint(
            0,
            held.num_starts(self.cfg.context_len),
            (batches, 8),
            generator=torch.Generator().manual_seed(probe_seed),
        )
        self.probe_batches: list[Batch] = [held.windows(row, self.cfg.context_len) for row in starts]
        model = build_model(self.cfg, seed=0)
        self.global_ = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.momentum = {n: torch.zeros_like(t) for n, t in self.global_.items()}
        self.locals = [copy.deepcopy(model) for _ in range(LEARNERS)]
        self.optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01) for m in self.locals]
        self.samplers = [
            BatchSampler(
                corpus.train_stream(3 * i, 16),
                batch_size=4,
                context_len=self.cfg.context_len,
                generator=torch.Generator().manual_seed(i),
            )
            for i in range(LEARNERS)
        ]
        self.probe = copy.deepcopy(model)
        self.contexts = [dict(self.global_) for _ in self.fragments]

    def loss(self, params: Mapping[str, torch.Tensor]) -> float:
        self.probe.load_state_dict(dict(params), strict=True)
        return evaluate(self.probe, self.probe_batches)

    def inner_step(self) -> None:
        for model, optimizer, sampler in zip(self.locals, self.optimizers, self.samplers, strict=True):
            inputs, targets = sampler.next_batch()
            _, loss = model(inputs, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    def scores(
        self, fragment: int, deltas: list[Tensors], screening: ScreeningConfig
    ) -> list[dict[str, Any]]:
        names = self.fragments[fragment]
        out = []
        for context_name, context in (("today", dict(self.global_)), ("base", self.contexts[fragment])):
            before = self.loss(context)
            for delta in deltas:
                after = self.loss({**context, **{n: context[n] - delta[n] for n in names}})
                opposite = self.loss({**context, **{n: context[n] + delta[n] for n in names}})
                out.append(
                    {
                        "context": context_name,
                        "fragment": fragment,
                        "honest_refused": verdict(before, after, opposite, screening),
                        "flip_refused": verdict(before, opposite, after, screening),
                    }
                )
        return out

    def sync(self, fragment: int, screening: ScreeningConfig) -> list[dict[str, Any]]:
        """Every learner's delta of `fragment` scored, then merged (mean, outer Nesterov) and fetched."""
        names = self.fragments[fragment]
        deltas = [
            {n: self.global_[n] - dict(m.named_parameters())[n].detach() for n in names} for m in self.locals
        ]
        scored = self.scores(fragment, deltas, screening)
        for n in names:
            mean = torch.stack([d[n] for d in deltas]).mean(0)
            self.momentum[n] = 0.9 * self.momentum[n] + mean
            self.global_[n] = self.global_[n] - 0.7 * (mean + 0.9 * self.momentum[n])
        self.contexts[fragment] = dict(self.global_)
        with torch.no_grad():
            for model in self.locals:
                for n, p in model.named_parameters():
                    if n in names:
                        p.copy_(self.global_[n])
        return scored


def run(steps: int, probe_seed: int, batches: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    state, screening, records = Run(probe_seed, batches), ScreeningConfig(), []
    for step in range(steps):
        state.inner_step()
        if step % H in SLOTS:
            records += [{**r, "step": step} for r in state.sync(SLOTS[step % H], screening)]
    return records


def rates(records: list[dict[str, Any]]) -> dict[str, Any]:
    count = len(records)
    return {
        "scores": count,
        "honest_refused": sum(r["honest_refused"] for r in records),
        "flips_passed": sum(not r["flip_refused"] for r in records),
        "honest_refused_by_fragment": [
            sum(r["honest_refused"] for r in records if r["fragment"] == f) for f in range(3)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument(
        "--probe-seeds", default="1000,2000,3000", help="held-out draws (the syncer's are random)"
    )
    parser.add_argument("--batches", default="2,4", help="held-out batches of 8 windows per score")
    args = parser.parse_args(argv)
    table: dict[str, Any] = {}
    for batches in [int(b) for b in args.batches.split(",")]:
        every: list[dict[str, Any]] = []
        for seed in [int(s) for s in args.probe_seeds.split(",")]:
            every += run(args.steps, seed, batches)
        for context in ("today", "base"):
            table[f"{context}, {batches} batches"] = rates([r for r in every if r["context"] == context])
            print(context, batches, table[f"{context}, {batches} batches"], flush=True)
    config = {"steps": args.steps, "probe_seeds": args.probe_seeds, "batches": args.batches}
    path = write_result(NAME, table, {"config": config})
    print(json.dumps(table))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
