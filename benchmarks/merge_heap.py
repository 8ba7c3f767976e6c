"""The peak RSS of merging one llama-1b fragment alone (issue 17, docs/scale.md "The llama-1b syncer core at P = 16"):
`merge_fragment` over two contributions held in spill files, as the syncer core holds them, its outer gradient
written to a file of the spill as the core's is (`--in-memory`: in memory, as before), measured from the RSS before it (the kernel's high-water mark reset first, benchmarks.scale `PhasePeaks`). Seconds and ~1 GiB, not the
model: to see what a merge holds over its outer gradient (chunk temporaries, freed heap) without the 1B core run.

Run: `python -m benchmarks.merge_heap --fragment 13` (a fragment of 25 tensors at P = 16; 3 has 11, 0 is one).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

GiB = 1 << 30


def merge_peak(
    fragment: int, num_fragments: int, *, in_memory: bool = False
) -> dict[str, float | int | bool]:
    import torch

    from benchmarks.scale import PhasePeaks, manifest, status_bytes
    from node.diloco import chunked
    from node.diloco.merge import Contribution, merge_fragment
    from node.diloco.spill import SpillDir, release_freed_memory
    from node.diloco.sync_client import run_fragment_plan
    from node.ml.model import CausalLM, ModelConfig

    torch.set_num_threads(1)
    run = manifest("llama-1b", num_fragments=num_fragments)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in CausalLM(ModelConfig.from_dict(run.model)).named_parameters()}
    names = run_fragment_plan(run).fragments[fragment].names
    gen = torch.Generator().manual_seed(0)
    global_params = {n: torch.randn(shapes[n], generator=gen) for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        spill, contributions = SpillDir(Path(tmp) / "spill"), []
        for peer in range(2):
            noise = {n: t + 1e-3 * torch.randn(t.shape, generator=gen) for n, t in global_params.items()}
            spill.write(f"c{peer}", noise)
            del noise
            contributions.append(Contribution(f"p{peer}", spill.tensors(f"c{peer}"), 0, 4, 256))
        release_freed_memory()
        meter, before, started = PhasePeaks(), status_bytes("VmRSS"), time.perf_counter()
        result = merge_fragment(
            global_params,
            contributions,
            embedding_names=(),
            clip_factor=3.0,
            spill=None if in_memory else spill,  # the syncer's: the outer gradient in a file of the spill
        )
        merge_s = time.perf_counter() - started
        meter.end("merge")
        grad = sum(4 * math.prod(chunked.shape(result.outer_grad, n)) for n in result.outer_grad)
    return {
        "fragment": fragment,
        "outer_grad_in_memory": in_memory,
        "tensors": len(names),
        "outer_grad_gib": round(grad / GiB, 3),
        "peak_over_before_gib": round((meter.peaks["merge"] - before) / GiB, 3),
        "merge_s": round(merge_s, 2),
        "resettable": meter.resettable,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fragment", type=int, default=13)
    parser.add_argument("--fragments-per-stage", type=int, default=16)
    parser.add_argument(
        "--in-memory",
        action="store_true",
        help="the outer gradient in memory (a core without a spill directory)",
    )
    args = parser.parse_args(argv)
    print(json.dumps(merge_peak(args.fragment, args.fragments_per_stage, in_memory=args.in_memory)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
