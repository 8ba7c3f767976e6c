"""Outer-gradient codecs in one process (issue 20 part 1): which codec settings keep the loss at >= 150x.

The live benchmark (`benchmarks.bandwidth_live`) costs minutes per arm; this runs the same algorithm without the
network, in seconds: the goodput swarm's model and recipe (byte-level llama, 2 layers of width 64, context 32,
AdamW lr 3e-3, batch 8, H = 12, 2 fragments plus the embedding, 4 learners on shards of the built-in corpus), each
learner's pseudo-gradient per fragment encoded with the real codec and error feedback
(`node.diloco.compression.ContributionEncoder`), decoded as the syncer does (`decode_contribution`), merged by the
syncer's `merge_fragment` (RDA, clipping at 3x the median norm, the screen's winsorizing `trim_fraction`) and
stepped by `OuterNesterov`. Rounds are synchronous (every fragment each round), unlike the live run's streaming.

    gap of a variant = its held-out loss at the last round / the fp32 arm's - 1   (same tokens, same seeds)

`gap_last5` compares the mean of the last 5 rounds' losses instead (one round's loss swings by a few per cent under
the default Nesterov step). The noise floor is the gap of an fp32 arm with other data seeds (`seed=1`). Each
variant is a ';'-separated item of comma-separated keys: codec (fp32 | topk | randk | int8 | int4), chunk, k,
bits, scale_bits, decay (the codec's feedback_decay), rotate (randk: 1 rotating strata of one permutation, 0 a
fresh draw per round), trim (the merge's trim_fraction), sparse (1: the merge's sparse winsorizing, what a syncer
under a top-k codec does), rda (0: plain mean instead of RDA), lr and momentum (the outer step), seed (data seeds
offset), init (the model's initialization seed offset). Every gap is against an fp32 arm (seed 0) with the variant's own outer step (lr, momentum), run once per
step; a randk push's mask is `mask_for(run_seed=SEED, fragment, version=round)`, as both sides would derive it.
`--energy` prints instead, per codec and fragment, the share of one learner's pseudo-gradient (48 AdamW steps from
the initial model) one push delivers: 1 - ||delta - decoded||^2 / ||delta||^2.
Run: `python -m benchmarks.codec_sweep [--rounds 30] [--variants "codec=topk,k=32;..."] [--write [--name N]]`.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks.common import write_result
from node.diloco.compression import ContributionEncoder, decode_contribution, fragment_delta
from node.diloco.fragments import FragmentPlan, plan_fragments
from node.diloco.merge import Contribution, merge_fragment
from node.diloco.outer import OuterNesterov
from node.ml.data import Batch, BatchSampler, evaluate, load_corpus, validation_batches
from node.ml.model import ModelConfig, build_model, embedding_param_names
from protocol.codec import TensorLimits
from protocol.compress import TOPK_CODECS, CodecSpec, compression_ratio, decode, encode, mask_for

NAME = "codec_sweep"
MODEL = ModelConfig(vocab_size=256, context_len=32, num_layers=2, width=64, num_heads=2)  # goodput's
LEARNERS, BATCH, H, INNER_LR, WEIGHT_DECAY, SEED = 4, 8, 12, 3e-3, 0.01, 11
CLIP_FACTOR = 3.0  # the syncer's default
DEFAULT_VARIANTS = "codec=fp32,seed=1;codec=topk,k=32,bits=2,scale_bits=16"
_SPEC_KEYS = ("codec", "chunk", "k", "bits", "scale_bits")


@dataclass(frozen=True, kw_only=True, slots=True)
class Variant:
    label: str
    spec: CodecSpec = field(default_factory=CodecSpec)
    trim: float = 0.25  # the screen's default trim_fraction
    outer_lr: float = 0.7
    momentum: float = 0.9
    seed: int = 0
    # the model's initialization: build_model(seed SEED + init); 0 is every earlier run's
    init: int = 0
    rda: bool = True  # the merge's RDA for non-embedding tensors; False: the plain weighted mean everywhere
    # the merge's winsorizing among the coordinates sent only (merge_fragment's sparse; a syncer under topk)
    sparse_trim: bool = False


def parse_variant(text: str) -> Variant:
    """'codec=topk,k=32,trim=0' -> Variant; ValueError on an unknown key or a bad codec."""
    values = dict(part.strip().split("=", 1) for part in text.split(",") if part.strip())
    unknown = set(values) - {
        *_SPEC_KEYS,
        "trim",
        "lr",
        "momentum",
        "seed",
        "init",
        "rda",
        "decay",
        "sparse",
        "rotate",
    }
    if unknown:
        raise ValueError(f"unknown variant keys {sorted(unknown)}")
    spec_fields: dict[str, Any] = {k: int(v) for k, v in values.items() if k in _SPEC_KEYS[1:]}
    spec_fields["feedback_decay"] = float(values.get("decay", 1.0))
    spec_fields["mask_rotate"] = values.get("rotate", "1") != "0"
    spec = CodecSpec(codec=values.get("codec", "fp32"), **spec_fields)  # type: ignore[arg-type]
    return Variant(
        label=text.strip(),
        spec=spec,
        trim=float(values.get("trim", 0.25)),
        outer_lr=float(values.get("lr", 0.7)),
        momentum=float(values.get("momentum", 0.9)),
        seed=int(values.get("seed", 0)),
        init=int(values.get("init", 0)),
        rda=values.get("rda", "1") != "0",
        sparse_trim=values.get("sparse", "1" if spec.codec in TOPK_CODECS else "0") != "0",
    )


@dataclass(slots=True)
class Setup:
    plan: FragmentPlan
    streams: list[Any]
    held: list[Batch]


def build_setup(eval_batches: int) -> Setup:
    corpus = load_corpus()
    model = build_model(MODEL, SEED)
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    plan = plan_fragments(sizes, 2, embedding_param_names(MODEL))
    streams = [corpus.train_stream(i, LEARNERS) for i in range(LEARNERS)]
    held = validation_batches(corpus, batch_size=8, context_len=MODEL.context_len, num_batches=eval_batches)
    return Setup(plan=plan, streams=streams, held=held)


def _contributions(
    variant: Variant,
    encoders: list[ContributionEncoder],
    replicas: list[torch.nn.Module],
    base: dict[str, torch.Tensor],
    fragment: int,
    version: int,
    sent_bytes: list[int] | None,
) -> list[Contribution]:
    names = encoders[0].plan.fragments[fragment].names
    out = []
    for i, (encoder, replica) in enumerate(zip(encoders, replicas, strict=True)):
        params = {n: p.detach() for n, p in replica.named_parameters() if n in names}
        if variant.spec.codec != "fp32":
            spec = variant.spec
            mask = (
                mask_for(spec, run_seed=SEED, fragment=fragment, version=version)
                if spec.codec == "randk"
                else None
            )
            sent = encoder.encode(fragment, base, params, mask=mask)
            encoder.commit(fragment, sent)
            if sent_bytes is not None:
                sent_bytes.append(sent.nbytes)
            params = decode_contribution(
                sent.tensors, sent.meta, spec=spec, base=base, names=names, mask=mask
            )
        out.append(Contribution(f"l{i}", params, version, H, H * BATCH * MODEL.context_len))
    return out


def run(
    setup: Setup,
    variant: Variant,
    rounds: int,
    sent_bytes: list[int] | None = None,
    eval_last: int | None = None,
) -> list[tuple[int, float]]:
    """Held-out loss of the global model after each round (only the last `eval_last` if given: the evaluation
    changes nothing else), against tokens trained by all learners; every push's payload bytes are appended to
    `sent_bytes` if given."""
    model = build_model(MODEL, SEED + variant.init)
    global_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    replicas = [copy.deepcopy(model) for _ in range(LEARNERS)]
    optimizers = [torch.optim.AdamW(r.parameters(), lr=INNER_LR, weight_decay=WEIGHT_DECAY) for r in replicas]
    samplers = [
        BatchSampler(
            stream,
            batch_size=BATCH,
            context_len=MODEL.context_len,
            generator=torch.Generator().manual_seed(1000 * variant.seed + i),
        )
        for i, stream in enumerate(setup.streams)
    ]
    encoders = [ContributionEncoder(variant.spec, setup.plan) for _ in range(LEARNERS)]
    outer = OuterNesterov(variant.outer_lr, variant.momentum)
    embedding = embedding_param_names(MODEL)
    curve, trained = [], 0
    for round_ in range(rounds):
        for replica, optimizer, sampler in zip(replicas, optimizers, samplers, strict=True):
            replica.load_state_dict(global_params, strict=False)
            for _ in range(H):
                inputs, targets = sampler.next_batch()
                optimizer.zero_grad(set_to_none=True)
                replica(inputs, targets)[1].backward()
                optimizer.step()
                trained += int(inputs.numel())
        for fragment in setup.plan.fragments:
            base = {n: global_params[n] for n in fragment.names}
            contributions = _contributions(
                variant, encoders, replicas, base, fragment.index, round_, sent_bytes
            )
            result = merge_fragment(
                base,
                contributions,
                embedding_names=embedding if variant.rda else set(fragment.names),
                clip_factor=CLIP_FACTOR,
                trim_fraction=variant.trim,
                sparse=variant.sparse_trim,
            )
            global_params.update(outer.step(base, result.outer_grad))
        if eval_last is None or round_ >= rounds - eval_last:
            model.load_state_dict(global_params, strict=False)
            curve.append((trained, evaluate(model, setup.held)))
    return curve


def energy(setup: Setup, specs: list[CodecSpec], steps: int = 4 * H) -> dict[str, list[float]]:
    """Per codec, per fragment: the share of one learner's pseudo-gradient's squared norm one push delivers,
    1 - ||delta - decoded||^2 / ||delta||^2 (learner 0, `steps` AdamW steps from the initial model, no feedback)."""
    model = build_model(MODEL, SEED)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR, weight_decay=WEIGHT_DECAY)
    sampler = BatchSampler(
        setup.streams[0],
        batch_size=BATCH,
        context_len=MODEL.context_len,
        generator=torch.Generator().manual_seed(0),
    )
    for _ in range(steps):
        inputs, targets = sampler.next_batch()
        optimizer.zero_grad(set_to_none=True)
        model(inputs, targets)[1].backward()
        optimizer.step()
    params = {n: p.detach() for n, p in model.named_parameters()}
    out: dict[str, list[float]] = {}
    for spec in specs:
        shares = []
        for fragment in setup.plan.fragments:
            delta = fragment_delta(base, params, fragment.names)
            mask = (
                mask_for(spec, run_seed=SEED, fragment=fragment.index, version=0)
                if spec.codec == "randk"
                else None
            )
            encoded = encode(delta, spec, mask=mask)
            decoded = decode(encoded.header, encoded.payload, _limits(delta), mask=mask)
            shares.append(round(1 - float((delta - decoded).norm() ** 2 / delta.norm() ** 2), 4))
        out[str(spec.header_fields())] = shares
    return out


def _limits(tensor: torch.Tensor) -> TensorLimits:
    return TensorLimits(max_bytes=4 * tensor.numel(), max_rank=1, max_dim=tensor.numel())


def _tail(curve: list[tuple[int, float]], last: int = 5) -> float:
    """Mean held-out loss of the last rounds: one round's loss of a lossy codec swings more than the gap."""
    return sum(loss for _, loss in curve[-last:]) / len(curve[-last:])


