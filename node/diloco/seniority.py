"""Seniority: how much of a merge fresh identities may hold (issue 18, Sybil resistance).

Admission (protocol.admission) makes each identity cost something; this bounds what many of them can do once
paid for. An identity is *young* until it has been in `young_rounds` accepted merges (any fragment) with
positive weight, each merge counted by the fraction of its weight the cap left it (a young identity scaled to
0.27 of its weight ages 0.27 of a round): a burst that keeps hitting the cap ages that much slower (measured: 5
late Sybils among 4 senior learners, counted whole, were senior after ~25 s and then held whole merges). In one merge, the total weight of young identities is capped at `young_weight_cap` of the
merge: when they hold more, their weights are scaled down together (each keeps its share among the young),
so a burst of fresh Sybils can never set the merged direction against the senior learners in the round.
A merge of young identities alone, while senior identities were merged within `senior_active_s`, has its outer
gradient scaled by the cap (as if seniors with no progress held the rest): at K = 1 a Sybil would otherwise wait
for a round of its own. When nobody is senior yet (a run's start), nothing is capped; the per-identity probation
ramp (node.diloco.probation) applies first, then too: a fresh identity's weight counts `probation.start_fraction`
against established ones, and a merge of fresh identities only steps by that fraction.

A refused contribution demotes its identity (its rounds restart from 0): it must earn its weight again. An
identity not merged for `forget_s` starts over too, so seniority cannot be banked by idle identities.

Pure: the caller passes `now`; bounded (least recently merged identities are forgotten first).

Saved with the syncer's state (`export` / `load`, as JSON `[[peer, rounds, last merged on the wall clock], ...]`,
the most recently merged first, at most `SAVED_MAX`): a restarted syncer or a standby that takes over would
otherwise see every learner young again, and with nobody senior nothing is capped, so a Sybil burst right after a
restart would hold whole merges. Malformed saved state raises `SeniorityStateError`; the caller logs it and starts
with an empty table (young again, the state of a fresh run) rather than refuse to resume.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from node.diloco.probation import ProbationConfig, ramp_weights

SAVED_MAX = 4096  # identities saved with a checkpoint (the most recently merged)
MAX_PEER_CHARS = 128  # as protocol.envelope.MAX_ID_CHARS

SavedSeniority = tuple[tuple[str, float, float], ...]  # (peer, rounds, last merged on the wall clock)


class SeniorityStateError(ValueError):
    """Saved seniority state that does not parse (the caller starts with an empty table)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SeniorityConfig:
    young_rounds: int = 16  # accepted merges before an identity is senior
    young_weight_cap: float = 0.25  # the most young identities hold of one merge (1.0: off)
    senior_active_s: float = 600.0  # seniors merged this recently make a young-only merge a capped one
    forget_s: float = 86400.0  # an identity not merged for this long is young again
    max_peers: int = 65536  # identities remembered
    # each identity's weight ramps up with its accepted merges (node.diloco.probation), before the young cap
    probation: ProbationConfig = field(default_factory=ProbationConfig)

    def __post_init__(self) -> None:
        if self.young_rounds < 0 or self.max_peers < 1:
            raise ValueError("seniority needs young_rounds >= 0 and max_peers >= 1")
        if not 0.0 <= self.young_weight_cap <= 1.0:
            raise ValueError("young_weight_cap must be in [0, 1] (1: off)")
        if not (self.senior_active_s > 0 and self.forget_s > 0):
            raise ValueError("senior_active_s and forget_s must be positive")


@dataclass(frozen=True, kw_only=True, slots=True)
class CappedWeights:
    weights: dict[str, float]  # the raw (unnormalised) weights, young ones scaled down
    # per peer scaled down (by its probation ramp relative to the round's largest, or by the cap), the fraction of a
    # round the merge ages it by (< 1)
    credit: dict[str, float]
    # what the merge's outer gradient is scaled by: the largest probation multiplier, times the cap for a young-only
    # merge while seniors are active (1: a full step)
    grad_scale: float
    young_share: float  # the young identities' share after the probation ramp, before the cap


@dataclass(slots=True)
class _Record:
    rounds: float
    last_merged: float


