"""Goodput versus link speed and codec, from the simulator's link model (tools/sim_links.py).

Eight Decoupled DiLoCo learners (K = 1 with the grace window, P = H = 24, tau = 2), no chip failures, every
learner on the same symmetric internet link (10 / 50 / 100 / 1000 Mbit/s, 20 ms one way to the syncer; the
syncer's own link unconstrained), an inner step of 2 s, for a 124M- and a 1B-parameter model. Each round sends a
fragment (1/24 of the model) up and fetches the merged fragment back, both under the codec: fp32, int8 and int4
block quantization (block 128, fp32 scales) and top-k (k = 32 of 4096, 2-bit values), the defaults of
`protocol.compress.CodecSpec`. Bytes per fragment are `protocol.compress.payload_size`, the exact encoded length.

What bounds goodput is a learner's link carrying one fragment each way per step: once bytes / bandwidth exceeds
the step time the learner waits at the overlap bound, and goodput falls to about step / transfer. The headline is
the slowest link at which each codec keeps >= 95% goodput for each model.
Run: `python -m benchmarks.simulate_links`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

from benchmarks.common import plot_path, write_result
from node.diloco.quorum import QuorumConfig
from protocol.compress import CodecSpec
from tools.sim_links import LinkModel, PeerLink
from tools.simulate import FailureModel, SimConfig, simulate

NAME = "simulate_links"
MODELS: dict[str, int] = {"124M": 124_000_000, "1B": 1_000_000_000}
LINK_MBPS: tuple[float, ...] = (10.0, 50.0, 100.0, 1000.0)
CODECS: dict[str, CodecSpec] = {
    "fp32": CodecSpec(codec="fp32"),
    "int8": CodecSpec(codec="int8"),
    "int4": CodecSpec(codec="int4"),
    "topk": CodecSpec(codec="topk"),
}
LATENCY_MS = 20.0
STEP_S = 2.0
NUM_LEARNERS = 8
GOOD_ENOUGH = 0.95


def link_config(model_params: int, mbps: float, codec: CodecSpec, *, steps: int = 600) -> SimConfig:
    """One cell: M learners on the same symmetric link, no failures, `steps` inner steps simulated."""
    links = LinkModel(model_params=model_params, peers=(PeerLink.symmetric(mbps, LATENCY_MS),), codec=codec)
    horizon = steps * STEP_S
    return SimConfig(
        system="diloco",
        num_chips=NUM_LEARNERS,
        num_learners=NUM_LEARNERS,
        horizon_s=horizon,
        warmup_s=0.1 * horizon,
        failures=replace(FailureModel(), mtbi_chip_s=math.inf),
        quorum=QuorumConfig.decoupled(),
        step_s=STEP_S,
        links=links,
    )


def run(steps: int) -> dict[str, dict[str, dict[str, float]]]:
    """goodput[model][codec][link Mbit/s as text]."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for model, params in MODELS.items():
        out[model] = {}
        for name, codec in CODECS.items():
            out[model][name] = {
                f"{mbps:g}": simulate(link_config(params, mbps, codec, steps=steps)).goodput
                for mbps in LINK_MBPS
            }
    return out


def slowest_good_link(row: dict[str, float]) -> float | None:
    """The slowest link speed (Mbit/s) with goodput >= GOOD_ENOUGH, if any."""
    good = [float(mbps) for mbps, g in row.items() if g >= GOOD_ENOUGH]
    return min(good) if good else None


def _plot(goodput: dict[str, dict[str, dict[str, float]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(goodput), figsize=(10, 4), sharey=True)
    for ax, (model, rows) in zip(axes, goodput.items(), strict=True):
        for i, (codec, row) in enumerate(rows.items()):
            ax.plot(
                [float(m) for m in row], [g * 100 for g in row.values()], "-o", color=f"C{i}", label=codec
            )
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(list(LINK_MBPS), [f"{m:g}" for m in LINK_MBPS])
        ax.set_xlabel("link Mbit/s (each way, 20 ms)")
        ax.set_title(f"{model} params, 8 learners, 2 s step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("goodput %")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.simulate_links", description=__doc__)
    parser.add_argument("--steps", type=int, default=600, help="inner steps simulated per cell")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    goodput = run(args.steps)
    seconds = time.perf_counter() - started
    bytes_per_fragment = {
        model: {name: LinkModel(model_params=params, codec=c).upload_bytes(24) for name, c in CODECS.items()}
        for model, params in MODELS.items()
    }
    for model, rows in goodput.items():
        print(f"{model}: goodput % at " + " / ".join(f"{m:g}" for m in LINK_MBPS) + " Mbit/s")
        for codec, row in rows.items():
            cells = " ".join(f"{g * 100:6.1f}" for g in row.values())
            print(f"  {codec:5s} {cells}   ({bytes_per_fragment[model][codec] / 1e6:8.3f} MB per fragment)")
    headline = {
        "slowest_link_mbps_for_95pct_goodput": {
            model: {codec: slowest_good_link(row) for codec, row in rows.items()}
            for model, rows in goodput.items()
        },
        "goodput_at_100mbps": {
            model: {codec: row["100"] for codec, row in rows.items()} for model, rows in goodput.items()
        },
        "seconds": seconds,
    }
    detail = {
        "goodput": goodput,
        "bytes_per_fragment": bytes_per_fragment,
        "setup": {
            "learners": NUM_LEARNERS,
            "step_s": STEP_S,
            "latency_ms": LATENCY_MS,
            "fragments": 24,
            "sync_every_steps": 24,
            "overlap_steps": 2,
            "steps_per_cell": args.steps,
            "quorum": "decoupled K=1 + grace",
            "codecs": {name: c.header_fields() for name, c in CODECS.items()},
        },
    }
    path = write_result(NAME, headline, detail)
    png = plot_path(NAME)
    _plot(goodput, str(png))
    print(f"wrote {path} and {png} ({seconds:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
