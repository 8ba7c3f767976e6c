"""Swarm membership: reaching the swarm, finding and trusting the run, heartbeats, and stage balance.

`join` turns `--join` targets into a running hivemind DHT with our identity, a verified run manifest whose owner
is pinned, and a `SwarmRecords` client. `Membership` keeps this node's signed heartbeat alive (refreshed every
`heartbeat_period_s`, expiring `HEARTBEAT_TTL_PERIODS` periods after it was written, so a node that dies silently
leaves the peer list within two periods) and announces leaving on shutdown.

The DHT process runs `QuotaDHTProtocol`: hivemind's validators never see who sent a record, so per-peer store
quotas (`protocol.limits.StoreQuota`) sit in front of the DHT's store handler, where the Noise-authenticated sender
is known, and refuse a record before it is validated or stored.
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
import hivemind.dht.node
import msgpack
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from node.config import NetworkConfig, NodeConfig
from node.runtime import VERSION, NodeContext, NodeMetrics, wait_or_stop
from protocol.errors import ConfigError, HivenodeError, JoinError, MalformedFrame, ManifestRejected
from protocol.identity import NodeIdentity
from protocol.keys import KeyKind, is_peer_id
from protocol.limits import LimitsConfig, QuotaConfig, QuotaStats, RateLimit, StoreQuota
from protocol.manifest import OwnerPins, RunManifest, SignedManifest
from protocol.records import (
    PEER_STATES,
    Heartbeat,
    HivenodeRecordValidator,
    PeerRecord,
    RecordLimits,
    RunRules,
    SwarmRecords,
    fetch_discovery,
    fetch_manifest,
    manifest_rejections,
)
from protocol.rpc import Route, call_framed

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


def dht_store_quota(limits: RecordLimits | None = None) -> QuotaConfig:
    """The store quotas every hivenode DHT peer applies, sized for our records (`RecordLimits`).

    A peer re-stores its heartbeat every `heartbeat_period_s` (2 s by default: 30 a minute), an authorized syncer
    its lease as often, and a node that joins or caches gets whole dictionaries replicated to it, one record per
    subkey. 240 records a minute per peer covers all of that with a 150-peer directory replicated at once, and
    still stops one identity from making us validate thousands of records a second. The global cap bounds a Sybil
    flood (a fresh identity costs ~1 ms): 12,000 a minute is 200 validations a second, ~2 % of one core. Values
    are capped like the validator caps them; expirations at the longest TTL any record kind may have, for every
    record, foreign ones included.
    """
    limits = limits or RecordLimits()
    records_total = 12_000
    return QuotaConfig(
        window_s=60.0,
        max_records_per_peer=240,
        max_bytes_per_peer=4 << 20,
        max_value_bytes=limits.max_value_bytes,
        max_records_total=records_total,
        max_expiration_horizon_s=max(limits.max_ttl_s(kind) for kind in KeyKind),
        clock_skew_s=limits.clock_skew_s,
        max_tracked_peers=records_total,
    )


class QuotaDHTProtocol(DHTProtocol):
    """hivemind's DHT protocol with `StoreQuota` in front of its store handler.

    `rpc_store` asks the quota about every record of a request, with the Noise-authenticated sender, before
    hivemind validates or stores anything; refused records are answered `False` (as hivemind answers a record
    its validators refuse) and never reach the validators or the storage. A whole dictionary (replication, cache)
    counts one record per subkey and is refused whole if any subkey is refused.

    Installed only inside `DetachedDHT`'s own process (see `DetachedDHT.run`), with its config in the class
    attribute `quota_config`. It keeps the wire names of `DHTProtocol`, so peers see no difference.
    """

    quota_config: QuotaConfig | None = None

    def __init__(self, *, _initialized_with_create: bool = False) -> None:
        super().__init__(_initialized_with_create=_initialized_with_create)
        config = type(self).quota_config
        self.store_quota = StoreQuota(config) if config is not None else None
        self._refusal_logged_at: dict[str, float] = {}

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return DHTProtocol._get_handle_name(namespace, method_name)

    async def rpc_store(self, request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
        quota = self.store_quota
        if quota is None:
            return await super().rpc_store(request, context)
        num = len(request.keys)
        fields = (request.subkeys, request.values, request.expiration_time, request.in_cache)
        if any(len(field) != num for field in fields):
            return dht_pb2.StoreResponse(store_ok=[False] * num, peer=self.node_info)
        peer, now = context.remote_id.to_base58(), get_dht_time()
        admitted = [
            self._admit(quota, peer, *item, now) for item in zip(request.keys, *fields[:3], strict=True)
        ]
        if all(admitted):
            return await super().rpc_store(request, context)
        kept = [i for i, ok in enumerate(admitted) if ok]
        subset = dht_pb2.StoreRequest(
            keys=[request.keys[i] for i in kept],
            subkeys=[request.subkeys[i] for i in kept],
            values=[request.values[i] for i in kept],
            expiration_time=[request.expiration_time[i] for i in kept],
            in_cache=[request.in_cache[i] for i in kept],
            peer=request.peer,
        )
        response = await super().rpc_store(subset, context)
        stored = iter(list(response.store_ok))
        del response.store_ok[:]
        response.store_ok.extend(next(stored, False) if ok else False for ok in admitted)
        return response

    def _admit(
        self,
        quota: StoreQuota,
        peer: str,
        key: bytes,
        tag: bytes,
        value: bytes,
        expiration: float,
        now: float,
    ) -> bool:
        if len(key) != DHTID.HASH_NBYTES:
            return False  # not a key hivemind could have made (its handler would raise on it)
        if tag != self.IS_DICTIONARY:
            subkey = None if tag == self.IS_REGULAR_VALUE else tag
            if subkey is not None and not self._is_subkey(subkey):
                return False
            return self._note(quota.admit_store(peer, key, len(value), expiration, now, subkey=subkey), peer)
        try:
            dictionary = self.serializer.loads(value)
        except Exception:  # garbage hivemind's handler would raise on: refuse the item instead
            return False
        if not isinstance(dictionary, DictionaryDHTValue) or not len(dictionary):
            return False  # an empty dictionary stores nothing; hivemind would still answer "stored"
        for subkey, item in dictionary.items():
            blob, item_expiration = item.value, item.expiration_time
            if not isinstance(blob, bytes) or type(item_expiration) not in (int, float):
                return False
            admission = quota.admit_store(
                peer, key, len(blob), float(item_expiration), now, subkey=self.serializer.dumps(subkey)
            )
            if not self._note(admission, peer):
                return False
        return True

    def _is_subkey(self, tag: bytes) -> bool:
        """Whether hivemind can decode `tag` into a subkey it can store (its handler would raise otherwise)."""
        try:
            subkey = self.serializer.loads(tag)
            hash(subkey)
        except Exception:  # undecodable, or a list or map: not usable as a dictionary key
            return False
        return True

    def _note(self, admission: Any, peer: str) -> bool:
        """Pass the admission through; log a peer's refusals at most once per quota window."""
        if admission:
            return True
        now = time.monotonic()
        assert self.store_quota is not None
        if now - self._refusal_logged_at.get(peer, -math.inf) >= self.store_quota.config.window_s:
            if len(self._refusal_logged_at) >= self.store_quota.config.max_tracked_peers:
                self._refusal_logged_at.clear()
            self._refusal_logged_at[peer] = now
            logger.warning("DHT store quota refused records from %s: %s", peer[-8:], admission.reason)
        return False


