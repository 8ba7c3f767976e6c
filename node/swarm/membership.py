"""Membership: this node's signed heartbeat and stage balance.

`Membership` keeps the heartbeat alive (refreshed every `heartbeat_period_s`, expiring `HEARTBEAT_TTL_PERIODS`
periods after it was written, so a node that dies silently leaves the peer list within two periods) and announces
leaving on shutdown. Where a new stage replica goes is `node.roles.registry.choose_role`'s (on the verifiers'
measurements, not the heartbeats' announced throughputs alone).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hivemind.utils import get_dht_time

from node.context import VERSION, NodeContext, NodeMetrics, wait_or_stop
from protocol.dht_io import SwarmRecords
from protocol.errors import HivenodeError
from protocol.records import (
    CONNECTIVITY_MODES,
    PEER_STATES,
    UNKNOWN_MODE,
    Heartbeat,
    MeasuredRecord,
    PeerRecord,
)

logger = logging.getLogger(__name__)

HEARTBEAT_TTL_PERIODS = 2.0  # a heartbeat outlives one missed refresh, not two
HEARTBEAT_JITTER = 0.1  # refresh up to 10 % early, so peers started together do not beat in lockstep


# ---- heartbeats ----


def _finite_or(value: object, default: float) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default
    return number if math.isfinite(number) and number >= 0 else default


def build_heartbeat(
    ctx: NodeContext, role_status: dict[str, Any], maddrs: Sequence[str], *, now: float
) -> Heartbeat:
    """This node's heartbeat from the role's status (fields it does not fill keep their defaults)."""
    span = role_status.get("span")
    loss = role_status.get("loss")
    state = role_status.get("state", "idle")
    if state not in PEER_STATES:
        logger.warning("role reported state %r, which heartbeats cannot carry; announcing 'idle'", state)
        state = "idle"
    return Heartbeat(
        role=ctx.role_name,
        state=state,
        stage=role_status.get("stage", ctx.stage),
        span=tuple(span) if span is not None else None,
        device=str(role_status.get("device", ctx.device))[:32],
        throughput=_finite_or(role_status.get("throughput"), 0.0),
        load=_finite_or(role_status.get("load"), 0.0),
        http=ctx.http_address,
        maddrs=tuple(maddrs)[:8],
        inner_step=max(0, int(role_status.get("inner_step") or 0)),
        tokens=max(0, int(role_status.get("tokens") or 0)),
        loss=float(loss) if isinstance(loss, int | float) and math.isfinite(loss) else None,
        version=VERSION,
        sent_at=now,
        mode=connectivity_mode(ctx.connectivity),
        # the DHT's store quotas and the syncers' stream slots favour a peer whose heartbeat shows it paid
        admission=ctx.admission_proof,
    )


def connectivity_mode(connectivity: Mapping[str, Any]) -> str:
    """The mode a heartbeat carries: the one decided at join (`Connectivity.as_dict()`), else unknown."""
    mode = connectivity.get("mode")
    return mode if isinstance(mode, str) and mode in CONNECTIVITY_MODES else UNKNOWN_MODE


class Membership:
    """Keeps one peer's heartbeat record alive and announces leaving. `heartbeat(now)` builds the record body."""

    def __init__(
        self,
        records: SwarmRecords,
        *,
        period_s: float,
        heartbeat: Callable[[float], Heartbeat],
        metrics: NodeMetrics | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.records = records
        self.period_s = period_s
        self.heartbeat = heartbeat
        self.metrics = metrics
        self.rng = rng or random.Random()
        self._last_expiration = 0.0
        self.last_ok_at: float | None = None

    def _expiration(self, now: float, ttl_s: float) -> float:
        # a store with an earlier expiration than what the DHT holds is refused: never go backwards
        expiration = max(now + ttl_s, self._last_expiration + 1e-3)
        self._last_expiration = expiration
        return expiration

    async def announce(self, *, leaving: bool = False) -> bool:
        now = get_dht_time()
        heartbeat = self.heartbeat(now)
        if leaving:
            heartbeat = _leaving(heartbeat)
        expiration = self._expiration(now, 0.0 if leaving else HEARTBEAT_TTL_PERIODS * self.period_s)
        ok = await self.records.publish_heartbeat(heartbeat, expiration=expiration)
        if ok:
            self.last_ok_at = now
        else:
            logger.warning("heartbeat was not stored by any DHT peer")
        if self.metrics is not None:
            (self.metrics.heartbeats if ok else self.metrics.heartbeat_failures).inc()
        return ok

    async def run(self, stop: asyncio.Event) -> None:
        """Refresh the heartbeat every period until `stop`; a failed refresh is logged and retried next period."""
        while not await wait_or_stop(stop, self.period_s * (1.0 - HEARTBEAT_JITTER * self.rng.random())):
            try:
                await self.announce()
            except asyncio.TimeoutError:
                if self.metrics is not None:
                    self.metrics.heartbeat_failures.inc()
                logger.warning("heartbeat store timed out after %.1f s", self.records.timeout_s)

    async def leave(self, timeout_s: float) -> None:
        """Replace our heartbeat with a `leaving` one that expires just after the last, so others drop us now."""
        if self._last_expiration == 0.0:
            return  # never announced: nothing to withdraw
        try:
            await asyncio.wait_for(self.announce(leaving=True), timeout_s)
            logger.info("announced leaving")
        except (asyncio.TimeoutError, HivenodeError) as e:
            logger.warning("could not announce leaving (%s); peers will drop us at expiry", e or "timeout")

    async def peers_or_empty(self) -> list[PeerRecord]:
        """Live peers, or an empty list if the DHT does not answer in time (callers treat it as 'nobody')."""
        try:
            peers = await self.records.list_peers()
        except asyncio.TimeoutError:
            logger.warning("listing peers timed out")
            return []
        if self.metrics is not None:
            self.metrics.peers_visible.set(len(peers))
        return peers

    async def measured_or_empty(self) -> list[MeasuredRecord]:
        """The authorized verifiers' `measured` records, or none if the DHT does not answer in time (placement then
        counts the replicas at their announced throughputs, as before any verifier measured them)."""
        try:
            return await self.records.list_measured()
        except asyncio.TimeoutError:
            logger.warning("listing the verifiers' measured throughputs timed out")
            return []


def _leaving(heartbeat: Heartbeat) -> Heartbeat:
    return dataclasses.replace(heartbeat, state="leaving", leaving=True)
