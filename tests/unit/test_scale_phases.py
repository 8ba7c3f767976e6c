"""benchmarks/scale.py's per-phase peak RSS (`PhasePeaks`): what holds the memory at a syncer core's peak, the push
being accepted or the merge (docs/scale.md). The kernel's high-water mark is reset between phases, so a phase's
peak is its own, not the highest of the phases before it."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks.scale import PhasePeaks, peak_phase, reset_peak_rss, status_bytes


class FakeProc:
    """A process's RSS and its high-water mark, resettable or not."""

    def __init__(self, *, resettable: bool = True) -> None:
        self.rss = self.hwm = 100
        self.resettable = resettable

    def use(self, rss: int) -> None:
        self.rss = rss
        self.hwm = max(self.hwm, rss)

    def read(self, field: str) -> int:
        return {"VmHWM": self.hwm, "VmRSS": self.rss}[field]

    def reset(self) -> bool:
        if self.resettable:
            self.hwm = self.rss
        return self.resettable


def run_phases(proc: FakeProc) -> PhasePeaks:
    meter = PhasePeaks(read=proc.read, reset=proc.reset)
    proc.use(900)  # a push of 800 held
    proc.use(100)  # accepted: on disk
    meter.end("accept")
    proc.use(300)  # a smaller merge
    proc.use(120)
    meter.end("merge")
    return meter


def test_each_phase_gets_its_own_peak_and_the_rss_after_it() -> None:
    meter = run_phases(FakeProc())
    assert meter.peaks == {"accept": 900, "merge": 300}
    assert meter.after == {"accept": 100, "merge": 120}
    assert meter.overall == 900 and meter.resettable


def test_without_a_reset_a_later_phase_reads_the_earlier_peak() -> None:
    # negative control: the mark not reset, the merge would be charged with the push's peak
    meter = run_phases(FakeProc(resettable=False))
    assert meter.peaks == {"accept": 900, "merge": 900}
    assert not meter.resettable  # and the report says the phases are not separated
    assert meter.report()["resettable"] is False


def test_a_phase_that_runs_again_keeps_its_highest_peak() -> None:
    proc = FakeProc()
    meter = PhasePeaks(read=proc.read, reset=proc.reset)
    for rss in (500, 200, 400):
        proc.use(rss)
        meter.end("merge")
    assert meter.peaks["merge"] == 500 and meter.after["merge"] == 500


def test_peak_phase_names_the_phase_that_set_the_peak() -> None:
    core = {"peak_rss": 900, "phase_peak_rss": {"push": 700, "accept": 900, "merge": 850}}
    assert peak_phase(core) == "accept"
    assert peak_phase({**core, "peak_rss": 1000}) == "setup"  # building the core peaked higher
    assert peak_phase({"peak_rss": 900}) is None and peak_phase({"skipped": "why"}) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/clear_refs is Linux's")
def test_real_high_water_mark_is_reset_between_phases() -> None:
    if not reset_peak_rss():
        pytest.skip("the high-water mark cannot be reset here")
    size = 256 << 20
    meter = PhasePeaks()
    big = torch.ones(size // 4)  # touched: resident
    del big
    meter.end("big")
    small = torch.ones(1 << 20)
    del small
    meter.end("small")
    assert meter.peaks["big"] - meter.peaks["small"] > 0.9 * size
    assert status_bytes("VmRSS") > 0
