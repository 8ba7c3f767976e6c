"""SENTINEL on the running pipeline: the boundary tap every tensor a verifier receives passes through once.

* `BoundaryTap` is the seam (a Protocol: `check`, `spot_check_due`, `spot_check`) that the pipeline driver
  (node/pipeline/driver.py) calls; `PassThroughTap` accepts everything (a driver without SENTINEL).
* `SentinelTap` is the `BoundaryTap` a verifier drives every received boundary tensor through: equivocation
  bookkeeping (from the signed header), the per-(stage, direction) monitors with the stage's input or output
  gradient as context, the per-own-microbatch violation ledger (cap, storms, re-warm), and the action: a flagged
  activation drops the microbatch (or is replaced by the EMA), a flagged gradient is replaced by the EMA and
  later boundaries of that microbatch are not judged (the cascade). A ban decision becomes a `BanNotice` with
  `BanEvidence` (the offender's signed header, scores, fences) queued for the DHT and a JSONL event.
  The notices are published, and every role enforces the resulting bans, by `node.swarm.bans.BanWatcher`.
* Spot checks (`verification.spotcheck`): after each checked tensor the driver asks `spot_check_due`
  (the tap's RNG draws, after the sender signed, at the rate its ledger state calls for: new, flagged and
  quarantined replicas more often); if due, the driver recomputes the same input on a random other replica
  of the stage (and on a third one after a mismatch) and hands the outputs to `spot_check`, which
  adjudicates, feeds convictions to the ledger (two within a window ban) and takes back the flag of a
  microbatch whose recomputation matched (the statistics were wrong, not the replica).
"""

from __future__ import annotations

import logging
import math
import random
import secrets
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from protocol.envelope import Direction, Header
from protocol.records import BanNotice
from verification.bans import (
    BanEvidence,
    SignedBoundaryHeader,
)
from verification.equivocation import EquivocationDetector, SignedHeader, Slot
from verification.ledger import LedgerConfig, LedgerDecision, ViolationLedger
from verification.sentinel import Direction as SentinelDirection
from verification.sentinel import SentinelConfig, SentinelMonitor, StageTurnover, Verdict
from verification.spotcheck import SpotCheckConfig, SpotCheckPolicy, SpotCheckVerdict

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    pass


EventSink = Callable[..., None]  # emit(event_name, **fields)


# ---------------------------------------------------------------------------------------------------- the tap


