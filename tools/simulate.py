"""Discrete-event simulator of training goodput under chip failures (digest §2, Table 1).

Three systems on N chips, with the failure model of the paper (chips fail as a Poisson process with
mean time between interruptions MTBI_chip = 1 year; failed chips return after a random delay):

* ``dp``: one data-parallel job without elasticity. A failure stops the whole job until the failed
  chips return, then it restarts.
* ``elastic_dp``: one data-parallel job with slice-granular elasticity. A failure takes its slice out;
  the job pauses to downscale, runs on the remaining slices, and pauses again to upscale when the slice
  returns.
* ``diloco``: M learners of N/M chips, each an elastic data-parallel job of its own (a learner *is* a
  smaller data-parallel job), under a syncer that runs the real cores of this package: the fragment
  schedule (`FragmentSchedule`), the merge trigger (`QuorumPolicy`, any mode: Decoupled K + grace,
  synchronous, elastic synchronous) and the merge weights (`token_weight`). A learner may not pass
  step s + tau before the round that merged its step-s fragment is done, so a syncer that waits
  (K = M, a dead learner) stalls everyone, and one that does not (K = 1) stalls no one. A learner
  whose chips are all gone recovers from a peer's state and resumes at the leader's step.

Goodput is useful chip-time over allocated chip-time: chips count while their job or learner is
computing inner steps; pauses, stalls, waits at the overlap bound and failed slices do not.

Failure semantics (our assumptions, documented because the paper's are unknown, digest Q13):

* interruptions hit chips that are computing: a job or learner that is paused, stalled or recovering
  does not fail again (MTBI counts operating time). The rate of a unit is its active chips / MTBI, and
  a unit's failure process is simulated as one Poisson stream (exact by superposition; chips are never
  simulated one by one, so 2.4M chips cost no more than 150k).
* the time for failed chips to return follows an exponentiated Weibull distribution [S]; its shape is
  assumed (k = 1.5, a = 2), its mean is calibrated.
* reconfiguration takes a fixed time, calibrated, one for a downscale and one for an upscale; a return during a
  reconfiguration joins it, and a reconfiguring unit does not fail (the elastic_dp row rejects failures then: the
  elastic job collapses too early, docs/simulator.md). The non-elastic restart takes a fixed time plus a restore
  whose work the job's chips share (restore_chip_s / chips), both calibrated: the one cost of ours that falls with
  the job's size.
* goodput_stderr: the standard error of a run's goodput from NOISE_BATCHES batch means over the measured span.

Parameters marked [P] come from the paper, [S] are guesses we calibrated against the paper's Table 1
(`benchmarks/simulate_table.py --calibrate`): the elastic and learner rows, which by the paper's rule measure one
curve of goodput against a unit's size, and the dp row; `--cross-validate` predicts each learner row from a fit
without it. docs/simulator.md says which parameter each row fits. Run ``python -m tools.simulate`` for the grid.
"""

from __future__ import annotations

import argparse
import heapq
import logging
import math
import random
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import pairwise
from typing import Literal, TypedDict

from node.diloco.counters import token_weight
from node.diloco.fragments import FragmentSchedule
from node.diloco.quorum import QuorumConfig, QuorumPolicy
from tools.sim_links import LinkModel, LinkTimes

logger = logging.getLogger(__name__)

SECONDS_PER_YEAR = 365.25 * 86400.0

CHIP_COUNTS: dict[str, int] = {
    "150k": 150_000,
    "300k": 300_000,
    "600k": 600_000,
    "1.2M": 1_200_000,
    "2.4M": 2_400_000,
}
SYSTEMS: tuple[str, ...] = ("dp", "elastic_dp", "M2", "M4", "M8", "M16")

# Table 1 of arXiv 2604.21428 as reconstructed in the digest (goodput as a fraction, MTBI_chip = 1 yr).
PAPER_TABLE1: dict[str, dict[str, float]] = {
    "dp": {"150k": 0.72, "300k": 0.57, "600k": 0.38, "1.2M": 0.27, "2.4M": 0.18},
    "elastic_dp": {"150k": 0.88, "300k": 0.80, "600k": 0.69, "1.2M": 0.58, "2.4M": 0.40},
    "M2": {"150k": 0.94, "300k": 0.88, "600k": 0.80, "1.2M": 0.70, "2.4M": 0.54},
    "M4": {"150k": 0.96, "300k": 0.93, "600k": 0.89, "1.2M": 0.82, "2.4M": 0.73},
    "M8": {"150k": 0.98, "300k": 0.96, "600k": 0.94, "1.2M": 0.88, "2.4M": 0.80},
    "M16": {"150k": 0.99, "300k": 0.98, "600k": 0.96, "1.2M": 0.93, "2.4M": 0.86},
}

