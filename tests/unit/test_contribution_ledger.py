"""The bootstrap's contribution ledger (SQLite) and the reasons `node status --peer` gives for a held-back credit."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from bootstrap.ledger import LEADERBOARD_COLUMNS, ContributionLedger, leaderboard_csv
from node.status.credit import explain_credit

A, B, C = "12D3KooWA", "12D3KooWB", "12D3KooWC"


def merge(fragment: int, version: int, t: float, per_peer: dict[str, Any]) -> dict[str, Any]:
    """A syncer `recent_merges` entry: peers given tokens are participants, peers given a string were rejected."""
    accepted = {p: v for p, v in per_peer.items() if not isinstance(v, str)}
    return {
        "fragment": fragment,
        "version": version,
        "t": t,
        "participants": list(accepted),
        "contributed": {p: [[8, tokens, 0.1, version - 1]] for p, tokens in accepted.items()},
        "rejected": {p: v for p, v in per_peer.items() if isinstance(v, str)},
    }


def ledger(tmp_path: Path, run_id: str = "run1") -> ContributionLedger:
    return ContributionLedger(tmp_path / "ledger.sqlite", run_id)


def test_merges_are_credited_once_with_their_tokens_and_refusals_with_their_reason(tmp_path: Path) -> None:
    book = ledger(tmp_path)
    tape = [merge(0, 1, 10.0, {A: 512, B: 256}), merge(1, 1, 11.0, {A: 512, C: "stale by 4 versions"})]
    assert book.record_merges(tape, now=12.0) == 4
    assert (
        book.record_merges(tape, now=14.0) == 0
    )  # the syncer lists the same recent merges again: no double count
    board = {row["peer_id"]: row for row in book.leaderboard()}
    assert [row["peer_id"] for row in book.leaderboard()] == [A, B, C]  # most verified tokens first
    assert (board[A]["verified_tokens"], board[A]["accepted"], board[A]["rejected"]) == (1024, 2, 0)
    assert (board[C]["verified_tokens"], board[C]["rejected"], board[C]["last_reject_reason"]) == (
        0,
        1,
        "stale by 4 versions",
    )
    assert book.recent(C) == [
        {
            "fragment": 1,
            "version": 1,
            "t": 11.0,
            "accepted": False,
            "tokens": 0.0,
            "reason": "stale by 4 versions",
        }
    ]
    book.close()
    reopened = ledger(tmp_path)  # durable: a restarted bootstrap neither loses nor re-counts
    assert reopened.record_merges(tape, now=20.0) == 0 and reopened.peer(A)["verified_tokens"] == 1024  # type: ignore[index]
    assert ledger(tmp_path, "another run").leaderboard() == []  # one file, kept apart per run id


def test_uptime_counts_only_the_time_between_close_sightings(tmp_path: Path) -> None:
    book = ledger(tmp_path)
    for now in (100.0, 102.0, 104.0):  # heartbeat period 2 s: seen every period
        book.observe_peers([(A, "learner")], now, period_s=2.0)
    book.observe_peers([(A, "learner")], 200.0, period_s=2.0)  # gone for 96 s: not uptime
    book.observe_peers([(A, "stage")], 202.0, period_s=2.0)
    row = book.peer(A)
    assert row is not None
    assert (row["uptime_s"], row["first_seen"], row["last_seen"], row["role"]) == (6.0, 100.0, 202.0, "stage")


def test_a_malformed_merge_entry_is_skipped_not_fatal(tmp_path: Path) -> None:
    book = ledger(tmp_path)
    assert (
        book.record_merges([{"fragment": "x"}, {"participants": [A]}, merge(0, 2, 1.0, {B: 64})], now=2.0)
        == 1
    )
    assert [row["peer_id"] for row in book.leaderboard()] == [B]


def test_csv_export_has_one_row_per_peer_under_the_header(tmp_path: Path) -> None:
    book = ledger(tmp_path)
    book.record_merges([merge(0, 1, 1.0, {A: 100, B: "non-finite values"})], now=2.0)
    rows = list(csv.DictReader(io.StringIO(leaderboard_csv(book.leaderboard()))))
    assert tuple(rows[0]) == LEADERBOARD_COLUMNS
    assert [(r["peer_id"], r["verified_tokens"], r["last_reject_reason"]) for r in rows] == [
        (A, "100.0", ""),
        (B, "0.0", "non-finite values"),
    ]


ACTIVE = {"syncer": [{"peer_id": "S", "state": "active"}], "bans": []}


def test_a_zero_credit_is_explained() -> None:
    # waiting for a syncer
    assert explain_credit(A, None, [], {"syncer": [], "bans": []})[0].startswith("waiting for a syncer")
    # not seen at all
    assert "has not seen this peer" in explain_credit(A, None, [], ACTIVE)[0]
    # nothing pushed yet
    fresh = {"verified_tokens": 0, "accepted": 0, "rejected": 0}
    assert explain_credit(A, fresh, [], ACTIVE) == [
        "no contribution merged yet: a learner or stage pushes after every sync_every_steps inner steps"
    ]
    # the last contributions rejected (the streak ends at the newest accepted one)
    recent = [
        {"accepted": False, "reason": "stale by 4 versions"},
        {"accepted": False, "reason": "stale by 3 versions"},
        {"accepted": False, "reason": "stale by 3 versions"},
        {"accepted": True, "reason": ""},
        {"accepted": False, "reason": "older"},
    ]
    row = {"verified_tokens": 512, "accepted": 1, "rejected": 4}
    assert explain_credit(A, row, recent, ACTIVE) == ["last 3 contribution(s) rejected: stale by 4 versions"]
    # banned by a verifier, with its evidence
    ban = {
        "offender": A,
        "in_effect": True,
        "verifiers": ["12D3KooWVerifierXYZ1"],
        "notices": [{"reason": "boundary activations off by 40 sigma", "evidence": "ab" * 40}],
    }
    reasons = explain_credit(A, row, recent[3:], {**ACTIVE, "bans": [ban]})
    assert (
        reasons[0].startswith("banned by verifier") and "boundary activations off by 40 sigma" in reasons[0]
    )
    assert "erifierXYZ1"[-8:] in reasons[0] and "evidence abab" in reasons[0]
    # negative control: a healthy peer gets no reason, and a ban not (yet) in effect is no reason
    assert explain_credit(A, row, recent[3:], ACTIVE) == []
    assert explain_credit(A, row, recent[3:], {**ACTIVE, "bans": [{**ban, "in_effect": False}]}) == []


def _syncer_status(since: float, counts: object, peer_id: str = "12D3KooWS") -> dict[str, Any]:
    return {"peer_id": peer_id, "admission": {"counted_since": since, "refused_by_reason": counts}}


def test_admission_refusals_are_counted_once_per_syncer_process_and_reason(tmp_path: Path) -> None:
    book = ledger(tmp_path)
    assert book.admission_refusals() == {}
    assert book.record_admission(_syncer_status(100.0, {"no_proof": 3}), now=101.0) == 1
    assert (
        book.record_admission(_syncer_status(100.0, {"no_proof": 3}), now=102.0) == 0
    )  # read again: no change
    assert book.record_admission(_syncer_status(100.0, {"no_proof": 5, "weak_proof": 1}), now=103.0) == 2
    # a restarted syncer (a new process) counts from 0 again: its counts add to the earlier process's
    book.record_admission(_syncer_status(200.0, {"no_proof": 2}), now=201.0)
    assert book.admission_refusals() == {"no_proof": 7, "weak_proof": 1}
    book.close()
    assert ledger(tmp_path).admission_refusals() == {"no_proof": 7, "weak_proof": 1}  # durable
    assert ledger(tmp_path, "run2").admission_refusals() == {}  # per run


def test_malformed_admission_counts_are_skipped_not_fatal(tmp_path: Path) -> None:
    book = ledger(tmp_path)
    for bad in (
        _syncer_status(100.0, ["no_proof"]),
        _syncer_status(100.0, {"no_proof": "many"}),
        _syncer_status(100.0, {f"r{i}": 1 for i in range(100)}),
        {"peer_id": "12D3KooWS", "admission": {"refused_by_reason": {"no_proof": 1}}},  # no counted_since
        {"admission": {"counted_since": 1.0, "refused_by_reason": {"no_proof": 1}}},
        {"peer_id": "12D3KooWS"},  # an older syncer: no admission section
    ):
        assert book.record_admission(bad, now=101.0) == 0
    assert book.admission_refusals() == {}
