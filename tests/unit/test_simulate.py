"""The discrete-event goodput simulator: determinism, sanity of the systems, analytic cross-checks."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from benchmarks import simulate_table
from benchmarks.simulate_table import _elastic_model, nelder_mead
from protocol.compress import CodecSpec, encode
from tools.sim_links import LinkModel, PeerLink
from tools.simulate import (
    DEFAULT_GRID_STEP_S,
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

SMALL = GridConfig(dp_failures_target=1_500.0, failures_target=1_500.0, learner_failures_target=300.0)


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
    # Failures only hit a computing job, each costs the return time plus the restart (its fixed part and the
    # job's share of the restore): goodput = 1 / (1 + rate * (E[return] + restart)).
    fm = FailureModel()
    assert fm.restore_chip_s > 0  # the calibrated model has the size-dependent part this checks
    config = SimConfig(system="dp", num_chips=600_000, horizon_s=3.0e5, warmup_s=1.0e4, failures=fm)
    rate = 600_000 / fm.mtbi_chip_s
    restart = fm.restart_s + fm.restore_chip_s / 600_000
    expected = 1.0 / (1.0 + rate * (fm.return_mean_s + restart))
    assert fm.dp_goodput(600_000) == pytest.approx(expected, rel=1e-12)  # what the calibration fits dp on
    result = simulate(config)
    assert result.goodput == pytest.approx(expected, rel=0.03)
    assert abs(result.goodput - expected) < 4 * result.goodput_stderr + 1e-3  # and within its own noise


def _implied_cost_s(fm: FailureModel, chips: int) -> float:
    """The mean cost of one failure a dp run implies: goodput = 1 / (1 + rate * cost)."""
    rate = chips / fm.mtbi_chip_s
    horizon = 30_000.0 / rate  # 30k failures: cost noise about 1%
    g = simulate(
        SimConfig(system="dp", num_chips=chips, horizon_s=horizon, warmup_s=0.05 * horizon, failures=fm)
    )
    return (1.0 / g.goodput - 1.0) / rate


def test_restore_work_makes_a_bigger_job_restart_faster() -> None:
    # The restore is work the job's chips share: restart = restart_s + restore_chip_s / chips.
    fm = replace(FailureModel(), restart_s=5.0, restore_chip_s=6.0e6)
    assert fm.restart_duration_s(150_000) == pytest.approx(45.0)
    assert fm.restart_duration_s(2_400_000) == pytest.approx(7.5)
    small, big = _implied_cost_s(fm, 150_000), _implied_cost_s(fm, 2_400_000)
    assert small - big == pytest.approx(45.0 - 7.5, abs=5.0)
    # negative control: without the restore term the cost per failure does not depend on the job's size
    flat = replace(fm, restore_chip_s=0.0)
    assert _implied_cost_s(flat, 150_000) == pytest.approx(_implied_cost_s(flat, 2_400_000), rel=0.04)
    # an elastic job never restarts: the restore does not touch it
    elastic = cell_config("elastic_dp", 600_000, replace(SMALL, failures=fm))
    assert simulate(elastic) == simulate(replace(elastic, failures=flat))
    with pytest.raises(ValueError):
        replace(fm, restore_chip_s=-1.0)


def test_goodput_stderr_matches_the_spread_over_seeds() -> None:
    config = cell_config("elastic_dp", 1_200_000, SMALL)
    runs = [simulate(replace(config, seed=seed)) for seed in range(8)]
    spread = statistics.stdev(r.goodput for r in runs)
    mean_stderr = statistics.fmean(r.goodput_stderr for r in runs)
    assert mean_stderr > 0.0 and spread / 3 < mean_stderr < spread * 3  # the batch means estimate the noise
    calm = replace(FailureModel(), mtbi_chip_s=math.inf)
    assert (
        simulate(SimConfig(system="dp", num_chips=1000, horizon_s=1000.0, failures=calm)).goodput_stderr
        == 0.0
    )


def test_cells_of_bigger_units_simulate_more_failures() -> None:
    grid = GridConfig(dp_failures_target=3_000.0, failures_target=2_000.0, learner_failures_target=1_000.0)
    mtbi = grid.failures.mtbi_chip_s

    def expected_failures(system: str, chips: int) -> float:
        return cell_config(system, chips, grid).horizon_s * chips / mtbi

    assert expected_failures("M16", 2_400_000) == pytest.approx(1_000.0)  # learners of 150k chips: the base
    assert expected_failures("M2", 2_400_000) == pytest.approx(8_000.0)  # learners of 1.2M chips: 8 times
    assert expected_failures("M8", 150_000) == pytest.approx(1_000.0)  # smaller units never get fewer
    assert expected_failures("elastic_dp", 600_000) == pytest.approx(8_000.0)
    assert expected_failures("dp", 2_400_000) == pytest.approx(3_000.0)  # dp: its own target, not scaled


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
    fine, coarse = (simulate(replace(base, step_s=s)) for s in (2.0, DEFAULT_GRID_STEP_S))
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
                "--dp-failures-target",
                "200",
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


# ----- links -------------------------------------------------------------------------------------
def _links_config(
    mbps: float, *, codec: str = "fp32", peers: tuple[PeerLink, ...] | None = None
) -> SimConfig:
    links = LinkModel(
        model_params=124_000_000,
        peers=peers if peers is not None else (PeerLink.symmetric(mbps, 20.0),),
        codec=CodecSpec(codec=codec),  # type: ignore[arg-type]
    )
    return SimConfig(
        system="diloco",
        num_chips=8,
        num_learners=8,
        horizon_s=400.0,
        warmup_s=40.0,
        failures=replace(FailureModel(), mtbi_chip_s=math.inf),
        step_s=2.0,
        links=links,
    )


@pytest.mark.parametrize("codec", ["fp32", "int8", "int4", "topk"])
def test_round_bytes_are_the_encoded_length(codec: str) -> None:
    spec = CodecSpec(codec=codec)  # type: ignore[arg-type]
    links = LinkModel(model_params=100_003, codec=spec)
    numel = links.fragment_numel(24)
    assert numel == 4_167  # ceil(100003 / 24): the last fragment is no larger than the others
    encoded = encode(torch.randn(numel, generator=torch.Generator().manual_seed(0)), spec)
    assert links.upload_bytes(24) == links.fetch_bytes(24) == encoded.nbytes
    fp32_fetch = LinkModel(model_params=100_003, codec=spec, fetch_codec=CodecSpec())
    assert fp32_fetch.fetch_bytes(24) == 4 * numel


def test_a_slower_link_lowers_goodput_monotonically() -> None:
    speeds = (1000.0, 100.0, 50.0, 10.0)
    goodputs = [simulate(_links_config(mbps)).goodput for mbps in speeds]
    assert goodputs == sorted(goodputs, reverse=True)
    assert goodputs[0] == pytest.approx(1.0, abs=1e-3)  # 20.7 MB in 0.17 s: well inside the 4 s overlap
    # 10 Mbit/s carries a 20.7 MB fragment each way in 16.5 s: throughput-bound near 2 s / 16.5 s
    assert goodputs[-1] == pytest.approx(2.0 / (20.67e6 * 8 / 10e6), rel=0.1)


def test_a_smaller_codec_recovers_goodput_on_a_slow_link() -> None:
    g = {
        codec: simulate(_links_config(10.0, codec=codec)).goodput
        for codec in ("fp32", "int8", "int4", "topk")
    }
    assert g["fp32"] < g["int8"] < g["int4"] < g["topk"]
    assert g["topk"] == pytest.approx(1.0, abs=1e-3)


def test_unconstrained_links_change_nothing() -> None:
    free = _links_config(math.inf, peers=(PeerLink(),))
    plain = replace(free, links=None)
    a, b = simulate(free), simulate(plain)
    assert a.goodput == pytest.approx(b.goodput, abs=1e-9)
    assert a.mean_merged_learners == pytest.approx(b.mean_merged_learners)


def test_latency_beyond_the_overlap_budget_stalls() -> None:
    near, far = (replace(_links_config(math.inf), links=None), _links_config(math.inf))
    far_links = LinkModel(model_params=1, peers=(PeerLink(latency_ms=2_500.0),))
    far = replace(far, links=far_links)  # 5 s round trip against tau * step = 4 s
    assert simulate(near).goodput == pytest.approx(1.0, abs=1e-3)
    assert simulate(far).goodput < 0.9


def test_one_slow_peer_stalls_a_synchronous_syncer_not_a_decoupled_one() -> None:
    peers = (PeerLink.symmetric(10.0, 20.0),) + (PeerLink.symmetric(1000.0, 20.0),) * 7
    decoupled = _links_config(0.0, peers=peers)
    synchronous = replace(decoupled, quorum=QuorumConfig.synchronous(8))
    g_dec, g_sync = simulate(decoupled).goodput, simulate(synchronous).goodput
    assert g_dec > 0.85  # only the slow learner waits for its own fetches
    assert g_sync < 0.3  # everyone waits for the slow learner's contribution


def test_link_validation() -> None:
    with pytest.raises(ValueError):
        PeerLink(uplink_mbps=0.0)
    with pytest.raises(ValueError):
        PeerLink(latency_ms=-1.0)
    with pytest.raises(ValueError):
        _links_config(10.0, peers=(PeerLink(),) * 3)  # neither one link nor one per learner


def test_nelder_mead_finds_a_quadratic_minimum() -> None:
    x, fx = nelder_mead(
        lambda t: (t[0] - 3.0) ** 2 + 10 * (t[1] + 1.0) ** 2, [0.0, 0.0], [1.0, 1.0], tol=1e-10
    )
    assert x == pytest.approx([3.0, -1.0], abs=1e-3) and fx < 1e-6


def test_a_downscale_costs_more_than_an_upscale_of_the_same_length() -> None:
    # Every failure of a running job pauses it to downscale, while a return that lands in a pause joins it: the two
    # pauses are different costs (and different operations, the paper names both), so the calibration fits them apart.
    config = cell_config("elastic_dp", 1_200_000, SMALL)

    def goodput(downscale_s: float, upscale_s: float) -> float:
        pauses = replace(config.failures, downscale_s=downscale_s, upscale_s=upscale_s)
        return simulate(replace(config, failures=pauses)).goodput

    free, down_only, up_only = goodput(0.0, 0.0), goodput(20.0, 0.0), goodput(0.0, 20.0)
    assert free > up_only > down_only
    assert up_only - down_only > 0.05  # 9 points here, the noise 0.3: a different cost, not a noise-sized gap
    fitted = _elastic_model([60.0, 10.0, 5.0, 9_000.4], FailureModel())
    assert (fitted.downscale_s, fitted.upscale_s, fitted.slice_chips) == (10.0, 5.0, 9_000)  # apart, not tied


def test_cross_validation_never_fits_the_row_it_predicts(monkeypatch: pytest.MonkeyPatch) -> None:
    # Stage 1 fits every learner row; the held-out figure is honest only if each row's refit never saw that row.
    fitted_on: list[tuple[str, ...]] = []

    def fake_calibrate(
        base: FailureModel, seed: int, rows: tuple[str, ...], max_evals: int
    ) -> tuple[FailureModel, dict[str, float]]:
        fitted_on.append(tuple(rows))
        return replace(base, return_mean_s=base.return_mean_s + len(fitted_on)), {"stage1_l4_points": 1.0}

    def fake_grid(grid: GridConfig, systems: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        # every cell 1 point above the paper per refit so far: the errors must come from this grid, not the fit's
        bump = grid.failures.return_mean_s - FailureModel().return_mean_s
        return {
            s: {c: SimpleNamespace(goodput=v + bump / 100) for c, v in simulate_table.PAPER_TABLE1[s].items()}
            for s in systems
        }

    monkeypatch.setattr(simulate_table, "calibrate", fake_calibrate)
    monkeypatch.setattr(simulate_table, "run_grid", fake_grid)
    out = simulate_table.cross_validate(FailureModel(), seed=0)
    assert list(out) == list(simulate_table.HELD_OUT_ROWS)
    for (row, result), rows in zip(out.items(), fitted_on, strict=True):
        assert row not in rows and set(rows) | {row} == set(simulate_table.ELASTIC_FIT_ROWS)
        assert result["fitted_on"] == list(rows)
    assert [o["held_out_max_abs_error_points"] for o in out.values()] == pytest.approx([1.0, 2.0, 3.0, 4.0])


def test_table_reports_held_out_errors_only_for_its_own_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(simulate_table, "RESULTS_DIR", tmp_path)
    model = FailureModel()
    assert simulate_table._held_out(model)["source"].startswith("none")
    cv = {
        "measured_at": "then",
        "headline": {"max_abs_error_points": 2.5},
        "base_failure_model": asdict(model),
    }
    (tmp_path / f"{simulate_table.CV_NAME}.json").write_text(json.dumps(cv))
    assert simulate_table._held_out(model)["max_abs_error_points"] == 2.5
    # a refit since: the stored figures are not its own
    other = replace(model, upscale_s=model.upscale_s + 1.0)
    stale = simulate_table._held_out(other)
    assert stale["source"].startswith("stale") and "max_abs_error_points" not in stale


def test_the_dp_row_bounds_the_return_mean() -> None:
    # The dp row's cost per failure is return + restart: a return mean above the bound leaves its best fit no
    # restart to give (it would need a negative one), so the row's error grows; at or below it, it does not.
    base = FailureModel()
    bound = simulate_table.dp_return_bound_s(base)
    below, below_err = simulate_table.fit_restart(replace(base, return_mean_s=bound - 5.0))
    at, at_err = simulate_table.fit_restart(replace(base, return_mean_s=bound))
    _, above_err = simulate_table.fit_restart(replace(base, return_mean_s=bound + 2.0))
    assert below.restart_s == pytest.approx(5.0, abs=0.01) and at.restart_s == pytest.approx(0.0, abs=0.01)
    assert below_err == pytest.approx(at_err, abs=1e-3) and at_err < 3.0
    assert above_err > at_err + 0.05  # the control: past the bound the dp row pays for it
