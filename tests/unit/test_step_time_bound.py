"""A learner's reported step time, which sizes the grace window, is bounded by what the syncer timed of its work
(issue 18: "a fake 1 us step time collapses the grace window"). The pure floor and clamp first (a fake clock), then
through SyncerCore: a majority of identities reporting 1 us, with the negative control (the bound off: they drag the
window to nothing)."""

from __future__ import annotations

import pytest

from node.diloco.quorum import PeerStepTimes, QuorumConfig, step_time_floor
from node.diloco.screening import ScreeningConfig
from node.diloco.syncer_core import SyncerCore
from tests.unit.test_syncer_core import core, learner_params

pytestmark = pytest.mark.timeout(60)

HONEST_STEP_S = 0.5


def test_the_floor_is_the_timed_seconds_per_credited_step_over_the_slack() -> None:
    assert step_time_floor(2.0, 4, 4.0) == pytest.approx(0.125)
    assert step_time_floor(2.0, 0, 4.0) is None  # nothing credited: nothing timed
    assert step_time_floor(0.0, 4, 4.0) is None
    assert step_time_floor(2.0, 4, 0.0) is None  # off
    with pytest.raises(ValueError):
        ScreeningConfig(step_time_slack_factor=0.5)  # below 1 would clamp honest learners up


def test_a_report_below_its_floor_is_raised_to_it_and_the_floor_outlives_an_untimed_report() -> None:
    times = PeerStepTimes()
    assert times.report("liar", 1e-6, now=0.0, floor_s=0.125) == 0.125
    assert times.report("liar", 1e-6, now=1.0) == 0.125  # untimed (no floor given): its latest floor holds
    assert times.report("honest", 0.5, now=2.0, floor_s=0.125) == 0.5  # above its floor: as reported
    # a peer never timed counts as reported: the upper median of 1e-6, 0.125 and 0.5
    assert times.report("fresh", 1e-6, now=3.0) == 0.125
    assert times.clamped == 2


def test_negative_control_without_floors_a_1us_majority_sets_the_median() -> None:
    times = PeerStepTimes()
    times.report("h1", HONEST_STEP_S, now=0.0)
    times.report("h2", HONEST_STEP_S, now=0.0)
    for i in range(3):
        median = times.report(f"liar{i}", 1e-6, now=1.0)
    assert median == 1e-6


def _grace_after_a_lying_majority(screening: ScreeningConfig, liar_steps: int) -> float:
    """Fragment 0's version 1 is published (a merge here, so work on it is timed); 2 s later 2 honest learners push
    4 steps each, reporting 0.5 s steps, and 3 liars push `liar_steps` steps each, reporting 1 us, at every one of
    10 rounds (each merged at once; K = 1 and everyone in)."""
    quorum = QuorumConfig.decoupled(1, grace_gamma=0.8, max_grace_steps=1.0)
    c = core(quorum, screening=screening, clip_factor=None)
    now = 10.0
    _push(c, "h1", steps=4, step_time_s=HONEST_STEP_S, now=now)
    assert c.merge_now(0, 1, now) is not None
    peers = {"h1": (4, HONEST_STEP_S), "h2": (4, HONEST_STEP_S)}
    peers.update({f"liar{i}": (liar_steps, 1e-6) for i in range(3)})
    for _ in range(10):
        now += 2.0
        for peer, (steps, step_time_s) in peers.items():
            _push(c, peer, steps=steps, step_time_s=step_time_s, now=now)
        assert c.merge_now(0, len(peers), now) is not None
    return c.policy.grace_s()


def _push(c: SyncerCore, peer: str, *, steps: int, step_time_s: float, now: float) -> None:
    c.accept(
        peer,
        0,
        learner_params(c, 0, 0.01),
        base_version=c.versions[0],
        steps=steps,
        tokens=steps * 64,
        sched_step=7,
        step_time_s=step_time_s,
        nonce=f"{peer}{now}".encode(),
        now=now,
    )


SCREENING = ScreeningConfig(loss_probe=False, copy_tolerance=0.0)


def test_a_majority_reporting_1us_steps_is_clamped_to_what_its_own_pushes_took() -> None:
    """Liars claiming an honest 4 steps in 2 s: their 1 us reports are raised to 2 / 4 / 4 = 0.125 s."""
    grace = _grace_after_a_lying_majority(SCREENING, liar_steps=4)
    assert grace == pytest.approx(2.0 / 4 / SCREENING.step_time_slack_factor, rel=0.01)


def test_a_majority_claiming_the_most_steps_allowed_still_cannot_shrink_the_window_below_the_run_rate() -> (
    None
):
    """Liars claiming the syncer's `max_steps_per_s` (10 in these tests: 20 steps in 2 s): the window falls no lower
    than 1 / (max_steps_per_s x slack) = 0.025 s (and their claims are capped there)."""
    grace = _grace_after_a_lying_majority(SCREENING, liar_steps=1000)
    assert grace == pytest.approx(1.0 / (10.0 * SCREENING.step_time_slack_factor), rel=0.01)


def test_negative_control_with_the_bound_off_a_1us_majority_collapses_the_window() -> None:
    off = ScreeningConfig(loss_probe=False, copy_tolerance=0.0, step_time_slack_factor=0.0)
    assert _grace_after_a_lying_majority(off, liar_steps=4) < 1e-3


def test_honest_learners_keep_their_window() -> None:
    """Every learner honest (4 steps of 0.5 s in 2 s): nobody is clamped, the window is one step time."""
    quorum = QuorumConfig.decoupled(1, grace_gamma=0.8, max_grace_steps=1.0)
    c = core(quorum, screening=SCREENING, clip_factor=None)
    now = 10.0
    _push(c, "h1", steps=4, step_time_s=HONEST_STEP_S, now=now)
    c.merge_now(0, 1, now)
    for _ in range(5):
        now += 2.0
        for peer in ("h1", "h2", "h3"):
            _push(c, peer, steps=4, step_time_s=HONEST_STEP_S, now=now)
        c.merge_now(0, 3, now)
    assert c.policy.grace_s() == pytest.approx(HONEST_STEP_S)
    assert c.policy.step_times is not None and c.policy.step_times.clamped == 0
