"""What the swarm looks like, from the records it publishes: the swarm map, the time series and the event list.

Pure (no I/O, no clock, no asyncio): `SwarmHistory.observe(document, now)` takes an `/api/swarm`-shaped document
(peers with their heartbeats, bans, syncer records; optionally the syncer's own status with merge details) and the
current DHT time, and keeps bounded ring buffers of

- samples: peers by role and health, tokens/s processed, goodput (tokens/s that count), mean training loss and
  per-peer loss, fragment versions; held-out loss points of the global model (a syncer's heartbeat `loss` is
  the held-out loss of its last evaluation; callers may add their own with `add_eval`);
- merges: one entry per fragment version the syncer publishes (quorum size, grace waited, weights, from the
  syncer's description of it, which may come a look or two after the version bump; an entry it never describes
  says why in `undescribed`);
- bans: one entry per accused peer, with the verifiers that signed and their evidence;
- events: joined (or rejoined), left (announced leaving, then gone), lost (stopped heartbeating without
  announcing it: killed, stalled or cut off), straggling, recovered, banned, merge (and notes callers add, e.g.
  the demo's chaos actions), numbered by `seq` for appending to a log.

The bootstrap serves `history_json()`/`events_json()`/`swarm_map(...)` in `/api/swarm`; the demo's terminal view
and its report read the same structures. Definitions:

- *health* of a peer: `banned` (a ban in effect); `leaving` (announced leaving: its last record says so, in
  `peers` or in the document's `leaving` list, which a bootstrap fills with the records that announce it; it
  stays `leaving` once gone); `missing` (stopped heartbeating without announcing it: killed, stalled or cut off);
  both are kept on the map for `remember_missing_s`; `straggling` (its heartbeat is more than
  `stale_periods` periods older than the freshest one seen, or, among three or more peers doing the same work, it trains at under
  `slow_fraction` of their median throughput); `idle` (joined but does no work, e.g. a role this version does
  not have); else `alive`.
- *mode* of a peer: how others reach it, from its heartbeat (`direct`, `relay`: through a relay's circuit,
  slower; `client`: not at all, it serves nothing), `unknown` for a heartbeat without it (an older node).
- *throughput*: tokens/s processed, from the increments of every learner's token counter and of every stage-0
  replica's (a pipeline microbatch crosses every stage; counting stage 0 counts it once), averaged over
  `rate_window_s`. A counter that goes down (a restarted process) counts from zero.
- *goodput*: tokens/s the global model gets, from merged work only: the tokens of the merges the syncer describes,
  divided by the number of fragments (a contribution counts its tokens once per fragment, so a token is in the
  model once every fragment has merged it). 0 while no merge has been seen; None (unknown) when merges were
  seen but the syncer described none of them. `goodput_source` says which (`syncer`, `no merges yet`,
  `merges not described`).
  Throughput is what the heartbeats report (unverified); views label it so and never show it as goodput.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.records import CONNECTIVITY_MODES, UNKNOWN_MODE

HEALTHS = ("alive", "straggling", "idle", "leaving", "missing", "banned")
TRAINING_ROLES = ("learner", "stage")
MAX_ENTRIES_PER_LOOK = 16  # versions of one fragment passed between two looks that get an entry each
AWAITING_DESCRIPTION = "awaiting the syncer's description"
NOT_DESCRIBED = "not described by the syncer (its status did not list this version in time)"
# in a bootstrap's state dir: events a local tool adds to its event list (the demo's faults), a JSON object a line
NOTES_FILENAME = "notes.jsonl"
MAX_NOTE_TEXT = 300  # characters of a note's text kept


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
    # a merge seen as a version bump waits this long for the syncer's description (its status may lag a look)
    describe_within_s: float = 30.0

    def __post_init__(self) -> None:
        for name in (
            "sample_period_s",
            "stale_periods",
            "remember_missing_s",
            "rate_window_s",
            "describe_within_s",
        ):
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


def peer_mode(record: Mapping[str, Any]) -> str:
    """A peer record's connectivity mode; anything but a known mode (absent, or a document from elsewhere) is unknown."""
    mode = record.get("mode")
    return mode if isinstance(mode, str) and mode in CONNECTIVITY_MODES else UNKNOWN_MODE


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


