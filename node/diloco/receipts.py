"""Verifier token receipts as the syncer's measure of a pipeline stage replica's work.

A stage replica's fragment counters are self-reported, and merge weights are quadratic in tokens. Verifiers
sign cumulative token receipts per replica and verifier session (`protocol.receipts.TokenReceipt`); the replica
keeps the newest of each session and relays them with its fragment contributions (`FragmentSync`'s
`receipts` provider, meta `receipts`: the raw frames, hex). The syncer checks each one (`protocol.receipts.verify_receipts`:
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
from typing import TYPE_CHECKING

from protocol.receipts import SessionKey

if TYPE_CHECKING:
    from protocol.receipts import TokenReceipt

logger = logging.getLogger(__name__)


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
    "ReceiptLedger",
    "newest_per_session",
]
