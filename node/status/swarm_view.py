"""What the swarm looks like, from the records it publishes: the swarm map, the time series and the event list.

Pure (no I/O, no clock, no asyncio): `SwarmHistory.observe(document, now)` takes an `/api/swarm`-shaped document
(peers with their heartbeats, bans, syncer records; optionally the syncer's own status with merge details) and the
current DHT time, and keeps bounded ring buffers of

- samples: peers by role and health, tokens/s processed, goodput (tokens/s that count), mean training loss and
  per-peer loss, fragment versions; held-out loss points of the global model (a syncer's heartbeat `loss` is
  the held-out loss of its last evaluation; callers may add their own with `add_eval`);
- merges: one entry per fragment version the syncer publishes (quorum size, grace waited, weights when the syncer
  says them, else the version bump alone);
- bans: one entry per accused peer, with the verifiers that signed and their evidence;
- events: joined (or rejoined), left (stopped heartbeating), straggling, recovered, banned, merge (and notes
  callers add, e.g. the demo's chaos actions), numbered by `seq` for appending to a log.

The bootstrap serves `history_json()`/`events_json()`/`swarm_map(...)` in `/api/swarm`; the demo's terminal view
and its report read the same structures. Definitions:

- *health* of a peer: `banned` (a ban in effect); `leaving` (announced); `missing` (no longer heartbeating: left,
  killed, stalled or cut off -- a clean leave withdraws the record and a crash lets it expire, so the records
  cannot tell them apart; kept on the map for `remember_missing_s`); `straggling` (its heartbeat is more than
  `stale_periods` periods older than the freshest one seen, or, among three or more peers doing the same work, it trains at under
  `slow_fraction` of their median throughput); `idle` (joined but does no work, e.g. a role this version does
  not have); else `alive`.
- *throughput*: tokens/s processed, from the increments of every learner's token counter and of every stage-0
  replica's (a pipeline microbatch crosses every stage; counting stage 0 counts it once), averaged over
  `rate_window_s`. A counter that goes down (a restarted process) counts from zero.
- *goodput*: tokens/s the global model gets. When the syncer describes its merges with their tokens, it is those,
  divided by the number of fragments (a contribution counts its tokens once per fragment, so a token is in the
  model once every fragment has merged it); otherwise it is the throughput of peers that are neither banned nor
  missing (their work can still reach the syncer). `goodput_source` says which.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

HEALTHS = ("alive", "straggling", "idle", "leaving", "missing", "banned")
TRAINING_ROLES = ("learner", "stage")


@dataclass(frozen=True, kw_only=True, slots=True)
class ViewConfig:
    """Sizes and thresholds of the swarm view."""

    sample_period_s: float = 2.0  # at most one time-series sample per period (events are seen at every call)
    max_samples: int = 1800  # ring length of the time series (an hour at 2 s)
    max_events: int = 400  # ring length of the event list
    max_merges: int = 2000  # ring length of the merge list
    max_peers_tracked: int = 256  # peers whose last heartbeat and loss series we keep
    stale_periods: float = 1.5  # heartbeat older than this many periods: straggling
    slow_fraction: float = 0.35  # throughput below this share of the median of its peers: straggling
    remember_missing_s: float = 60.0  # a peer that vanished without leaving stays on the map this long
    max_evidence_chars: int = 512  # hex characters of ban evidence kept per notice
    rate_window_s: float = 5.0  # tokens/s are averaged over this window (heartbeat counters move in steps)

    def __post_init__(self) -> None:
        for name in ("sample_period_s", "stale_periods", "remember_missing_s", "rate_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        for name in ("max_samples", "max_events", "max_merges", "max_peers_tracked", "max_evidence_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 <= self.slow_fraction < 1:
            raise ValueError("slow_fraction must be in [0, 1)")


def short(peer_id: str) -> str:
    """The distinguishing tail of a peer id (every Ed25519 peer id starts with `12D3KooW`)."""
    return peer_id[-8:] if peer_id else "--------"


def _num(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def banned_set(bans: Iterable[Mapping[str, Any]]) -> set[str]:
    """Offenders whose ban is in effect (enough distinct verifiers signed)."""
    return {str(b.get("offender")) for b in bans if b.get("in_effect")}


def heartbeat_period(document: Mapping[str, Any], default_s: float = 2.0) -> float:
    settings = document.get("settings")
    period = _num(settings.get("heartbeat_period_s")) if isinstance(settings, Mapping) else None
    return period if period and period > 0 else default_s


def _throughput_groups(peers: Sequence[Mapping[str, Any]]) -> dict[tuple[str, Any], list[float]]:
    """Throughputs of working peers, grouped as they should be compared: learners together, stages per stage."""
    groups: dict[tuple[str, Any], list[float]] = {}
    for peer in peers:
        role = peer.get("role")
        throughput = _num(peer.get("throughput"))
        if role in TRAINING_ROLES and throughput is not None and throughput > 0:
            key = (role, peer.get("stage") if role == "stage" else None)
            groups.setdefault(key, []).append(throughput)
    return groups


def peer_health(
    peer: Mapping[str, Any],
    *,
    now: float,
    banned: set[str],
    group_median: float | None,
    period_s: float,
    config: ViewConfig,
    freshest_age_s: float = 0.0,
) -> tuple[str, str]:
    """(health, why) of one live peer record; see the module docstring. `freshest_age_s`, the age of the newest
    heartbeat seen, is the observer's own lag (a slow DHT answer ages every record alike): ages count above it."""
    if peer.get("peer_id") in banned:
        return "banned", "a ban is in effect"
    if peer.get("leaving") or peer.get("state") == "leaving":
        return "leaving", "announced leaving"
    sent_at = _num(peer.get("sent_at"))
    if sent_at is not None and now - sent_at - freshest_age_s > config.stale_periods * period_s:
        return "straggling", f"last heartbeat {now - sent_at:.1f} s ago"
    throughput = _num(peer.get("throughput")) or 0.0
    if (
        peer.get("role") in TRAINING_ROLES
        and group_median
        and throughput < config.slow_fraction * group_median
    ):
        return "straggling", f"{throughput:.0f} tok/s, median of its peers {group_median:.0f}"
    if peer.get("state") == "idle" and peer.get("role") != "bootstrap":
        return "idle", "joined but does no work"
    return "alive", ""


