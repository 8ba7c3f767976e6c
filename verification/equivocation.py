"""Equivocation detector: one signer, one slot, two different payloads.

Every boundary tensor is signed over a header that binds (run, microbatch, stage, direction) and the
digest of the payload. An honest replica sends exactly one payload per slot (a retry resends the same
bytes); the slot includes the request it answers and the inner step it computed at, so neither a rerouted
input nor a context rebuilt after the replica stepped frames it. Two valid signatures by the same signer over different digests for the same slot prove that the
signer equivocated, for example sending one tensor to the next stage and another to a spot-checker or a
second verifier. The proof is the pair of signed headers: anyone can re-check it from the signer's public
key, so it is ban-grade evidence that needs no statistics (the ledger may let it bypass the stage cap).

This module owns only the bookkeeping; signature checks happen before `observe` is called (protocol/).
Memory is bounded by an entry cap (least recently seen first out) and by expiry with the passed-in clock.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class EquivocationConfig:
    max_entries: int = 100_000  # remembered (signer, slot) pairs; oldest seen are dropped first
    ttl_s: float = 600.0  # a slot is forgotten this long after it was last seen

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.ttl_s <= 0:
            raise ValueError("need max_entries >= 1 and ttl_s > 0")


@dataclass(frozen=True, slots=True)
class Slot:
    """What one signer may sign exactly one payload for."""

    run_id: str
    microbatch_id: int
    stage: int
    direction: str
    input_digest: str = ""  # the request the payload answers: a new input for a microbatch is a new slot
    # the signer's inner step it computed at (bound in its signed header): a context rebuilt after the replica
    # stepped answers the same input with other weights, honestly, so it is a new slot, never a proof
    step: int = -1


@dataclass(frozen=True, slots=True)
class SignedHeader:
    """A header whose signature the caller has verified: the evidence a proof is made of."""

    header: bytes  # the canonical signed header bytes
    signature: bytes
    digest: bytes  # payload digest bound by the header


@dataclass(frozen=True, slots=True)
class EquivocationProof:
    signer: str
    slot: Slot
    first: SignedHeader
    second: SignedHeader
    first_seen: float
    second_seen: float

    @property
    def reason(self) -> str:
        return (
            f"equivocation by {self.signer} on run {self.slot.run_id} microbatch {self.slot.microbatch_id} "
            f"stage {self.slot.stage} {self.slot.direction}: digests {self.first.digest.hex()[:16]} "
            f"and {self.second.digest.hex()[:16]}"
        )


class EquivocationDetector:
    def __init__(self, config: EquivocationConfig | None = None) -> None:
        self.config = config or EquivocationConfig()
        self._seen: OrderedDict[tuple[str, Slot], tuple[SignedHeader, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def observe(self, signer: str, slot: Slot, signed: SignedHeader, now: float) -> EquivocationProof | None:
        """Record a verified header; return a proof if the signer already signed another digest for it."""
        self._expire(now)
        key = (signer, slot)
        previous = self._seen.get(key)
        if previous is not None:
            first, first_seen = previous
            if first.digest != signed.digest:
                proof = EquivocationProof(signer, slot, first, signed, first_seen, now)
                logger.warning("%s", proof.reason)
                return proof
            self._seen.move_to_end(key)
            self._seen[key] = (first, now)  # a retry of the same payload keeps the slot alive
            return None
        self._seen[key] = (signed, now)
        while len(self._seen) > self.config.max_entries:
            self._seen.popitem(last=False)
        return None

    def _expire(self, now: float) -> None:
        cutoff = now - self.config.ttl_s
        while self._seen:
            _, (_, seen) = next(iter(self._seen.items()))
            if seen >= cutoff:
                break
            self._seen.popitem(last=False)
