"""Swarm membership: reaching the swarm, finding and trusting the run, heartbeats, and stage balance.

`join` turns `--join` targets into a running hivemind DHT with our identity, a verified run manifest whose owner
is pinned, and a `SwarmRecords` client. `Membership` keeps this node's signed heartbeat alive (refreshed every
`heartbeat_period_s`, expiring `HEARTBEAT_TTL_PERIODS` periods after it was written, so a node that dies silently
leaves the peer list within two periods) and announces leaving on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import random
import re
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import urlparse

import aiohttp
import hivemind
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from node.config import NetworkConfig, NodeConfig
from node.runtime import VERSION, NodeContext, NodeMetrics, wait_or_stop
from protocol.errors import ConfigError, HivenodeError, JoinError
from protocol.identity import NodeIdentity
from protocol.keys import is_peer_id
from protocol.manifest import OwnerPins, RunManifest, SignedManifest
from protocol.records import (
    PEER_STATES,
    Heartbeat,
    HivenodeRecordValidator,
    PeerRecord,
    RunRules,
    SwarmRecords,
    fetch_discovery,
    fetch_manifest,
)

logger = logging.getLogger(__name__)

HEARTBEAT_TTL_PERIODS = 2.0  # a heartbeat outlives one missed refresh, not two
HEARTBEAT_JITTER = 0.1  # refresh up to 10 % early, so peers started together do not beat in lockstep
PARENT_WATCH_PERIOD_S = 0.5
_DISCOVERY_RETRY_S = (0.2, 2.0)  # first and longest pause between manifest lookups while joining
_DAEMON_TIMESTAMP = re.compile(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d(\.\d+)? ")


# ---- join targets ----


@dataclass(frozen=True, slots=True)
class JoinPlan:
    """Where to dial, and the run an http bootstrap vouched for (still checked against its owner signature)."""

    maddrs: tuple[str, ...]
    hinted: SignedManifest | None = None


def is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def check_multiaddr(text: str) -> str:
    """Validate a `--join` multiaddr: it must parse and end in /p2p/<Ed25519 peer id>; raise ConfigError."""
    try:
        maddr = Multiaddr(text)
    except Exception as e:  # the multiaddr library raises a zoo of types for malformed input
        raise ConfigError(f"--join {text!r} is not a multiaddr ({e})") from None
    try:
        peer_id = maddr.value_for_protocol("p2p")
    except Exception:  # ProtocolLookupError when there is no /p2p/ part
        peer_id = None
    if not peer_id or not is_peer_id(peer_id):
        raise ConfigError(
            f"--join {text!r} must end in /p2p/<peer id> of an Ed25519 key (12D3KooW...): copy the line the "
            "bootstrap printed"
        )
    return str(maddr)


def swarm_url(target: str) -> str:
    """A bootstrap URL given with or without its `/api/swarm` path."""
    parsed = urlparse(target)
    if not parsed.hostname:
        raise ConfigError(f"--join {target!r} is not a usable URL")
    if parsed.path in ("", "/"):
        return target.rstrip("/") + "/api/swarm"
    return target


async def fetch_json(url: str, timeout_s: float) -> Any:
    """GET a JSON document; raise JoinError with one line on any failure."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
            if response.status != 200:
                raise JoinError(f"{url} answered HTTP {response.status}")
            return await response.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        detail = str(e) or type(e).__name__
        raise JoinError(f"cannot fetch {url}: {detail}") from None


async def resolve_join(targets: Sequence[str], timeout_s: float) -> JoinPlan:
    """Multiaddrs are used as given; URLs are asked for their `bootstrap_maddrs` and signed manifest."""
    maddrs: list[str] = []
    hinted: SignedManifest | None = None
    for target in targets:
        if not is_url(target):
            maddrs.append(check_multiaddr(target))
            continue
        url = swarm_url(target)
        data = await fetch_json(url, timeout_s)
        listed = data.get("bootstrap_maddrs") if isinstance(data, dict) else None
        if not isinstance(listed, list) or not listed:
            raise JoinError(f"{url} lists no bootstrap_maddrs (is it a hivenode bootstrap?)")
        maddrs.extend(check_multiaddr(str(m)) for m in listed[:16])
        if hinted is None and isinstance(data.get("manifest"), str):
            hinted = SignedManifest.from_b64(data["manifest"])
            hinted.verify()  # a tampered manifest stops the join here, with ManifestRejected
    return JoinPlan(tuple(dict.fromkeys(maddrs)), hinted)