class MergeLog:
    """Merges seen as version bumps of the syncers' records: an entry per version, filled in from the syncer's
    description of it (quorum, grace, weights, tokens) when its status gives one, and the tokens they committed."""

    def __init__(self, config: ViewConfig, note: Callable[..., None]) -> None:
        self.entries: deque[dict[str, Any]] = deque(maxlen=config.max_merges)
        self.total = 0  # merges counted (beyond the ring of entries)
        self.versions: dict[str, list[int]] = {}  # syncer peer id -> last versions vector seen
        self.committed_known = False  # the syncer described at least one merge with its tokens
        self.committed_total = 0.0
        self.fresh_committed = 0.0  # committed since the last `take_committed`
        # (fragment, version) -> (seen at, its entry, fragments): merges still awaiting their description
        self._awaiting: dict[tuple[int, int], tuple[float, dict[str, Any], int]] = {}
        self._max_awaiting = config.max_merges
        self._describe_within_s = config.describe_within_s
        self._note = note

    def take_committed(self) -> float:
        committed, self.fresh_committed = self.fresh_committed, 0.0
        return committed

    def observe(self, syncers: Sequence[Mapping[str, Any]], status: object, now: float) -> None:
        """Version bumps of the syncers' records since the last look, described by `status` where it can."""
        details = _merge_details(status)
        self._describe_awaiting(details, now)
        for record in syncers:
            peer_id = str(record.get("peer_id", ""))
            versions = [v for v in record.get("versions") or [] if isinstance(v, int)]
            previous = self.versions.get(peer_id)
            self.versions[peer_id] = versions
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
        """Merges that took `fragment` from version `before` to `after`: an entry per version (the newest
        `MAX_ENTRIES_PER_LOOK`; older ones lumped into one entry with their `count`), and one event."""
        first = max(before + 1, after - MAX_ENTRIES_PER_LOOK + 1)
        if first > before + 1:
            self._add_merge(now, fragment, first - 1, first - 1 - before, None, num_fragments)
        for version in range(first, after + 1):
            self._add_merge(now, fragment, version, 1, details.get((fragment, version)), num_fragments)
        quorum = self.entries[-1].get("quorum")
        text = f"fragment {fragment} -> v{after}"
        if after - before > 1:
            text += f" ({after - before} merges since the last look)"
        elif quorum is not None:
            text += f" (quorum {quorum})"
        self._note(now, "merge", text, fragment=fragment, version=after)

    def _add_merge(
        self, now: float, fragment: int, version: int, count: int, detail: Mapping | None, num_fragments: int
    ) -> None:
        merge: dict[str, Any] = {"t": round(now, 3), "fragment": fragment, "version": version, "count": count}
        if detail is not None:
            self._describe(merge, detail, num_fragments)
        elif count > 1:
            merge["undescribed"] = f"{count} merges between two looks at the swarm, not described one by one"
        else:
            merge["undescribed"] = AWAITING_DESCRIPTION
            self._awaiting[(fragment, version)] = (now, merge, num_fragments)
            while len(self._awaiting) > self._max_awaiting:
                oldest = next(iter(self._awaiting))
                self._awaiting.pop(oldest)[1]["undescribed"] = NOT_DESCRIBED
        self.entries.append(merge)
        self.total += count

    def _describe(self, merge: dict[str, Any], detail: Mapping[str, Any], num_fragments: int) -> None:
        """Fill a merge entry from the syncer's description; its tokens are what goodput counts."""
        merge.pop("undescribed", None)
        merge.update(_normalized(detail))
        tokens = _num(merge.get("tokens"))
        if tokens is not None:
            # a contribution counts its tokens once per fragment: a token is in the model once all are merged
            self.committed_known = True
            committed = tokens / max(num_fragments, 1)
            self.fresh_committed += committed
            self.committed_total += committed

    def _describe_awaiting(self, details: Mapping[tuple[int, int], Mapping[str, Any]], now: float) -> None:
        """Merges seen before the syncer's status described them (it is read a look behind the records): fill them
        in when it does, or say they were never described once `describe_within_s` has passed."""
        for key, (seen_at, merge, num_fragments) in list(self._awaiting.items()):
            detail = details.get(key)
            if detail is not None:
                self._describe(merge, detail, num_fragments)
            elif now - seen_at <= self._describe_within_s:
                continue
            else:
                merge["undescribed"] = NOT_DESCRIBED
            del self._awaiting[key]


