"""What the pipeline driver counts and credits: hop errors and microbatch outcomes, the driver's totals
(`DriverStats`), and the verified tokens per stage replica with the signed receipts that state them
(`ReceiptBook`). No I/O and no clock: the receipts' issue time is passed in."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from node.pipeline.routing import HopFailure, IdempotencyKey, IdempotencyLedger, Phase
from protocol.identity import NodeIdentity
from protocol.receipts import TokenReceipt

logger = logging.getLogger(__name__)


class HopError(Exception):
    """One request to one replica failed; `failure` is what the retry policy decides on."""

    def __init__(self, failure: HopFailure, detail: str = "") -> None:
        super().__init__(f"{failure.value}: {detail}" if detail else failure.value)
        self.failure = failure
        self.detail = detail


class MicrobatchAbandoned(Exception):  # noqa: N818 - reads as the outcome
    """A hop ran out of replicas or retries, or a boundary check dropped the microbatch."""


@dataclass(slots=True)
class MicrobatchOutcome:
    microbatch: int
    completed: bool
    loss: float | None = None
    tokens: int = 0
    retries: int = 0  # hops tried again (elsewhere, or the same replica after a lost answer)
    recomputed: int = 0  # forwards re-run because the context holder was gone
    replicas: list[str | None] = field(default_factory=list)  # per stage, the replica that applied it
    failures: list[dict[str, Any]] = field(default_factory=list)
    # (stage, replica) left after a timeout or a lost answer for another replica: it may have applied it too
    maybe_twice: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""


@dataclass(slots=True)
class DriverStats:
    completed: int = 0
    abandoned: int = 0
    tokens: int = 0
    retries: int = 0
    recomputed: int = 0
    recovered: int = 0  # completed microbatches that needed at least one retry
    double_applied: int = 0  # a backward acknowledged twice for one (microbatch, stage): must stay 0
    maybe_applied_twice: int = 0  # applying hops moved on after a timeout or a lost answer (at-least-once)
    bad_replies: int = 0
    spot_checks: int = 0  # spot-check recomputations concluded (see SentinelTap for their outcomes)
    disguised_checks: int = 0  # recomputations sent as ordinary training requests (node/pipeline/checks.py)
    duplicate_gradients: int = 0  # of which backward ones: the checker applied the microbatch a second time
    failures: dict[str, int] = field(default_factory=dict)
    applied_per_stage: dict[int, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=lambda: {"seal_s": 0.0, "open_s": 0.0, "call_s": 0.0})


@dataclass(slots=True)
class _Credit:
    stage: int
    tokens: int = 0
    microbatches: int = 0
    last_microbatch: int = 0
    sequence: int = 0
    receipted_tokens: int = 0  # tokens covered by the latest receipt emitted


class ReceiptBook:
    """Verified tokens per stage replica for one verifier session, and the receipts that state them."""

    def __init__(self, identity: NodeIdentity, run_id: str, *, session: str | None = None) -> None:
        self.identity = identity
        self.run_id = run_id
        self.session = session or secrets.token_hex(8)
        self._credits: dict[str, _Credit] = {}
        self.latest: dict[str, TokenReceipt] = {}

    def credit(self, replica: str, stage: int, *, tokens: int, microbatch: int) -> None:
        """A replica's part of a microbatch was verified and applied (its backward answered and checked)."""
        c = self._credits.get(replica)
        if c is None or c.stage != stage:  # a replica that moved stages starts a new count
            c = self._credits[replica] = _Credit(stage=stage)
        c.tokens += tokens
        c.microbatches += 1
        c.last_microbatch = max(c.last_microbatch, microbatch)

    def due(self, now: float) -> list[tuple[TokenReceipt, bytearray]]:
        """A fresh signed receipt for every replica whose verified tokens grew since its last receipt."""
        out = []
        for replica, c in self._credits.items():
            if c.tokens == c.receipted_tokens:
                continue
            c.sequence += 1
            c.receipted_tokens = c.tokens
            receipt = TokenReceipt(
                verifier=self.identity.peer_id,
                replica=replica,
                stage=c.stage,
                session=self.session,
                sequence=c.sequence,
                tokens=c.tokens,
                microbatches=c.microbatches,
                last_microbatch=c.last_microbatch,
                issued_at=now,
            )
            self.latest[replica] = receipt
            out.append((receipt, receipt.seal(self.identity, self.run_id)))
        return out

    def tokens_by_replica(self) -> dict[str, int]:
        return {replica: c.tokens for replica, c in self._credits.items()}


