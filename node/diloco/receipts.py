"""Verifier token receipts as the syncer's measure of a pipeline stage replica's work.

A stage replica's fragment counters are self-reported, and merge weights are quadratic in tokens. Verifiers
sign cumulative token receipts per replica and verifier session (`node.stage.TokenReceipt`); the replica
keeps the newest of each session and relays them with its fragment contributions (`FragmentSync`'s
`receipts` provider, meta `receipts`: the raw frames, hex). The syncer checks each one (`verify_receipts`:
signed by an authorized verifier, for this run, naming this replica and the fragment's stage, not too old)
and caps the contribution's tokens at the growth of the verified counts since the receipts it saw with the
peer's last merged contribution of that fragment (`ReceiptLedger`). So a replica is weighted by what
verifiers saw it do, never more than it claims; tokens a late receipt did not cover yet are credited at the
next sync, since the baseline only moves when a contribution is merged.

Bad receipts (forged, tampered, unauthorized signer, garbage) are rejected one by one with a typed error
(`BadReceipt`, or the envelope's own error) that the syncer counts and, for forgery, strikes the relayer
for; receipts that are merely out of context (an old session, a replica that moved stages) are counted and
ignored. Nothing here raises on remote data except `parse_receipts_meta` on a malformed field.

The ledger is not checkpointed: after a syncer failover the first sync of a replica counts each session from
its start, which the replica's own (capped) counters still bound.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from protocol.errors import MalformedFrame, ProtocolError

if TYPE_CHECKING:
    from node.stage import TokenReceipt

logger = logging.getLogger(__name__)

RECEIPTS_META = "receipts"  # contribution meta key: a list of hex-encoded receipt frames
MAX_RECEIPTS = 16  # receipts one contribution may carry (the newest)
MAX_RECEIPT_BYTES = 2000  # a receipt is one small metadata-only envelope (hex: twice that, < meta's 4096)
RECEIPT_MAX_AGE_S = 3600.0
# reasons that mean someone forged or garbled a receipt: the relaying replica is struck for them; others (old,
# another stage or replica, a replay) can be honest and are only counted
FORGERY_REASONS = frozenset(
    {"bad signature", "digest mismatch", "malformed", "bad receipt", "not an authorized verifier"}
)  # the last is node.stage.UNAUTHORIZED

SessionKey = tuple[str, str]  # (verifier, session)


class BadReceipt(ProtocolError):
    reason = "bad receipt"


def receipts_meta(frames: Sequence[bytes]) -> list[str]:
    """The wire form of the newest `MAX_RECEIPTS` frames (callers pass them oldest first)."""
    kept = [bytes(f) for f in frames if 0 < len(f) <= MAX_RECEIPT_BYTES][-MAX_RECEIPTS:]
    return [f.hex() for f in kept]


def parse_receipts_meta(meta: Mapping[str, Any]) -> list[bytes]:
    """Receipt frames from a contribution's meta; [] if absent. MalformedFrame if the field is not a short list
    of hex strings (that is the sender's fault)."""
    value = meta.get(RECEIPTS_META)
    if value is None:
        return []
    if type(value) is not list or len(value) > MAX_RECEIPTS:
        raise MalformedFrame("receipts must be a list of at most 16 hex strings", reason="bad receipt")
    frames = []
    for item in value:
        if type(item) is not str or not 0 < len(item) <= 2 * MAX_RECEIPT_BYTES:
            raise MalformedFrame("a receipt is a hex string", reason="bad receipt")
        try:
            frames.append(bytes.fromhex(item))
        except ValueError:
            raise MalformedFrame("a receipt is a hex string", reason="bad receipt") from None
    return frames


def verify_receipts(
    frames: Sequence[bytes],
    *,
    run_id: str,
    replica: str,
    stage: int,
    authorized_verifiers: Sequence[str],
    now: float,
    max_age_s: float = RECEIPT_MAX_AGE_S,
) -> tuple[list[TokenReceipt], list[ProtocolError]]:
    """Open every frame with `node.stage.open_receipt`; returns (valid receipts, one error per rejected frame)."""
    from node.stage import open_receipt

    valid, errors = [], []
    for frame in frames:
        try:
            valid.append(
                open_receipt(
                    frame,
                    run_id=run_id,
                    replica=replica,
                    stage=stage,
                    authorized_verifiers=authorized_verifiers,
                    now=now,
                    max_age_s=max_age_s,
                )
            )
        except ProtocolError as e:
            errors.append(e)
        except (
            Exception
        ) as e:  # remote bytes: whatever the parser raises is the sender's problem, not a crash
            errors.append(BadReceipt(f"receipt does not parse: {type(e).__name__}"))
    return valid, errors


def newest_per_session(receipts: Sequence[TokenReceipt]) -> dict[SessionKey, int]:
    """Cumulative verified tokens per (verifier, session): the highest count seen (counts only grow)."""
    out: dict[SessionKey, int] = {}
    for receipt in receipts:
        key = (receipt.verifier, receipt.session)
        out[key] = max(out.get(key, 0), receipt.tokens)
    return out


class ReceiptLedger:
    """Per (peer, fragment), the verified count of every session as of the peer's last merged contribution."""

    def __init__(self, max_entries: int = 65536) -> None:
        self._baseline: OrderedDict[tuple[str, int], dict[SessionKey, int]] = OrderedDict()
        self._max_entries = max_entries

    def growth(
        self,
        peer: str,
        fragment: int,
        receipts: Sequence[TokenReceipt],
        *,
        also: Sequence[Mapping[SessionKey, int]] = (),
    ) -> tuple[int, dict[SessionKey, int]]:
        """(verified tokens since the last merged contribution, the counts to commit if this one is merged).

        `also`: counts already claimed by the peer's contributions that are accepted but not merged yet (they
        raise the baseline, so two contributions merged together cannot both claim the same growth)."""
        seen = newest_per_session(receipts)
        baseline = dict(self._baseline.get((peer, fragment), {}))
        for counts in also:
            for key, tokens in counts.items():
                baseline[key] = max(baseline.get(key, 0), tokens)
        grown = sum(max(0, tokens - baseline.get(key, 0)) for key, tokens in seen.items())
        return grown, {key: max(tokens, baseline.get(key, 0)) for key, tokens in seen.items()}

    def commit(self, peer: str, fragment: int, counts: Mapping[SessionKey, int]) -> None:
        if not counts:
            return
        key = (peer, fragment)
        merged = dict(self._baseline.pop(key, {}))
        for session, tokens in counts.items():
            merged[session] = max(merged.get(session, 0), tokens)
        self._baseline[key] = merged
        while len(self._baseline) > self._max_entries:
            self._baseline.popitem(last=False)


__all__ = [
    "FORGERY_REASONS",
    "MAX_RECEIPTS",
    "RECEIPTS_META",
    "BadReceipt",
    "ReceiptLedger",
    "newest_per_session",
    "parse_receipts_meta",
    "receipts_meta",
    "verify_receipts",
]
