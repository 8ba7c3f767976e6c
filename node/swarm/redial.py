"""Re-dialing the bootstraps after losing every peer (`Redialer`): hivemind never re-contacts its initial peers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import hivemind

from node.config import NetworkConfig
from node.context import wait_or_stop
from node.swarm.reachability import _maddr_part, _without_peer_id
from node.swarm.relay import DaemonMaddr

logger = logging.getLogger(__name__)


async def _routing_view(_dht: Any, node: Any, entry_points: Sequence[str]) -> tuple[int, int]:
    """Runs inside the DHT process: (peers in the routing table, how many of them are entry points). hivemind
    drops a peer from the table after one failed call."""
    table = {peer.to_base58() for peer in node.protocol.routing_table.peer_id_to_uid}
    entries = {_maddr_part(entry, "p2p") for entry in entry_points}
    return len(table), len(table & entries)


async def _redial(_dht: Any, node: Any, entry_points: Sequence[str]) -> int:
    """Runs inside the DHT process: dial each entry point and ping it; return how many answered.

    hivemind never re-contacts its initial peers by itself, and the daemon forgets a peer's addresses some minutes
    after the last connection, so the address is handed to the daemon again before the ping.
    """
    from hivemind.p2p import PeerID

    answered = 0
    for entry in entry_points:
        peer = _maddr_part(entry, "p2p")
        if peer is None:
            continue
        peer_id = PeerID.from_base58(peer)
        with contextlib.suppress(Exception):  # unreachable: the ping below fails too and says so
            await asyncio.wait_for(
                node.p2p._client.connect(peer_id, [DaemonMaddr(_without_peer_id(entry))]), 5.0
            )
        if await node.protocol.call_ping(peer_id) is not None:
            answered += 1
    return answered


class Redialer:
    """Keeps this node in touch with its entry points (the bootstraps it joined through).

    hivemind drops a peer from its routing table after one failed call and never re-contacts its initial peers, so
    after a partition a node may stay alone, or in a DHT of its own with the peers on its side, for good. Every
    `peer_check_period_s` this looks at the routing table; when no entry point is left in it, it re-dials them with
    exponential backoff (`redial_min_s` doubling to `redial_max_s`, with jitter) and says so: once when contact is
    lost, at each failed attempt, and once when it is back. Counts in `attempts` and `recoveries`.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        entry_points: Sequence[str],
        network: NetworkConfig,
        *,
        rng: random.Random | None = None,
        events: Any = None,
    ) -> None:
        self.dht = dht
        self.entry_points = tuple(entry_points)
        self.network = network
        self.rng = rng or random.Random()
        self.events = events
        self.attempts = 0
        self.recoveries = 0
        self.lost_since: float | None = None

    async def _call(self, fn: Any) -> Any:
        return await asyncio.wait_for(self.dht.run_coroutine(fn, return_future=True), 30.0)

    async def run(self, stop: asyncio.Event) -> None:
        backoff_s = self.network.redial_min_s
        delay_s = self.network.peer_check_period_s
        while not await wait_or_stop(stop, delay_s):
            num_peers, num_entries = await self._call(partial(_routing_view, entry_points=self.entry_points))
            if num_entries > 0:
                if self.lost_since is not None:
                    self._recovered()
                backoff_s, delay_s = self.network.redial_min_s, self.network.peer_check_period_s
                continue
            if self.lost_since is None:
                self.lost_since = time.monotonic()
                logger.warning(
                    "%s; re-dialing %d bootstrap(s) with backoff %.1f-%.0f s",
                    "lost every peer" if num_peers == 0 else f"lost every bootstrap ({num_peers} peers left)",
                    len(self.entry_points),
                    self.network.redial_min_s,
                    self.network.redial_max_s,
                )
                self._emit("peers_lost", peers_left=num_peers)
            self.attempts += 1
            answered = await self._call(partial(_redial, entry_points=self.entry_points))
            if answered:
                self._recovered()
                backoff_s, delay_s = self.network.redial_min_s, self.network.peer_check_period_s
                continue
            delay_s = backoff_s * (1.0 + 0.1 * self.rng.random())
            logger.warning(
                "re-dial attempt %d: no bootstrap answered; next in %.1f s", self.attempts, delay_s
            )
            backoff_s = min(2.0 * backoff_s, self.network.redial_max_s)

    def _recovered(self) -> None:
        assert self.lost_since is not None
        self.recoveries += 1
        lost_s = time.monotonic() - self.lost_since
        self.lost_since = None
        logger.warning(
            "reconnected to the swarm after %.1f s (%d re-dial attempts so far)", lost_s, self.attempts
        )
        self._emit("peers_recovered", lost_s=round(lost_s, 3), attempts=self.attempts)

    def _emit(self, event: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(event, **fields)
