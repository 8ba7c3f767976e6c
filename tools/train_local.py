"""Single-process reference training: the baseline every distributed run is compared with.

Plain AdamW on the whole training split, held-out loss at fixed intervals. Run as
`python -m tools.train_local --steps 240` for a quick check of the model and data modules.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass

import torch

from node.ml.data import BatchSampler, Corpus, evaluate, load_corpus, validation_batches
from node.ml.model import ModelConfig, build_model, count_parameters

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalTrainResult:
    eval_steps: list[int]  # inner steps after which held-out loss was measured
    losses: list[float]  # held-out loss (nats/token) at each of eval_steps
    train_seconds: float  # wall time of the training steps, evaluation excluded
    steps: int

    @property
    def step_seconds(self) -> float:
        return self.train_seconds / max(self.steps, 1)


def train_local_run(
    cfg: ModelConfig,
    corpus: Corpus,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    eval_every: int | None = None,
    num_val_batches: int = 16,
    weight_decay: float = 0.01,
) -> LocalTrainResult:
    """Train a fresh model from `seed` for `steps` AdamW steps; evaluate every `eval_every` and at the end."""
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError(f"need steps >= 1, batch_size >= 1, lr > 0; got {steps}, {batch_size}, {lr}")
    eval_every = eval_every or steps
    model = build_model(cfg, seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sampler = BatchSampler(
        corpus.train_stream(),
        batch_size=batch_size,
        context_len=cfg.context_len,
        generator=torch.Generator().manual_seed(seed),
    )
    held_out = validation_batches(
        corpus, batch_size=batch_size, context_len=cfg.context_len, num_batches=num_val_batches
    )
    eval_steps: list[int] = []
    losses: list[float] = []
    train_seconds = 0.0
    for step in range(1, steps + 1):
        started = time.perf_counter()
        inputs, targets = sampler.next_batch()
        _, loss = model(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        train_seconds += time.perf_counter() - started
        if step % eval_every == 0 or step == steps:
            eval_steps.append(step)
            losses.append(evaluate(model, held_out))
            logger.info("step %d: train loss %.3f, held-out loss %.3f", step, loss.item(), losses[-1])
    return LocalTrainResult(eval_steps=eval_steps, losses=losses, train_seconds=train_seconds, steps=steps)


def train_local(
    cfg: ModelConfig,
    corpus: Corpus,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    *,
    eval_every: int | None = None,
    num_val_batches: int = 16,
) -> list[float]:
    """Held-out losses of a single-process AdamW run, at every `eval_every` steps and at the end."""
    result = train_local_run(
        cfg,
        corpus,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        eval_every=eval_every,
        num_val_batches=num_val_batches,
    )
    return result.losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=40)
    parser.add_argument("--data", default=None, help="text file or directory; default: the stdlib source")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = ModelConfig()
    corpus = load_corpus(args.data)
    print(f"model: {count_parameters(build_model(cfg, args.seed)):,} parameters; corpus {corpus.source}")
    result = train_local_run(
        cfg,
        corpus,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        eval_every=args.eval_every,
    )
    for step, loss in zip(result.eval_steps, result.losses, strict=True):
        print(f"step {step:5d}  held-out loss {loss:.3f}")
    tokens_per_s = args.batch_size * cfg.context_len / result.step_seconds
    print(
        f"step time {result.step_seconds * 1000:.0f} ms at batch {args.batch_size} ({tokens_per_s:,.0f} tokens/s)"
    )


if __name__ == "__main__":
    main()