System = Literal["dp", "elastic_dp", "diloco"]


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureModel:
    """Chip failures, repairs and reconfiguration costs. Defaults are the calibrated values."""

    mtbi_chip_s: float = SECONDS_PER_YEAR  # [P] mean time between interruptions of one chip
    # Calibrated values (docs/simulator.md): return_mean_s, the elastic pauses and slice_chips on the elastic_dp and
    # learner rows of Table 1 (the dp row bounding the return mean), then restart_s and restore_chip_s on the dp row.
    return_mean_s: float = 71.2  # [S, calibrated] mean time for failed chips to return
    return_weibull_k: float = 1.5  # [S, assumed] Weibull shape of the return time
    return_weibull_a: float = 2.0  # [S, assumed] exponent of the exponentiated Weibull
    restart_s: float = 0.1  # [S, calibrated] non-elastic restart once chips are back: the fixed part ...
    # ... plus the checkpoint restore, a fixed amount of work the job's chips share (each reads its shard), so a
    # bigger job restores faster: restart = restart_s + restore_chip_s / chips. The paper's dp row needs a cost per
    # failure that falls with the job's size (docs/simulator.md); this is the one term of ours that does.
    restore_chip_s: float = 3_270_000.0  # [S, calibrated] restore work of one non-elastic restart, chip-s
    downscale_s: float = 14.8  # [P named, value calibrated] elastic pause to drop a failed slice (unplanned)
    upscale_s: float = 9.3  # [P named, value calibrated] elastic pause to re-add a returned slice (planned)
    slice_chips: int = 10_360  # [S, calibrated] chips per elastic slice (a failure takes out its slice)
    lose_inflight_step: bool = False  # a failure also discards the step being computed

    def __post_init__(self) -> None:
        positive = ("mtbi_chip_s", "return_mean_s", "return_weibull_k", "return_weibull_a")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"FailureModel.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("restart_s", "restore_chip_s", "downscale_s", "upscale_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"FailureModel.{name} must be finite and >= 0, got {value!r}")
        if self.slice_chips < 1:
            raise ValueError(f"FailureModel.slice_chips must be >= 1, got {self.slice_chips!r}")

    def restart_duration_s(self, chips: float) -> float:
        """A non-elastic job's restart once its chips are back: fixed part plus its share of the restore."""
        return self.restart_s + self.restore_chip_s / chips

    def dp_goodput(self, chips: float) -> float:
        """The non-elastic job's goodput by the renewal formula, exact for this model (failures only hit a
        computing job, each costs a return and a restart): 1 / (1 + rate * (E[return] + restart))."""
        rate = chips / self.mtbi_chip_s
        return 1.0 / (1.0 + rate * (self.return_mean_s + self.restart_duration_s(chips)))

    def sample_return_s(self, rng: random.Random) -> float:
        """One draw of the return delay: scale * (-ln(1 - u**(1/a)))**(1/k)."""
        k, a = self.return_weibull_k, self.return_weibull_a
        scale = self.return_mean_s / _exp_weibull_unit_mean(k, a)
        u = rng.random()
        return scale * (-math.log1p(-(u ** (1.0 / a)))) ** (1.0 / k)


