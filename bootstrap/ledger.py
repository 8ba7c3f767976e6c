"""The bootstrap's durable contribution ledger: who contributed what to the run, in one SQLite file.

`<state_dir>/ledger.sqlite` (stdlib sqlite3, WAL) keeps, per run id and peer id: verified tokens, accepted and
rejected contributions (each with its fragment, version, tokens and the syncer's reason for a refusal), uptime
and first/last seen. Its inputs are what the bootstrap already observes every heartbeat period:

* the active syncer's `recent_merges` (its /api/status): a participant of a merge is an accepted contribution,
  credited with the tokens the syncer merged for it (`contributed`: per contribution [steps, tokens, ...]; the
  syncer caps a learner's tokens by its steps and a stage replica's by the verifier-signed receipts it holds,
  docs/diloco.md), so "verified tokens" are tokens that entered the model; `rejected` names refused peers and
  why. A merge is counted once: rows are keyed by (run, fragment, version, peer), and re-reading the same
  `recent_merges` adds nothing, across bootstrap restarts too.
* the live heartbeats: last seen, and uptime (the time between two sightings at most `gap_periods`
  heartbeat periods apart, so an absence is not counted as uptime).
* the active syncer's admission refusals (its /api/status `admission.refused_by_reason`: pushes refused for want
  of the run's proof-of-work, before any screening, issue 18). Those identities never contributed, so they are
  not rows of the leaderboard; the counts are kept per syncer process (`counted_since`) and reason, as the
  largest count seen, so re-reading the same status adds nothing and the run's total is their sum.

Every method takes `now` (wall seconds): no clock is read here. Nothing in it is trusted for more than what it
reports: the syncer is authorized by the owner, and the heartbeats are signed by their peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import logging
import sqlite3
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from node.status.credit import explain_credit

logger = logging.getLogger(__name__)

LEDGER_FILENAME = "ledger.sqlite"
LEADERBOARD_COLUMNS = (
    "peer_id",
    "role",
    "verified_tokens",
    "accepted",
    "rejected",
    "last_reject_reason",
    "last_accepted_at",
    "uptime_s",
    "first_seen",
    "last_seen",
)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS peers (
    run_id TEXT NOT NULL, peer_id TEXT NOT NULL, role TEXT NOT NULL DEFAULT '',
    first_seen REAL, last_seen REAL, uptime_s REAL NOT NULL DEFAULT 0,
    verified_tokens REAL NOT NULL DEFAULT 0, accepted INTEGER NOT NULL DEFAULT 0,
    rejected INTEGER NOT NULL DEFAULT 0, last_accepted_at REAL, last_reject_reason TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (run_id, peer_id));
CREATE TABLE IF NOT EXISTS contributions (
    run_id TEXT NOT NULL, fragment INTEGER NOT NULL, version INTEGER NOT NULL, peer_id TEXT NOT NULL,
    t REAL NOT NULL, accepted INTEGER NOT NULL, tokens REAL NOT NULL, reason TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (run_id, fragment, version, peer_id));
CREATE INDEX IF NOT EXISTS contributions_by_peer ON contributions (run_id, peer_id, t);
CREATE TABLE IF NOT EXISTS admission_refusals (
    run_id TEXT NOT NULL, syncer_id TEXT NOT NULL, since REAL NOT NULL, reason TEXT NOT NULL,
    count INTEGER NOT NULL, t REAL NOT NULL,
    PRIMARY KEY (run_id, syncer_id, since, reason));
"""
MAX_ADMISSION_REASONS = (
    16  # protocol.admission has 4 causes; a syncer naming more is not believed beyond this
)


