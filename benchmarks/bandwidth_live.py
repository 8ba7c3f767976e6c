"""Outer-gradient codecs in a live swarm: held-out loss at equal merged tokens, and the bytes each push carried.

One arm per codec, one after another, each a fresh swarm of real processes on loopback (the goodput benchmark's
`Swarm`: a bootstrap, a primary and a standby syncer, 4 learners stepping at a fixed speed on the built-in
standard-library corpus, the same seeds), failure-free. The run manifest of an arm differs only in its
`[outer_codec]` table. From the syncers' events, the held-out loss curve against merged tokens (`measure`);
from the learners' status, the bytes their pushes carried and what fp32 would have carried.

    loss gap of a codec = (its final held-out loss - the fp32 arm's loss interpolated at the same merged tokens)
                          / the latter

Called by `benchmarks.bandwidth` (which writes the results); alone: `python -m benchmarks.bandwidth_live`.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.goodput import Arm, Swarm, interpolate, measure
from protocol.compress import CodecSpec

logger = logging.getLogger("benchmarks.bandwidth_live")


def run_toml_table(spec: CodecSpec) -> str:
    fields = spec.header_fields()
    lines = [f'codec = "{fields.pop("codec")}"'] + [f"{k} = {v}" for k, v in fields.items()]
    return "\n[outer_codec]\n" + "\n".join(lines) + "\n"


def run_arm(root: Path, name: str, spec: CodecSpec, duration_s: float, min_step_s: float) -> dict[str, Any]:
    """One failure-free swarm with `spec` as the run's outer codec; `measure`'s result plus push bytes."""
    swarm = Swarm(
        root, Arm(name=name, mode="decoupled", chaos=False), min_step_s, run_extra=run_toml_table(spec)
    )
    try:
        swarm.start()
        warmup_s = swarm.warm_up()
        logger.info("arm %s: formed after %.1f s; measuring %.0f s", name, warmup_s, duration_s)
        result = measure(swarm, [], duration_s)
    finally:
        swarm.stop()
    sent = [s.get("push_bytes", 0) for s in result["learner_sync"].values()]
    plain = [s.get("push_bytes_fp32", 0) for s in result["learner_sync"].values()]
    pushes = [s.get("acked", 0) for s in result["learner_sync"].values()]
    result.pop("learner_samples", None)
    result.update(
        codec=spec.header_fields(),
        warmup_s=round(warmup_s, 2),
        push_bytes=sum(sent),
        push_bytes_fp32=sum(plain),
        pushes_acked=sum(pushes),
        live_compression=round(sum(plain) / sum(sent), 2) if sum(sent) else None,
    )
    logger.info(
        "arm %s: %d tokens merged, %d merges, push bytes %d (fp32 %d)",
        name,
        result["tokens_merged"],
        result["merges"],
        result["push_bytes"],
        result["push_bytes_fp32"],
    )
    return result


def loss_gap(arm: dict[str, Any], reference: dict[str, Any]) -> float | None:
    if not arm["loss_curve"] or not reference["loss_curve"]:
        return None
    tokens, loss = arm["loss_curve"][-1]
    ref = interpolate(reference["loss_curve"], tokens)
    return round((loss - ref) / ref, 4) if ref else None


def run_live(codecs: dict[str, CodecSpec], duration_s: float, min_step_s: float) -> dict[str, dict[str, Any]]:
    """Every arm of `codecs` (the first is the reference, fp32), each with its `loss_gap` against it."""
    results: dict[str, dict[str, Any]] = {}
    base = Path(tempfile.mkdtemp(prefix="bandwidth-live-"))
    try:
        for index, (name, spec) in enumerate(codecs.items()):
            root = base / f"arm{index}"
            root.mkdir()
            results[name] = run_arm(root, f"codec{index}", spec, duration_s, min_step_s)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    reference = next(iter(results.values()))
    for result in results.values():
        result["loss_gap"] = loss_gap(result, reference)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds measured per arm")
    parser.add_argument("--min-step-s", type=float, default=0.25)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    codecs = {
        "fp32": CodecSpec(),
        "topk 1/128 2-bit": CodecSpec(codec="topk", chunk=4096, k=32, bits=2, scale_bits=16),
    }
    results = run_live(codecs, args.duration, args.min_step_s)
    print(
        json.dumps(
            {
                n: {k: r[k] for k in ("loss_gap", "live_compression", "tokens_merged")}
                for n, r in results.items()
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
