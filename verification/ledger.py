"""Violation ledger: turns per-microbatch SENTINEL flags into quarantine and ban decisions.

This module owns the ban policy core of one verifier. It knows nothing of tensors or of the network;
it is told, for every checked microbatch, which replica of which stage sent it and whether it was flagged,
and answers with a decision and a reason. Enforcement (routing, signed DHT ban records) is the caller's.

The rule (docs/sentinel.md explains and measures it):

- Flags are counted per signer over its OWN last `window_microbatches` microbatches, so the ban rate of an
  honest replica does not grow with its share of traffic (the surviving replicas after a ban carry more).
- A leaky strike counter (one strike per flag, one forgiven per `forgive_clean_microbatches` clean in a
  row) catches intermittent attackers that never put `ban_flags` into one window.
- A stage-wide flag storm (more than `storm_fraction` of the stage's replicas flagged within a few
  microbatches each, with no single replica holding most of the flags) is the verifier's problem, not
  the replicas': the flags in it are forgiven and the answer is `rewarm`.
- Flags recorded while bans are paused after a storm quarantine but never count towards a ban.
- A ban needs corroboration: peers of the same stage must have sent clean microbatches since the suspect's
  first counted flag. Until then, while bans are paused after a storm anywhere (`storm_cooldown_s`), or
  when the cap would be exceeded, the suspect is quarantined instead.
- Spot-check convictions (two replicas against one) quarantine; two within the window ban. A spot check
  that matches a flagged microbatch exonerates it: the flag was the statistics' error, not the signer's.
- Never ban more than `max_banned_fraction_per_stage` of a stage's replicas, nor leave fewer than
  `min_active_replicas_per_stage`, except on cryptographic proof (equivocation).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Literal

logger = logging.getLogger(__name__)

Action = Literal["none", "quarantine", "ban", "rewarm", "release"]

# States of one microbatch in a signer's window.
CLEAN, FLAG, PAUSED_FLAG = 0, 1, 2


@dataclass(frozen=True, kw_only=True, slots=True)
class LedgerConfig:
    """Ban policy thresholds; all counts are in the signer's own microbatches unless named otherwise."""

    window_microbatches: int = 20  # each signer's last N own microbatches
    ban_flags: int = 3  # flags within the window that make a ban candidate
    quarantine_flags: int = 2  # flags within the window that quarantine (more spot checks, less traffic)
    forgive_clean_microbatches: int = 50  # one strike forgiven per this many clean in a row
    max_strikes: int = 6  # leaky-bucket strikes that make a ban candidate (intermittent attackers)
    storm_records_per_replica: int = 4  # storm look-back: this many stage records per replica
    storm_fraction: float = 0.5  # storm when MORE than this share of the stage's replicas were flagged
    storm_min_replicas: int = 2  # and at least this many
    storm_dominance: float = 2.0  # and no replica has over this x the runner-up's flags (own windows)
    # After any storm, statistical bans in every stage pause this long (in the caller's clock units):
    # honest turbulence (an lr change, a big merge) reaches the stages one replica at a time, and the
    # first replica to go odd looks exactly like a lone offender until its peers follow. (Pausing only
    # the storming stage was measured too: honest bans came back in the lr spike.)
    storm_cooldown_s: float = 60.0
    # Statistical evidence must stand this long (from the moment the signer first qualified, with no
    # storm anywhere meanwhile) before it bans; the suspect is quarantined (spot-checked at the
    # quarantine rate) in between, so spot-check evidence usually convicts a real attacker sooner.
    confirm_s: float = 20.0
    convictions_to_ban: int = 2  # spot-check convictions within the window that ban (see record_evidence)
    # Marginal convictions (the odd one within SpotCheckConfig.ban_margin tolerances of the others, where an
    # honest replica running ahead was also seen) weigh less: this many of them alone ban, and each counts
    # convictions_to_ban / marginal_convictions_to_ban of a full one.
    marginal_convictions_to_ban: int = 4
    corroboration_clean: int = 2  # clean peer microbatches since the suspect's first counted flag
    release_clean_microbatches: int = 20  # clean in a row that lift a quarantine
    max_banned_fraction_per_stage: float = 0.5  # statistical bans never exceed this share of a stage
    min_active_replicas_per_stage: int = 2  # and never leave fewer unbanned replicas than this

    def __post_init__(self) -> None:
        if self.window_microbatches < 1:
            raise ValueError("window_microbatches must be >= 1")
        if not 1 <= self.quarantine_flags <= self.ban_flags <= self.window_microbatches:
            raise ValueError("need 1 <= quarantine_flags <= ban_flags <= window_microbatches")
        if self.forgive_clean_microbatches < 1 or self.max_strikes < 1:
            raise ValueError("forgive_clean_microbatches and max_strikes must be >= 1")
        if self.storm_records_per_replica < 1 or self.storm_min_replicas < 2 or self.storm_dominance < 1:
            raise ValueError(
                "need storm_records_per_replica >= 1, storm_min_replicas >= 2, storm_dominance >= 1"
            )
        if not 0.0 < self.storm_fraction < 1.0:
            raise ValueError("storm_fraction must be in (0, 1)")
        if not 1 <= self.convictions_to_ban <= self.marginal_convictions_to_ban:
            raise ValueError("need 1 <= convictions_to_ban <= marginal_convictions_to_ban")
        if self.storm_cooldown_s < 0 or self.confirm_s < 0:
            raise ValueError("storm_cooldown_s and confirm_s must be >= 0")
        if self.corroboration_clean < 0 or self.release_clean_microbatches < 1:
            raise ValueError("need corroboration_clean >= 0 and release_clean_microbatches >= 1")
        if not 0.0 <= self.max_banned_fraction_per_stage < 1.0:
            raise ValueError("max_banned_fraction_per_stage must be in [0, 1)")
        if self.min_active_replicas_per_stage < 1:
            raise ValueError("min_active_replicas_per_stage must be >= 1")