class SwarmHistory:
    """Bounded history of one swarm; feed it documents in time order with `observe(document, now)`."""

    def __init__(self, config: ViewConfig | None = None) -> None:
        self.config = config or ViewConfig()
        c = self.config
        self.samples: deque[dict[str, Any]] = deque(maxlen=c.max_samples)
        self.events: deque[dict[str, Any]] = deque(maxlen=c.max_events)
        self.bans: dict[str, dict[str, Any]] = {}
        self.eval_points: deque[dict[str, Any]] = deque(maxlen=c.max_samples)
        self.peer_loss: dict[str, deque[tuple[float, float]]] = {}
        self._peers: dict[str, _PeerTrack] = {}
        self.merge_log = MergeLog(c, self.note)
        self._syncer_losses: dict[str, float] = {}  # syncer peer id -> last held-out loss it announced
        self._last_sample_at = -math.inf
        self._increments: deque[tuple[float, int, int, float]] = deque()  # (t, tokens, useful, committed)
        self._pending = [0, 0]  # token increments of the observation in progress (all, useful)
        self.tokens_total = 0
        self.useful_tokens_total = 0
        self.started_at: float | None = None
        self.event_seq = 0

    # ---- ingest ----

    def note(self, now: float, kind: str, text: str, **fields: Any) -> None:
        """Add an event (also for callers: e.g. the demo's chaos actions). `seq` numbers events from 1."""
        self.event_seq += 1
        self.events.append({"seq": self.event_seq, "t": round(now, 3), "kind": kind, "text": text, **fields})

    def add_notes(self, lines: Iterable[bytes | str], now: float) -> int:
        """Events from a notes file (`NOTES_FILENAME`): each line a JSON object with `kind` and `text`, and
        optionally `t` (else `now`), `peer`, `target`, `phase`; other lines and fields are ignored. Returns how
        many were added."""
        added = 0
        for line in lines:
            try:
                note = json.loads(line)
            except ValueError:
                continue
            if not isinstance(note, dict) or not isinstance(note.get("kind"), str):
                continue
            t = _num(note.get("t"))
            fields = {k: str(note[k])[:64] for k in ("peer", "target", "phase") if note.get(k) is not None}
            self.note(
                now if t is None else t,
                note["kind"][:32],
                str(note.get("text", ""))[:MAX_NOTE_TEXT],
                **fields,
            )
            added += 1
        return added

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
        leaving = {str(p.get("peer_id")) for p in document.get("leaving") or [] if isinstance(p, Mapping)}
        banned = banned_set(document.get("bans") or [])
        self._observe_bans(document.get("bans") or [], now)
        self._observe_peers(peers, banned, now, heartbeat_period(document))
        self._observe_departures({str(p["peer_id"]) for p in peers}, leaving, now)
        self.merge_log.observe(document.get("syncer") or [], document.get("syncer_status"), now)
        self._increments.append((now, self._pending[0], self._pending[1], self.merge_log.take_committed()))
        self._pending = [0, 0]
        if now - self._last_sample_at >= self.config.sample_period_s:
            self._sample(peers, banned, now)

    def _observe_peers(
        self, peers: Sequence[Mapping[str, Any]], banned: set[str], now: float, period_s: float
    ) -> None:
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

    def _observe_departures(self, live: set[str], leaving: set[str], now: float) -> None:
        """Peers no longer in the live list: `left` if they announced leaving (their last record said so, or the
        document lists them as leaving), else `lost` (killed, stalled or cut off: the record just expired)."""
        for peer_id, track in self._peers.items():
            if peer_id in live or track.gone:
                continue
            track.gone = True
            who = f"{short(peer_id)} ({track.role})"
            if peer_id in leaving or track.health == "leaving":
                track.health = "leaving"
                self.note(now, "left", f"{who} left: announced leaving", peer=peer_id)
            else:
                track.health = "missing"
                self.note(
                    now,
                    "lost",
                    f"{who} lost: stopped heartbeating without announcing leaving (killed, stalled or cut off)",
                    peer=peer_id,
                )
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
            if self.merge_log.committed_known:
                goodput = sum(i[3] for i in self._increments) / span
            elif not self.merges_total:
                goodput = 0.0  # nothing merged yet: whatever the heartbeats say, the model got no tokens
        versions = [sum(v) for v in self.merge_log.versions.values()]
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
    def merges(self) -> deque[dict[str, Any]]:
        return self.merge_log.entries

    @property
    def merges_total(self) -> int:
        return self.merge_log.total

    @property
    def goodput_source(self) -> str:
        """Where goodput comes from: `syncer` (its merges' tokens), `no merges yet` (goodput is 0), or `merges
        not described` (merges seen, none described with its tokens: goodput is unknown)."""
        if self.merge_log.committed_known:
            return "syncer"
        return "merges not described" if self.merges_total else "no merges yet"

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
        modes: dict[str, int] = dict.fromkeys((*CONNECTIVITY_MODES, UNKNOWN_MODE), 0)
        for cell in cells:
            counts[cell["health"]] += 1
            modes[cell["mode"]] += 1
        return {
            "stages": stages,
            "learners": groups["learner"],
            "verifiers": groups["verifier"],
            "syncers": groups["syncer"],
            "bootstraps": groups["bootstrap"],
            "counts": counts,
            "modes": modes,
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
            "mode": peer_mode(record),
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
        merges, log = list(self.merges), self.merge_log
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
                "committed_tokens": round(log.committed_total) if log.committed_known else None,
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


def goodput_text(goodput: float | None, source: str) -> str:
    """Goodput as the views say it: merged work only, 0 before the first merge, never a heartbeat figure."""
    if source == "syncer":
        return f"goodput {goodput or 0:,.0f} tok/s merged"
    if source == "no merges yet":
        return "goodput 0 tok/s (no merges yet)"
    return f"goodput unknown ({source})"


def throughput_text(throughput: float | None) -> str:
    """Tokens/s processed, as the peers' heartbeats report them (unverified: not all of it reaches the model)."""
    return f"{throughput or 0:,.0f} tok/s processed (reported by heartbeats)"


def summary_line(history: SwarmHistory) -> str:
    """One line for logs: peers, goodput (merged), merges, throughput reported by heartbeats, loss, bans."""
    last = history.samples[-1] if history.samples else None
    if last is None:
        return "no samples yet"
    loss = f"{last['loss']:.3f}" if last["loss"] is not None else "-"
    return (
        f"{last['peers']} peers; {goodput_text(last['goodput'], history.goodput_source)},"
        f" {history.merges_total} merges; {throughput_text(last['throughput'])}; loss {loss};"
        f" {len(history.bans)} bans"
    )