# ---- the DHT ----


class DetachedDHT(hivemind.DHT):
    """hivemind's DHT process, detached from our signals.

    The DHT process is forked after we installed asyncio signal handlers, so it would inherit them (and the
    loop's wakeup fd) and then ignore the SIGTERM that `DHT.shutdown()` falls back to. It also shares our process
    group, so a Ctrl+C in a terminal (or a group kill) would kill it and its p2pd before we could announce
    leaving. In its own group with default signal handling, our process alone decides when the DHT stops; and
    `_exit_with_parent` stops it if we die without deciding.
    """

    def run(self) -> None:
        os.setpgid(0, 0)
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        super().run()  # hivemind then ignores SIGINT in this process


_PARENT_WATCH_TASKS: set[asyncio.Task[None]] = set()  # lives in the DHT process


async def _exit_with_parent(_dht: Any, node: Any, *, parent_pid: int, period_s: float) -> None:
    """Runs inside hivemind's DHT process: if our process dies (even by SIGKILL), stop the DHT and its p2pd
    instead of leaving them orphaned."""

    async def watch() -> None:
        while os.getppid() == parent_pid:
            await asyncio.sleep(period_s)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(node.shutdown(), 3.0)
        os._exit(0)

    task = asyncio.create_task(watch())
    _PARENT_WATCH_TASKS.add(task)


def _daemon_message(error: BaseException) -> str:
    text = _DAEMON_TIMESTAMP.sub("", str(error)).strip() or type(error).__name__
    return text[0].lower() + text[1:]


def start_dht(
    identity: NodeIdentity,
    initial_peers: Sequence[str],
    network: NetworkConfig,
    validator: HivenodeRecordValidator,
) -> hivemind.DHT:
    """Start hivemind's DHT with our Ed25519 identity (its peer id is `identity.peer_id`); raise JoinError.

    hivemind's own identity-in-use check only works for RSA keys, so it is off; `IdentityLock` covers it.
    Blocks for the daemon start, at most `network.join_timeout_s`.
    """
    if identity.path is None:
        raise ValueError("the DHT needs an identity stored in a file")
    try:
        dht = DetachedDHT(
            initial_peers=list(initial_peers) or None,
            start=True,
            record_validators=[validator],
            identity_path=str(identity.path),
            check_if_identity_free=False,
            host_maddrs=list(network.listen),
            announce_maddrs=list(network.announce) or None,
            startup_timeout=network.join_timeout_s,
            client_mode=network.client_mode,
        )
    except Exception as e:  # hivemind reports a failed start as P2PDaemonError, RuntimeError or TimeoutError
        logger.debug("DHT start failed", exc_info=True)
        message = _daemon_message(e)
        if initial_peers and "failed to connect to bootstrap peers" in message:
            raise JoinError(
                f"cannot reach the swarm: no entry point answered ({', '.join(initial_peers)}); "
                "is the bootstrap running, and is its address (peer id included) current?"
            ) from None
        where = f" via {', '.join(initial_peers)}" if initial_peers else ""
        raise JoinError(f"cannot start the DHT{where}: {message}") from None
    dht.run_coroutine(partial(_exit_with_parent, parent_pid=os.getpid(), period_s=PARENT_WATCH_PERIOD_S))
    return dht


# ---- finding and trusting the run ----


@dataclass(frozen=True, slots=True)
class Joined:
    dht: hivemind.DHT
    signed: SignedManifest
    manifest: RunManifest
    records: SwarmRecords
    maddrs: tuple[str, ...]
    now: float  # DHT time when the join completed


