"""Goodput grid of the paper's Table 1 from our discrete-event simulator, next to the paper's.

Runs `tools.simulate` over data parallel, elastic data parallel and Decoupled DiLoCo with M = 2, 4, 8, 16
learners at 150k ... 2.4M chips (MTBI_chip = 1 year), writes benchmarks/results/simulate_table.json
(`grid`, `paper_grid`, `headline`) and a plot, and prints both grids.

Calibration (`--calibrate`): the failure model's unknown [S] parameters are fitted with Nelder-Mead on the
data-parallel, elastic data-parallel and M = 8 rows (15 cells), so the M = 2, 4, 16 rows (15 cells) stay
predictions. Two stages, from the current defaults: (1) on elastic_dp and M8, the mean return time of failed chips,
the elastic downscale and upscale times (apart: the paper names both, and they cost differently, since every failure
of a running job pauses it while a return that lands in a pause joins it) and the slice size (the M8 row, whose 150k
learners are 18.75k chips, pins it); (2) on dp, the non-elastic
restart's fixed part and its restore work (chip-seconds the job's chips share). The dp row depends on stage 1 only
through the return mean. Each stage simulates its rows exactly as the reported grid does (same failure targets
and seed). The defaults of `tools.simulate.FailureModel` are the result, rounded; docs/simulator.md has the table.
The exponentiated-Weibull shape (k = 1.5, a = 2) is assumed, not fitted (only the mean matters to first order).

Why a restore term: the paper's dp row is not consistent with a constant cost per failure (600k needs at least
1.26 min per failure to land within 3 points, 2.4M at most 1.24 min, by the renewal formula); it needs a cost that
falls with the job's size, and restore work shared by the job's chips is one.
Tight cells: the paper's M2 and M4 at 2.4M stray 4 points from its own rule "M learners on N chips ~ elastic DP on
N/M chips", in opposite directions (M2: 54 vs elastic 1.2M: 58; M4: 73 vs elastic 600k: 69), which our model follows
by construction (a learner is an elastic job of N/M chips); so our error there is about the elastic cell's -4 (M4)
and +4 (M2). Those two cells come from one secondary source (digest §2.3: the 2.4M column is confirmed elsewhere
for dp, elastic, M8 and M16 only). Model changes tried against the M4 cell and rejected are in docs/simulator.md.
Noise: every cell reports the standard error of its goodput (batch means); `seconds` is the wall time of the grid
alone, `cpu_seconds` its CPU time, `load_1min_before_after` the machine's load around it.
Run: `python -m benchmarks.simulate_table [--calibrate]`.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace

from benchmarks.common import plot_path, write_result
from tools.simulate import (
    CHIP_COUNTS,
    HETERO_PAPER,
    PAPER_TABLE1,
    SYSTEMS,
    FailureModel,
    GridConfig,
    SimResult,
    format_grid,
    hetero_configs,
    max_abs_error_points,
    run_grid,
    simulate,
)

NAME = "simulate_table"
ELASTIC_FIT_ROWS = ("elastic_dp", "M8")  # stage 1: return mean, downscale, upscale, slice size; stage 2: dp
FITTED_ROWS = ("dp", *ELASTIC_FIT_ROWS)
RESTORE_UNIT_CHIP_S = 1e6  # the fit moves restore_chip_s in millions of chip-seconds (steps of one size)


def _goodputs(results: dict[str, dict[str, SimResult]]) -> dict[str, dict[str, float]]:
    return {s: {c: r.goodput for c, r in row.items()} for s, row in results.items()}


def _elastic_model(theta: Sequence[float], base: FailureModel) -> FailureModel:
    return_mean_s, downscale_s, upscale_s, slice_chips = theta
    return replace(
        base,
        return_mean_s=return_mean_s,
        downscale_s=downscale_s,
        upscale_s=upscale_s,
        slice_chips=max(1, round(slice_chips)),
    )


def _dp_model(theta: Sequence[float], base: FailureModel) -> FailureModel:
    restart_s, restore_mchip_s = theta
    return replace(base, restart_s=restart_s, restore_chip_s=restore_mchip_s * RESTORE_UNIT_CHIP_S)


def _rows_loss(model: FailureModel, rows: Sequence[str], seed: int) -> float:
    """L4 norm of `rows`' errors in points (a smooth stand-in for the max), simulated exactly as the reported
    grid simulates them (same failure targets and seed), so the fitted rows of the grid are what was minimised."""
    ours = _goodputs(run_grid(GridConfig(failures=model, seed=seed), rows))
    errors = [(ours[s][c] - PAPER_TABLE1[s][c]) * 100.0 for s in ours for c in ours[s]]
    return math.fsum(e**4 for e in errors) ** 0.25


def nelder_mead(
    f: Callable[[Sequence[float]], float],
    x0: Sequence[float],
    steps: Sequence[float],
    *,
    max_evals: int = 150,
    tol: float = 1e-3,
) -> tuple[list[float], float]:
    """Plain Nelder-Mead (reflection 1, expansion 2, contraction 0.5, shrink 0.5); returns (x, f(x))."""
    simplex = [list(x0)] + [
        [x + (s if i == j else 0.0) for j, x in enumerate(x0)] for i, s in enumerate(steps)
    ]
    values = [f(x) for x in simplex]
    evals = len(simplex)
    while evals < max_evals:
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] <= tol:
            break
        centroid = [sum(p[j] for p in simplex[:-1]) / (len(simplex) - 1) for j in range(len(x0))]

        worst = simplex[-1]

        def towards(
            scale: float, centroid: list[float] = centroid, worst: list[float] = worst
        ) -> list[float]:
            return [c + scale * (w - c) for c, w in zip(centroid, worst, strict=True)]

        reflected = towards(-1.0)
        fr = f(reflected)
        evals += 1
        if fr < values[0]:
            expanded = towards(-2.0)
            fe = f(expanded)
            evals += 1
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = towards(0.5)
            fc = f(contracted)
            evals += 1
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [
                    [b + 0.5 * (x - b) for b, x in zip(best, p, strict=True)] for p in simplex[1:]
                ]
                values = [values[0]] + [f(p) for p in simplex[1:]]
                evals += len(simplex) - 1
    i = min(range(len(simplex)), key=values.__getitem__)
    return simplex[i], values[i]


def calibrate(base: FailureModel, seed: int) -> tuple[FailureModel, dict[str, float]]:
    """Refine in two stages from `base` (the defaults, themselves a fit; steps sized for a local search).
    1: return mean, downscale and upscale times and slice on elastic_dp and M8 (L4 of the simulated errors).
    2: the restart's fixed part and restore work on dp, whose goodput is a renewal process: the formula is exact for
    this model (a unit test checks the simulation against it), so the max error is minimised on it, free of noise.
    The dp row depends on stage 1 only through the return mean; fitting all five on one loss let the dp row's errors,
    the largest, swamp the others'."""

    def elastic_loss(theta: Sequence[float]) -> float:
        if min(theta) <= 0:
            return math.inf
        return _rows_loss(_elastic_model(theta, base), ELASTIC_FIT_ROWS, seed)

    x0 = [base.return_mean_s, base.downscale_s, base.upscale_s, float(base.slice_chips)]
    x, elastic_l4 = nelder_mead(elastic_loss, x0, [4.0, 2.0, 2.0, 1_500.0], max_evals=60, tol=0.01)
    model = _elastic_model(x, base)
    logging.info("stage 1 (elastic_dp, M8): %s -> %s (L4 %.3f)", x0, [round(v, 2) for v in x], elastic_l4)

    def dp_max_error(theta: Sequence[float]) -> float:
        if min(theta) < 0:  # either part of the restart may be zero
            return math.inf
        dp = _dp_model(theta, model)
        return max(abs(dp.dp_goodput(CHIP_COUNTS[c]) - PAPER_TABLE1["dp"][c]) * 100.0 for c in CHIP_COUNTS)

    x0 = [model.restart_s, model.restore_chip_s / RESTORE_UNIT_CHIP_S]
    x, dp_max = nelder_mead(dp_max_error, x0, [2.0, 0.5], max_evals=2_000, tol=1e-9)
    logging.info("stage 2 (dp, renewal formula): %s -> %s (max %.3f)", x0, [round(v, 3) for v in x], dp_max)
    return _dp_model(x, model), {"elastic_m8_l4_points": elastic_l4, "dp_formula_max_points": dp_max}