def ratio(spec: CodecSpec, plan: FragmentPlan) -> float:
    """fp32 bytes over encoded bytes of one push of every fragment (short last chunks included)."""
    sizes = [f.num_params for f in plan.fragments]
    return 4 * sum(sizes) / sum(4 * n / compression_ratio(spec, n) for n in sizes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--eval-batches", type=int, default=64)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/<name>.json")
    parser.add_argument(
        "--energy",
        action="store_true",
        help="print the share of a pseudo-gradient one push delivers, then stop",
    )
    parser.add_argument("--name", default=NAME, help="the results file's name (default codec_sweep)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    setup = build_setup(args.eval_batches)
    variants = [parse_variant(t) for t in args.variants.split(";") if t.strip()]
    if args.energy:
        print(json.dumps(energy(setup, [v.spec for v in variants if v.spec.codec != "fp32"]), indent=1))
        return 0
    curves: dict[str, list[tuple[int, float]]] = {}
    rows: dict[str, Any] = {}
    for variant in variants:
        ref_label = _reference(setup, variant, args.rounds, curves, rows)
        ref, ref_tail = curves[ref_label][-1][1], _tail(curves[ref_label])
        started = time.monotonic()
        curves[variant.label] = run(setup, variant, args.rounds)
        loss = curves[variant.label][-1][1]
        rows[variant.label] = {
            "ratio": round(ratio(variant.spec, setup.plan), 1),
            "loss": round(loss, 4),
            "against": ref_label,
            "gap": round(loss / ref - 1, 4),
            "gap_last5": round(_tail(curves[variant.label]) / ref_tail - 1, 4),
        }
        print(f"{variant.label}: {rows[variant.label]} ({time.monotonic() - started:.0f} s)", flush=True)
    fp32_loss = rows.get("fp32", {}).get("loss")
    print(json.dumps({"fp32_loss": fp32_loss, **rows}, indent=1))
    if args.write:
        write_result(args.name, {"rounds": args.rounds, "fp32_loss": fp32_loss, **rows}, {"curves": curves})
    return 0


def _reference(
    setup: Setup,
    variant: Variant,
    rounds: int,
    curves: dict[str, list[tuple[int, float]]],
    rows: dict[str, Any],
) -> str:
    """The label of the fp32 arm at the variant's outer step (data seeds 0), run the first time it is needed."""
    default = variant.outer_lr == 0.7 and variant.momentum == 0.9
    label = "fp32" if default else f"fp32,lr={variant.outer_lr:g},momentum={variant.momentum:g}"
    if label not in curves:
        curves[label] = run(
            setup, Variant(label=label, outer_lr=variant.outer_lr, momentum=variant.momentum), rounds
        )
        rows[label] = {"ratio": 1.0, "loss": round(curves[label][-1][1], 4), "reference": True}
        print(f"{label}: {rows[label]}", flush=True)
    return label


if __name__ == "__main__":
    raise SystemExit(main())
