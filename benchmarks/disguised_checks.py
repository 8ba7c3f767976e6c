"""What disguised spot checks cost an honest pipeline, against marked ones (docs/sentinel.md, "Disguised spot checks").

The in-process production pipeline (`tools.pipeline_harness`: `PipelineDriver`, `StageService`s, `SentinelTap`
with the run's default spot-check rates), 3 stages x (2, 3, 2) honest replicas, from scratch, averaged every 10
microbatches; one arm per switch value (`disguised_spot_checks`) and seed. Reported per arm: the held-out
loss at the end, the spot checks concluded, the recomputations sent as training requests and the microbatches a
checker applied a second time (backward checks), what the stages applied in all against what the verifier
completed, the contexts left waiting on the stages (forward checks whose backward never comes) and dropped, the
wall time, and bans (must be none); headline: the held-out loss gap (disguised against marked, mean and worst over
the seeds: the duplicated microbatches' effect on training, next to the seed-to-seed noise of the routing), the
share of duplicated microbatches, the wall-time ratio and the bans.

Run: `python -m benchmarks.disguised_checks [--microbatches 300] [--seeds 0,1,2]` (about 3 min on the shared
2-core machine); writes `benchmarks/results/disguised_checks.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from tools.pipeline_harness import HarnessConfig, build_arm, drive

RESULTS = Path(__file__).parent / "results" / "disguised_checks.json"


def arm_result(disguised: bool, microbatches: int, seed: int) -> dict[str, Any]:
    config = HarnessConfig(merge_every=10, even_routing=True, disguised_spot_checks=disguised)
    arm = build_arm(config, attack=None, verify=True, seed=seed)
    started = time.perf_counter()
    result = drive(arm, microbatches, seed, eval_every=microbatches)
    wall_s = time.perf_counter() - started
    stats = arm.driver.stats
    cores = [service.core for service in arm.services.values()]
    dropped: dict[str, int] = {}
    for core in cores:
        for reason, count in core.counters.contexts_dropped.items():
            dropped[reason] = dropped.get(reason, 0) + count
    return {
        "disguised_spot_checks": disguised,
        "held_out_loss": round(result["loss"], 4),
        "completed": result["completed"],
        "spot_checks": stats.spot_checks,
        "tap_spot_checks": arm.tap.stats.spot_checks,
        "disguised_checks": stats.disguised_checks,
        "duplicate_gradients": stats.duplicate_gradients,
        "applied_by_stages": sum(core.counters.microbatches_applied for core in cores),
        "applied_by_the_verifier": sum(stats.applied_per_stage.values()),
        "contexts_waiting": sum(core.num_contexts for core in cores),
        "contexts_dropped": dropped,
        "wall_s": round(wall_s, 1),
        "banned": len(arm.banned()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=300)
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny tensors: one intra-op thread is faster on a shared machine
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = [
        arm_result(disguised, args.microbatches, seed) | {"seed": seed}
        for seed in seeds
        for disguised in (False, True)
    ]
    marked, disguised = arms[0::2], arms[1::2]
    gaps = [d["held_out_loss"] / m["held_out_loss"] - 1 for m, d in zip(marked, disguised, strict=True)]
    total = sum(d["applied_by_the_verifier"] for d in disguised)
    report = {
        "microbatches": args.microbatches,
        "seeds": seeds,
        "arms": arms,
        "headline": {
            "loss_gap_mean": round(sum(gaps) / len(gaps), 4),
            "loss_gap_worst": round(max(gaps, key=abs), 4),
            "duplicate_share": round(sum(d["duplicate_gradients"] for d in disguised) / max(total, 1), 4),
            "wall_ratio": round(
                sum(d["wall_s"] for d in disguised) / max(sum(m["wall_s"] for m in marked), 1e-9), 3
            ),
            "banned": sum(a["banned"] for a in arms),
        },
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