def _plot(ours: dict[str, dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(CHIP_COUNTS)
    xs = [CHIP_COUNTS[c] for c in labels]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, system in enumerate(ours):
        color = f"C{i}"
        ax.plot(xs, [ours[system][c] * 100 for c in labels], "-o", color=color, label=f"{system} (ours)")
        ax.plot(xs, [PAPER_TABLE1[system][c] * 100 for c in labels], "--x", color=color, alpha=0.6)
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(xs, labels)
    ax.set_xlabel("chips (MTBI per chip = 1 year)")
    ax.set_ylabel("goodput %")
    ax.set_title("Goodput: simulator (solid) vs paper Table 1 (dashed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.simulate_table", description=__doc__)
    parser.add_argument("--calibrate", action="store_true", help="refit the failure model first (minutes)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    model = FailureModel()
    calibration: dict[str, object] = {"source": "FailureModel defaults (fitted earlier with --calibrate)"}
    if args.calibrate:
        started = time.perf_counter()
        model, losses = calibrate(model, args.seed)
        calibration = {
            "source": "refitted in this run",
            **losses,
            "seconds": time.perf_counter() - started,
        }
        print(f"calibrated: {model}")

    grid = GridConfig(failures=model, seed=args.seed)
    load_before = os.getloadavg()[0]
    started, started_cpu = time.perf_counter(), time.process_time()
    results = run_grid(grid, SYSTEMS)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - started_cpu
    load_after = os.getloadavg()[0]
    ours = _goodputs(results)
    print(format_grid(ours))

    baseline_rows = {s: ours[s] for s in FITTED_ROWS}
    learner_rows = {s: row for s, row in ours.items() if s not in FITTED_ROWS}
    headline = {
        "max_abs_error_points": max_abs_error_points(ours),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,  # the machine is shared: wall time above CPU time is contention
        "load_1min_before_after": [load_before, load_after],  # the load average the grid ran under
        "max_stderr_points": max(r.goodput_stderr for row in results.values() for r in row.values()) * 100,
        "max_abs_error_points_fitted_rows": max_abs_error_points(baseline_rows),
        "max_abs_error_points_predicted_rows": max_abs_error_points(learner_rows),
        "fitted_rows": list(FITTED_ROWS),
        "predicted_rows": list(learner_rows),
        "cells_within_3_points": sum(
            1 for s in ours for c in ours[s] if abs(ours[s][c] - PAPER_TABLE1[s][c]) * 100 <= 3.0
        ),
        "cells": sum(len(row) for row in ours.values()),
    }
    print(
        f"max |ours - paper| {headline['max_abs_error_points']:.2f} points"
        f" (fitted rows {headline['max_abs_error_points_fitted_rows']:.2f},"
        f" predicted rows {headline['max_abs_error_points_predicted_rows']:.2f});"
        f" {headline['cells_within_3_points']}/{headline['cells']} cells within 3;"
        f" noise (standard error) <= {headline['max_stderr_points']:.2f} points;"
        f" grid {seconds:.1f}s wall, {cpu_seconds:.1f}s CPU at load {load_before:.1f}-{load_after:.1f}"
    )

    hetero = {}
    for name, config in hetero_configs(seed=args.seed).items():
        r = simulate(config)
        hetero[name] = {
            "goodput": r.goodput,
            "paper_goodput": HETERO_PAPER[name],
            "mean_merged_learners": r.mean_merged_learners,
            "merged_step_share": r.merged_step_share,
        }
        print(f"hetero {name:10s} goodput {r.goodput * 100:5.1f}% (paper {HETERO_PAPER[name] * 100:.0f}%)")

    detail = {
        "grid": ours,
        "paper_grid": PAPER_TABLE1,
        "errors_points": {s: {c: (ours[s][c] - PAPER_TABLE1[s][c]) * 100 for c in ours[s]} for s in ours},
        "stderr_points": {
            s: {c: r.goodput_stderr * 100 for c, r in row.items()} for s, row in results.items()
        },
        "failure_model": asdict(model),
        "grid_config": {
            "step_s": grid.step_s,
            "dp_failures_target": grid.dp_failures_target,
            "failures_target": grid.failures_target,
            "learner_failures_target": grid.learner_failures_target,
            "warmup_fraction": grid.warmup_fraction,
            "noise_reference_chips": grid.noise_reference_chips,
            "quorum": asdict(grid.quorum),
            "seed": grid.seed,
        },
        "cells": {
            s: {
                c: {
                    "failures": r.failures,
                    "measured_s": r.measured_s,
                    "events": r.events,
                    "mean_merged_learners": r.mean_merged_learners,
                }
                for c, r in row.items()
            }
            for s, row in results.items()
        },
        "calibration": calibration,
        "hetero_quorum": hetero,
    }
    path = write_result(NAME, headline, detail)
    png = plot_path(NAME)
    _plot(ours, str(png))
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