@lru_cache(maxsize=64)
def _exp_weibull_unit_mean(k: float, a: float) -> float:
    """Mean of the exponentiated Weibull with scale 1: integral of the survival function (Simpson)."""
    upper = 60.0 ** (1.0 / k)  # beyond this the survival is about a * e^-60: negligible
    n = 20_000
    h = upper / n

    def survival(y: float) -> float:
        return 1.0 - (-math.expm1(-(y**k))) ** a

    total = survival(0.0) + survival(upper)
    for i in range(1, n):
        total += (4.0 if i % 2 else 2.0) * survival(i * h)
    return total * h / 3.0


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    """One simulated run; `system` picks the model, the rest parameterises it."""

    system: System
    num_chips: int  # N, all systems
    horizon_s: float  # simulated seconds, warm-up included
    warmup_s: float = 0.0  # simulated seconds discarded before measuring
    failures: FailureModel = field(default_factory=FailureModel)
    seed: int = 0
    # diloco only
    num_learners: int = 8  # M; each gets num_chips / M chips
    quorum: QuorumConfig = field(default_factory=QuorumConfig)
    step_s: float = 2.0  # nominal inner step time of a learner at speed 1
    num_fragments: int = 24  # P
    sync_every_steps: int = 24  # H
    overlap_steps: int = 2  # tau
    sync_s: float = 0.5  # syncer time from merge start to the broadcast being usable
    detection_timeout_s: float = 10.0  # membership keeps a dead learner "alive" this long
    speed_factors: tuple[float, ...] = ()  # relative speed per learner (empty = all 1.0)
    speed_jitter: float = 0.0  # each round, speed *= 1 + N(0, jitter) (clipped to [0.5, 1.5])
    tokens_per_step: int = 1_000_000  # tokens per step of a learner with all its chips
    links: LinkModel | None = None  # None: transfers take no time (a data-centre network next to a step)

    def __post_init__(self) -> None:
        if self.system not in ("dp", "elastic_dp", "diloco"):
            raise ValueError(f"unknown system {self.system!r}")
        if self.num_chips < 1:
            raise ValueError(f"num_chips must be >= 1, got {self.num_chips}")
        if not (self.horizon_s > 0 and 0 <= self.warmup_s < self.horizon_s):
            raise ValueError("need horizon_s > 0 and 0 <= warmup_s < horizon_s")
        if self.num_learners < 1 or self.num_chips < self.num_learners:
            raise ValueError("need 1 <= num_learners <= num_chips")
        if self.speed_factors and len(self.speed_factors) != self.num_learners:
            raise ValueError("speed_factors needs one entry per learner")
        if any(not f > 0 for f in self.speed_factors):
            raise ValueError("speed factors must be > 0")
        if not 0.0 <= self.speed_jitter <= 0.5:
            raise ValueError(f"speed_jitter must be in [0, 0.5], got {self.speed_jitter}")
        for name in ("step_s", "sync_s", "detection_timeout_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be finite and >= 0")
        if not self.step_s > 0 or self.tokens_per_step < 1:
            raise ValueError("step_s must be > 0 and tokens_per_step >= 1")
        if self.links is not None:
            self.links.timings(self.num_learners, self.num_fragments)  # one link per learner, or one for all
        # Validates P, H, tau.
        FragmentSchedule(
            num_fragments=self.num_fragments,
            sync_every_steps=self.sync_every_steps,
            overlap_steps=self.overlap_steps,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    system: System
    num_chips: int
    num_learners: int
    goodput: float  # useful chip-time / allocated chip-time over the measured span
    measured_s: float  # simulated seconds measured (horizon minus warm-up)
    failures: int  # interruptions that hit a computing unit during the measured span
    rounds_merged: int  # diloco: rounds whose merge had positive weight
    rounds_skipped: int  # diloco: rounds closed with no weighted contribution
    mean_merged_learners: float  # diloco: contributors per merged round
    mean_effective_learners: float  # diloco: (sum w)^2 / sum w^2 per merged round (token weights)
    merged_step_share: float  # diloco: share of learner fragment-steps that entered some merge
    events: int  # events processed (cost)
    goodput_stderr: float = 0.0  # standard error of `goodput` from NOISE_BATCHES batch means


_RUNNING, _PAUSED, _STALLED = 0, 1, 2
_FAIL, _RETURN, _PAUSE_END, _CHECK, _MERGE_DONE, _FETCH_DONE, _WARMUP, _BATCH, _END = range(9)
_EPS = 1e-9
# The measured span is cut into this many equal batches; the spread of their goodputs gives the standard error
# (batch means: each batch spans hundreds of failures or more in the grid, so batches are nearly independent).
NOISE_BATCHES = 10


class _SyncerStats(TypedDict):
    """Totals over a DiLoCo run's rounds: counts, and sums the result divides by the rounds merged."""

    merged: int
    skipped: int
    learners: float
    effective: float
    steps: float


@dataclass(slots=True)
class _Round:
    """One merge of one fragment, from opening to its merge decision."""

    index: int
    step: float  # learners contribute once they reach this local step
    fragment: int
    opened_at: float
    quorum_at: float | None = None
    gen: int = 0  # invalidates stale CHECK events


class _Unit:
    """A job or a learner: chips in equal slices that fail while computing and return later."""

    __slots__ = (
        "index",
        "chips",
        "n_slices",
        "slice_size",
        "elastic",
        "up",
        "num_down",
        "state",
        "active_chips",
        "gen",
        "rng",
        "progress",
        "t",
        "base_rate",
        "rate",
        "useful",
        "stepped",
        "tokens",
        "down_since",
        "failures",
        "cap",
        "link",
        "next_upload",
        "up_free",
        "down_free",
        "delivered",
        "fetching",
    )

    def __init__(self, index: int, chips: float, slice_chips: int, elastic: bool, rng: random.Random) -> None:
        self.index = index
        self.chips = chips
        self.n_slices = max(1, round(chips / slice_chips))
        self.slice_size = chips / self.n_slices
        self.elastic = elastic
        self.up = [True] * self.n_slices
        self.num_down = 0
        self.state = _RUNNING
        self.active_chips = chips
        self.gen = 0
        self.rng = rng
        self.progress = 0.0  # inner steps (float)
        self.t = 0.0  # time `progress` refers to
        self.base_rate = 1.0  # steps per second at speed factor 1 (set by the engine)
        self.rate = 1.0
        self.useful = 0.0  # chip-seconds spent computing steps
        self.stepped = 0.0  # steps computed (not jumped over on recovery)
        self.tokens = 0.0  # tokens processed
        self.down_since: float | None = None  # set while every slice is gone
        self.failures = 0
        self.cap = math.inf  # the step it may not pass before a merged fragment arrives (diloco)
        # links (diloco with a LinkModel only)
        self.link: LinkTimes | None = None
        self.next_upload = 0  # the first round whose contribution is not yet on the uplink
        self.up_free = 0.0  # when the uplink finishes its queued uploads
        self.down_free = 0.0  # when the downlink finishes its queued fetches
        self.delivered: dict[int, float] = {}  # round -> when its contribution reaches the syncer
        self.fetching: dict[int, float] = {}  # round -> its step, merged but not yet fetched


class _Engine:
    def __init__(self, config: SimConfig) -> None:
        self.cfg = config
        self.fm = config.failures
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.events = 0
        self._init_units()
        self.diloco = config.system == "diloco"
        if self.diloco:
            self._init_syncer()
        self.useful_at_warmup = 0.0
        self.stepped_at_warmup = 0.0
        self.failures_at_warmup = 0
        self.useful_marks: list[float] = []  # useful chip-seconds at warm-up and at each batch boundary

    # ----- setup -------------------------------------------------------------------------------
    def _init_units(self) -> None:
        cfg = self.cfg
        count = cfg.num_learners if cfg.system == "diloco" else 1
        elastic = cfg.system != "dp"
        chips = cfg.num_chips / count
        self.units = [
            _Unit(i, chips, self.fm.slice_chips, elastic, random.Random(f"{cfg.seed}/unit/{i}"))
            for i in range(count)
        ]
        for unit in self.units:
            factor = cfg.speed_factors[unit.index] if cfg.speed_factors else 1.0
            unit.base_rate = factor / cfg.step_s
            unit.rate = unit.base_rate

    def _init_syncer(self) -> None:
        cfg = self.cfg
        self.schedule = FragmentSchedule(
            num_fragments=cfg.num_fragments,
            sync_every_steps=cfg.sync_every_steps,
            overlap_steps=cfg.overlap_steps,
        )
        self.pattern = [
            (s, p) for s in range(1, cfg.sync_every_steps + 1) for p in self.schedule.due_to_send(s)
        ]
        self.policy = QuorumPolicy(cfg.quorum)
        self.jitter_rng = random.Random(f"{cfg.seed}/jitter")
        m, p = cfg.num_learners, cfg.num_fragments
        self.mark_steps = [[0.0] * p for _ in range(m)]
        self.mark_tokens = [[0.0] * p for _ in range(m)]
        self.rounds: dict[int, _Round] = {}  # open: waiting for quorum or in the grace window
        self.merging: dict[int, float] = {}  # closed, broadcast not yet usable: round -> step
        self.newest = -1
        self._open_round(0)
        timings = cfg.links.timings(m, p) if cfg.links is not None else None
        for unit in self.units:
            unit.cap = self._round_step(0) + cfg.overlap_steps
            if timings is not None:
                unit.link = timings[unit.index]
        # the grace window's xi_sync: merge time plus a typical learner's fetch of the merged fragment
        self.mean_fetch_s = math.fsum(t.fetch_s + t.latency_s for t in timings) / m if timings else 0.0
        self.stats: _SyncerStats = {
            "merged": 0,
            "skipped": 0,
            "learners": 0.0,
            "effective": 0.0,
            "steps": 0.0,
        }

    def _round_step(self, r: int) -> float:
        period, h = len(self.pattern), self.cfg.sync_every_steps
        return float(self.pattern[r % period][0] + h * (r // period))

    def _round_fragment(self, r: int) -> int:
        return self.pattern[r % len(self.pattern)][1]

    # ----- event loop --------------------------------------------------------------------------
    def push(self, at: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at, self.seq, kind, a, b))

    def run(self) -> SimResult:
        cfg = self.cfg
        for unit in self.units:
            self._start_running(unit)
        self.push(cfg.warmup_s, _WARMUP)
        batch_s = (cfg.horizon_s - cfg.warmup_s) / NOISE_BATCHES
        for i in range(1, NOISE_BATCHES):
            self.push(cfg.warmup_s + i * batch_s, _BATCH)
        self.push(cfg.horizon_s, _END)
        handlers = {
            _FAIL: self._on_fail,
            _RETURN: self._on_return,
            _PAUSE_END: self._on_pause_end,
            _CHECK: self._on_check,
            _MERGE_DONE: self._on_merge_done,
            _FETCH_DONE: self._on_fetch_done,
        }
        while self.heap:
            at, _, kind, a, b = heapq.heappop(self.heap)
            self.now = at
            self.events += 1
            if kind == _END:
                break
            if kind in (_WARMUP, _BATCH):
                _mark(self, warmup=kind == _WARMUP)
                continue
            handlers[kind](a, b)
        _mark(self, warmup=False)
        return _summarise(self)

    # ----- units -------------------------------------------------------------------------------
    def _advance(self, unit: _Unit) -> None:
        """Bring `unit` to self.now, crediting the steps it computed (never beyond the cap)."""
        if unit.state == _RUNNING and self.now > unit.t:
            target = min(unit.cap, unit.progress + unit.rate * (self.now - unit.t))
            done = target - unit.progress
            if done > 0:
                start_progress = unit.progress
                unit.useful += unit.active_chips * done / unit.rate
                unit.stepped += done
                unit.tokens += done * self.cfg.tokens_per_step * unit.active_chips / unit.chips
                unit.progress = target
                if unit.link is not None:
                    self._queue_uploads(unit, start_progress)
        unit.t = self.now

    def _queue_uploads(self, unit: _Unit, start_progress: float) -> None:
        """Put the contribution of every round `unit` reached since `unit.t` on its uplink, in order."""
        link = unit.link
        assert link is not None
        while (step := self._round_step(unit.next_upload)) <= unit.progress + _EPS:
            reached = unit.t + max(0.0, step - start_progress) / unit.rate
            unit.up_free = max(reached, unit.up_free) + link.upload_s
            unit.delivered[unit.next_upload] = unit.up_free + link.latency_s
            unit.next_upload += 1

    def _drop_partial_step(self, unit: _Unit) -> None:
        partial = unit.progress - math.floor(unit.progress + _EPS)
        if partial <= _EPS:
            return
        unit.progress -= partial
        unit.stepped -= partial
        unit.useful -= unit.active_chips * partial / unit.rate
        unit.tokens -= partial * self.cfg.tokens_per_step * unit.active_chips / unit.chips

    def _start_running(self, unit: _Unit) -> None:
        unit.t = self.now
        unit.state = _RUNNING
        unit.gen += 1
        rate = unit.active_chips / self.fm.mtbi_chip_s
        if rate > 0 and math.isfinite(self.fm.mtbi_chip_s):
            self.push(self.now + unit.rng.expovariate(rate), _FAIL, unit.index, unit.gen)

    def _pause(self, unit: _Unit, duration_s: float) -> None:
        self._advance(unit)
        unit.state = _PAUSED
        unit.gen += 1
        self.push(self.now + duration_s, _PAUSE_END, unit.index, unit.gen)

    def _on_fail(self, index: int, gen: int) -> None:
        unit = self.units[index]
        if gen != unit.gen or unit.state != _RUNNING:
            return
        self._advance(unit)
        unit.failures += 1
        if self.fm.lose_inflight_step:
            self._drop_partial_step(unit)
        slice_index = unit.rng.randrange(unit.n_slices)
        while not unit.up[slice_index]:  # only computing slices fail; at least one is up while running
            slice_index = unit.rng.randrange(unit.n_slices)
        unit.up[slice_index] = False
        unit.num_down += 1
        if unit.num_down == unit.n_slices:
            unit.down_since = self.now
        self.push(self.now + self.fm.sample_return_s(unit.rng), _RETURN, index, slice_index)
        if unit.elastic:
            self._pause(unit, self.fm.downscale_s)
        else:
            unit.state = _STALLED
            unit.active_chips = 0.0
            unit.gen += 1
        self._learner_changed()

    def _on_return(self, index: int, slice_index: int) -> None:
        unit = self.units[index]
        unit.up[slice_index] = True
        unit.num_down -= 1
        if unit.elastic:
            if unit.state != _PAUSED:  # running: upscale; all gone: this is the recovery
                self._pause(unit, self.fm.upscale_s)
        elif unit.state == _STALLED and unit.num_down == 0:
            self._pause(unit, self.fm.restart_duration_s(unit.chips))
        self._learner_changed()

    def _on_pause_end(self, index: int, gen: int) -> None:
        unit = self.units[index]
        if gen != unit.gen:
            return
        unit.active_chips = (unit.n_slices - unit.num_down) * unit.slice_size
        if unit.active_chips <= 0 or (not unit.elastic and unit.num_down):
            unit.state = _STALLED
            unit.active_chips = 0.0
            if unit.down_since is None:
                unit.down_since = self.now
            unit.gen += 1
        else:
            if unit.down_since is not None and self.diloco:
                _recover(self, unit)
            unit.down_since = None
            self._start_running(unit)
        self._learner_changed()

    # ----- syncer ------------------------------------------------------------------------------
    def _learner_changed(self) -> None:
        if self.diloco:
            for rnd in self.rounds.values():
                rnd.gen += 1
                self.push(self.now, _CHECK, rnd.index, rnd.gen)

    def _open_round(self, r: int) -> None:
        rnd = _Round(index=r, step=self._round_step(r), fragment=self._round_fragment(r), opened_at=self.now)
        self.rounds[r] = rnd
        self.newest = r
        self.push(self.now, _CHECK, r, rnd.gen)

    def _progress_at(self, unit: _Unit) -> float:
        if unit.state != _RUNNING:
            return unit.progress
        return min(unit.cap, unit.progress + unit.rate * (self.now - unit.t))

    def _arrival(self, unit: _Unit, rnd: _Round) -> float:
        """When `unit`'s contribution to `rnd` reaches the syncer: -inf if it has (no links: once the unit
        reached the round's step), inf if it cannot without a state change. With links, the caller has
        brought `unit` to now, so a contribution it computed is on its uplink already."""
        link = unit.link
        if link is not None and rnd.index < unit.next_upload:
            return unit.delivered.get(rnd.index, math.inf)  # absent: jumped over on recovery
        progress = self._progress_at(unit)
        if link is None and progress >= rnd.step - _EPS:
            return -math.inf
        if unit.state != _RUNNING or unit.cap < rnd.step - _EPS:
            return math.inf
        reached = self.now + max(0.0, rnd.step - progress) / unit.rate
        if link is None:
            return reached
        # an earliest bound (later rounds may queue ahead of it): a check at that time looks again
        return max(reached, unit.up_free) + link.upload_s + link.latency_s

    def _arrivals(self, rnd: _Round) -> tuple[list[_Unit], list[float]]:
        """The learners whose contribution to `rnd` is at the syncer, and the sorted times the others' will be."""
        now = self.now
        if self.cfg.links is not None:
            arrivals = [self._arrival(u, rnd) for u in self.units]
            arrived = [u for u, at in zip(self.units, arrivals, strict=True) if at <= now + _EPS]
            return arrived, sorted(at for at in arrivals if now + _EPS < at < math.inf)
        # No links: `_arrival` inlined (same arithmetic), the quorum check being most of a grid cell's time.
        arrived, future, step = [], [], rnd.step
        for unit in self.units:
            running = unit.state == _RUNNING
            progress = min(unit.cap, unit.progress + unit.rate * (now - unit.t)) if running else unit.progress
            if progress >= step - _EPS:
                arrived.append(unit)
            elif running and unit.cap >= step - _EPS:
                at = now + (step - progress) / unit.rate
                if at <= now + _EPS:
                    arrived.append(unit)
                else:
                    future.append(at)
        future.sort()
        return arrived, future

    def _expected(self) -> tuple[int, float]:
        """Learners the membership believes alive, and when that belief next changes."""
        alive, next_change = 0, math.inf
        for unit in self.units:
            if unit.down_since is None:
                alive += 1
            else:
                expiry = unit.down_since + self.cfg.detection_timeout_s
                if expiry > self.now:
                    alive += 1
                    next_change = min(next_change, expiry)
        return alive, next_change

    def _on_check(self, r: int, gen: int) -> None:
        rnd = self.rounds.get(r)
        if rnd is None or gen != rnd.gen:
            return
        if self.cfg.links is not None:
            for unit in self.units:
                self._advance(unit)
        arrived, future = self._arrivals(rnd)
        expected, membership_change = self._expected()
        required = self.policy.required(expected)
        if rnd.quorum_at is None and len(arrived) >= required:
            rnd.quorum_at = self.now
            self.policy.observe_quorum(self.now - rnd.opened_at)
            if r == self.newest:  # the next round's quorum wait overlaps this one's grace window
                self._open_round(r + 1)
        decision = self.policy.decide(self.now, rnd.opened_at, len(arrived), expected, rnd.quorum_at)
        if decision.action == "merge":
            self._merge(rnd, arrived)
            return
        wake = membership_change
        if rnd.quorum_at is None:
            missing = required - len(arrived)
            if missing <= len(future):
                wake = min(wake, future[missing - 1])
        else:
            if decision.deadline is not None:
                wake = min(wake, decision.deadline)
            missing = expected - len(arrived)
            if 0 < missing <= len(future):
                wake = min(wake, future[missing - 1])
        if wake < math.inf:
            self.push(max(wake, self.now), _CHECK, r, gen)

    def _merge(self, rnd: _Round, arrived: Sequence[_Unit]) -> None:
        cfg = self.cfg
        p = rnd.fragment
        weights: list[float] = []
        steps_in: list[float] = []
        for unit in arrived:
            self._advance(unit)
            c_steps = max(0.0, rnd.step - self.mark_steps[unit.index][p])
            per_step = cfg.tokens_per_step * unit.active_chips / unit.chips
            at_step = unit.tokens - max(0.0, unit.progress - rnd.step) * per_step
            c_tokens = max(0.0, at_step - self.mark_tokens[unit.index][p])
            weights.append(token_weight(c_tokens, c_steps))
            steps_in.append(c_steps)
        total = math.fsum(weights)
        if self.now >= cfg.warmup_s:
            if total > 0:
                self.stats["merged"] += 1
                self.stats["learners"] += sum(1 for w in weights if w > 0)
                self.stats["effective"] += total * total / math.fsum(w * w for w in weights)
                self.stats["steps"] += math.fsum(s for s, w in zip(steps_in, weights, strict=True) if w > 0)
            else:
                self.stats["skipped"] += 1
        if arrived:
            self.policy.observe_step(sum(1.0 / u.rate for u in arrived) / len(arrived))
        self.policy.observe_sync(cfg.sync_s + self.mean_fetch_s)
        del self.rounds[rnd.index]
        for unit in self.units:
            unit.delivered.pop(rnd.index, None)
        self.merging[rnd.index] = rnd.step
        self.push(self.now + cfg.sync_s, _MERGE_DONE, rnd.index, 0)

    def _on_merge_done(self, r: int, _: int) -> None:
        for unit in self.units:
            self._advance(unit)
        step = self.merging.pop(r)
        p = self._round_fragment(r)
        for unit in self.units:
            if unit.down_since is not None:  # gone: it recovers from a peer's state instead
                continue
            if unit.link is None:
                self._overwrite(unit, p)
            else:  # fetched in turn on its downlink; until then it may not pass step + tau
                unit.down_free = max(self.now, unit.down_free) + unit.link.fetch_s
                unit.fetching[r] = step
                self.push(unit.down_free + unit.link.latency_s, _FETCH_DONE, unit.index, r)
        for unit in self.units:
            self._refresh_cap(unit)
        if self.cfg.speed_jitter > 0:
            jitter = self.cfg.speed_jitter
            for unit in self.units:
                noise = min(0.5, max(-0.5, self.jitter_rng.gauss(0.0, jitter)))
                unit.rate = unit.base_rate * (1.0 + noise)
        self._learner_changed()

    def _on_fetch_done(self, index: int, r: int) -> None:
        unit = self.units[index]
        self._advance(unit)
        del unit.fetching[r]
        if unit.down_since is None:
            self._overwrite(unit, self._round_fragment(r))
        self._refresh_cap(unit)
        self._learner_changed()

    def _overwrite(self, unit: _Unit, fragment: int) -> None:
        """The merged fragment overwrites the learner's copy and resets that fragment's counters."""
        self.mark_steps[unit.index][fragment] = unit.progress
        self.mark_tokens[unit.index][fragment] = unit.tokens

    def _refresh_cap(self, unit: _Unit) -> None:
        """`unit` may not pass step s + tau before it holds the merge of every round up to step s."""
        pending = min(
            min((rnd.step for rnd in self.rounds.values()), default=math.inf),
            min(self.merging.values(), default=math.inf),
            min(unit.fetching.values(), default=math.inf),
        )
        unit.cap = pending + self.cfg.overlap_steps

    # ----- accounting --------------------------------------------------------------------------


def _mark(engine: _Engine, *, warmup: bool) -> None:
    """Bring every unit to now and note the useful chip-time (warm-up end, batch boundaries, horizon)."""
    for unit in engine.units:
        engine._advance(unit)
    useful = math.fsum(u.useful for u in engine.units)
    engine.useful_marks.append(useful)
    if warmup:
        engine.useful_at_warmup = useful
        engine.stepped_at_warmup = sum(u.stepped for u in engine.units)
        engine.failures_at_warmup = sum(u.failures for u in engine.units)


def _recover(engine: _Engine, unit: _Unit) -> None:
    """A learner back from losing every chip fetches a live peer's state and resumes at its step."""
    leader = max((engine._progress_at(u) for u in engine.units if u.state == _RUNNING), default=0.0)
    engine._refresh_cap(unit)
    unit.progress = min(unit.cap, max(unit.progress, leader))
    if unit.link is not None:  # the rounds it jumped over are never sent
        while engine._round_step(unit.next_upload) <= unit.progress + _EPS:
            unit.next_upload += 1
    for p in range(engine.cfg.num_fragments):
        engine.mark_steps[unit.index][p] = unit.progress
        engine.mark_tokens[unit.index][p] = unit.tokens


def _summarise(engine: _Engine) -> SimResult:
    """The measured totals of a finished run (every unit already brought to the horizon)."""
    cfg, units = engine.cfg, engine.units
    measured = cfg.horizon_s - cfg.warmup_s
    useful = sum(u.useful for u in units) - engine.useful_at_warmup
    stepped = sum(u.stepped for u in units) - engine.stepped_at_warmup
    stats = engine.stats if engine.diloco else None
    merged = stats["merged"] if stats else 0
    marks = engine.useful_marks
    batch_goodputs = [(b - a) * NOISE_BATCHES / (cfg.num_chips * measured) for a, b in pairwise(marks)]
    return SimResult(
        system=cfg.system,
        num_chips=cfg.num_chips,
        num_learners=len(units),
        goodput=useful / (cfg.num_chips * measured),
        measured_s=measured,
        failures=sum(u.failures for u in units) - engine.failures_at_warmup,
        rounds_merged=merged,
        rounds_skipped=stats["skipped"] if stats else 0,
        mean_merged_learners=stats["learners"] / merged if stats and merged else 0.0,
        mean_effective_learners=stats["effective"] / merged if stats and merged else 0.0,
        merged_step_share=stats["steps"] / (stepped * cfg.num_fragments) if stats and stepped else 0.0,
        events=engine.events,
        goodput_stderr=statistics.stdev(batch_goodputs) / math.sqrt(len(batch_goodputs)),
    )


def simulate(config: SimConfig) -> SimResult:
    """Run one simulation to its horizon; deterministic for a given config (seeded RNG streams)."""
    return _Engine(config).run()


# ----- the Table 1 grid -------------------------------------------------------------------------
DEFAULT_FAILURES_TARGET = 20_000.0  # elastic_dp cells: cheap (events scale with failures)
# dp cells: cheaper still, and their noise, ~ g (1 - g) per failure, is largest in the small jobs that the
# unit-size scaling leaves at the base: more failures, not scaled. The dp row is fitted on its exact formula to within
# 2.67 points at three cells, so its simulation noise is all that stands between them and 3: at 100k failures seed 0
# put 600k 0.3 above the formula, at 400k (3 s more per grid) seeds 0-2 stay within 0.1.
DEFAULT_DP_FAILURES_TARGET = 400_000.0
DEFAULT_LEARNER_FAILURES_TARGET = 4_000.0  # diloco cells (all learners): a failure costs a few quorum checks
# K = 1 goodput does not depend on the step time (no one waits; failure streams are seeded per learner
# and a unit test checks the independence: 2 s and this step agree to 12 digits), so the grid uses a coarse step
# to keep rounds few: the cost of a DiLoCo cell is then mostly its failures, not its rounds.
DEFAULT_GRID_STEP_S = 1_000.0


class _CellCommon(TypedDict):
    """The SimConfig fields every system of a grid cell shares."""

    num_chips: int
    horizon_s: float
    warmup_s: float
    failures: FailureModel
    step_s: float
    seed: int


@dataclass(frozen=True, kw_only=True, slots=True)
class GridConfig:
    """How the Table 1 grid is simulated: run length per cell and the shared model settings."""

    dp_failures_target: float = DEFAULT_DP_FAILURES_TARGET  # expected interruptions per dp cell ...
    failures_target: float = DEFAULT_FAILURES_TARGET  # ... per elastic_dp cell ...
    learner_failures_target: float = DEFAULT_LEARNER_FAILURES_TARGET  # ... per diloco cell (all learners)
    # A unit (job or learner) of more chips than this simulates proportionally more failures: the goodput noise
    # per failure grows with the unit's size (one return spans more of its failures), so every cell gets about the
    # same noise, and the cells of small units, where it is low anyway, stay cheap.
    noise_reference_chips: float = 150_000.0
    min_horizon_s: float = 3_600.0  # never simulate less than this
    warmup_fraction: float = 0.05  # share of each horizon discarded
    step_s: float = DEFAULT_GRID_STEP_S  # step time of every unit (only matters with in-flight step loss)
    failures: FailureModel = field(default_factory=FailureModel)
    quorum: QuorumConfig = field(default_factory=QuorumConfig.decoupled)
    seed: int = 0

    def __post_init__(self) -> None:
        positive = (
            self.dp_failures_target,
            self.failures_target,
            self.learner_failures_target,
            self.noise_reference_chips,
            self.min_horizon_s,
        )
        if not all(v > 0 for v in positive):
            raise ValueError("failure targets, noise_reference_chips and min_horizon_s must be > 0")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError("warmup_fraction must be in [0, 1)")


def cell_config(system: str, num_chips: int, grid: GridConfig) -> SimConfig:
    """The SimConfig of one grid cell; `system` is dp, elastic_dp or M<number of learners>."""
    baseline = system in ("dp", "elastic_dp")
    if not baseline and not (system.startswith("M") and system[1:].isdigit() and int(system[1:]) >= 1):
        raise ValueError(f"unknown grid system {system!r}")
    units = 1 if baseline else int(system[1:])
    if system == "dp":
        target = grid.dp_failures_target
    else:
        target = grid.failures_target if baseline else grid.learner_failures_target
        target *= max(1.0, num_chips / units / grid.noise_reference_chips)
    horizon = max(grid.min_horizon_s, target * grid.failures.mtbi_chip_s / num_chips)
    common: _CellCommon = {
        "num_chips": num_chips,
        "horizon_s": horizon,
        "warmup_s": grid.warmup_fraction * horizon,
        "failures": grid.failures,
        "step_s": grid.step_s,
        "seed": grid.seed,
    }
    if system == "dp":
        return SimConfig(system="dp", **common)
    if system == "elastic_dp":
        return SimConfig(system="elastic_dp", **common)
    return SimConfig(system="diloco", num_learners=units, quorum=grid.quorum, **common)


def run_grid(
    grid: GridConfig,
    systems: Iterable[str] = SYSTEMS,
    chip_counts: Iterable[str] = tuple(CHIP_COUNTS),
) -> dict[str, dict[str, SimResult]]:
    """Simulate every (system, chip count) cell; returns results[system][chip label]."""
    out: dict[str, dict[str, SimResult]] = {}
    for system in systems:
        out[system] = {}
        for label in chip_counts:
            out[system][label] = simulate(cell_config(system, CHIP_COUNTS[label], grid))
    return out


def max_abs_error_points(
    grid: dict[str, dict[str, float]], reference: dict[str, dict[str, float]] = PAPER_TABLE1
) -> float:
    """Largest |ours - paper| over the cells both grids have, in percentage points."""
    errors = [
        abs(value - reference[system][label]) * 100.0
        for system, row in grid.items()
        for label, value in row.items()
        if system in reference and label in reference[system]
    ]
    return max(errors) if errors else 0.0


def format_grid(ours: dict[str, dict[str, float]], paper: dict[str, dict[str, float]] = PAPER_TABLE1) -> str:
    """A text table: each cell 'ours (paper)' in percent."""
    labels = [label for label in CHIP_COUNTS if any(label in row for row in ours.values())]
    lines = ["goodput %, ours (paper)".ljust(14) + "".join(label.rjust(13) for label in labels)]
    for system, row in ours.items():
        cells = []
        for label in labels:
            if label not in row:
                cells.append("".rjust(13))
                continue
            ref = paper.get(system, {}).get(label)
            text = f"{row[label] * 100:5.1f}" + (f" ({ref * 100:3.0f})" if ref is not None else "      ")
            cells.append(text.rjust(13))
        lines.append(system.ljust(14) + "".join(cells))
    return "\n".join(lines)


# ----- heterogeneous learners (digest §3.4, Figure 6) ---------------------------------------------
HETERO_PAPER = {"K=8": 0.84, "K=1": 1.00, "K=1+grace": 1.00}


def hetero_configs(*, steps: int = 3_000, seed: int = 0) -> dict[str, SimConfig]:
    """Eight learners, four of them 18% slower, 10% per-step speed noise, no failures."""
    factors = (1.0,) * 4 + (1.0 / 1.18,) * 4
    base = SimConfig(
        system="diloco",
        num_chips=8,
        num_learners=8,
        horizon_s=steps * 2.0,
        warmup_s=steps * 2.0 * 0.05,
        failures=replace(FailureModel(), mtbi_chip_s=math.inf),
        speed_factors=factors,
        speed_jitter=0.10,
        seed=seed,
    )
    return {
        "K=8": replace(base, quorum=QuorumConfig.synchronous(8)),
        "K=1": replace(base, quorum=QuorumConfig.decoupled(1, grace_gamma=0.0)),
        "K=1+grace": replace(base, quorum=QuorumConfig.decoupled(1)),
    }


# ----- CLI -------------------------------------------------------------------------------------
def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.simulate",
        description="Goodput of data parallel, elastic data parallel and Decoupled DiLoCo under chip failures.",
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of dp, elastic_dp, M<n>")
    parser.add_argument("--chips", default=",".join(CHIP_COUNTS), help="comma list of 150k,300k,...")
    parser.add_argument("--dp-failures-target", type=float, default=DEFAULT_DP_FAILURES_TARGET)
    parser.add_argument("--failures-target", type=float, default=DEFAULT_FAILURES_TARGET)
    parser.add_argument("--learner-failures-target", type=float, default=DEFAULT_LEARNER_FAILURES_TARGET)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hetero", action="store_true", help="also run the heterogeneous-speed quorum table")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.WARNING)
    grid = GridConfig(
        dp_failures_target=args.dp_failures_target,
        failures_target=args.failures_target,
        learner_failures_target=args.learner_failures_target,
        seed=args.seed,
    )
    started = time.perf_counter()
    results = run_grid(grid, args.systems.split(","), args.chips.split(","))
    ours = {s: {c: r.goodput for c, r in row.items()} for s, row in results.items()}
    elapsed = time.perf_counter() - started
    print(format_grid(ours))
    print(f"max |ours - paper| = {max_abs_error_points(ours):.1f} points; {elapsed:.1f}s")
    if args.hetero:
        print("\nheterogeneous learners (M=8, 4 at -18%, 10% jitter, no failures):")
        for name, config in hetero_configs(seed=args.seed).items():
            r = simulate(config)
            print(
                f"  {name:10s} goodput {r.goodput * 100:5.1f}% (paper {HETERO_PAPER[name] * 100:.0f}%)"
                f"  learners/merge {r.mean_merged_learners:4.2f}"
                f"  merged step share {r.merged_step_share * 100:5.1f}%"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