class ContributionLedger:
    """One run's view of `<state_dir>/ledger.sqlite`; `close()` when done."""

    def __init__(self, path: Path, run_id: str, *, gap_periods: float = 3.0) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.run_id = run_id
        self.gap_periods = gap_periods
        self._db = sqlite3.connect(str(path), isolation_level=None)  # autocommit; transactions explicit
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """All of one observation or none of it (a crash mid-way never counts half a merge)."""
        self._db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # ---- inputs ----

    def observe_peers(self, peers: Iterable[tuple[str, str]], now: float, period_s: float) -> None:
        """(peer id, role) of every live peer at `now`; uptime grows by the time since a recent last sighting."""
        with self._transaction():
            for peer_id, role in peers:
                self._ensure(peer_id, now)
                self._db.execute(
                    "UPDATE peers SET role = ?, uptime_s = uptime_s + CASE WHEN ? - last_seen <= ? "
                    "THEN MAX(? - last_seen, 0) ELSE 0 END, last_seen = ? WHERE run_id = ? AND peer_id = ?",
                    (role, now, self.gap_periods * period_s, now, now, self.run_id, peer_id),
                )

    def record_merges(self, merges: Iterable[Mapping[str, Any]], now: float) -> int:
        """Count the merges (the syncer's `recent_merges` entries) not counted yet; how many contributions were."""
        added = 0
        with self._transaction():
            for merge in merges:
                try:
                    added += self._record_merge(merge, now)
                except (KeyError, TypeError, ValueError) as e:  # an odd entry: skipped, never a crash
                    logger.warning("ledger: skipping a malformed merge entry (%s: %s)", type(e).__name__, e)
        return added

    def _record_merge(self, merge: Mapping[str, Any], now: float) -> int:
        fragment, version = int(merge["fragment"]), int(merge["version"])
        when = float(merge.get("t") or now)
        contributed: Mapping[str, Any] = merge.get("contributed") or {}
        added = 0
        for peer_id in merge.get("participants") or []:
            tokens = sum(float(c[1]) for c in contributed.get(peer_id) or [])
            if self._insert(fragment, version, str(peer_id), when, accepted=True, tokens=tokens, reason=""):
                self._ensure(str(peer_id), when)
                self._db.execute(
                    "UPDATE peers SET verified_tokens = verified_tokens + ?, accepted = accepted + 1, "
                    "last_accepted_at = MAX(COALESCE(last_accepted_at, 0), ?) WHERE run_id = ? AND peer_id = ?",
                    (tokens, when, self.run_id, peer_id),
                )
                added += 1
        for peer_id, reason in (merge.get("rejected") or {}).items():
            if self._insert(
                fragment, version, str(peer_id), when, accepted=False, tokens=0.0, reason=str(reason)
            ):
                self._ensure(str(peer_id), when)
                self._db.execute(
                    "UPDATE peers SET rejected = rejected + 1, last_reject_reason = ? WHERE run_id = ? AND peer_id = ?",
                    (str(reason), self.run_id, peer_id),
                )
                added += 1
        return added

    def record_admission(self, status: Mapping[str, Any], now: float) -> int:
        """The syncer status's admission refusals by reason (see the module docstring); how many counts grew.
        A malformed status is skipped with a log line, never a crash."""
        try:
            syncer_id, admission = str(status["peer_id"]), status.get("admission") or {}
            since, by_reason = float(admission["counted_since"]), admission["refused_by_reason"]
            counts = [(str(reason), int(count)) for reason, count in by_reason.items()]
            if not (0 < len(syncer_id) <= 128 and len(counts) <= MAX_ADMISSION_REASONS):
                raise ValueError("too long")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if status.get("admission"):  # an older syncer has none: nothing to say
                logger.warning("ledger: skipping malformed admission counts (%s: %s)", type(e).__name__, e)
            return 0
        grown = 0
        with self._transaction():
            for reason, count in counts:
                cursor = self._db.execute(
                    "INSERT INTO admission_refusals VALUES (?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT DO UPDATE SET count = excluded.count, t = excluded.t WHERE excluded.count > count",
                    (self.run_id, syncer_id, since, reason[:64], max(0, count), now),
                )
                grown += cursor.rowcount
        return grown

    def admission_refusals(self) -> dict[str, int]:
        """Pushes refused at admission over the run (every syncer process), by reason."""
        rows = self._db.execute(
            "SELECT reason, SUM(count) AS n FROM admission_refusals WHERE run_id = ? GROUP BY reason ORDER BY reason",
            (self.run_id,),
        ).fetchall()
        return {row["reason"]: int(row["n"]) for row in rows if row["n"]}

    def _insert(
        self,
        fragment: int,
        version: int,
        peer_id: str,
        when: float,
        *,
        accepted: bool,
        tokens: float,
        reason: str,
    ) -> bool:
        cursor = self._db.execute(
            "INSERT OR IGNORE INTO contributions VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (self.run_id, fragment, version, peer_id, when, int(accepted), tokens, reason),
        )
        return cursor.rowcount == 1

    def _ensure(self, peer_id: str, now: float) -> None:
        self._db.execute(
            "INSERT OR IGNORE INTO peers (run_id, peer_id, first_seen, last_seen) VALUES (?, ?, ?, ?)",
            (self.run_id, peer_id, now, now),
        )

    # ---- outputs ----

    def leaderboard(self) -> list[dict[str, Any]]:
        """Every peer of the run, most verified tokens first."""
        rows = self._db.execute(
            f"SELECT {', '.join(LEADERBOARD_COLUMNS)} FROM peers WHERE run_id = ? "
            "ORDER BY verified_tokens DESC, accepted DESC, peer_id",
            (self.run_id,),
        ).fetchall()
        return [dict(row) for row in rows]

    def peer(self, peer_id: str) -> dict[str, Any] | None:
        row = self._db.execute(
            f"SELECT {', '.join(LEADERBOARD_COLUMNS)} FROM peers WHERE run_id = ? AND peer_id = ?",
            (self.run_id, peer_id),
        ).fetchone()
        return dict(row) if row is not None else None

    def recent(self, peer_id: str, limit: int = 10) -> list[dict[str, Any]]:
        """The peer's latest contributions, newest first: fragment, version, t, accepted, tokens, reason."""
        rows = self._db.execute(
            "SELECT fragment, version, t, accepted, tokens, reason FROM contributions "
            "WHERE run_id = ? AND peer_id = ? ORDER BY t DESC, version DESC LIMIT ?",
            (self.run_id, peer_id, limit),
        ).fetchall()
        return [{**dict(row), "accepted": bool(row["accepted"])} for row in rows]