class Seniority:
    """Per identity, the merges it was accepted in (see the module docstring)."""

    def __init__(self, config: SeniorityConfig | None = None) -> None:
        self.config = config or SeniorityConfig()
        self._peers: OrderedDict[str, _Record] = OrderedDict()
        self.demotions = 0
        self.capped_merges = 0
        self.ramped_merges = 0  # merges in which the probation ramp scaled a weight or the step
        self._senior_merged_at = -math.inf  # the last merge with a senior participant

    def rounds(self, peer: str, now: float) -> float:
        record = self._peers.get(peer)
        if record is None or now - record.last_merged > self.config.forget_s:
            return 0
        return record.rounds

    def last_merged(self, peer: str) -> float | None:
        """When a merge last took `peer` (None: never, or since demoted)."""
        record = self._peers.get(peer)
        return None if record is None else record.last_merged

    def is_young(self, peer: str, now: float) -> bool:
        return self.rounds(peer, now) < self.config.young_rounds

    def observe_merge(
        self, participants: Iterable[str], now: float, credit: Mapping[str, float] | None = None
    ) -> None:
        """Each participant (positive weight) of a committed merge gains one round, or its `credit` (what the
        cap left it of its weight, `CappedWeights.credit`)."""
        for peer in participants:
            rounds = self.rounds(peer, now) + min(1.0, max(0.0, (credit or {}).get(peer, 1.0)))
            self._peers.pop(peer, None)  # re-inserted last: the table is ordered by the latest merge
            self._peers[peer] = _Record(rounds, now)
            if rounds >= self.config.young_rounds:
                self._senior_merged_at = now
        while len(self._peers) > self.config.max_peers:
            self._peers.popitem(last=False)

    def demote(self, peer: str, now: float) -> None:
        """A refused contribution: the identity starts over (young, 0 rounds)."""
        if self._peers.pop(peer, None) is not None:
            self.demotions += 1

    def _seniors_active(self, now: float) -> bool:
        # a scalar, not a scan of the table: `cap` runs in the merge's worker thread while the loop updates it
        return now - self._senior_merged_at <= self.config.senior_active_s

    def cap(self, weights: Mapping[str, float], now: float) -> CappedWeights:
        """`weights` (raw, peer -> weight), each times its identity's probation ramp (node.diloco.probation), then
        with the young identities' total held to the cap. An identity ages by the fraction of its weight both left
        it, the ramp's relative to the round's largest multiplier: a round of identities equally new (a run's start)
        ages each by a whole round, though its step is scaled; a fresh one beside established ones by its ramp, and
        with the cap never faster than the cap alone let it (its ramped weight, capped, is the capped weight)."""
        ramped = ramp_weights(weights, lambda peer: self.rounds(peer, now), self.config.probation)
        self.ramped_merges += bool(ramped.multipliers)
        capped = self._cap(ramped.weights, now)
        if not ramped.multipliers:
            return capped
        credit = dict(capped.credit)
        for peer, multiplier in ramped.multipliers.items():
            credit[peer] = credit.get(peer, 1.0) * multiplier / ramped.step_scale
        credit = {p: c for p, c in credit.items() if c < 1.0}
        grad_scale = capped.grad_scale * ramped.step_scale
        return CappedWeights(
            weights=capped.weights, credit=credit, grad_scale=grad_scale, young_share=capped.young_share
        )

    def _cap(self, weights: Mapping[str, float], now: float) -> CappedWeights:
        """`weights` with the young identities' total held to the cap."""
        cap = self.config.young_weight_cap
        young = {p for p, w in weights.items() if w > 0 and self.is_young(p, now)}
        young_total = math.fsum(weights[p] for p in young)
        senior_total = math.fsum(w for p, w in weights.items() if p not in young and w > 0)
        total = young_total + senior_total
        share = young_total / total if total > 0 else 0.0
        out = dict(weights)
        if cap >= 1.0 or share <= cap:
            return CappedWeights(weights=out, credit={}, grad_scale=1.0, young_share=share)
        if senior_total <= 0:  # young only: capped only while seniors exist in the run
            scale = cap if self._seniors_active(now) else 1.0
            self.capped_merges += scale < 1.0
            credit = {p: scale for p in young} if scale < 1.0 else {}
            return CappedWeights(weights=out, credit=credit, grad_scale=scale, young_share=share)
        # f * Y / (f * Y + S) = cap  <=>  f = cap * S / ((1 - cap) * Y)
        factor = cap * senior_total / ((1.0 - cap) * young_total)
        for peer in young:
            out[peer] = weights[peer] * factor
        self.capped_merges += 1
        credit = {p: factor for p in young}
        return CappedWeights(weights=out, credit=credit, grad_scale=1.0, young_share=share)

    def export(self, wall_offset: float, *, limit: int = SAVED_MAX) -> SavedSeniority:
        """At most `limit` identities, the most recently merged first, dated on the wall clock (`wall_offset`:
        wall clock minus the clock `now` is on), for a checkpoint or a standby's mirror (`load` forgets the
        idle ones)."""
        recent = itertools.islice(reversed(self._peers.items()), limit)
        return tuple((peer, r.rounds, r.last_merged + wall_offset) for peer, r in recent)

    def load(self, saved: SavedSeniority, now: float, wall_offset: float) -> None:
        """Replace the table with `saved` (from `export`, maybe of another process: dates are on the wall
        clock). A date ahead of `now` (another machine's clock) counts as merged now."""
        peers: OrderedDict[str, _Record] = OrderedDict()
        for peer, rounds, wall in sorted(saved, key=lambda e: e[2])[-self.config.max_peers :]:
            last = min(now, wall - wall_offset)
            if now - last <= self.config.forget_s:
                peers.pop(peer, None)
                peers[peer] = _Record(rounds, last)
        self._peers = peers  # one assignment: `cap` may read the table from the merge's worker thread
        seniors = [r.last_merged for r in peers.values() if r.rounds >= self.config.young_rounds]
        self._senior_merged_at = max(seniors, default=-math.inf)

    def status(self, now: float) -> dict[str, Any]:
        young = sum(1 for p in self._peers if self.is_young(p, now))
        return {
            "identities": len(self._peers),
            "young": young,
            "senior": len(self._peers) - young,
            "demotions": self.demotions,
            "capped_merges": self.capped_merges,
            "ramped_merges": self.ramped_merges,
        }


