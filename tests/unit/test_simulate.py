"""The discrete-event goodput simulator: determinism, sanity of the systems, analytic cross-checks."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tools.simulate import (
    FailureModel,
    GridConfig,
    QuorumConfig,
    SimConfig,
    cell_config,
    format_grid,
    hetero_configs,
    main,
    max_abs_error_points,
    run_grid,
    simulate,
)

SMALL = GridConfig(failures_target=1_500.0, learner_failures_target=300.0)


def test_deterministic_for_a_seed() -> None:
    config = cell_config("M4", 1_200_000, SMALL)
    assert simulate(config) == simulate(config)
    other = simulate(replace(config, seed=1))
    assert other.goodput != simulate(config).goodput


def test_tiny_grid_orders_the_systems_like_the_paper() -> None:
    results = run_grid(SMALL, ("dp", "elastic_dp", "M8"), ("150k", "1.2M"))
    g = {s: {c: r.goodput for c, r in row.items()} for s, row in results.items()}
    for label in ("150k", "1.2M"):
        assert 0.0 < g["dp"][label] < g["elastic_dp"][label] < g["M8"][label] <= 1.0
        assert results["M8"][label].failures > 0 and results["M8"][label].rounds_merged > 0
    assert g["dp"]["1.2M"] < g["dp"]["150k"]
    assert max_abs_error_points(g) < 10.0  # loose: the calibrated grid is checked by the benchmark
    assert "M8" in format_grid(g)


def test_dp_matches_the_renewal_formula() -> None:
    # Failures only hit a computing job, each costs the return time plus the restart:
    # goodput = 1 / (1 + rate * (E[return] + restart)).
    fm = FailureModel()
    config = SimConfig(system="dp", num_chips=600_000, horizon_s=3.0e5, warmup_s=1.0e4, failures=fm)
    rate = 600_000 / fm.mtbi_chip_s
    expected = 1.0 / (1.0 + rate * (fm.return_mean_s + fm.restart_s))
    assert simulate(config).goodput == pytest.approx(expected, rel=0.03)


def test_no_failures_means_full_goodput() -> None:
    calm = replace(FailureModel(), mtbi_chip_s=math.inf)
    for system in ("dp", "elastic_dp"):
        r = simulate(SimConfig(system=system, num_chips=1000, horizon_s=1000.0, failures=calm))
        assert r.goodput == pytest.approx(1.0) and r.failures == 0
    r = simulate(SimConfig(system="diloco", num_chips=1000, num_learners=4, horizon_s=2000.0, failures=calm))
    assert r.goodput == pytest.approx(1.0)
    assert r.mean_merged_learners == pytest.approx(4.0, abs=0.1)  # equal speeds: everyone makes the grace


def test_k1_goodput_does_not_depend_on_step_time() -> None:
    base = cell_config("M4", 2_400_000, SMALL)
    fine, coarse = (simulate(replace(base, step_s=s)) for s in (2.0, 30.0))
    assert fine.goodput == pytest.approx(coarse.goodput, rel=1e-12)  # same failures, nobody waits
    assert fine.failures == coarse.failures
    assert fine.rounds_merged > 10 * coarse.rounds_merged


def test_waiting_for_dead_learners_costs_goodput() -> None:
    # 8 learners of 18.75k chips are one slice each: a failure takes a learner down until its chips return.
    decoupled = replace(cell_config("M8", 150_000, SMALL), step_s=5.0)
    sync = replace(decoupled, quorum=QuorumConfig.synchronous(8))
    elastic_sync = replace(decoupled, quorum=QuorumConfig.elastic_synchronous(), detection_timeout_s=20.0)
    g_decoupled, g_sync, g_elastic = (simulate(c).goodput for c in (decoupled, sync, elastic_sync))
    assert g_sync < g_elastic < g_decoupled


def test_heterogeneous_speeds_quorum_table() -> None:
    configs = hetero_configs(steps=400)
    results = {name: simulate(config) for name, config in configs.items()}
    assert results["K=8"].goodput < 0.95
    assert results["K=1"].goodput == pytest.approx(1.0, abs=1e-3)
    assert results["K=1+grace"].goodput == pytest.approx(1.0, abs=1e-3)
    assert results["K=1"].mean_merged_learners == pytest.approx(1.0)
    assert results["K=8"].mean_merged_learners == pytest.approx(8.0)


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        SimConfig(system="dp", num_chips=10, horizon_s=10.0, warmup_s=10.0)
    with pytest.raises(ValueError):
        SimConfig(system="diloco", num_chips=10, horizon_s=10.0, num_learners=2, speed_factors=(1.0,))
    with pytest.raises(ValueError):
        cell_config("X3", 1000, SMALL)


def test_cli_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "--systems",
                "dp,M2",
                "--chips",
                "300k",
                "--failures-target",
                "200",
                "--learner-failures-target",
                "50",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "dp" in out and "M2" in out and "300k" in out and "max |ours - paper|" in out