class Accounting:
    """The driver's bookkeeping for every microbatch: outcomes and totals, hop failures (logged), and each
    backward acknowledgement, which credits the replica's tokens once (`IdempotencyLedger`: a second
    acknowledgement for one (microbatch, stage) is counted as `double_applied`, never credited)."""

    def __init__(self, run_id: str, verifier: str, receipts: ReceiptBook) -> None:
        self.run_id = run_id
        self.verifier = verifier
        self.receipts = receipts
        self.ledger = IdempotencyLedger()
        self.stats = DriverStats()

    def applied(self, microbatch: int, stage: int, replica: str, *, tokens: int) -> None:
        """`replica` acknowledged (and the driver checked) the backward of `microbatch` at `stage`."""
        key = IdempotencyKey(self.run_id, self.verifier, microbatch, stage, Phase.BACKWARD)
        if not self.ledger.mark_applied(key):
            self.stats.double_applied += 1
            logger.error("microbatch %d was acknowledged twice at stage %d", microbatch, stage)
            return
        per_stage = self.stats.applied_per_stage
        per_stage[stage] = per_stage.get(stage, 0) + 1
        self.receipts.credit(replica, stage, tokens=tokens, microbatch=microbatch)

    def completed(self, outcome: MicrobatchOutcome, *, loss: float, tokens: int) -> None:
        outcome.completed = True
        outcome.loss = loss
        outcome.tokens = tokens
        self.stats.completed += 1
        self.stats.tokens += tokens
        if outcome.retries:
            self.stats.recovered += 1

    def abandoned(self, outcome: MicrobatchOutcome, error: MicrobatchAbandoned) -> None:
        outcome.reason = str(error)
        self.stats.abandoned += 1
        logger.info("microbatch %d abandoned: %s", outcome.microbatch, error)

    def recomputed(self, outcome: MicrobatchOutcome) -> None:
        """A forward re-run on another replica because the one holding the context failed its backward."""
        outcome.recomputed += 1
        self.stats.recomputed += 1

    def moved_on(self, outcome: MicrobatchOutcome, stage: int, left: str, to: str) -> None:
        """A hop that applies (the last stage's loss, a backward) timed out or lost its answer on `left`, was asked
        of `left` again, and now goes to `to`. `left` may have applied it too: a slow replica that applied and
        one that did not look the same from here, and waiting on a frozen one would stall the microbatch."""
        self.stats.maybe_applied_twice += 1
        outcome.maybe_twice.append({"stage": stage, "replica": left, "moved_to": to})
        logger.warning(
            "microbatch %d: moved from %s to %s at stage %d after a timeout or a lost answer; it may be applied twice",
            outcome.microbatch,
            left[-8:],
            to[-8:],
            stage,
        )

    def asked_again(self, outcome: MicrobatchOutcome, stage: int, replica: str, error: HopError) -> None:
        """The answer was lost: the same replica is asked again (it answers from cache if it applied it)."""
        outcome.retries += 1
        self.stats.retries += 1
        outcome.failures.append(
            {"stage": stage, "replica": replica, "failure": error.failure.value, "detail": "asked again"}
        )
        logger.info(
            "microbatch %d: answer of %s at stage %d lost (%s); asking again",
            outcome.microbatch,
            replica[-8:],
            stage,
            error,
        )

    def failed(
        self, outcome: MicrobatchOutcome, stage: int, replica: str, error: HopError, *, cooldown: float
    ) -> None:
        """A hop failed and will be tried elsewhere or given up; `cooldown`: what the router gave `replica`."""
        failures = self.stats.failures
        failures[error.failure.value] = failures.get(error.failure.value, 0) + 1
        self.stats.retries += 1
        outcome.failures.append(
            {"stage": stage, "replica": replica, "failure": error.failure.value, "detail": error.detail[:200]}
        )
        logger.info(
            "microbatch %d: hop at stage %d on %s failed (%s)%s",
            outcome.microbatch,
            stage,
            replica[-8:],
            error,
            f"; cooldown {cooldown:.0f} s" if cooldown else "",
        )
