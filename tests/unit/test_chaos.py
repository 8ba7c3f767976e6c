"""The chaos harness without real processes: seeded schedules and a runner against a recording controller."""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from tools.chaos import SYNCER_TARGET, ChaosConfig, ChaosRunner, announcement, plan_faults


def test_the_schedule_is_seeded_counted_spaced_and_inside_the_window() -> None:
    config = ChaosConfig(seed=7, duration_s=90.0, learner_kills=2, stragglers=2, syncer_kills=1)
    learners = ["l0", "l1", "l2", "l3"]
    plan = plan_faults(config, learners)
    assert plan == plan_faults(config, learners)
    assert plan != plan_faults(ChaosConfig(seed=8, duration_s=90.0, learner_kills=2, stragglers=2), learners)
    assert Counter(f.kind for f in plan) == {"kill": 2, "stop": 2, "kill_syncer": 1}
    starts = [f.at_s for f in plan]
    assert starts == sorted(starts)
    assert all(b - a >= config.min_gap_s for a, b in zip(starts, starts[1:], strict=False))
    assert all(config.margin_s <= f.at_s and f.at_s + f.duration_s <= 90.0 - config.margin_s for f in plan)
    assert {f.target for f in plan if f.kind == "kill_syncer"} == {SYNCER_TARGET}
    assert {f.target for f in plan if f.kind != "kill_syncer"} <= set(learners)


def test_impossible_schedules_are_refused() -> None:
    with pytest.raises(ValueError):
        plan_faults(ChaosConfig(duration_s=20.0, margin_s=5.0, learner_kills=5, min_gap_s=5.0), ["l0"])
    with pytest.raises(ValueError):
        plan_faults(ChaosConfig(learner_kills=1), [])


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.25  # every look at the clock moves it: the runner's waits terminate
        return self.now


class Recorder:
    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail_on = fail_on
        self.syncer = "syncer-a"

    def signal(self, name: str, signum: int) -> None:
        if name == self.fail_on:
            raise ProcessLookupError(name)
        self.calls.append((signal.Signals(signum).name, name))
        if name == self.syncer and signum == signal.SIGKILL:
            self.syncer = "syncer-b"  # the standby takes over

    def restart(self, name: str) -> None:
        self.calls.append(("restart", name))

    def active_syncer(self) -> str:
        return self.syncer


def test_the_runner_injects_ends_and_counts_every_fault() -> None:
    config = ChaosConfig(seed=3, duration_s=60.0, learner_kills=1, stragglers=1, syncer_kills=1, margin_s=5.0)
    plan = plan_faults(config, ["l0", "l1"])
    controller = Recorder()
    report = ChaosRunner(plan, controller, clock=FakeClock(), wait=lambda _s: False).run()
    assert report.check(plan)
    kinds = [c[0] for c in controller.calls]
    assert Counter(kinds) == {"SIGKILL": 2, "restart": 2, "SIGSTOP": 1, "SIGCONT": 1}
    assert ("SIGKILL", "syncer-a") in controller.calls and ("restart", "syncer-a") in controller.calls
    for item in report.injected:
        assert (
            item.ended_at_s is not None
            and item.ended_at_s >= item.injected_at_s + item.fault.duration_s - 0.5
        )


def test_a_fault_that_cannot_be_injected_fails_the_check() -> None:
    plan = plan_faults(
        ChaosConfig(seed=1, duration_s=40.0, learner_kills=1, stragglers=0, syncer_kills=0), ["l0"]
    )
    report = ChaosRunner(plan, Recorder(fail_on="l0"), clock=FakeClock(), wait=lambda _s: False).run()
    assert not report.check(plan) and report.injected[0].error.startswith("ProcessLookupError")


def test_every_fault_is_announced_when_it_starts_and_when_it_ends() -> None:
    config = ChaosConfig(seed=3, duration_s=60.0, learner_kills=1, stragglers=1, syncer_kills=1, margin_s=5.0)
    plan = plan_faults(config, ["l0", "l1"])
    said: list[dict[str, object]] = []
    runner = ChaosRunner(
        plan,
        Recorder(),
        clock=FakeClock(),
        wait=lambda _s: False,
        on_event=lambda phase, injected: said.append(announcement(phase, injected)),
    )
    report = runner.run()
    assert len(said) == 2 * len(plan)
    times = [a["at_s"] for a in said]
    assert times == sorted(times)  # said as they happen, in order
    for item in report.injected:
        start, end = [a for a in said if a["target"] == item.target and a["kind"] == item.fault.kind]
        assert (start["phase"], end["phase"]) == ("start", "end")
        assert start["at_s"] == round(item.injected_at_s, 3) and end["at_s"] == round(item.ended_at_s, 3)
        assert item.target in start["text"] and item.target in end["text"]
    texts = {a["kind"]: str(a["text"]) for a in said if a["phase"] == "start"}
    assert texts["kill"].startswith("fault: kill l") and "(SIGKILL); restart in 3 s" in texts["kill"]
    assert texts["stop"].startswith("fault: stall l") and "(SIGSTOP); resume in 4 s" in texts["stop"]
    assert texts["kill_syncer"] == "fault: kill the active syncer syncer-a (SIGKILL); restart in 3 s"
    ends = [a["text"] for a in said if a["phase"] == "end"]
    assert sum("resumed (SIGCONT)" in t for t in ends) == 1 and sum("restarted after" in t for t in ends) == 2


def test_a_fault_that_could_not_be_injected_is_announced_as_such() -> None:
    plan = plan_faults(
        ChaosConfig(seed=1, duration_s=40.0, learner_kills=1, stragglers=0, syncer_kills=0), ["l0"]
    )
    said: list[dict[str, object]] = []
    ChaosRunner(
        plan,
        Recorder(fail_on="l0"),
        clock=FakeClock(),
        wait=lambda _s: False,
        on_event=lambda phase, injected: said.append(announcement(phase, injected)),
    ).run()
    assert [a["phase"] for a in said] == ["start"]
    assert str(said[0]["text"]).startswith("fault: kill l0 could not be injected: ProcessLookupError")