def seniority_to_json(saved: SavedSeniority, *, max_chars: int | None = None) -> str:
    """`saved` as JSON; with `max_chars`, only the leading (most recently merged) entries that fit."""
    kept: list[str] = []
    size = 2
    for peer, rounds, wall in saved:
        item = json.dumps([peer, round(rounds, 4), round(wall, 3)])
        size += len(item) + 1
        if max_chars is not None and size > max_chars:
            break
        kept.append(item)
    return "[" + ",".join(kept) + "]"


def seniority_from_json(text: str, *, limit: int = SAVED_MAX) -> SavedSeniority:
    """Parse saved seniority; SeniorityStateError on anything but a list of at most `limit`
    [peer, rounds >= 0, wall > 0] (finite numbers, peer a short string)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise SeniorityStateError(f"seniority state is not JSON ({e})") from None
    if not isinstance(data, list) or len(data) > limit:
        raise SeniorityStateError(f"seniority state is not a list of at most {limit} entries")
    out = []
    for item in data:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)):
            raise SeniorityStateError("seniority entry is not [peer, rounds, wall]")
        peer, rounds, wall = item
        numbers = all(type(v) in (int, float) and math.isfinite(v) for v in (rounds, wall))
        if not (0 < len(peer) <= MAX_PEER_CHARS and numbers and rounds >= 0 and wall > 0):
            raise SeniorityStateError("seniority entry out of range")
        out.append((peer, float(rounds), float(wall)))
    return tuple(out)


WIRE_CHUNK_CHARS = 4000  # protocol.envelope.MAX_META_STR_CHARS is 4096
WIRE_MAX_CHARS = 16000  # what a standby's state pull carries (~170 identities): the frame header is 256 KiB


def seniority_chunks(saved: SavedSeniority, *, max_chars: int = WIRE_MAX_CHARS) -> list[str]:
    """The leading entries of `saved` that fit `max_chars` of JSON, cut into envelope-meta strings."""
    text = seniority_to_json(saved, max_chars=max_chars)
    return [text[i : i + WIRE_CHUNK_CHARS] for i in range(0, len(text), WIRE_CHUNK_CHARS)]


def seniority_from_chunks(value: object) -> SavedSeniority:
    """What `seniority_chunks` sent (an envelope meta value); SeniorityStateError if it is anything else."""
    if not (isinstance(value, list) and all(isinstance(chunk, str) for chunk in value)):
        raise SeniorityStateError("seniority state is not a list of strings")
    if sum(len(chunk) for chunk in value) > WIRE_MAX_CHARS:
        raise SeniorityStateError("seniority state is too long")
    return seniority_from_json("".join(value))