def leaderboard_csv(rows: Iterable[Mapping[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=LEADERBOARD_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


class LeaderboardApi:
    """`GET /api/leaderboard` (JSON; `?peer=ID`: that peer's row, recent contributions and the reasons its credit
    is held back) and `GET /api/leaderboard.csv`, over a ledger and the bootstrap's swarm document."""

    def __init__(self, ledger: ContributionLedger, swarm: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        self.ledger = ledger
        self.swarm = swarm

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/api/leaderboard", self.handle_json)
        app.router.add_get("/api/leaderboard.csv", self.handle_csv)
        app.router.add_get("/leaderboard", self.handle_page)

    async def handle_page(self, _request: web.Request) -> web.StreamResponse:
        return web.FileResponse(Path(__file__).resolve().parent / "static" / "leaderboard.html")

    async def handle_json(self, request: web.Request) -> web.Response:
        peer_id = request.query.get("peer")
        if not peer_id:
            board = {
                "run_id": self.ledger.run_id,
                "peers": self.ledger.leaderboard(),
                "admission_refused": self.ledger.admission_refusals(),  # identities with no row: never contributed
            }
            return web.json_response(board)
        try:
            swarm = await self.swarm()
        except asyncio.TimeoutError:
            return web.json_response({"error": "the DHT did not answer in time"}, status=503)
        row, recent = self.ledger.peer(peer_id), self.ledger.recent(peer_id)
        reasons = explain_credit(peer_id, row, recent, swarm)
        body = {
            "run_id": self.ledger.run_id,
            "peer_id": peer_id,
            "peer": row,
            "recent": recent,
            "reasons": reasons,
        }
        return web.json_response(body)

    async def handle_csv(self, _request: web.Request) -> web.Response:
        text = leaderboard_csv(self.ledger.leaderboard())
        headers = {"Content-Disposition": f'attachment; filename="leaderboard-{self.ledger.run_id[:12]}.csv"'}
        return web.Response(text=text, content_type="text/csv", headers=headers)
