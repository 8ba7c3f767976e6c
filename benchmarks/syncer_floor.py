"""Where a syncer core's memory goes, and what it would hold with the global parameters on disk (issue 17,
docs/scale.md "The llama-124m syncer, broken down").

`breakdown`: the RSS after each import (torch, transformers, hivemind, the node's syncer modules with the model's),
after the seed model, the core and the probe's skeleton, then through a core round as `python -m benchmarks.scale
--core llama-124m` runs it (two synthetic contributions per fragment built in memory, each scored by the held-out
loss probe, accepted; each fragment merged): per kind of step, the highest peak (the kernel's high-water mark, reset
after each step) and the highest RSS right after it.

`floor`: the seed model written to one spill file (`node.diloco.spill.SpillDir`) and dropped, then the probe's
held-out loss with every tensor streamed from that file (`node.ml.streamed_forward`: a block of rows at a time)
against the same loss with the model in memory: what the probe would hold if the core kept its parameters in spill
files (not built: docs/scale.md says what that needs).

Run: `python -m benchmarks.syncer_floor` (both, llama-124m, one fresh process: the import figures need it);
`--model llama-tiny` for a quick look. Prints JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

from tools.proctree import status_bytes

GiB = 1 << 30


class Marks:
    """Peak and RSS at named points; the high-water mark is reset after each (`/proc/self/clear_refs` 5)."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, float]] = {}

    def mark(self, what: str) -> None:
        peak, now = status_bytes("VmHWM") / GiB, status_bytes("VmRSS") / GiB
        row = self.rows.setdefault(what, {"peak_gib": 0.0, "rss_after_gib": 0.0})
        row["peak_gib"] = round(max(row["peak_gib"], peak), 3)
        row["rss_after_gib"] = round(max(row["rss_after_gib"], now), 3)
        with contextlib.suppress(OSError):
            pathlib.Path("/proc/self/clear_refs").write_text("5")


def imports(marks: Marks) -> None:
    """The process's layers, in the order a syncer imports them (each import's own cost, if not loaded yet)."""
    marks.mark("interpreter")
    import torch  # noqa: F401

    marks.mark("import torch")
    import transformers  # noqa: F401

    marks.mark("import transformers")
    import hivemind  # noqa: F401

    marks.mark("import hivemind")
    import node.roles.syncer  # noqa: F401
    from benchmarks import scale  # noqa: F401

    marks.mark("import node.roles.syncer, benchmarks.scale")


def breakdown(model: str) -> dict[str, Any]:
    """The process's layers, the core's build and a core round (module docstring)."""
    marks = Marks()
    imports(marks)
    import torch

    from benchmarks import scale
    from node.diloco.screening import ScreeningConfig
    from node.diloco.spill import release_freed_memory
    from node.ml.model import ModelConfig, build_model

    run = scale.manifest(model)
    built = build_model(ModelConfig.from_dict(run.model), run.seed)
    marks.mark("seed model built")
    with tempfile.TemporaryDirectory() as tmp:
        params = dict(built.named_parameters())
        core = scale.new_core(run, params, ScreeningConfig(loss_probe=True), pathlib.Path(tmp) / "spill")
        del built, params
        marks.mark("core built (the seed model taken)")
        scorer = scale.build_probe_for(run)
        marks.mark("probe skeleton and held-out batches")
        gen, merged = torch.Generator().manual_seed(0), 0
        for fragment in range(core.plan.num_fragments):
            for peer in range(2):
                push = scale.synthetic(core, fragment, gen)
                marks.mark("round: a synthetic push built in memory")
                score = scale.probe_score(scorer, core, fragment, push)
                marks.mark("round: the push scored by the probe")
                core.accept(
                    f"peer-{peer}", fragment, push, base_version=0, steps=4, tokens=4 * scale.SEQ, sched_step=4,
                    step_time_s=1.0, nonce=bytes([peer]) * 16, now=time.monotonic() + 60.0, loss=score,
                )  # fmt: skip
                del push
                release_freed_memory()
                marks.mark("round: accepted, the push dropped")
            merged += core.merge_now(fragment, 2, time.monotonic() + 60.0) is not None
            marks.mark("round: a fragment merged (between rounds after it)")
    return {"sizes": scale.sizes(run), "marks": marks.rows, "fragments_merged": merged}


def streamed_file(spill: Any, key: str) -> Mapping[str, Any]:
    """The spill file `key` as a mapping whose every tensor a forward pass streams from the file, a block of rows
    at a time (`node.ml.streamed_forward.streamed_names`)."""
    from node.diloco.spill import SpilledTensors

    class Streamed(SpilledTensors):
        @property
        def streamed(self) -> frozenset[str]:
            return frozenset(self)

    return Streamed(spill, key)


def timed_loss(loss: Callable[[Mapping[str, Any]], float], params: Mapping[str, Any]) -> tuple[float, float]:
    started = time.perf_counter()
    value = loss(params)
    return value, round(time.perf_counter() - started, 2)


def floor(model: str) -> dict[str, Any]:
    """The probe's loss in memory, then with every tensor streamed from a spill file (module docstring)."""
    from functools import partial

    from benchmarks import scale
    from node.diloco.spill import SpillDir, release_freed_memory
    from node.ml.model import ModelConfig, build_model
    from node.roles.syncer import model_skeleton, skeleton_loss

    marks, run = Marks(), scale.manifest(model)
    cfg = ModelConfig.from_dict(run.model)
    batches = [scale.learnable_batch(cfg.vocab_size, 2, seed=1000 + i) for i in range(2)]
    loss = partial(skeleton_loss, model_skeleton(cfg), batches=batches)
    marks.mark("process and the probe's skeleton")
    built = build_model(cfg, run.seed)
    params = {n: p.detach() for n, p in built.named_parameters()}
    marks.mark("seed model built")
    in_memory, memory_s = timed_loss(loss, params)
    marks.mark("probe's loss, the model in memory")
    with tempfile.TemporaryDirectory() as tmp:
        spill = SpillDir(pathlib.Path(tmp) / "spill")
        spill.write("global", params)
        del built, params
        release_freed_memory()
        marks.mark("model written to a spill file and dropped")
        on_disk, disk_s = timed_loss(loss, streamed_file(spill, "global"))
        marks.mark("probe's loss, every tensor streamed from the file")
    return {
        "sizes": scale.sizes(run),
        "marks": marks.rows,
        "loss_in_memory": in_memory,
        "loss_streamed": on_disk,
        "bit_equal": in_memory == on_disk,
        "seconds_in_memory": memory_s,
        "seconds_streamed": disk_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama-124m")
    parser.add_argument("--only", choices=("breakdown", "floor"), default=None)
    args = parser.parse_args(argv)
    out: dict[str, Any] = {
        "model": args.model,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if args.only in (None, "breakdown"):
        out["breakdown"] = breakdown(args.model)
    if args.only in (None, "floor"):
        out["floor"] = floor(args.model)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