def pick_run(
    candidates: Sequence[SignedManifest], *, run_id: str | None, pins: OwnerPins
) -> SignedManifest | None:
    """Choose among verified manifests: the requested run id, else the only one, else the only pinned one."""
    if run_id is not None:
        return next((c for c in candidates if c.run_id == run_id), None)
    unique = list({c.run_id: c for c in candidates}.values())
    if len(unique) <= 1:
        return unique[0] if unique else None
    pinned = [c for c in unique if pins.pinned(c.verify().name) == c.owner]
    if len(pinned) == 1:
        return pinned[0]
    listing = ", ".join(f"{c.verify().name!r} ({c.run_id})" for c in unique)
    raise JoinError(f"this DHT hosts several runs: {listing}; set run_id in node.toml to pick one")


async def discover_run(
    dht: hivemind.DHT, plan: JoinPlan, config: NodeConfig, pins: OwnerPins
) -> SignedManifest:
    """Find the run's signed manifest, retrying until `join_timeout_s` (a bootstrap may publish a moment late)."""
    if plan.hinted is not None and (config.run_id is None or plan.hinted.run_id == config.run_id):
        return plan.hinted
    deadline = time.monotonic() + config.network.join_timeout_s
    pause_s = _DISCOVERY_RETRY_S[0]
    timeout_s = config.network.request_timeout_s
    while True:
        try:
            candidates = await fetch_discovery(dht, timeout_s=timeout_s, now=get_dht_time())
            if config.run_id is not None:
                direct = await fetch_manifest(dht, config.run_id, timeout_s=timeout_s, now=get_dht_time())
                candidates += [direct] if direct is not None else []
        except asyncio.TimeoutError:
            candidates = []  # a slow DHT answer is "not found yet": retry until the deadline
        chosen = pick_run(candidates, run_id=config.run_id, pins=pins)
        if chosen is not None:
            return chosen
        if time.monotonic() + pause_s > deadline:
            wanted = f"the manifest of run {config.run_id}" if config.run_id else "a run manifest"
            raise JoinError(
                f"reached the DHT but found no {wanted} within {config.network.join_timeout_s:g} s; "
                "is the entry point a hivenode bootstrap, or connected to one?"
            )
        await asyncio.sleep(pause_s)
        pause_s = min(2 * pause_s, _DISCOVERY_RETRY_S[1])


async def join(config: NodeConfig, identity: NodeIdentity) -> Joined:
    """Reach the swarm, find and verify the run, pin its owner. Raises ConfigError/JoinError/ManifestRejected/
    OwnerPinMismatch with one-line messages; on failure nothing is left running."""
    plan = await resolve_join(config.join, config.network.request_timeout_s)
    dht = start_dht(identity, plan.maddrs, config.network, HivenodeRecordValidator())
    try:
        pins = OwnerPins(config.state_dir / OwnerPins.FILENAME)
        signed = await discover_run(dht, plan, config, pins)
        manifest = signed.verify()
        if pins.check_and_pin(manifest.name, signed.owner):
            logger.info("pinned owner %s for run %r (trust on first use)", signed.owner, manifest.name)
        rules = RunRules.from_manifest(signed, manifest)
        dht.add_validators([HivenodeRecordValidator([rules])])
        records = SwarmRecords(dht, rules, identity, timeout_s=config.network.request_timeout_s)
        maddrs = tuple(str(m) for m in dht.get_visible_maddrs())
    except BaseException:
        dht.shutdown()
        raise
    logger.info(
        "joined run %r (%s) through %d entry point(s)", manifest.name, signed.run_id, len(plan.maddrs)
    )
    return Joined(dht, signed, manifest, records, maddrs, get_dht_time())


# ---- stage balance ----


def least_served_stage(peers: Sequence[PeerRecord], num_stages: int) -> int:
    """The stage with the least announced throughput (then fewest replicas, then lowest index)."""
    throughput = [0.0] * num_stages
    replicas = [0] * num_stages
    for peer in peers:
        hb = peer.heartbeat
        if hb.role == "stage" and hb.stage is not None and 0 <= hb.stage < num_stages and not hb.leaving:
            throughput[hb.stage] += hb.throughput
            replicas[hb.stage] += 1
    return min(range(num_stages), key=lambda s: (throughput[s], replicas[s], s))


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
    )


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


def _leaving(heartbeat: Heartbeat) -> Heartbeat:
    return dataclasses.replace(heartbeat, state="leaving", leaving=True)