async def _quota_stats(_dht: Any, node: Any) -> QuotaStats | None:
    """Runs inside the DHT process: the store quota's counters (None if the DHT runs without quotas)."""
    quota = getattr(node.protocol, "store_quota", None)
    return quota.stats() if quota is not None else None


def dht_quota_stats(dht: hivemind.DHT) -> QuotaStats | None:
    """The store quota's counters of a DHT started by `start_dht` (blocks for one round trip to its process)."""
    return dht.run_coroutine(_quota_stats)


class DetachedDHT(hivemind.DHT):
    """hivemind's DHT process, detached from our signals, with per-peer store quotas.

    The DHT process is forked after we installed asyncio signal handlers, so it would inherit them (and the
    loop's wakeup fd) and then ignore the SIGTERM that `DHT.shutdown()` falls back to. It also shares our process
    group, so a Ctrl+C in a terminal (or a group kill) would kill it and its p2pd before we could announce
    leaving. In its own group with default signal handling, our process alone decides when the DHT stops; and
    `_exit_with_parent` stops it if we die without deciding.

    `store_quota` (None: no quotas) is applied by `QuotaDHTProtocol`, which this process alone uses.
    """

    def __init__(self, *args: Any, store_quota: QuotaConfig | None = None, **kwargs: Any) -> None:
        self._store_quota = store_quota  # read in run(), in the DHT process (forked with this attribute)
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        os.setpgid(0, 0)
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        if self._store_quota is not None:
            # This process is ours alone: hivemind's DHTNode builds its protocol from this module-level name.
            QuotaDHTProtocol.quota_config = self._store_quota
            hivemind.dht.node.DHTProtocol = QuotaDHTProtocol  # type: ignore[misc]
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
    *,
    store_quota: QuotaConfig | None = None,
    client_mode: bool | None = None,
) -> hivemind.DHT:
    """Start hivemind's DHT with our Ed25519 identity (its peer id is `identity.peer_id`); raise JoinError.

    hivemind's own identity-in-use check only works for RSA keys, so it is off; `IdentityLock` covers it.
    Blocks for the daemon start, at most `network.join_timeout_s`. `store_quota` defaults to `dht_store_quota()`;
    `client_mode` to `network.client_mode`.
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
            client_mode=network.client_mode if client_mode is None else client_mode,
            use_relay=network.use_relay,
            use_auto_relay=network.use_auto_relay,
            store_quota=store_quota or dht_store_quota(),
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


# ---- reachability (can others dial us?) ----

REACH_ROUTE = "reach.check"  # served by bootstraps: "dial me back at these addresses"
MAX_REACH_MADDRS = 4  # addresses one check may ask a bootstrap to dial
MAX_REACH_REQUEST_BYTES = 4096
# One check dials from fresh daemons (a p2pd start each, ~0.5 s of CPU): a peer gets two in a burst and one per 30 s,
# and the bootstrap one a second overall, so the check cannot be turned into a way to make it spawn daemons.
REACH_RATE = RateLimit(rate_per_s=1.0 / 30.0, burst=2.0)
REACH_GLOBAL_RATE = RateLimit(rate_per_s=1.0, burst=5.0)
# A probe's own dial gives up after ~5-7 s on a black hole (measured); the rest is its daemon's start.
REACH_PROBE_TIMEOUT_S = 15.0
_DIALABLE_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")


@dataclass(frozen=True, slots=True)
class Reachability:
    """What a bootstrap saw when it dialed us back. `reachable` is None when nobody could tell."""

    reachable: bool | None
    checked: tuple[str, ...] = ()  # our addresses it tried
    dialable: tuple[str, ...] = ()  # those it reached
    observed: tuple[str, ...] = ()  # where our connection to it came from (our public address behind NAT)
    checker: str = ""  # its peer id

    def advice(self, listen: Sequence[str]) -> str:
        """One line: what we run as, and what to open or set to serve."""
        port = next((p for p in map(_tcp_port, (*self.checked, *listen)) if p), None) or 31338
        ip = next((h for h in map(_host, self.observed) if h), None) or "<public ip>"
        tried = ", ".join(self.checked) or "none"
        return (
            f"peers cannot reach this node (the bootstrap could not dial {tried}); running in client mode "
            f"(it still trains, but serves nothing); to serve, open TCP port {port} to this machine (forward it "
            f"on your router) and start with --listen /ip4/0.0.0.0/tcp/{port} --announce /ip4/{ip}/tcp/{port}"
        )


def _maddr_part(text: str, protocol: str) -> str | None:
    try:
        return Multiaddr(text).value_for_protocol(protocol)
    except Exception:  # no such part, or not a multiaddr
        return None


def _tcp_port(text: str) -> int | None:
    port = _maddr_part(text, "tcp")
    return int(port) if port and port.isdigit() and port != "0" else None


def _host(text: str) -> str | None:
    return next((h for proto in _DIALABLE_PROTOCOLS if (h := _maddr_part(text, proto))), None)


def _without_peer_id(text: str) -> str:
    return text.split("/p2p/", 1)[0]


def _is_loopback(text: str) -> bool:
    host = _host(text)
    return host is not None and (host.startswith("127.") or host in ("::1", "localhost"))


def dial_targets(requested: object, caller: str) -> list[str]:
    """The addresses a reach check may dial: at most `MAX_REACH_MADDRS` plain TCP multiaddrs of the caller (a
    trailing /p2p/ must name the caller; relay circuits are refused). Raises MalformedFrame."""
    if not isinstance(requested, list) or not requested or len(requested) > MAX_REACH_MADDRS:
        raise MalformedFrame(f"a reach check names 1 to {MAX_REACH_MADDRS} addresses")
    targets = []
    for item in requested:
        if not isinstance(item, str) or len(item) > 256 or "p2p-circuit" in item:
            raise MalformedFrame("a reach check address must be a short, direct multiaddr")
        peer = _maddr_part(item, "p2p")
        if peer is not None and peer != caller:
            raise MalformedFrame("a reach check may only ask to dial its caller")
        base = _without_peer_id(item)
        if _host(base) is None or _tcp_port(base) is None:
            raise MalformedFrame(f"not a dialable TCP multiaddr: {base[:64]!r}")
        targets.append(base)
    return list(dict.fromkeys(targets))


def _unpack_small(raw: bytes | bytearray) -> object:
    """msgpack from a peer, for the small reach messages: strings and lists only, everything capped."""
    try:
        return msgpack.unpackb(
            bytes(raw),
            raw=False,
            max_str_len=256,
            max_bin_len=0,
            max_array_len=16,
            max_map_len=8,
            max_ext_len=0,
        )
    except Exception:  # msgpack raises a zoo of types on garbage
        raise MalformedFrame("not a small msgpack message") from None


def parse_reach_reply(
    raw: bytes | bytearray, ours: Sequence[str]
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(dialable, unknown, observed) from a bootstrap's answer; only our own addresses count as dialable or
    unknown. Raises MalformedFrame."""
    reply = _unpack_small(raw)
    if not isinstance(reply, dict):
        raise MalformedFrame("a reach answer is a map")

    def strings(name: str) -> list[str]:
        items = reply.get(name, [])
        if not isinstance(items, list) or not all(isinstance(m, str) for m in items):
            raise MalformedFrame(f"a reach answer's {name!r} is a list of strings")
        return items

    dialable = tuple(m for m in strings("dialable") if m in ours)
    unknown = tuple(m for m in strings("unknown") if m in ours)
    return dialable, unknown, tuple(strings("observed")[:MAX_REACH_MADDRS])