@dataclass(frozen=True, slots=True)
class LedgerDecision:
    """What to do about `signer`; `related` holds decisions about stage peers the same event caused."""

    action: Action
    reason: str
    signer: str
    stage: int
    related: tuple[LedgerDecision, ...] = ()

    def all(self) -> Iterator[LedgerDecision]:
        """This decision and the related ones, for callers that act on each."""
        yield self
        yield from self.related


@dataclass(slots=True)
class _Signer:
    stage: int
    window: deque[tuple[int, int]]  # (stage sequence number, CLEAN / FLAG / PAUSED_FLAG), own microbatches
    strikes: int = 0
    clean_run: int = 0
    quarantined: bool = False
    banned: bool = False
    microbatches: int = 0
    last_microbatch: int | None = None
    last_forgave: bool = False  # whether the latest record earned a forgiveness (undone if amended)
    candidate_since: float | None = None  # when its statistical evidence first reached ban level
    candidate_storms: int = 0  # the ledger's storm count when that clock started
    convictions: deque[int] = field(default_factory=lambda: deque(maxlen=16))  # own-microbatch count at each
    marginal: deque[int] = field(default_factory=lambda: deque(maxlen=16))  # likewise, marginal convictions
    ids: deque[tuple[int, int]] = field(default_factory=deque)  # (microbatch id, stage seq) of the window

    def flags(self) -> int:
        """Flags in the window, including those recorded while bans were paused (they quarantine)."""
        return sum(1 for _, state in self.window if state != CLEAN)

    def ban_flags(self) -> int:
        """Flags that may ban: recorded outside a pause after a storm (turbulence is not evidence)."""
        return sum(1 for _, state in self.window if state == FLAG)

    def first_flag_seq(self) -> int | None:
        return next((seq for seq, flagged in self.window if flagged), None)

    def to_state(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "window": [list(item) for item in self.window],
            "strikes": self.strikes,
            "clean_run": self.clean_run,
            "quarantined": self.quarantined,
            "banned": self.banned,
            "microbatches": self.microbatches,
            "last_microbatch": self.last_microbatch,
            "candidate_since": self.candidate_since,
            "candidate_storms": self.candidate_storms,
            "convictions": list(self.convictions),
            "marginal": list(self.marginal),
            "ids": [list(item) for item in self.ids],
        }

    @classmethod
    def from_state(cls, s: dict[str, Any], window_microbatches: int) -> _Signer:
        return cls(
            stage=int(s["stage"]),
            window=deque(((int(seq), int(f)) for seq, f in s["window"]), maxlen=window_microbatches),
            strikes=int(s["strikes"]),
            clean_run=int(s["clean_run"]),
            quarantined=bool(s["quarantined"]),
            banned=bool(s["banned"]),
            microbatches=int(s["microbatches"]),
            last_microbatch=None if s.get("last_microbatch") is None else int(s["last_microbatch"]),
            candidate_since=None if s.get("candidate_since") is None else float(s["candidate_since"]),
            candidate_storms=int(s.get("candidate_storms", 0)),
            convictions=deque((int(c) for c in s.get("convictions", [])), maxlen=16),
            marginal=deque((int(c) for c in s.get("marginal", [])), maxlen=16),
            ids=deque((int(mb), int(seq)) for mb, seq in s.get("ids", [])),
        )


