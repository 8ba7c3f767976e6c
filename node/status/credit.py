"""Why a peer's credit is what it is: the reasons `python -m node status --peer` prints under its ledger line.

Pure: it reads the bootstrap's ledger row and recent contributions for the peer and the swarm document
(/api/swarm: syncer records, bans), and returns sentences; empty when nothing holds the credit back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from node.context import short_id


def explain_credit(
    peer_id: str,
    row: Mapping[str, Any] | None,
    recent: Sequence[Mapping[str, Any]],
    swarm: Mapping[str, Any],
) -> list[str]:
    """The reasons this peer's verified tokens are zero or not growing, most decisive first."""
    reasons = []
    for ban in swarm.get("bans") or []:
        if ban.get("offender") == peer_id and ban.get("in_effect"):
            by = ", ".join(short_id(str(v)) for v in ban.get("verifiers") or [])
            why = "; ".join(sorted({str(n.get("reason", "")) for n in ban.get("notices") or []} - {""}))
            evidence = next(
                (str(n.get("evidence", "")) for n in ban.get("notices") or [] if n.get("evidence")), ""
            )
            reasons.append(
                f"banned by verifier {by}: {why or 'no reason given'}"
                + (f" (evidence {evidence[:32]}...)" if evidence else "")
            )
    if not any(s.get("state") == "active" for s in swarm.get("syncer") or []):
        reasons.append(
            "waiting for a syncer: no syncer of this run is active, so nothing is merged or credited"
        )
    if row is None:
        reasons.append(
            "the bootstrap has not seen this peer: is it running, joined to this run, and are its heartbeats "
            "reaching the DHT?"
        )
        return reasons
    streak = 0
    for entry in recent:  # newest first
        if entry.get("accepted"):
            break
        streak += 1
    if streak:
        reasons.append(
            f"last {streak} contribution(s) rejected: {recent[0].get('reason') or 'no reason given'}"
        )
    elif not row.get("accepted") and not row.get("rejected"):
        reasons.append(
            "no contribution merged yet: a learner or stage pushes after every sync_every_steps inner steps"
        )
    elif not row.get("verified_tokens"):
        reasons.append("contributions were merged with no verified tokens (no inner steps, or no receipts)")
    return reasons
