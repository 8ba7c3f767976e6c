"""SENTINEL boundary monitor on a synthetic residual stage with three slightly different replicas."""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from verification.attacks import Attack, AttackConfig
from verification.ledger import ViolationLedger
from verification.sentinel import (
    METRICS,
    BoundaryMonitor,
    SentinelConfig,
    SentinelMonitor,
    StageTurnover,
    Verdict,
    _compute_fences,
)

BATCH, TOKENS, WIDTH = 8, 16, 32


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Small ops spread over OpenMP threads stall for milliseconds on a shared, busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


FAST = SentinelConfig(warmup_checks=60, min_window_checks=24, window_checks=128)
NO_LOCKOUT = dataclasses.replace(FAST, lockout_checks=0)


class SyntheticStage:
    """Inputs with a fixed positional pattern; each replica is y = x + 0.5 tanh(x W_r)."""

    def __init__(self, seed: int, replicas: int = 3) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.pattern = torch.randn(TOKENS, WIDTH, generator=self.gen)
        base = torch.randn(WIDTH, WIDTH, generator=self.gen) / WIDTH**0.5
        self.weights = [base + 0.02 * torch.randn(WIDTH, WIDTH, generator=self.gen) for _ in range(replicas)]
        self.names = [f"r{i}" for i in range(replicas)]

    def shift_all(self, scale: float) -> None:
        """An honest stage-wide change (a merged version, an lr change): same for every replica."""
        jump = torch.randn(WIDTH, WIDTH, generator=self.gen) * scale / WIDTH**0.5
        self.weights = [w + jump for w in self.weights]
        self.pattern = self.pattern + scale * torch.randn(TOKENS, WIDTH, generator=self.gen)

    def microbatch(self, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.pattern + torch.randn(BATCH, TOKENS, WIDTH, generator=self.gen)
        return x + 0.5 * torch.tanh(x @ self.weights[replica]), x


def drive(
    monitor: BoundaryMonitor,
    stage: SyntheticStage,
    checks: int,
    *,
    start: int = 0,
    attack: Attack | None = None,
    attacker: int = 0,
    context: bool = True,
) -> list[Verdict]:
    verdicts = []
    for i in range(start, start + checks):
        replica = i % len(stage.names)
        y, x = stage.microbatch(replica)
        if attack is not None and replica == attacker:
            y = attack.apply(y, direction="forward", microbatch_id=i, step=i)
        verdicts.append(monitor.check(y, stage.names[replica], i, float(i), context=x if context else None))
    return verdicts


_WARMED: dict[tuple[int, SentinelConfig], tuple[BoundaryMonitor, torch.Tensor]] = {}


def warmed(seed: int = 0, config: SentinelConfig = FAST) -> tuple[BoundaryMonitor, SyntheticStage]:
    """A monitor after 300 honest checks, and the stage in the state it left; cached (deep copies)."""
    key = (seed, config)
    if key not in _WARMED:
        monitor = BoundaryMonitor(config, stage=1, direction="forward")
        stage = SyntheticStage(seed)
        drive(monitor, stage, 300)
        _WARMED[key] = (monitor, stage.gen.get_state())
    monitor, gen_state = _WARMED[key]
    stage = SyntheticStage(seed)
    stage.gen.set_state(gen_state)
    return copy.deepcopy(monitor), stage


def flag_rate(verdicts: list[Verdict]) -> float:
    return sum(v.flagged for v in verdicts) / len(verdicts)


def test_warm_up_never_flags_valid_tensors_and_always_flags_non_finite() -> None:
    monitor = BoundaryMonitor(FAST, stage=0, direction="forward")
    stage = SyntheticStage(0)
    garbage = [torch.full((BATCH, TOKENS, WIDTH), 1e3), torch.zeros(BATCH, TOKENS, WIDTH)]
    for i in range(FAST.warmup_checks - 1):
        y, _ = stage.microbatch(i % 3)
        assert not monitor.check(y if i % 7 else garbage[i % 2], "r0", i, float(i)).flagged
    bad = torch.ones(BATCH, TOKENS, WIDTH)
    bad[0, 0, 0] = float("inf")
    verdict = monitor.check(bad, "r0", 999, 0.0)
    assert verdict.flagged and verdict.mode == "invalid" and "non-finite" in verdict.reason


def test_shape_mismatch_is_flagged() -> None:
    monitor, _ = warmed()
    verdict = monitor.check(torch.ones(BATCH, TOKENS + 1, WIDTH), "r0", 0, 0.0)
    assert verdict.flagged and "shape" in verdict.reason
    # a different batch size is fine: the baseline is over tokens and features
    _, stage = warmed()
    y, x = stage.microbatch(0)
    assert not monitor.check(y[:3], "r0", 1, 1.0, context=x[:3]).flagged
    # nothing to judge: flagged with a reason, never an exception
    for empty in (torch.ones(0, TOKENS, WIDTH), torch.tensor(1.0)):
        verdict = monitor.check(empty, "r0", 2, 2.0)
        assert verdict.flagged and verdict.mode == "invalid", verdict


def test_clean_stream_is_almost_never_flagged() -> None:
    monitor, stage = warmed()
    verdicts = drive(monitor, stage, 900, start=300)
    assert flag_rate(verdicts) < 0.005
    assert {v.mode for v in verdicts} == {"peer"}
    assert set(verdicts[-1].deviations) == set(METRICS)


@pytest.mark.parametrize(
    "kind, strength",
    [
        ("zeros", None),
        ("constant", None),
        ("random", 1.0),
        ("scaling", -1.0),
        ("scaling", 10.0),
        ("scaling", 1.5),
        ("sign_flip", 0.5),
        ("bias", 0.5),
        ("mimic", 0.0),
        ("mimic", 1.0),
        ("delay", None),
    ],
)
def test_attacks_are_flagged(kind: str, strength: float | None) -> None:
    monitor, stage = warmed()
    attack = Attack(AttackConfig(kind=kind, strength=strength, start_after=330, delay_steps=21, seed=1))
    # the attack object learns (mimic) and keeps history (delay) on the attacker's honest steps
    for i in range(0, 330, 3):
        attack.apply(stage.microbatch(0)[0], direction="forward", microbatch_id=i, step=i)
    verdicts = drive(monitor, stage, 90, start=330, attack=attack)
    attacked = [v for v in verdicts if v.signer == "r0"]
    honest = [v for v in verdicts if v.signer != "r0"]
    assert flag_rate(attacked) >= 0.9, attacked[0].reason
    assert flag_rate(honest) < 0.05


def test_paired_metrics_catch_what_batch_statistics_cannot() -> None:
    # A sign flip of half the features keeps every batch-mean statistic of a centred tensor.
    config = SentinelConfig(warmup_checks=60, min_window_checks=24, window_checks=128)
    results = {}
    for context in (False, True):
        monitor = BoundaryMonitor(config, stage=1, direction="backward")
        stage = SyntheticStage(3)
        stage.pattern.zero_()  # gradient-like: no mean structure
        drive(monitor, stage, 300, context=context)
        attack = Attack(AttackConfig(kind="sign_flip", strength=0.5, seed=4))
        verdicts = drive(monitor, stage, 90, start=300, attack=attack, context=context)
        results[context] = flag_rate([v for v in verdicts if v.signer == "r0"])
    assert results[False] < 0.2 and results[True] >= 0.9


def test_flagged_tensors_do_not_move_the_baseline() -> None:
    monitor, stage = warmed()
    before = monitor.baseline()
    verdict = monitor.check(torch.full((BATCH, TOKENS, WIDTH), 50.0), "r0", 0, 0.0)
    assert verdict.flagged
    assert torch.equal(monitor.baseline(), before)
    y, x = stage.microbatch(1)
    assert not monitor.check(y, "r1", 1, 1.0, context=x).flagged
    assert not torch.equal(monitor.baseline(), before)


def test_score_is_pure() -> None:
    monitor, stage = warmed()
    y, x = stage.microbatch(0)
    state = monitor.state_dict()
    first = monitor.score(y, "r0", 0, 0.0, context=x)
    second = monitor.score(y, "r0", 0, 0.0, context=x)
    assert (first.flagged, first.scores, first.deviations) == (
        second.flagged,
        second.scores,
        second.deviations,
    )
    assert _states_equal(state, monitor.state_dict())


def test_stage_wide_shift_re_anchors_instead_of_locking_out() -> None:
    """Honest shift of every replica: cross-replica centring keeps flagging short-lived and the ledger
    bans nobody, while the paper's history-only fences flag nearly everything afterwards (the lock-out
    of the digest's section 13)."""
    results = {}
    for name, config in (
        ("peer", FAST),
        ("history only", SentinelConfig(**{**_kw(FAST), "min_peer_replicas": 10**6})),
    ):
        monitor, stage = warmed(seed=5, config=config)
        stage.shift_all(1.0)
        after = drive(monitor, stage, 300, start=300)
        results[name] = (flag_rate(after[:60]), flag_rate(after[-150:]))
        if name == "peer":
            ledger = ViolationLedger()
            decisions = [ledger.record(v.signer, 1, v.flagged, float(i)) for i, v in enumerate(after)]
            assert not any(d.action == "ban" for dec in decisions for d in dec.all())
    assert results["history only"][1] > 0.9  # locked out: the baseline never learns the new normal
    # (the lock-out rule leaves it: the shifted replicas wrote that history themselves)
    assert results["peer"][1] < 0.02  # re-anchored: the EMA learned the shifted traffic
    assert results["peer"][0] < 0.35  # a few checks per replica until the centre has moved


def test_a_single_replica_that_shifts_stays_flagged_and_is_not_absorbed() -> None:
    """The same kind of change as above, on one replica only: the centre stays with the majority,
    so the odd replica is flagged to the end instead of being learned as the new normal."""
    monitor, stage = warmed(seed=6)
    verdicts = drive(
        monitor, stage, 300, start=300, attack=Attack(AttackConfig(kind="scaling", strength=1.3))
    )
    odd = [v for v in verdicts if v.signer == "r0"]
    assert flag_rate(odd[:10]) > 0.9 and flag_rate(odd[-10:]) > 0.9
    assert flag_rate([v for v in verdicts if v.signer != "r0"]) < 0.02


def test_stage_turnover_reports_a_stage_whose_replicas_were_all_replaced() -> None:
    turnover = StageTurnover()
    assert turnover.observe({0: ["a"], 1: ["b", "c"]}) == []  # first sight: nothing to compare with
    assert turnover.observe({0: [], 1: ["c", "d"]}) == []  # stage 0 empty (keeps "a"); stage 1 kept "c"
    assert turnover.observe({0: ["m"], 1: ["d"]}) == [0]  # "a" gone, "m" moved in; "d" was seen beside "c"
    assert turnover.observe({0: ["m", "n"], 1: ["d"]}) == []  # reported once: "m" is stage 0's now


def test_a_stage_whose_replicas_were_all_replaced_is_not_locked_out_after_a_reset() -> None:
    """Stage 0's replicas built its history; then they are gone and one newcomer serves it, on weights that
    differ (the global version, not their local ones). Fewer than two replicas: history-only fences. Kept,
    that history flags the newcomer to the end (negative control); reset, a fresh one judges it."""
    results = {}
    for reset in (False, True):
        monitor = SentinelMonitor(NO_LOCKOUT)  # the lock-out rule would re-anchor it too (test below)
        stage = SyntheticStage(8)
        for i in range(300):
            y, x = stage.microbatch(i % 3)
            monitor.check(0, "forward", stage.names[i % 3], i, y, float(i), context=x)
        stage.shift_all(1.0)
        if reset:
            monitor.reset_stage(0)
        verdicts = []
        for i in range(300, 600):
            y, x = stage.microbatch(0)
            verdicts.append(monitor.check(0, "forward", "newcomer", i, y, float(i), context=x))
        results[reset] = flag_rate(verdicts[-150:])
    assert results[False] > 0.9  # locked out: every tensor the stage's only replica sends is dropped
    assert results[True] < 0.02


def _survivor_run(
    config: SentinelConfig, *, seconds_per_check: float = 1.0, passes_every: int = 0
) -> tuple[BoundaryMonitor, list[Verdict]]:
    """Two replicas of a stage; r0 takes nearly all the traffic (r1 sits out a routing cooldown), so r0 writes
    the history. Then r0 dies and r1, whose outputs moved apart meanwhile, is the stage's only replica;
    with `passes_every` = k, every k-th of its tensors is like r0's and passes."""
    monitor = BoundaryMonitor(config, stage=0, direction="forward")
    stage = SyntheticStage(9, replicas=2)
    for i in range(400):
        replica = 1 if i % 40 == 0 else 0
        y, x = stage.microbatch(replica)
        monitor.check(y, stage.names[replica], i, i * seconds_per_check, context=x)
    offset = 0.6  # a level r0 never had (in test_pipeline: level z=-11, sign flips z=+27 against the history)
    verdicts = []
    for i in range(400, 800):
        y, x = stage.microbatch(1)
        if not (passes_every and i % passes_every == 0):
            y = y + offset
        verdicts.append(monitor.check(y, "r1", i, i * seconds_per_check, context=x))
    return monitor, verdicts


@pytest.mark.parametrize("passes_every", [0, 20], ids=["all refused", "1 in 20 passes"])
def test_a_survivor_judged_against_its_departed_peers_history_is_not_locked_out(passes_every: int) -> None:
    """The test_pipeline lock-out: after its peer's SIGKILL the survivor's forwards were refused, every one for 18 s
    (training stopped) in one run, 97-99 % for 21 s in another. Without the rule (negative control) the survivor is
    flagged to the end; with it the history starts again on the survivor once `lockout_fraction` of the last
    `lockout_checks` checks were refused for `lockout_s`, and it is judged against the new one."""
    _, kept = _survivor_run(NO_LOCKOUT, passes_every=passes_every)
    assert flag_rate(kept[-150:]) > 0.9
    monitor, verdicts = _survivor_run(FAST, passes_every=passes_every)
    first = next(i for i, v in enumerate(verdicts) if v.reanchored)
    assert monitor.reanchors == 1 and verdicts[first].flagged and "locked out" in verdicts[first].reason
    refused = verdicts[first - FAST.lockout_checks + 1 : first + 1]
    assert flag_rate(refused) >= FAST.lockout_fraction
    assert verdicts[first].microbatch_id - refused[0].microbatch_id >= FAST.lockout_s  # 1 s per check here
    usual = [v for v in verdicts[-150:] if not (passes_every and v.microbatch_id % passes_every == 0)]
    assert flag_rate(usual) < 0.02  # (the odd one in 20 that passed before is the odd one now)
    warming = verdicts[first + 1 : first + 1 + FAST.warmup_checks]
    assert not any(v.flagged for v in warming)


def test_the_tap_drops_until_the_lock_out_then_reports_it_and_passes_the_survivor() -> None:
    """The verifier's seam around the same scenario: the survivor's forwards are dropped (never banned: its
    peer sends nothing clean meanwhile), the re-anchor is counted and put on the event tape, and after it
    the survivor's tensors pass."""
    from protocol.envelope import Direction
    from verification.tap import Drop, SentinelTap, SentinelTapConfig

    events: list[tuple[str, dict[str, object]]] = []
    clock = [0.0]
    tap = SentinelTap(
        verifier="v",
        run_id="run",
        config=SentinelTapConfig(sentinel=FAST, spot=None),
        stage_replicas=lambda _stage: ("r0", "r1"),
        emit=lambda event, **fields: events.append((event, fields)),
        clock=lambda: clock[0],
        wall_clock=lambda: clock[0],
    )
    stage = SyntheticStage(9, replicas=2)
    results = []
    for i in range(800):
        replica = 1 if i >= 400 or i % 40 == 0 else 0
        y, x = stage.microbatch(replica)
        y = y + (0.6 if i >= 400 else 0.0)
        clock[0] = float(i)
        out = tap.check(0, Direction.FORWARD, stage.names[replica], i, y, None, context=x)  # type: ignore[arg-type]
        results.append(isinstance(out, Drop))
    resets = [fields for event, fields in events if event == "sentinel_reset"]
    assert resets == [{"stage": 0, "direction": "forward", "replicas": ["r1"], "why": "locked out"}]
    assert tap.status()["reanchors"] == 1 and tap.banned() == frozenset()
    assert sum(results[400:480]) >= FAST.lockout_checks  # dropped until then...
    assert not any(results[-200:])  # ...and its traffic passes after


def test_a_refusal_streak_shorter_than_lockout_s_is_not_a_lock_out() -> None:
    """The writer may only be sitting out a routing cooldown (seconds): a streak of refusals must also last
    `lockout_s` before the survivor is taken for the stage's only replica. Here 400 checks take 4 s."""
    monitor, verdicts = _survivor_run(FAST, seconds_per_check=0.01)
    assert monitor.reanchors == 0 and flag_rate(verdicts[-150:]) > 0.9


def test_the_lock_out_rule_never_re_anchors_a_replica_on_a_history_it_wrote() -> None:
    """A lone replica that wrote its stage's history and then sends something else (here a scaling attack) is
    what the history is there to catch: flagged to the end, no re-anchor."""
    monitor = BoundaryMonitor(FAST, stage=0, direction="forward")
    stage = SyntheticStage(10, replicas=1)
    drive(monitor, stage, 300)
    verdicts = drive(
        monitor, stage, 400, start=300, attack=Attack(AttackConfig(kind="scaling", strength=1.5))
    )
    assert monitor.reanchors == 0
    assert flag_rate(verdicts) > 0.95 and not any(v.reanchored for v in verdicts)


def test_rewarm_flags_only_blatant_deviations_for_a_while() -> None:
    monitor, stage = warmed(seed=7)
    monitor.rewarm()
    y, x = stage.microbatch(0)
    moderate = monitor.check(1.1 * y, "r0", 0, 0.0, context=x)
    blatant = monitor.check(torch.zeros_like(y), "r0", 1, 1.0, context=x)
    assert moderate.mode == "rewarm" and not moderate.flagged
    assert blatant.flagged
    drive(monitor, stage, FAST.rewarm_checks, start=2)
    assert monitor.check(1.1 * y, "r0", 99, 99.0, context=x).flagged


def test_state_round_trip_gives_identical_verdicts_and_no_re_learning() -> None:
    monitor, stage = warmed(seed=8)
    restored = BoundaryMonitor(FAST, stage=1, direction="forward")
    restored.load_state_dict(monitor.state_dict())
    assert not restored.in_warmup
    stage_copy = SyntheticStage(8)
    stage_copy.gen.set_state(stage.gen.get_state())
    a = drive(monitor, stage, 60, start=300, attack=Attack(AttackConfig(kind="scaling", strength=2.0)))
    b = drive(restored, stage_copy, 60, start=300, attack=Attack(AttackConfig(kind="scaling", strength=2.0)))
    assert [(v.flagged, v.reason) for v in a] == [(v.flagged, v.reason) for v in b]
    assert any(v.flagged for v in a)
    # a verifier that restarts WITHOUT state re-learns and flags nobody meanwhile
    fresh = BoundaryMonitor(FAST, stage=1, direction="forward")
    assert not any(v.flagged for v in drive(fresh, stage, FAST.warmup_checks, start=400))


def test_state_dict_holds_only_plain_tensors_and_numbers() -> None:
    monitor, _ = warmed()

    def plain(value: object) -> bool:
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        return value is None or isinstance(value, (int, float, str, torch.Tensor))

    assert plain(monitor.state_dict())
    with pytest.raises(ValueError):
        BoundaryMonitor(FAST, stage=2, direction="forward").load_state_dict(monitor.state_dict())


def test_replacement_is_the_baseline_broadcast() -> None:
    monitor, stage = warmed()
    y, _ = stage.microbatch(0)
    replacement = monitor.replacement_for(y)
    assert replacement.shape == y.shape
    assert torch.allclose(replacement[0], monitor.baseline()) and torch.equal(replacement[0], replacement[-1])
    assert torch.count_nonzero(BoundaryMonitor(FAST, stage=0, direction="backward").replacement_for(y)) == 0


def test_fences_have_one_width_per_side_for_skewed_metrics() -> None:
    # A right-skewed honest metric (like the gradient's gain) gets a wider upper fence and keeps a
    # tight lower one; a symmetric metric gets equal sides.
    rng = np.random.default_rng(0)
    skewed = rng.gamma(2.0, 1.0, 4000) * 0.1
    symmetric = rng.standard_normal(4000) * 0.1
    data = np.stack([skewed, symmetric], axis=1)
    fences = _compute_fences(data, SentinelConfig(metrics=("l1",)))
    assert fences.sigma_high[0] > 1.2 * fences.sigma_low[0]  # gamma(2): about 1.3
    assert fences.sigma_high[1] == pytest.approx(fences.sigma_low[1], rel=0.1)
    assert fences.sigma_high[1] == pytest.approx(0.1, rel=0.1)
    low, high = fences.bounds(6.0)
    assert (data[:, 0] >= low[0]).all() and (data[:, 0] <= high[0]).mean() > 0.999


def test_fences_from_one_sort_match_the_quantile_definitions() -> None:
    # _compute_fences takes every quantile from one sort per column (for speed); it must give what
    # the definitions give: linear-interpolation quantiles over the finite values of each column and,
    # per side, the median of the deviations on that side (NaN columns: no context was passed).
    rng = np.random.default_rng(3)
    for trial in range(60):
        rows = int(rng.integers(1, 200))
        data = rng.standard_normal((rows, 8)) * rng.gamma(1.0, 1.0, 8)
        if trial % 3 == 0:
            data[:, 6:] = np.nan
        if trial % 4 == 0:
            data[rng.random(data.shape) < 0.3] = np.nan
        if trial % 5 == 0:
            data = np.round(data, 1)  # ties at the median
        mad = _compute_fences(data, SentinelConfig())
        tukey = _compute_fences(data, SentinelConfig(fence_kind="tukey"))
        for j in range(8):
            column = data[:, j][~np.isnan(data[:, j])]
            if column.size == 0:
                assert np.isnan([mad.centre[j], mad.sigma_low[j], mad.sigma_high[j], tukey.q1[j]]).all()
                continue
            centre = np.quantile(column, 0.5)
            deviation = column - centre
            high = max(np.median(deviation[deviation >= 0]) * 1.4826, 0.01)
            low = max(np.median(-deviation[deviation <= 0]) * 1.4826, 0.01)
            assert mad.centre[j] == pytest.approx(centre, abs=1e-12)
            assert mad.sigma_high[j] == pytest.approx(high, abs=1e-12)
            assert mad.sigma_low[j] == pytest.approx(low, abs=1e-12)
            assert tukey.q1[j] == pytest.approx(np.quantile(column, 0.25), abs=1e-12)
            assert tukey.q3[j] == pytest.approx(np.quantile(column, 0.75), abs=1e-12)


def test_tukey_fences_work_too() -> None:
    config = SentinelConfig(**{**_kw(FAST), "fence_kind": "tukey", "fence_k": 3.0})
    monitor, stage = warmed(config=config)
    assert flag_rate(drive(monitor, stage, 300, start=300)) < 0.01
    y, x = stage.microbatch(0)
    assert monitor.check(-y, "r0", 0, 0.0, context=x).flagged


def test_sentinel_monitor_routes_boundaries_and_round_trips() -> None:
    sentinel = SentinelMonitor(FAST)
    stage = SyntheticStage(9)
    for i in range(200):
        y, x = stage.microbatch(i % 3)
        sentinel.check(1, "forward", f"r{i % 3}", i, y, float(i), context=x)
        sentinel.check(1, "backward", f"r{i % 3}", i, -0.01 * y, float(i))
    restored = SentinelMonitor(FAST)
    restored.load_state_dict(sentinel.state_dict())
    assert _states_equal(restored.state_dict(), sentinel.state_dict())
    assert restored.boundary(1, "backward").accepted_count == 200


def test_check_cost_is_small_for_pipeline_sized_tensors() -> None:
    """Loose regression bound (machines are shared); the measured figure is in docs/sentinel.md."""
    monitor = BoundaryMonitor(
        SentinelConfig(warmup_checks=20, min_window_checks=10), stage=1, direction="forward"
    )
    gen = torch.Generator().manual_seed(0)
    pattern = torch.randn(128, 128, generator=gen)
    xs = [pattern + torch.randn(16, 128, 128, generator=gen) for _ in range(8)]
    for i in range(60):
        monitor.check(xs[i % 8] + 0.1 * xs[(i + 1) % 8], f"r{i % 3}", i, float(i), context=xs[i % 8])
    times = []
    for i in range(60):
        y = xs[i % 8] + 0.1 * xs[(i + 1) % 8]
        t0 = time.process_time()  # CPU time: wall time on a shared machine measures the neighbours
        monitor.check(y, f"r{i % 3}", i, float(i), context=xs[i % 8])
        times.append(time.process_time() - t0)
    assert statistics.median(times) < 0.01


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ema_beta_forward": 1.0},
        {"metrics": ("l1", "nope")},
        {"metrics": ()},
        {"fence_kind": "iqr"},
        {"fence_k": 0.0},
        {"fence_k": 10.0, "blatant_k": 5.0},
        {"min_window_checks": 1000},
        {"min_peer_replicas": 1},
        {"lockout_checks": -1},
        {"lockout_max_share": 1.5},
        {"lockout_s": -1.0},
        {"lockout_fraction": 0.0},
    ],
)
def test_config_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SentinelConfig(**kwargs)  # type: ignore[arg-type]


def _kw(config: SentinelConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def _states_equal(a: object, b: object) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_states_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)))
    return a == b