@dataclass(frozen=True, kw_only=True, slots=True)
class SentinelTapConfig:
    enabled: bool = True  # False: pass everything through (the negative control)
    drop_flagged_activations: bool = True  # False: replace a flagged activation by the EMA instead
    ban_ttl_s: float = 3600.0  # lifetime of a published ban notice (re-published while it holds)
    evidence_per_replica: int = 4  # flagged tensors' signed headers kept per replica for the evidence
    tainted_microbatches: int = 4096  # microbatch ids remembered as "already handled upstream"
    sentinel: SentinelConfig = field(default_factory=SentinelConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    spot: SpotCheckConfig | None = field(default_factory=SpotCheckConfig)  # None: no spot checks
    spot_seed: int | None = None  # the spot-check draws' RNG seed (None: unpredictable, the default)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ban_ttl_s) and self.ban_ttl_s > 0):
            raise ValueError("ban_ttl_s must be positive")
        if self.evidence_per_replica < 1 or self.tainted_microbatches < 1:
            raise ValueError("evidence_per_replica and tainted_microbatches must be >= 1")


@dataclass(slots=True)
class TapStats:
    checked: int = 0
    flagged: int = 0
    dropped: int = 0
    replaced: int = 0
    skipped_cascade: int = 0
    bans: int = 0
    rewarms: int = 0
    resets: int = 0  # stages whose history was dropped: every replica replaced (StageTurnover)
    reanchors: int = 0  # boundaries whose history started again: locked out (SentinelConfig.lockout_checks)
    quarantines: int = 0
    equivocations: int = 0
    spot_checks: int = 0  # recomputations started (a third replica's is not counted again)
    spot_matches: int = 0
    spot_thirds: int = 0  # mismatches that asked a third replica
    spot_convictions: int = 0
    spot_uncorroborated: int = 0  # convictions by two identical replicas or while turbulent: never a ban
    spot_turbulent: int = 0  # of those, convictions while no two replicas agreed in a recent three-way check
    spot_marginal: int = 0  # convictions near the tolerance: each a fraction of a full one
    spot_inconclusive: int = 0
    spot_exonerated: int = 0  # flagged microbatches whose recomputation matched: flag taken back
    check_s: float = 0.0


@dataclass(slots=True)
class _Flag:
    microbatch: int
    verdict: Verdict
    signed: SignedBoundaryHeader | None


class SentinelTap:
    """The verifier's SENTINEL seam (`node.roles.verifier.BoundaryTap` protocol); see the module docstring."""

    def __init__(
        self,
        *,
        verifier: str,
        run_id: str,
        config: SentinelTapConfig | None = None,
        stage_replicas: Callable[[int], Collection[str]] = lambda _stage: (),
        emit: EventSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.verifier = verifier
        self.run_id = run_id
        self.config = config or SentinelTapConfig()
        self.stage_replicas = stage_replicas
        self.emit = emit or (lambda event, **fields: None)
        self.clock = clock
        self.wall_clock = wall_clock
        self.monitor = SentinelMonitor(self.config.sentinel)
        self.turnover = StageTurnover()
        self.ledger = ViolationLedger(self.config.ledger)
        self.equivocation = EquivocationDetector()
        self.stats = TapStats()
        self.seen: dict[tuple[int, str], int] = {}
        self.banned_locally: dict[str, str] = {}  # offender -> reason; effective for this verifier at once
        self.pending: deque[BanNotice] = deque()  # notices to publish (BanWatcher drains it)
        self.ban_log: list[dict[str, Any]] = []  # (for tests and benchmarks) every ban this tap decided
        self._flags: dict[str, deque[_Flag]] = {}
        self._tainted: deque[int] = deque()
        self._tainted_set: set[int] = set()
        seed = self.config.spot_seed if self.config.spot_seed is not None else secrets.randbits(64)
        self.spot_rng = random.Random(seed)
        self._spot: dict[tuple[int, str], SpotCheckPolicy] = {}
        self._recent: dict[str, deque[_Flag]] = {}  # each replica's last checked tensors (spot evidence)
        # (replica, microbatch) of tensors a spot check cleared of their flag (the driver uses them after all)
        self._cleared: deque[tuple[str, int]] = deque(maxlen=64)

    # ---- the seam

    def check(
        self,
        stage: int,
        direction: Direction,
        replica: str,
        microbatch_id: int,
        tensor: torch.Tensor,
        header: Header,
        *,
        context: torch.Tensor | None = None,
        signed: SignedBoundaryHeader | None = None,
    ) -> torch.Tensor | Any:

        key = (stage, direction.value)
        self.seen[key] = self.seen.get(key, 0) + 1
        if not self.config.enabled:
            return tensor
        if microbatch_id in self._tainted_set:
            self.stats.skipped_cascade += 1  # contaminated upstream: do not blame this replica
            return tensor
        started = time.perf_counter()
        now = self.clock()
        try:
            if signed is not None and self._equivocated(
                stage, direction.value, replica, microbatch_id, header, signed, now
            ):
                return Drop(f"equivocation by {replica[-8:]}")
            dir_name: SentinelDirection = "forward" if direction is Direction.FORWARD else "backward"
            paired = context if context is not None and tuple(context.shape) == tuple(tensor.shape) else None
            verdict = self.monitor.check(stage, dir_name, replica, microbatch_id, tensor, now, context=paired)
            self.stats.checked += 1
            if verdict.reanchored:
                self._reanchored(stage, dir_name, replica)
            replicas = self._replicas(stage, replica)
            decision = self.ledger.record(
                replica, stage, verdict.flagged, now, microbatch_id=microbatch_id, replicas=replicas
            )
            self._recent.setdefault(replica, deque(maxlen=8)).append(_Flag(microbatch_id, verdict, signed))
            if verdict.flagged:
                self.stats.flagged += 1
                self._remember_flag(replica, microbatch_id, verdict, signed)
            self._act(decision)
            if not verdict.flagged:
                return tensor
            if dir_name == "forward" and self.config.drop_flagged_activations:
                # Not tainted: the tensor goes nowhere, and the driver asks another replica for this hop,
                # whose answer (and everything downstream of it) is checked as usual.
                self.stats.dropped += 1
                return Drop(f"SENTINEL flagged {replica[-8:]} at stage {stage} forward: {verdict.reason}")
            self._taint(microbatch_id)  # the replacement travels on: later boundaries must not blame others
            self.stats.replaced += 1
            return self.monitor.boundary(stage, dir_name).replacement_for(tensor)
        finally:
            self.stats.check_s += time.perf_counter() - started

    # ---- spot checks (the driver runs the recomputations; see the module docstring)

    def spot_check_due(self, stage: int, direction: Direction, replica: str) -> bool:
        """Draw whether `replica`'s tensor just checked at (stage, direction) is recomputed elsewhere."""
        if not self.config.enabled or self.config.spot is None or replica in self.banned_locally:
            return False
        latest = self._recent.get(replica)
        flagged_now = bool(latest) and latest[-1].verdict.flagged  # type: ignore[index]
        draw = self._spot_policy(stage, direction).should_check(
            self.spot_rng,
            microbatches_seen=self.ledger.microbatches_seen(replica),
            recent_flags=self.ledger.flags_in_window(replica),
            quarantined=self.ledger.is_quarantined(replica),
            flagged_now=flagged_now,
        )
        return draw.check

    def spot_check(
        self,
        stage: int,
        direction: Direction,
        replica: str,
        microbatch_id: int,
        original: torch.Tensor,
        checker: str,
        checker_output: torch.Tensor,
        *,
        third: str | None = None,
        third_output: torch.Tensor | None = None,
    ) -> SpotCheckVerdict:
        """Adjudicate a recomputation of `replica`'s `original` by `checker` (and `third` after a
        `need_third`), and act on it: a conviction goes to the ledger as evidence, a match takes back a
        flag of that microbatch."""
        policy = self._spot_policy(stage, direction)
        other = Direction.BACKWARD if direction is Direction.FORWARD else Direction.FORWARD
        verdict = policy.adjudicate(
            original,
            checker_output,
            third_output,
            turbulent_elsewhere=self._spot_policy(stage, other).turbulent,
        )
        self._tally_spot(policy, verdict, replica, microbatch_id, first_round=third_output is None)
        culprit = {"original": replica, "checker": checker}.get(verdict.culprit or "")
        if culprit is not None:
            self._convict(culprit, verdict, stage, direction, replica, microbatch_id)
        if verdict.outcome != "match":
            self.emit(
                "sentinel_spotcheck",
                replica=replica,
                checker=checker,
                third=third,
                stage=stage,
                direction=direction.value,
                microbatch=microbatch_id,
                outcome=verdict.outcome,
                reason=verdict.reason,
            )
        return verdict

    def _tally_spot(
        self,
        policy: SpotCheckPolicy,
        verdict: SpotCheckVerdict,
        replica: str,
        microbatch_id: int,
        *,
        first_round: bool,
    ) -> None:
        """Count the outcome; a match (or a checker found odd) close enough to honest clears the flag."""
        stats = self.stats
        if first_round:
            stats.spot_checks += 1
        outcome = verdict.outcome
        if outcome == "need_third":
            stats.spot_thirds += 1
        elif outcome in ("match", "checker_faulty"):
            stats.spot_matches += int(outcome == "match")
            if policy.clears(verdict):
                self._cleared.append((replica, microbatch_id))
                self._exonerate(replica, microbatch_id, verdict.reason)
        elif outcome == "inconclusive":
            stats.spot_inconclusive += 1

    def _convict(
        self,
        culprit: str,
        verdict: SpotCheckVerdict,
        stage: int,
        direction: Direction,
        replica: str,
        microbatch_id: int,
    ) -> None:
        """A spot-check conviction: a convicted original taints its microbatch and keeps its flag as ban
        evidence; either culprit gets the conviction in the ledger (weighted as the verdict says)."""
        stats = self.stats
        stats.spot_convictions += 1
        if culprit == replica:
            self._taint(microbatch_id)
            kept = next((f for f in self._recent.get(replica, ()) if f.microbatch == microbatch_id), None)
            if kept is not None:
                self._remember_flag(replica, microbatch_id, kept.verdict, kept.signed)
        dir_name: SentinelDirection = "forward" if direction is Direction.FORWARD else "backward"
        reason = f"spot check of microbatch {microbatch_id} at stage {stage} {dir_name}: {verdict.reason}"
        stats.spot_uncorroborated += int(not verdict.corroborated)
        stats.spot_turbulent += int(verdict.turbulent)
        stats.spot_marginal += int(verdict.marginal)
        decision = self.ledger.record_evidence(
            culprit,
            stage,
            self.clock(),
            reason=reason,
            corroborated=verdict.corroborated,
            marginal=verdict.marginal,
            replicas=self._replicas(stage, culprit),
        )
        self._act(decision, kind="spotcheck")

    def spot_suspect(self, replica: str) -> bool:
        """Flags in its ledger window, or quarantined: drawn as a checker last (`unsuspected_checkers_first`)."""
        spot = self.config.spot  # None: no spot checks, so no checker is drawn
        on = spot is None or spot.unsuspected_checkers_first
        return on and (self.ledger.is_quarantined(replica) or self.ledger.flags_in_window(replica) > 0)

    def spot_cleared(self, replica: str, microbatch_id: int) -> bool:
        """Whether a spot check cleared `replica`'s tensor of `microbatch_id` (use it even if flagged)."""
        return (replica, microbatch_id) in self._cleared

    def _spot_policy(self, stage: int, direction: Direction) -> SpotCheckPolicy:
        # one per boundary: honest replicas differ more on gradients than on activations (the tolerance)
        key = (stage, direction.value)
        policy = self._spot.get(key)
        if policy is None:
            policy = self._spot[key] = SpotCheckPolicy(self.config.spot or SpotCheckConfig())
        return policy

    def _exonerate(self, replica: str, microbatch_id: int, reason: str) -> None:
        before = self.ledger.flags_in_window(replica)
        decision = self.ledger.exonerate(replica, microbatch_id, reason=reason)
        if self.ledger.flags_in_window(replica) < before:
            self.stats.spot_exonerated += 1
            self._tainted_set.discard(microbatch_id)  # later boundaries may judge it again
        self._act(decision)

    # ---- queries

    def observe_replicas(self, members: Mapping[int, Collection[str]]) -> None:
        """The live replicas of every stage, after each refresh: a stage whose replicas were all replaced
        starts a fresh history (StageTurnover says why)."""
        for stage in self.turnover.observe(members):
            self.monitor.reset_stage(stage)
            self.stats.resets += 1
            logger.warning(
                "stage %d: every replica replaced; SENTINEL history of the stage starts again", stage
            )
            self.emit(
                "sentinel_reset", stage=stage, replicas=sorted(members[stage]), why="every replica replaced"
            )

    def _reanchored(self, stage: int, direction: str, replica: str) -> None:
        self.stats.reanchors += 1  # the monitor logged why
        self.emit("sentinel_reset", stage=stage, direction=direction, replicas=[replica], why="locked out")

    def banned(self) -> frozenset[str]:
        return frozenset(self.banned_locally)

    def status(self) -> dict[str, Any]:
        s = self.stats
        return {
            "enabled": self.config.enabled,
            "checked": s.checked,
            "flagged": s.flagged,
            "dropped": s.dropped,
            "replaced": s.replaced,
            "skipped_cascade": s.skipped_cascade,
            "bans": s.bans,
            "rewarms": s.rewarms,
            "resets": s.resets,
            "reanchors": s.reanchors,
            "quarantines": s.quarantines,
            "equivocations": s.equivocations,
            "spot_checks": s.spot_checks,
            "spot_convictions": s.spot_convictions,
            "spot_exonerated": s.spot_exonerated,
            "check_ms_mean": round(1000 * s.check_s / max(s.checked, 1), 3),
            "banned": sorted(self.banned_locally),
            "quarantined": self.ledger.quarantined(),
            "flags_in_window": self.ledger.flagged(),
        }

    # ---- pieces

    def _replicas(self, stage: int, replica: str) -> list[str]:
        known = [p for p in self.stage_replicas(stage) if p not in self.banned_locally]
        return known if replica in known else [*known, replica]

    def _taint(self, microbatch_id: int) -> None:
        if microbatch_id in self._tainted_set:
            return
        self._tainted.append(microbatch_id)
        self._tainted_set.add(microbatch_id)
        while len(self._tainted) > self.config.tainted_microbatches:
            self._tainted_set.discard(self._tainted.popleft())

    def _remember_flag(
        self, replica: str, microbatch_id: int, verdict: Verdict, signed: SignedBoundaryHeader | None
    ) -> None:
        kept = self._flags.setdefault(replica, deque(maxlen=self.config.evidence_per_replica))
        kept.append(_Flag(microbatch_id, verdict, signed))

    def _equivocated(
        self,
        stage: int,
        direction: str,
        replica: str,
        microbatch_id: int,
        header: Header,
        signed: SignedBoundaryHeader,
        now: float,
    ) -> bool:
        slot = Slot(
            self.run_id,
            microbatch_id,
            stage,
            direction,
            str(header.meta.get("input_digest", "")),
            header.step,
        )
        proof = self.equivocation.observe(
            replica, slot, SignedHeader(signed.header, signed.signature, header.digest), now
        )
        if proof is None:
            return False
        self.stats.equivocations += 1
        headers = (
            SignedBoundaryHeader(proof.first.header, proof.first.signature),
            SignedBoundaryHeader(proof.second.header, proof.second.signature),
        )
        decision = self.ledger.record_evidence(
            replica, stage, now, reason=proof.reason, bypass_cap=True, replicas=self._replicas(stage, replica)
        )
        self._act(decision, kind="equivocation", headers=headers)
        return True

    def _act(
        self,
        decision: LedgerDecision,
        *,
        kind: str = "statistical",
        headers: tuple[SignedBoundaryHeader, ...] | None = None,
    ) -> None:
        for d in decision.all():
            if d.action == "ban":
                self._ban(d, kind=kind, headers=headers)
            elif d.action == "rewarm":
                self.stats.rewarms += 1
                self.monitor.rewarm(d.stage)
                self.emit("sentinel_rewarm", stage=d.stage, reason=d.reason)
            elif d.action == "quarantine":
                self.stats.quarantines += 1
                self.emit("sentinel_quarantine", replica=d.signer, stage=d.stage, reason=d.reason)
            elif d.action == "release":
                self.emit("sentinel_release", replica=d.signer, stage=d.stage, reason=d.reason)

    def _ban(self, d: LedgerDecision, *, kind: str, headers: tuple[SignedBoundaryHeader, ...] | None) -> None:
        if d.signer in self.banned_locally:
            return
        flags = list(self._flags.pop(d.signer, ()))
        last = flags[-1].verdict if flags else None
        if headers is None:
            headers = tuple(f.signed for f in flags[-2:] if f.signed is not None)
        evidence = BanEvidence(
            offender=d.signer,
            verifier=self.verifier,
            kind=kind,  # type: ignore[arg-type]
            reason=d.reason,
            stage=d.stage,
            headers=headers,
            scores=dict(last.scores) if last else {},
            fences=dict(last.fences) if last else {},
            microbatches=tuple(f.microbatch for f in flags),
        )
        notice = BanNotice(
            offender=d.signer,
            reason=d.reason[:200],
            evidence=evidence.to_bytes(),
            stage=d.stage,
            issued_at=self.wall_clock(),
        )
        self.banned_locally[d.signer] = d.reason
        self.monitor.forget_replica(d.signer)
        self.pending.append(notice)
        self.stats.bans += 1
        entry = {
            "offender": d.signer,
            "stage": d.stage,
            "kind": kind,
            "reason": d.reason,
            "flagged_microbatches": [f.microbatch for f in flags],
            "own_microbatches": self.ledger.microbatches_seen(d.signer),
        }
        self.ban_log.append(entry)
        self.emit("sentinel_ban", **entry)


# ---------------------------------------------------------------------------------------------------- enforcement


# ---------------------------------------------------------------------------------------------------- unsafe


__all__ = [
    "SentinelTap",
    "SentinelTapConfig",
    "TapStats",
]


@dataclass(frozen=True, slots=True)
class Drop:
    """The boundary check refuses a tensor: the microbatch is dropped (downstream boundaries skip it)."""

    reason: str


class BoundaryTap(Protocol):
    """Every boundary tensor the verifier receives passes through `check` exactly once (SENTINEL plugs in here).

    `stage` is the stage that produced the tensor, `direction` forward (its output activation) or backward
    (the gradient of its input). `check` returns the tensor to use downstream (a flagged gradient may be
    replaced) or a `Drop`. After each check the driver asks `spot_check_due`; when it is due, the driver
    recomputes the same request on other replicas of the stage and hands the outputs to `spot_check`.
    Implementations: `SentinelTap` (production) and `PassThroughTap` (accepts everything).
    """

    def check(
        self,
        stage: int,
        direction: Direction,
        replica: str,
        microbatch_id: int,
        tensor: torch.Tensor,
        header: Header,
        *,
        context: torch.Tensor | None = None,
        signed: SignedBoundaryHeader | None = None,
    ) -> torch.Tensor | Drop:
        """`context`: what the verifier sent that stage for this microbatch (its input forward, the output
        gradient it was given backward; None when there is none). `signed`: the answer's header and signature."""
        ...

    def spot_check_due(self, stage: int, direction: Direction, replica: str) -> bool: ...

    def spot_check(
        self,
        stage: int,
        direction: Direction,
        replica: str,
        microbatch_id: int,
        original: torch.Tensor,
        checker: str,
        checker_output: torch.Tensor,
        *,
        third: str | None = None,
        third_output: torch.Tensor | None = None,
    ) -> SpotCheckVerdict: ...


class PassThroughTap:
    """The `BoundaryTap` of a driver without SENTINEL: accepts every tensor, counts what it saw, never spot-checks."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, str], int] = {}

    def check(
        self,
        stage: int,
        direction: Direction,
        replica: str,
        microbatch_id: int,
        tensor: torch.Tensor,
        header: Header,
        *,
        context: torch.Tensor | None = None,
        signed: SignedBoundaryHeader | None = None,
    ) -> torch.Tensor | Drop:
        del replica, microbatch_id, header, context, signed
        key = (stage, direction.value)
        self.seen[key] = self.seen.get(key, 0) + 1
        return tensor

    def spot_check_due(self, stage: int, direction: Direction, replica: str) -> bool:
        del stage, direction, replica
        return False

    def spot_check(
        self,
        stage: int,
        direction: Direction,
        replica: str,
        microbatch_id: int,
        original: torch.Tensor,
        checker: str,
        checker_output: torch.Tensor,
        *,
        third: str | None = None,
        third_output: torch.Tensor | None = None,
    ) -> SpotCheckVerdict:
        raise RuntimeError("PassThroughTap never draws a spot check, so it is never asked to judge one")