@dataclass(slots=True)
class _PeerTrack:
    peer_id: str
    role: str
    stage: int | None
    first_seen: float
    last_seen: float
    last_record: dict[str, Any]
    health: str = "alive"
    tokens: int = 0  # last token counter seen
    gone: bool = False  # no longer in the live list


class SwarmHistory:
    """Bounded history of one swarm; feed it documents in time order with `observe(document, now)`."""

    def __init__(self, config: ViewConfig | None = None) -> None:
        self.config = config or ViewConfig()
        c = self.config
        self.samples: deque[dict[str, Any]] = deque(maxlen=c.max_samples)
        self.events: deque[dict[str, Any]] = deque(maxlen=c.max_events)
        self.merges: deque[dict[str, Any]] = deque(maxlen=c.max_merges)
        self.bans: dict[str, dict[str, Any]] = {}
        self.eval_points: deque[dict[str, float]] = deque(maxlen=c.max_samples)
        self.peer_loss: dict[str, deque[tuple[float, float]]] = {}
        self._peers: dict[str, _PeerTrack] = {}
        self._versions: dict[str, list[int]] = {}  # syncer peer id -> last versions vector seen
        self._syncer_losses: dict[str, float] = {}  # syncer peer id -> last held-out loss it announced
        self._last_sample_at = -math.inf
        self._increments: deque[tuple[float, int, int, float]] = deque()  # (t, tokens, useful, committed)
        self._pending = [0, 0, 0.0]  # increments of the observation in progress
        self._committed_known = False
        self.tokens_total = 0
        self.useful_tokens_total = 0
        self.committed_tokens_total = 0.0
        self.started_at: float | None = None
        self.event_seq = 0
        self.merges_total = 0

    # ---- ingest ----

    def note(self, now: float, kind: str, text: str, **fields: Any) -> None:
        """Add an event (also for callers: e.g. the demo's chaos actions). `seq` numbers events from 1."""
        self.event_seq += 1
        self.events.append({"seq": self.event_seq, "t": round(now, 3), "kind": kind, "text": text, **fields})

    def events_after(self, seq: int) -> list[dict[str, Any]]:
        """Events numbered after `seq`, oldest first (for appending to a log)."""
        return [e for e in self.events if e["seq"] > seq]

    def add_eval(self, now: float, loss: float, *, label: str = "held-out") -> None:
        """A held-out loss of the global model, measured by whoever can (the demo evaluates the syncer's copy)."""
        if math.isfinite(loss):
            self.eval_points.append({"t": round(now, 3), "loss": round(loss, 5), "label": label})

    def observe(self, document: Mapping[str, Any], now: float) -> None:
        """Take in one swarm document seen at DHT time `now`."""
        if self.started_at is None:
            self.started_at = now
        peers = [p for p in document.get("peers") or [] if isinstance(p, Mapping) and p.get("peer_id")]
        banned = banned_set(document.get("bans") or [])
        self._observe_bans(document.get("bans") or [], now)
        self._observe_peers(peers, banned, now, heartbeat_period(document))
        self._observe_syncer(document.get("syncer") or [], document.get("syncer_status"), now)
        self._increments.append((now, self._pending[0], self._pending[1], self._pending[2]))
        self._pending = [0, 0, 0.0]
        if now - self._last_sample_at >= self.config.sample_period_s:
            self._sample(peers, banned, now)

    def _observe_peers(
        self, peers: Sequence[Mapping[str, Any]], banned: set[str], now: float, period_s: float
    ) -> None:
        live = {str(p["peer_id"]) for p in peers}
        # with two peers, which one is "slow" is a coin toss on noisy rates: compare within groups of three or more
        medians = {k: statistics.median(v) for k, v in _throughput_groups(peers).items() if len(v) >= 3}
        ages = [now - t for p in peers if (t := _num(p.get("sent_at"))) is not None]
        freshest_age_s = max(min(ages), 0.0) if ages else 0.0
        for peer in peers:
            peer_id = str(peer["peer_id"])
            track = self._peers.get(peer_id)
            role, stage = str(peer.get("role", "?")), peer.get("stage")
            # a peer back from a stall keeps its counter; one restarted starts again below it (see _count_tokens)
            previous_tokens = track.tokens if track is not None else 0
            if track is None or track.gone:
                verb = "rejoined" if track is not None else "joined"
                where = f" stage {stage}" if stage is not None else ""
                self.note(now, "joined", f"{short(peer_id)} {verb} as {role}{where}", peer=peer_id, role=role)
                track = _PeerTrack(peer_id, role, stage, now, now, dict(peer))
                self._peers[peer_id] = track
            key = (role, stage if role == "stage" else None)
            health, why = peer_health(
                peer,
                now=now,
                banned=banned,
                group_median=medians.get(key),
                period_s=period_s,
                config=self.config,
                freshest_age_s=freshest_age_s,
            )
            if _worth_an_event(track.health, health):
                kind = "recovered" if health == "alive" else health
                self.note(
                    now, kind, f"{short(peer_id)} ({role}) {kind}" + (f": {why}" if why else ""), peer=peer_id
                )
            track.role, track.stage, track.health = role, stage, health
            track.last_seen, track.last_record = now, dict(peer)
            self._count_tokens(track, peer, previous_tokens, health)
            loss = _num(peer.get("loss"))
            if loss is not None and role == "syncer" and loss != self._syncer_losses.get(peer_id):
                # a syncer's heartbeat loss is the held-out loss of the global model it last evaluated
                self._syncer_losses[peer_id] = loss
                self.add_eval(now, loss, label=f"syncer {short(peer_id)}")
            if loss is not None and role in TRAINING_ROLES:
                series = self.peer_loss.setdefault(peer_id, deque(maxlen=self.config.max_samples))
                if not series or now - series[-1][0] >= self.config.sample_period_s:
                    series.append((round(now, 3), round(loss, 5)))
        for peer_id, track in self._peers.items():
            if peer_id not in live and not track.gone:
                # a clean leave withdraws the record at once and a crash lets it expire: both just vanish
                track.gone = True
                self.note(now, "left", f"{short(peer_id)} ({track.role}) stopped heartbeating", peer=peer_id)
                track.health = "missing"
        self._forget_old_peers(now)

    def _count_tokens(self, track: _PeerTrack, peer: Mapping[str, Any], previous: int, health: str) -> None:
        tokens = peer.get("tokens")
        tokens = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0 else 0
        counted = track.role == "learner" or (track.role == "stage" and track.stage == 0)
        delta = tokens - previous if tokens >= previous else tokens  # a restarted process counts from zero
        track.tokens = tokens
        if counted and delta > 0:
            self._pending[0] += delta
            self.tokens_total += delta
            if health != "banned":
                self._pending[1] += delta
                self.useful_tokens_total += delta

    def _forget_old_peers(self, now: float) -> None:
        gone = [
            t for t in self._peers.values() if t.gone and now - t.last_seen > self.config.remember_missing_s
        ]
        overflow = len(self._peers) - self.config.max_peers_tracked
        if overflow > 0:
            gone += sorted((t for t in self._peers.values() if t.gone), key=lambda t: t.last_seen)[:overflow]
        for track in gone:
            self._peers.pop(track.peer_id, None)
        while len(self.peer_loss) > self.config.max_peers_tracked:
            self.peer_loss.pop(next(iter(self.peer_loss)))

    def _observe_bans(self, bans: Sequence[Mapping[str, Any]], now: float) -> None:
        for ban in bans:
            offender = str(ban.get("offender", ""))
            if not offender:
                continue
            notices = [self._notice(n) for n in ban.get("notices") or [] if isinstance(n, Mapping)]
            entry = self.bans.get(offender)
            if entry is None:
                reasons = sorted({n["reason"] for n in notices if n.get("reason")})
                stage = next((n["stage"] for n in notices if n.get("stage") is not None), None)
                entry = {
                    "offender": offender,
                    "first_seen": round(now, 3),
                    "stage": stage,
                    "reasons": reasons,
                }
                self.bans[offender] = entry
                role = self._peers[offender].role if offender in self._peers else "peer"
                why = "; ".join(reasons) or "no reason given"
                self.note(now, "banned", f"{short(offender)} ({role}) banned: {why}", peer=offender)
            entry["verifiers"] = list(ban.get("verifiers") or [])
            entry["in_effect"] = bool(ban.get("in_effect"))
            entry["notices"] = notices

    def _notice(self, notice: Mapping[str, Any]) -> dict[str, Any]:
        evidence = str(notice.get("evidence", ""))
        return {
            "verifier": str(notice.get("verifier", "")),
            "reason": str(notice.get("reason", "")),
            "stage": notice.get("stage"),
            "issued_at": _num(notice.get("issued_at")),
            "evidence": evidence[: self.config.max_evidence_chars],
            "evidence_bytes": len(evidence) // 2,
        }

    def _observe_syncer(self, syncers: Sequence[Mapping[str, Any]], status: object, now: float) -> None:
        details = _merge_details(status)
        for record in syncers:
            peer_id = str(record.get("peer_id", ""))
            versions = [v for v in record.get("versions") or [] if isinstance(v, int)]
            previous = self._versions.get(peer_id)
            self._versions[peer_id] = versions
            if previous is None:
                continue  # the first sight of a syncer is its state, not a merge we saw happen
            for fragment, version in enumerate(versions):
                before = previous[fragment] if fragment < len(previous) else 0
                if version > before:
                    self._add_merges(now, fragment, before, version, details, len(versions))

    def _add_merges(
        self,
        now: float,
        fragment: int,
        before: int,
        after: int,
        details: Mapping[tuple[int, int], Mapping[str, Any]],
        num_fragments: int,
    ) -> None:
        """Merges that took `fragment` from version `before` to `after`: one entry per version the syncer
        describes, versions it does not describe lumped into one entry with their `count`."""
        lumped = 0
        versions = range(before + 1, after + 1) if after - before <= 256 else range(after, after + 1)
        for version in versions:
            detail = details.get((fragment, version))
            if detail is None and version < after:
                lumped += 1
                continue
            count = lumped + 1 if detail is None else 1
            if detail is not None and lumped:
                self._add_merge(now, fragment, version - 1, lumped, None, num_fragments)
            self._add_merge(now, fragment, version, count if detail is None else 1, detail, num_fragments)
            lumped = 0

    def _add_merge(
        self, now: float, fragment: int, version: int, count: int, detail: Mapping | None, num_fragments: int
    ) -> None:
        merge: dict[str, Any] = {"t": round(now, 3), "fragment": fragment, "version": version, "count": count}
        if detail is not None:
            merge.update(_normalized(detail))
            tokens = _num(merge.get("tokens"))
            if tokens is not None:
                # a contribution counts its tokens once per fragment: a token is in the model once all are merged
                self._committed_known = True
                committed = tokens / max(num_fragments, 1)
                self._pending[2] += committed
                self.committed_tokens_total += committed
        self.merges.append(merge)
        self.merges_total += count
        quorum = merge.get("quorum")
        text = f"fragment {fragment} -> v{version}" + (f" (quorum {quorum})" if quorum is not None else "")
        if count > 1:
            text += f" ({count} merges since the last look)"
        self.note(now, "merge", text, fragment=fragment, version=version)

    def _sample(self, peers: Sequence[Mapping[str, Any]], banned: set[str], now: float) -> None:
        dt = now - self._last_sample_at if math.isfinite(self._last_sample_at) else None
        self._last_sample_at = now
        by_role: dict[str, int] = {}
        by_health: dict[str, int] = dict.fromkeys(HEALTHS, 0)
        workers = 0  # peers whose tokens the throughput counts, working now
        for track in self._peers.values():
            by_health[track.health] = by_health.get(track.health, 0) + 1
            if not track.gone:
                by_role[track.role] = by_role.get(track.role, 0) + 1
            counted = track.role == "learner" or (track.role == "stage" and track.stage == 0)
            workers += counted and track.health in ("alive", "straggling")
        losses = [
            loss
            for p in peers
            if p.get("role") in TRAINING_ROLES and p.get("peer_id") not in banned
            if (loss := _num(p.get("loss"))) is not None
        ]
        throughput = goodput = None
        while self._increments and self._increments[0][0] <= now - self.config.rate_window_s:
            self._increments.popleft()
        started_at = self.started_at if self.started_at is not None else now
        span = min(self.config.rate_window_s, now - started_at)
        if dt is not None and span > 0:
            throughput = sum(i[1] for i in self._increments) / span
            goodput = sum(i[3] if self._committed_known else i[2] for i in self._increments) / span
        versions = [sum(v) for v in self._versions.values()]
        self.samples.append(
            {
                "t": round(now, 3),
                "peers": sum(by_role.values()),
                "by_role": by_role,
                "by_health": by_health,
                "workers": workers,
                "throughput": _round(throughput, 1),
                "goodput": _round(goodput, 1),
                "loss": _round(statistics.fmean(losses)) if losses else None,
                "versions": max(versions) if versions else 0,
                "tokens": self.tokens_total,
            }
        )

    # ---- views ----

    @property
    def goodput_source(self) -> str:
        return "syncer" if self._committed_known else "heartbeats"

    def swarm_map(self, document: Mapping[str, Any]) -> dict[str, Any]:
        """Peers grouped for drawing: a stages x replicas grid, then learners, verifiers, syncers, bootstraps.
        Peers that vanished without leaving stay for `remember_missing_s`, marked `missing`."""
        settings = document.get("settings")
        num_stages = settings.get("num_stages") if isinstance(settings, Mapping) else None
        cells = [self._cell(t) for t in sorted(self._peers.values(), key=lambda t: t.peer_id)]
        stage_count = max(
            [num_stages if isinstance(num_stages, int) else 0]
            + [c["stage"] + 1 for c in cells if c["role"] == "stage" and isinstance(c["stage"], int)]
        )
        stages: list[list[dict[str, Any]]] = [[] for _ in range(stage_count)]
        groups: dict[str, list[dict[str, Any]]] = {
            r: [] for r in ("learner", "verifier", "syncer", "bootstrap")
        }
        for cell in cells:
            if cell["role"] == "stage" and isinstance(cell["stage"], int) and cell["stage"] < stage_count:
                stages[cell["stage"]].append(cell)
            else:
                groups.setdefault(cell["role"], []).append(cell)
        counts: dict[str, int] = dict.fromkeys(HEALTHS, 0)
        for cell in cells:
            counts[cell["health"]] += 1
        return {
            "stages": stages,
            "learners": groups["learner"],
            "verifiers": groups["verifier"],
            "syncers": groups["syncer"],
            "bootstraps": groups["bootstrap"],
            "counts": counts,
        }

    def _cell(self, track: _PeerTrack) -> dict[str, Any]:
        record = track.last_record
        return {
            "peer_id": track.peer_id,
            "short": short(track.peer_id),
            "role": track.role,
            "stage": track.stage,
            "span": record.get("span"),
            "health": track.health,
            "state": "gone" if track.gone else record.get("state"),
            "throughput": _round(_num(record.get("throughput")), 1),
            "loss": _round(_num(record.get("loss"))),
            "inner_step": record.get("inner_step"),
            "tokens": record.get("tokens"),
            "http": record.get("http", ""),
            "last_seen": round(track.last_seen, 3),
        }

    def history_json(
        self,
        *,
        max_points: int | None = None,
        max_peer_series: int | None = None,
        max_merges: int | None = None,
    ) -> dict[str, Any]:
        """Column-oriented series for charts (aligned on `t`), merges, bans, held-out loss points. `max_points`
        thins every series to about that many points (evenly, keeping the newest), `max_peer_series` keeps the
        loss series of the most recently seen peers only, `max_merges` the newest merges: what a page polling
        every few seconds should download, whatever the size of the swarm."""
        samples = _thin(list(self.samples), max_points)
        peer_ids = sorted(
            self.peer_loss, key=lambda p: self.peer_loss[p][-1][0] if self.peer_loss[p] else 0.0
        )
        if max_peer_series is not None:
            peer_ids = peer_ids[-max_peer_series:]
        merges = list(self.merges)
        return {
            "t": [s["t"] for s in samples],
            "peers": [s["peers"] for s in samples],
            "alive": [s["by_health"].get("alive", 0) for s in samples],
            "straggling": [s["by_health"].get("straggling", 0) for s in samples],
            "missing": [s["by_health"].get("missing", 0) for s in samples],
            "banned": [s["by_health"].get("banned", 0) for s in samples],
            "workers": [s["workers"] for s in samples],
            "throughput": [s["throughput"] for s in samples],
            "goodput": [s["goodput"] for s in samples],
            "goodput_source": self.goodput_source,
            "loss": [s["loss"] for s in samples],
            "versions": [s["versions"] for s in samples],
            "tokens": [s["tokens"] for s in samples],
            "peer_loss": {
                peer_id: {"t": [p[0] for p in series], "loss": [p[1] for p in series]}
                for peer_id in peer_ids
                for series in [_thin(list(self.peer_loss[peer_id]), max_points)]
            },
            "eval": _thin(list(self.eval_points), max_points),
            "merges": merges[-max_merges:] if max_merges is not None else merges,
            "bans": list(self.bans.values()),
            "totals": {
                "tokens": self.tokens_total,
                "useful_tokens": self.useful_tokens_total,
                "committed_tokens": round(self.committed_tokens_total) if self._committed_known else None,
                "merges": self.merges_total,
                "bans": len(self.bans),
            },
            "started_at": self.started_at,
        }

    def events_json(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Events, newest first."""
        events = list(reversed(self.events))
        return events[:limit] if limit is not None else events


def _thin(items: list[Any], max_points: int | None) -> list[Any]:
    """Every k-th item so that at most about `max_points` remain, always keeping the newest."""
    if max_points is None or len(items) <= max_points:
        return items
    stride = math.ceil(len(items) / max_points)
    return items[::-1][::stride][::-1]


def _worth_an_event(before: str, after: str) -> bool:
    """Health changes the event list reports: becoming a straggler, and a straggler recovering (bans have their
    own event, from the ban record)."""
    return before != after and (after == "straggling" or (before == "straggling" and after == "alive"))


def _merge_details(status: object) -> dict[tuple[int, int], Mapping[str, Any]]:
    """Merge descriptions from a syncer's status document, keyed by (fragment, version): a list of recent merges
    under `recent_merges` (or `merges`), each with at least `fragment` and `version`, and whatever else the
    syncer says (participants, weights, tokens, grace waited, ...)."""
    if not isinstance(status, Mapping):
        return {}
    out: dict[tuple[int, int], Mapping[str, Any]] = {}
    for key in ("recent_merges", "merges"):
        merges = status.get(key)
        if not isinstance(merges, list):
            continue
        for merge in merges[-512:]:
            if isinstance(merge, Mapping):
                fragment, version = merge.get("fragment"), merge.get("version")
                if isinstance(fragment, int) and isinstance(version, int):
                    out[(fragment, version)] = merge
    return out


def _normalized(detail: Mapping[str, Any]) -> dict[str, Any]:
    """The merge fields the views use, from a syncer's merge record: `quorum` (contributions merged),
    `grace_s` (grace actually waited), `weights`, `tokens`, `participants`, plus what else it says."""
    out = {k: v for k, v in detail.items() if k not in ("t", "fragment", "version", "event", "peer")}
    participants = detail.get("participants")
    if "quorum" not in out and isinstance(participants, list):
        out["quorum"] = len(participants)
    waited = _num(detail.get("grace_waited_s"))
    if waited is not None:
        out["grace_window_s"] = out.get("grace_s")
        out["grace_s"] = waited
    return out


def summary_line(history: SwarmHistory) -> str:
    """One line for logs: peers, throughput, goodput, merges, bans."""
    last = history.samples[-1] if history.samples else None
    if last is None:
        return "no samples yet"
    throughput = last["throughput"] if last["throughput"] is not None else 0.0
    goodput = last["goodput"] if last["goodput"] is not None else 0.0
    loss = f"{last['loss']:.3f}" if last["loss"] is not None else "-"
    return (
        f"{last['peers']} peers, {throughput:.0f} tok/s, goodput {goodput:.0f} tok/s, loss {loss}, "
        f"{history.merges_total} merges, {len(history.bans)} bans"
    )
