"""An RPC flood from ONE peer identity against a node's framed route, with and without the per-peer limiter.

The experiment of `tools/flood.py` (three processes with their own p2pd on loopback: a victim
serving a ~4 ms route, an honest peer at 40 req/s, a flooder), at the issue's rate: the flooder asks for 10,000
requests a second for `--flood-s` seconds from one identity (one p2pd), pinned to one core ("the attacker's
machine"), all three peers at a raised priority on the shared box. Two engines (see the test's docstring): "answered" (hivemind's client,
waiting for every answer; what CI runs) and "hangup" (`FLOOD_PROCS` processes of a C loop on the daemon's control
socket, hanging up once the request is written; the one that gets near the asked rate). It also sweeps lower rates,
so the plot shows where the node's stream intake gives out. Each point runs the limiter on and off side by side
(the control), `--reps` times; the median is reported.

Recorded per run: the offered rate (streams the flooder's daemon opened, per second), what reached our layer and what
the victim's daemon dropped before it did, the honest peer's throughput with and without the flood (and the ratio),
the victim's RSS growth and CPU. Headline (the 10,000/s point): `offered_rps`, `honest_ratio`,
`honest_ratio_no_limiter`, `victim_rss_growth_mib`. The box's load average is recorded next to the figures: on a
shared 2-core machine the figures move with it.

Run: `python -m benchmarks.flood [--rates 1000 3000 10000] [--engines answered hangup] [--reps 1] [--flood-s 3]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from benchmarks.common import plot_path, write_result
from tools.flood import FLOOD_RATE_PER_S, run_flood

NAME = "flood"


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in runs)


def _point(rate: float, engine: str, reps: int, flood_s: float) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for _ in range(reps):
        for defended, key in ((True, "on"), (False, "off")):
            summary = run_flood(defended, rate, flood_s, engine).summary()
            summary["load_average"] = os.getloadavg()[0]
            runs[key].append(summary)
            print(
                f"{engine:>8} rate {rate:>6.0f} limiter {key:>3}: offered {summary['offered_rps']:7.0f}/s, reached us "
                f"{summary['reached_us']}, dropped below us {summary['dropped_below_us']}, honest ratio "
                f"{summary['honest_ratio']:.2f}, RSS +{summary['victim_rss_growth_mib']:.1f} MiB, "
                f"load {summary['load_average']:.1f}",
                flush=True,
            )
    return {
        "engine": engine,
        "rate_asked": rate,
        "offered_rps": _median(runs["on"], "offered_rps"),
        "offered_rps_no_limiter": _median(runs["off"], "offered_rps"),
        "honest_ratio": _median(runs["on"], "honest_ratio"),
        "honest_ratio_no_limiter": _median(runs["off"], "honest_ratio"),
        "victim_rss_growth_mib": _median(runs["on"], "victim_rss_growth_mib"),
        "victim_rss_growth_mib_no_limiter": _median(runs["off"], "victim_rss_growth_mib"),
        "runs": runs,
    }


def _plot(points: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for engine, colour in (("answered", "tab:blue"), ("hangup", "tab:red")):
        mine = sorted((p for p in points if p["engine"] == engine), key=lambda p: p["offered_rps"])
        if not mine:
            continue
        ax.plot(
            [p["offered_rps"] for p in mine],
            [p["honest_ratio"] for p in mine],
            "o-",
            color=colour,
            label=f"{engine}: limiter on",
        )
        ax.plot(
            [p["offered_rps_no_limiter"] for p in mine],
            [p["honest_ratio_no_limiter"] for p in mine],
            "s--",
            color=colour,
            alpha=0.6,
            label=f"{engine}: limiter off (control)",
        )
    ax.axhline(0.8, color="grey", linestyle=":", label="goal: 80 % of the no-flood throughput")
    ax.set_xscale("log")
    ax.set_xlabel("flood offered by one identity (requests/s, achieved)")
    ax.set_ylabel("honest throughput / no-flood")
    ax.set_ylim(0, 1.2)
    ax.set_title("One-peer RPC flood against a 4 ms route (2-core box, shared)")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(plot_path(NAME), dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[1_000.0, 3_000.0, FLOOD_RATE_PER_S])
    parser.add_argument(
        "--engines", nargs="+", default=["answered", "hangup"], choices=["answered", "hangup"]
    )
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--flood-s", type=float, default=3.0)
    args = parser.parse_args()
    load_before = os.getloadavg()
    points = [_point(rate, engine, args.reps, args.flood_s) for engine in args.engines for rate in args.rates]
    # the headline: the highest rate asked, from the engine that offered the most there
    asked = max(p["rate_asked"] for p in points)
    top = max((p for p in points if p["rate_asked"] == asked), key=lambda p: p["offered_rps"])
    headline = {
        "engine": top["engine"],
        "rate_asked": top["rate_asked"],
        "offered_rps": round(top["offered_rps"], 1),
        "honest_ratio": round(top["honest_ratio"], 3),
        "honest_ratio_no_limiter": round(top["honest_ratio_no_limiter"], 3),
        "victim_rss_growth_mib": round(top["victim_rss_growth_mib"], 2),
        "load_average": [round(x, 2) for x in load_before],
    }
    path = write_result(NAME, headline, {"points": points, "flood_s": args.flood_s, "reps": args.reps})
    _plot(points)
    print(f"headline {headline}\nwrote {path} and {plot_path(NAME)}")


if __name__ == "__main__":
    main()
