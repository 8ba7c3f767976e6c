"""Compressed boundary activations and gradients (issue 20, part 2): bytes per microbatch and held-out loss at equal
tokens, for each `protocol.boundary_codec` codec against fp32.

One in-process pipeline per codec (`tools.pipeline_harness`: the production stage and driver code, sealing and
opening every frame, through `DirectTransport`), the same seeds, weights and batches, SENTINEL off (its detection
with a codec is `benchmarks/sentinel_table.py --activation-codec`). A counting transport adds up the bytes of every
frame each way (requests and answers: activations, gradients, tokens and targets, headers and signatures);
`boundary_ratio` is the ratio of the boundary tensors alone (payload of an activation or gradient frame).
The held-out loss is measured through the pipeline on the same held-out batches after the last microbatch. A last
fp32 arm with another batch order (same init) gives the noise floor: the loss gap a harmless change makes.

Called by `benchmarks.bandwidth` (its `activation_*` headline keys); alone: `python -m benchmarks.bandwidth_activations`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import torch

from protocol.boundary_codec import BOUNDARY_CODECS, BoundaryCodecName, compression_ratio
from tools.pipeline_harness import HarnessConfig, build_arm, drive

RECOMMENDED_ACTIVATION: BoundaryCodecName = "int8"


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
    train_bytes = counter.bytes  # includes the held-out evaluations' forwards: the same count in every arm
    shape = (config.batch_size, int(config.model["context_len"]), int(config.model["width"]))
    return {
        "codec": codec,
        "microbatches": microbatches,
        "completed": result["completed"],
        "tokens": result["tokens"],
        "loss": result["loss"],
        "losses": result["losses"],
        "frame_bytes": train_bytes,
        "frame_bytes_per_microbatch": train_bytes / max(1, result["completed"]),
        "boundary_ratio": compression_ratio(codec, shape),
        "seconds": elapsed,
    }


def measure(microbatches: int, seed: int = 0, lr: float = 3e-3) -> dict[str, Any]:
    torch.set_num_threads(1)
    arms = {codec: run_arm(codec, microbatches, seed, lr) for codec in BOUNDARY_CODECS}
    # the noise floor: fp32 again with another batch order, same init (how far a harmless change moves the loss)
    arms["fp32 other batches"] = run_arm("fp32", microbatches, seed, lr, data_seed=seed + 1)
    base = arms["fp32"]
    for arm in arms.values():
        arm["frame_ratio"] = base["frame_bytes_per_microbatch"] / arm["frame_bytes_per_microbatch"]
        arm["loss_gap"] = (arm["loss"] - base["loss"]) / base["loss"]
    return {
        "recommended": RECOMMENDED_ACTIVATION,
        "microbatches": microbatches,
        "seed": seed,
        "lr": lr,
        "arms": arms,
        "setup": "tools.pipeline_harness, 3 stages x 1 replica, model "
        + json.dumps(dataclasses.asdict(HarnessConfig())["model"])
        + ", batch 8, SENTINEL off",
    }


def headline(result: dict[str, Any]) -> dict[str, Any]:
    best = result["arms"][result["recommended"]]
    return {
        "activation_codec": result["recommended"],
        "activation_compression": round(best["frame_ratio"], 2),
        "activation_boundary_compression": round(best["boundary_ratio"], 2),
        "activation_loss_gap": round(best["loss_gap"], 4),
        "activation_int4_compression": round(result["arms"]["int4"]["frame_ratio"], 2),
        "activation_int4_loss_gap": round(result["arms"]["int4"]["loss_gap"], 4),
        "activation_noise_loss_gap": round(result["arms"]["fp32 other batches"]["loss_gap"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, default=300)
    args = parser.parse_args()
    result = measure(args.microbatches)
    print(json.dumps(headline(result), indent=1))
    for codec, arm in result["arms"].items():
        print(
            f"{codec}: {arm['frame_bytes_per_microbatch'] / 1024:.1f} KiB/microbatch "
            f"({arm['frame_ratio']:.2f}x), loss {arm['loss']:.4f} ({arm['loss_gap']:+.2%}), {arm['seconds']:.0f} s"
        )


if __name__ == "__main__":
    main()