async def probe_dial(maddr: str, peer_id: str, timeout_s: float) -> bool | None:
    """Whether a fresh daemon, with no relay and no other connection, can open a secure connection to `peer_id`
    at `maddr` (the handshake checks the peer id). None when the probe itself failed (our daemon did not start in
    time, say): that says nothing about the peer, and must not make it give up serving."""
    try:
        probe = await P2P.create(
            initial_peers=[f"{maddr}/p2p/{peer_id}"],
            dht_mode="client",
            use_relay=False,
            auto_nat=False,
            nat_port_map=False,
            no_listen=True,
            startup_timeout=timeout_s,
            check_if_identity_free=False,
        )
    except Exception as e:  # P2PDaemonError; only "failed to connect to bootstrap peers" is about the peer
        message = _daemon_message(e)
        logger.debug("reach probe of %s at %s failed: %s", peer_id[-8:], maddr, message)
        return False if "failed to connect to bootstrap peers" in message else None
    await probe.shutdown()
    return True


def reach_check_route(p2p: Any, *, probe_timeout_s: float = REACH_PROBE_TIMEOUT_S) -> Route:
    """The `REACH_ROUTE` a bootstrap serves on `p2p`: dial the caller back at the addresses it names; answer
    msgpack {"dialable": [...], "unknown": [...], "observed": [...]} ("unknown": our probe failed, not the
    dial). Bounded: `REACH_RATE` per peer, one probe at a time."""
    busy = asyncio.Semaphore(1)

    async def check(frame: bytearray, caller: str) -> bytes:
        targets = dial_targets(_unpack_small(frame), caller)
        async with busy:  # one check at a time; its few addresses in parallel, so it ends within one timeout
            outcomes = await asyncio.gather(*(probe_dial(m, caller, probe_timeout_s) for m in targets))
        results = dict(zip(targets, outcomes, strict=True))
        dialable = [m for m, ok in results.items() if ok]
        unknown = [m for m, ok in results.items() if ok is None]
        observed = [
            str(addr)
            for info in await p2p.list_peers()
            if info.peer_id.to_base58() == caller
            for addr in info.addrs
        ][:MAX_REACH_MADDRS]
        logger.info(
            "reach check for %s: %d of %d address(es) dialable%s",
            caller[-8:],
            len(dialable),
            len(targets),
            f" ({len(unknown)} could not be probed)" if unknown else "",
        )
        return msgpack.packb({"dialable": dialable, "unknown": unknown, "observed": observed})

    return Route(check, MAX_REACH_REQUEST_BYTES, rate=REACH_RATE)