@dataclass(slots=True)
class _Stage:
    records: deque[tuple[int, str, bool]] = field(default_factory=lambda: deque(maxlen=4096))
    next_seq: int = 0
    members: frozenset[str] = frozenset()
    banned: set[str] = field(default_factory=set)

    def to_state(self) -> dict[str, Any]:
        return {
            "records": [list(r) for r in self.records],
            "next_seq": self.next_seq,
            "members": sorted(self.members),
            "banned": sorted(self.banned),
        }

    @classmethod
    def from_state(cls, s: dict[str, Any]) -> _Stage:
        stage = cls(next_seq=int(s["next_seq"]), members=frozenset(s["members"]), banned=set(s["banned"]))
        stage.records.extend((int(seq), str(name), bool(f)) for seq, name, f in s["records"])
        return stage


class ViolationLedger:
    """Per-signer violation accounting with forgiveness, storms, corroboration and a per-stage cap."""

    def __init__(self, config: LedgerConfig | None = None) -> None:
        self.config = config or LedgerConfig()
        self._signers: dict[str, _Signer] = {}
        self._stages: dict[int, _Stage] = {}
        self._paused_until = -math.inf  # statistical bans pause until then (after a storm)
        self._storms = 0  # storms so far: a suspect's confirmation restarts after any new one

    # ----------------------------------------------------------------- queries

    def is_banned(self, signer: str) -> bool:
        st = self._signers.get(signer)
        return bool(st and st.banned)

    def is_quarantined(self, signer: str) -> bool:
        st = self._signers.get(signer)
        return bool(st and st.quarantined and not st.banned)

    def quarantined(self) -> list[str]:
        return sorted(signer for signer in self._signers if self.is_quarantined(signer))

    def flagged(self) -> dict[str, int]:
        """Unbanned signers with flags in their window, and how many."""
        return {s: n for s, st in sorted(self._signers.items()) if not st.banned and (n := st.flags())}

    def banned(self, stage: int) -> frozenset[str]:
        return frozenset(self._stages[stage].banned) if stage in self._stages else frozenset()

    def flags_in_window(self, signer: str) -> int:
        st = self._signers.get(signer)
        return st.flags() if st else 0

    def microbatches_seen(self, signer: str) -> int:
        st = self._signers.get(signer)
        return st.microbatches if st else 0

    # ----------------------------------------------------------------- recording

    def record(
        self,
        signer: str,
        stage: int,
        flagged: bool,
        now: float,
        *,
        microbatch_id: int | None = None,
        replicas: Collection[str] | None = None,
    ) -> LedgerDecision:
        """Account one checked tensor of `signer` (a replica of `stage`).

        Pass `microbatch_id` so that the forward and backward checks of one microbatch count once (a
        flag in either direction flags the microbatch); without it every call is its own microbatch.
        `replicas` is the stage's current replica set as the verifier knows it (banned ones may be
        omitted); without it the ledger uses the signers it saw recently in that stage."""
        stage_state = self._stage(stage)
        self._update_members(stage_state, signer, replicas)
        st = self._signer(signer, stage)
        if st.banned:
            return LedgerDecision("none", "already banned; record ignored", signer, stage)
        # Several microbatches are in flight at once, so a microbatch's backward check need not follow
        # its forward directly: look it up among the window's ids, not only the latest.
        seen = None if microbatch_id is None else next((q for mb, q in st.ids if mb == microbatch_id), None)
        if seen is not None and any(q == seen for q, _ in st.window):
            newly_flagged = self._amend(st, stage_state, seen, flagged, now)
            if not newly_flagged:
                return LedgerDecision("none", "same microbatch, already counted", signer, stage)
        else:
            seq = stage_state.next_seq
            stage_state.next_seq += 1
            stage_state.records.append((seq, signer, flagged))
            self._account(st, seq, flagged, now)
            st.last_microbatch = microbatch_id
            if microbatch_id is not None:
                st.ids.append((microbatch_id, seq))
                while len(st.ids) > self.config.window_microbatches:
                    st.ids.popleft()
        if flagged and self._is_storm(stage_state):
            return self._storm(stage_state, signer, stage, now)
        decision = self._evaluate(signer, st, stage_state, now)
        related = tuple(
            d
            for peer in sorted(stage_state.members)
            if peer != signer and self.is_quarantined(peer)
            for d in [self._evaluate(peer, self._signers[peer], stage_state, now)]
            if d.action != "none"
        )
        return LedgerDecision(decision.action, decision.reason, signer, stage, related)

    def record_evidence(
        self,
        signer: str,
        stage: int,
        now: float,
        *,
        reason: str,
        proof: bool = False,
        bypass_cap: bool = False,
        corroborated: bool = True,
        marginal: bool = False,
        replicas: Collection[str] | None = None,
    ) -> LedgerDecision:
        """Evidence beyond statistics against `signer`.

        `proof=True` (an equivocation proof: cryptographic, anyone can re-check it) bans at once, even
        past the stage cap. Otherwise it is a spot-check conviction (two replicas against one): it
        quarantines, which makes the verifier recompute every microbatch of the signer, and bans at the
        `convictions_to_ban`-th conviction within the signer's last `window_microbatches` (cap applies).
        One conviction is not enough: right after a staggered merge two replicas can be nearly identical
        while an honest third that has not adopted it yet is the odd one out by its whole local drift
        (measured: 0.65 relative difference on gradients against 0.10 between the other two).
        `bypass_cap=True` is the earlier name of `proof=True` and means the same. `corroborated=False` (the
        two replicas that outvoted the signer were identical copies of one version: one opinion, see
        `SpotCheckVerdict.corroborated`) quarantines and never counts towards a ban. `marginal=True` (the
        odd one was near the others, `SpotCheckVerdict.marginal`) counts as a fraction of a conviction:
        `marginal_convictions_to_ban` of them ban, so a liar near honest variation must keep losing."""
        stage_state = self._stage(stage)
        self._update_members(stage_state, signer, replicas)
        st = self._signer(signer, stage)
        if st.banned:
            return LedgerDecision("none", "already banned", signer, stage)
        if proof or bypass_cap:
            return self._ban(st, stage_state, signer, stage, f"proof: {reason}", now)
        if not corroborated:
            return self._quarantine(st, signer, stage, f"uncorroborated spot-check conviction: {reason}")
        (st.marginal if marginal else st.convictions).append(st.microbatches)
        cfg = self.config
        full = sum(1 for at in st.convictions if st.microbatches - at < cfg.window_microbatches)
        near = sum(1 for at in st.marginal if st.microbatches - at < cfg.window_microbatches)
        recent = full + near
        # integer form of full / convictions_to_ban + near / marginal_convictions_to_ban >= 1
        if full * cfg.marginal_convictions_to_ban + near * cfg.convictions_to_ban < (
            cfg.convictions_to_ban * cfg.marginal_convictions_to_ban
        ):
            kind = "marginal spot-check conviction" if marginal else "spot-check conviction"
            return self._quarantine(st, signer, stage, f"{kind} {recent}: {reason}")
        if not self._cap_allows_ban(stage_state):
            return self._quarantine(
                st, signer, stage, f"{recent} spot-check convictions but the stage ban cap is reached"
            )
        return self._ban(
            st, stage_state, signer, stage, f"{recent} spot-check convictions, latest: {reason}", now
        )

    def exonerate(
        self, signer: str, microbatch_id: int, *, reason: str = "spot check matched"
    ) -> LedgerDecision:
        """A recomputation on a stage peer matched the signer's flagged microbatch: the flag was the
        statistics' error (honest turbulence), so it is taken back, with its strike. Only flags still in
        the signer's window can be taken back; convictions never are."""
        st = self._signers.get(signer)
        if st is None or st.banned:
            return LedgerDecision("none", "unknown or banned signer", signer, -1 if st is None else st.stage)
        seq = next((s for mb, s in st.ids if mb == microbatch_id), None)
        index = next((i for i, (s, _) in enumerate(st.window) if s == seq), None) if seq is not None else None
        if index is None or st.window[index][1] == CLEAN:
            return LedgerDecision("none", "nothing to take back", signer, st.stage)
        state = st.window[index][1]
        st.window[index] = (st.window[index][0], CLEAN)
        if state == FLAG:
            st.strikes = max(0, st.strikes - 1)
        records = self._stage(st.stage).records
        for i in range(len(records) - 1, -1, -1):
            if records[i][0] == seq:
                records[i] = (seq, records[i][1], False)
                break
        if st.ban_flags() < self.config.ban_flags and st.strikes < self.config.max_strikes:
            st.candidate_since = None
        if st.quarantined and st.flags() < self.config.quarantine_flags and not self._recently_convicted(st):
            return self._release(
                st, signer, st.stage, f"flag on microbatch {microbatch_id} taken back: {reason}"
            )
        return LedgerDecision(
            "none", f"flag on microbatch {microbatch_id} taken back: {reason}", signer, st.stage
        )

    # ----------------------------------------------------------------- internals

    def _recently_convicted(self, st: _Signer) -> bool:
        window = self.config.window_microbatches
        return any(st.microbatches - at < window for at in (*st.convictions, *st.marginal))

    def _stage(self, stage: int) -> _Stage:
        return self._stages.setdefault(stage, _Stage())

    def _signer(self, signer: str, stage: int) -> _Signer:
        st = self._signers.get(signer)
        if st is None or st.stage != stage:
            # A signer that moved to another stage starts afresh there; its ban (if any) stays.
            banned = bool(st and st.banned)
            st = _Signer(stage=stage, window=deque(maxlen=self.config.window_microbatches), banned=banned)
            self._signers[signer] = st
        return st

    def _update_members(self, stage_state: _Stage, signer: str, replicas: Collection[str] | None) -> None:
        if replicas is not None:
            members = set(replicas)
        else:
            look_back = self.config.window_microbatches * max(1, len(stage_state.members))
            members = {s for _, s, _ in islice(reversed(stage_state.records), look_back)}
        stage_state.members = frozenset(members | {signer} | stage_state.banned)

    def _flag_state(self, flagged: bool, now: float) -> int:
        if not flagged:
            return CLEAN
        return PAUSED_FLAG if now < self._paused_until else FLAG

    def _account(self, st: _Signer, seq: int, flagged: bool, now: float) -> None:
        st.window.append((seq, self._flag_state(flagged, now)))
        st.microbatches += 1
        st.last_forgave = False
        if flagged:
            if now >= self._paused_until:  # turbulence flags stay in the window but leave no strike
                st.strikes += 1
            st.clean_run = 0
            return
        st.clean_run += 1
        if st.clean_run % self.config.forgive_clean_microbatches == 0 and st.strikes > 0:
            st.strikes -= 1
            st.last_forgave = True

    def _amend(self, st: _Signer, stage_state: _Stage, seq: int, flagged: bool, now: float) -> bool:
        """Fold a second check of one of the signer's microbatches into it; True if it newly flags it."""
        index = next(i for i, (q, _) in enumerate(st.window) if q == seq)
        state = st.window[index][1]
        if state != CLEAN or not flagged:
            return False
        st.window[index] = (seq, self._flag_state(True, now))
        for i in range(len(stage_state.records) - 1, -1, -1):
            if stage_state.records[i][0] == seq:
                stage_state.records[i] = (seq, stage_state.records[i][1], True)
                break
        # Undo the clean accounting of this microbatch and count it as a flag instead.
        if index == len(st.window) - 1 and st.last_forgave:
            st.strikes += 1  # the forgiveness this microbatch granted is withdrawn
            st.last_forgave = False
        st.clean_run = min(st.clean_run, len(st.window) - 1 - index)
        if now >= self._paused_until:
            st.strikes += 1
        return True

    def _storm_window(self, stage_state: _Stage) -> list[tuple[int, str, bool]]:
        span = self.config.storm_records_per_replica * max(1, len(stage_state.members - stage_state.banned))
        return list(islice(reversed(stage_state.records), span))[::-1]

    def _is_storm(self, stage_state: _Stage) -> bool:
        counts: dict[str, int] = {}
        for _, s, f in self._storm_window(stage_state):
            if f and s not in stage_state.banned:
                counts[s] = counts.get(s, 0) + 1
        active = len(stage_state.members - stage_state.banned)
        if len(counts) < self.config.storm_min_replicas or len(counts) <= self.config.storm_fraction * active:
            return False
        # A storm is many replicas a little odd, not one replica very odd: when one replica holds most
        # of the flags over its own window, it is an individual plus a coincidence (measured: an
        # attacker flagged on every microbatch plus one honest flag called storm after storm and was
        # never banned). Own windows, not the short storm window: there each replica has only a few
        # records, and "2 flags against 1" let a moderate attacker (30 % flagged) hide just the same.
        own = sorted((self._signers[s].flags() for s in counts), reverse=True)
        return own[0] <= self.config.storm_dominance * own[1]

    def _storm(self, stage_state: _Stage, signer: str, stage: int, now: float) -> LedgerDecision:
        window = self._storm_window(stage_state)
        first_seq = window[0][0]
        flagged = sorted({s for _, s, f in window if f and s not in stage_state.banned})
        self._paused_until = max(self._paused_until, now + self.config.storm_cooldown_s)
        self._storms += 1
        forgiven = 0
        for peer in stage_state.members:
            st = self._signers.get(peer)
            if st is None or st.banned:
                continue
            for i, (seq, state) in enumerate(st.window):
                if state != CLEAN and seq >= first_seq:
                    st.window[i] = (seq, CLEAN)
                    if state == FLAG:  # paused flags never added a strike
                        st.strikes = max(0, st.strikes - 1)
                    forgiven += 1
        related = tuple(
            self._release(self._signers[p], p, stage, "stage-wide flag storm: flags forgiven")
            for p in sorted(stage_state.members)
            if p != signer and self.is_quarantined(p) and not self._recently_convicted(self._signers[p])
        )
        me = self._signers[signer]
        if me.quarantined and not self._recently_convicted(me):  # a conviction is not turbulence
            me.quarantined = False
        reason = (
            f"stage-wide flag storm at t={now:.1f}: {len(flagged)} of "
            f"{len(stage_state.members - stage_state.banned)} replicas flagged ({', '.join(flagged)}); "
            f"{forgiven} flags forgiven, re-warm the stage's monitors; statistical bans paused "
            f"until t={self._paused_until:.1f}"
        )
        logger.warning("stage %d: %s", stage, reason)
        return LedgerDecision("rewarm", reason, signer, stage, related)

    def _evaluate(self, signer: str, st: _Signer, stage_state: _Stage, now: float) -> LedgerDecision:
        cfg = self.config
        flags = st.flags()
        ban_flags = st.ban_flags()
        stage = st.stage
        if ban_flags >= cfg.ban_flags or st.strikes >= cfg.max_strikes:
            evidence = (
                f"{ban_flags} flags ({flags} with those during storm pauses) in its last "
                f"{len(st.window)} microbatches, {st.strikes} strikes"
            )
            if st.candidate_since is None or st.candidate_storms != self._storms:
                # (re)start the confirmation clock, also after a storm during a pause (when the clock
                # was already set to the pause's end); after a storm it starts when the pause ends
                st.candidate_since = max(now, self._paused_until)
                st.candidate_storms = self._storms
            confirm_at = st.candidate_since + cfg.confirm_s
            if now < confirm_at:
                return self._quarantine(st, signer, stage, f"{evidence}; confirming until t={confirm_at:.1f}")
            missing = self._missing_corroboration(signer, st, stage_state)
            if missing > 0:
                return self._quarantine(
                    st, signer, stage, f"{evidence}; awaiting {missing} clean peer microbatches"
                )
            if now < self._paused_until:
                reason = f"{evidence}; bans paused after a flag storm until t={self._paused_until:.1f}"
                return self._quarantine(st, signer, stage, reason)
            if not self._cap_allows_ban(stage_state):
                return self._quarantine(st, signer, stage, f"{evidence}; stage ban cap reached")
            return self._ban(st, stage_state, signer, stage, evidence, now)
        st.candidate_since = None
        if flags >= cfg.quarantine_flags:
            return self._quarantine(
                st, signer, stage, f"{flags} flags in its last {len(st.window)} microbatches"
            )
        if st.quarantined and st.clean_run >= cfg.release_clean_microbatches:
            return self._release(st, signer, stage, f"{st.clean_run} clean microbatches in a row")
        return LedgerDecision("none", "quarantined" if st.quarantined else "ok", signer, stage)

    def _missing_corroboration(self, signer: str, st: _Signer, stage_state: _Stage) -> int:
        anchor = st.first_flag_seq()
        if anchor is None:
            anchor = st.window[-1][0] if st.window else stage_state.next_seq
        clean_peers = 0
        for seq, peer, flagged in reversed(stage_state.records):
            if seq <= anchor or clean_peers >= self.config.corroboration_clean:
                break
            clean_peers += int(peer != signer and not flagged)
        return max(0, self.config.corroboration_clean - clean_peers)

    def _cap_allows_ban(self, stage_state: _Stage) -> bool:
        members = len(stage_state.members)
        after = len(stage_state.banned) + 1
        within_fraction = after <= math.floor(self.config.max_banned_fraction_per_stage * members)
        return within_fraction and members - after >= self.config.min_active_replicas_per_stage

    def _quarantine(self, st: _Signer, signer: str, stage: int, reason: str) -> LedgerDecision:
        if st.quarantined:
            return LedgerDecision("none", f"quarantined: {reason}", signer, stage)
        st.quarantined = True
        logger.info("quarantine %s (stage %d): %s", signer, stage, reason)
        return LedgerDecision("quarantine", reason, signer, stage)

    def _release(self, st: _Signer, signer: str, stage: int, reason: str) -> LedgerDecision:
        st.quarantined = False
        logger.info("release %s (stage %d): %s", signer, stage, reason)
        return LedgerDecision("release", reason, signer, stage)

    def _ban(
        self, st: _Signer, stage_state: _Stage, signer: str, stage: int, reason: str, now: float
    ) -> LedgerDecision:
        st.banned = True
        st.quarantined = False
        stage_state.banned.add(signer)
        logger.warning("BAN %s (stage %d) at t=%.1f: %s", signer, stage, now, reason)
        return LedgerDecision("ban", reason, signer, stage)

    # ----------------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, Any]:
        """Plain containers, so a restarted verifier keeps its evidence and its bans."""
        return {
            "signers": {name: st.to_state() for name, st in self._signers.items()},
            "stages": {stage: s.to_state() for stage, s in self._stages.items()},
            "paused_until": self._paused_until,
            "storms": self._storms,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._paused_until = float(state.get("paused_until", -math.inf))
        self._storms = int(state.get("storms", 0))
        window = self.config.window_microbatches
        self._signers = {name: _Signer.from_state(s, window) for name, s in state["signers"].items()}
        self._stages = {int(stage): _Stage.from_state(s) for stage, s in state["stages"].items()}