def reach_limits() -> LimitsConfig:
    """The limiter of a server that serves only `REACH_ROUTE`."""
    return LimitsConfig(
        rpc_rates={REACH_ROUTE: REACH_RATE}, global_rate=REACH_GLOBAL_RATE, max_streams_per_peer=2
    )


def needs_reach_check(network: NetworkConfig, entry_points: Sequence[str]) -> bool:
    """Whether asking a bootstrap can tell us anything: not when we are a client already, nor when we listen on
    loopback only, announce nothing else, and every bootstrap is on this machine too (it dials our loopback)."""
    if network.client_mode or not network.check_reachability or not entry_points:
        return False
    local = not network.announce and all(_is_loopback(m) for m in network.listen)
    return not (local and all(_is_loopback(m) for m in entry_points))


async def check_reachability(
    dht: hivemind.DHT, entry_points: Sequence[str], *, timeout_s: float
) -> Reachability:
    """Ask the first bootstrap of `entry_points` that answers to dial us back at our announced addresses."""
    ours = [_without_peer_id(str(m)) for m in dht.get_visible_maddrs()][:MAX_REACH_MADDRS]
    ours = [m for m in ours if "p2p-circuit" not in m]
    if not ours:
        return Reachability(False)
    p2p = await dht.replicate_p2p()
    try:
        for entry in entry_points:
            checker = _maddr_part(entry, "p2p")
            if checker is None:
                continue
            try:
                answer = await call_framed(
                    p2p,
                    checker,
                    REACH_ROUTE,
                    msgpack.packb(ours),
                    max_response_bytes=MAX_REACH_REQUEST_BYTES,
                    timeout_s=timeout_s,
                )
                dialable, unknown, observed = parse_reach_reply(answer, ours)
            except Exception as e:  # an older bootstrap, a throttled check, a timeout: ask the next one
                logger.debug("reach check via %s failed: %r", checker[-8:], e)
                continue
            if not dialable and unknown:
                continue  # its probe failed, not ours to judge: ask the next bootstrap
            return Reachability(bool(dialable), tuple(ours), dialable, observed, checker)
    finally:
        await p2p.shutdown()
    return Reachability(None, tuple(ours))


# ---- re-dialing the bootstraps after losing every peer ----


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
                node.p2p._client.connect(peer_id, [Multiaddr(_without_peer_id(entry))]), 5.0
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


# ---- finding and trusting the run ----


@dataclass(frozen=True, slots=True)
class Joined:
    dht: hivemind.DHT
    signed: SignedManifest
    manifest: RunManifest
    records: SwarmRecords
    maddrs: tuple[str, ...]
    now: float  # DHT time when the join completed
    entry_points: tuple[
        str, ...
    ] = ()  # the bootstrap multiaddrs we joined through (re-dialed if peers are lost)
    reachability: Reachability | None = None  # None: not checked (see `needs_reach_check`)

    @property
    def client_mode(self) -> bool:
        """True when others cannot dial us: the DHT serves nothing and neither should our roles."""
        return self.reachability is not None and self.reachability.reachable is False


async def start_reachable_dht(
    identity: NodeIdentity, entry_points: Sequence[str], network: NetworkConfig
) -> tuple[hivemind.DHT, Reachability | None]:
    """Start the DHT, then ask a bootstrap to dial us back (Petals' pattern). If it cannot, say in one line what
    to open or set, and restart as a client-mode node with auto-relay: it still trains and stores its records,
    but serves nothing. Raises JoinError like `start_dht`; on failure nothing is left running."""
    dht = start_dht(identity, entry_points, network, HivenodeRecordValidator())
    if not needs_reach_check(network, entry_points):
        return dht, None
    try:
        reach = await check_reachability(dht, entry_points, timeout_s=network.join_timeout_s)
    except BaseException:
        dht.shutdown()
        raise
    if reach.reachable is None:
        logger.info("no bootstrap could check whether peers reach us; serving as announced")
    if reach.reachable is not False:
        return dht, reach
    logger.warning(reach.advice(network.listen))
    dht.shutdown()
    client = dataclasses.replace(network, client_mode=True, use_auto_relay=True)
    return start_dht(identity, entry_points, client, HivenodeRecordValidator()), reach


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
        await _refuse_tampered_manifests(dht, timeout_s)
        if time.monotonic() + pause_s > deadline:
            wanted = f"manifest of run {config.run_id}" if config.run_id else "run manifest"
            raise JoinError(
                f"reached the DHT but found no {wanted} within {config.network.join_timeout_s:g} s; "
                "is the entry point a hivenode bootstrap, or connected to one?"
            )
        await asyncio.sleep(pause_s)
        pause_s = min(2 * pause_s, _DISCOVERY_RETRY_S[1])


async def _refuse_tampered_manifests(dht: hivemind.DHT, timeout_s: float) -> None:
    """No valid manifest found, but our DHT's validator refused manifest records: say so now (ManifestRejected),
    rather than "found no run manifest" after the join timeout. A valid one, when there is, is always taken first."""
    try:
        rejected = await manifest_rejections(dht, timeout_s=timeout_s)
    except asyncio.TimeoutError:
        return
    if rejected:
        raise ManifestRejected(
            f"the DHT holds no valid run manifest but refused {len(set(rejected))} manifest record(s), latest: "
            f"{rejected[-1]}; refusing to join"
        )


async def join(config: NodeConfig, identity: NodeIdentity) -> Joined:
    """Reach the swarm, find and verify the run, pin its owner. Raises ConfigError/JoinError/ManifestRejected/
    OwnerPinMismatch with one-line messages; on failure nothing is left running."""
    plan = await resolve_join(config.join, config.network.request_timeout_s)
    dht, reachability = await start_reachable_dht(identity, plan.maddrs, config.network)
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
    return Joined(dht, signed, manifest, records, maddrs, get_dht_time(), plan.maddrs, reachability)


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
