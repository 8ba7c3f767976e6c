"""Reachability: can others dial us? A bootstrap serves `REACH_ROUTE` and dials a caller back from a fresh daemon;
a node asks it once after starting its DHT and, if nobody can reach it, restarts with a reservation on the
bootstraps' relays, checks that a fresh daemon reaches it through one, and is then in relay mode; client mode only
when no relay works (`start_reachable_dht`, which also says which mode and why: `node.swarm.relay.Connectivity`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import hivemind
import msgpack
from hivemind.p2p import P2P
from hivemind.utils.multiaddr import Multiaddr

from node.config import NetworkConfig
from node.swarm.dht import _daemon_message, start_dht
from node.swarm.relay import CIRCUIT, Connectivity, decide_connectivity
from protocol.errors import JoinError, MalformedFrame
from protocol.identity import NodeIdentity
from protocol.limits import LimitsConfig, RateLimit
from protocol.records import HivenodeRecordValidator
from protocol.rpc import Route, call_framed

logger = logging.getLogger(__name__)

REACH_ROUTE = "reach.check"  # served by bootstraps: "dial me back at these addresses"
MAX_REACH_MADDRS = 4  # addresses one check may ask a bootstrap to dial
MAX_REACH_REQUEST_BYTES = 4096
# One check dials from fresh daemons (a p2pd start each, ~0.5 s of CPU): a peer gets three in a burst (a check and
# the retries of an inconclusive one) and one per 30 s, and the bootstrap one a second overall, so the check cannot be turned into a way to make it spawn daemons.
REACH_RATE = RateLimit(rate_per_s=1.0 / 30.0, burst=3.0)
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
            f"peers cannot dial this node directly (the bootstrap could not dial {tried}); to be dialed directly "
            f"(faster than a relay), open TCP port {port} to this machine (forward it on your router) and start "
            f"with --listen /ip4/0.0.0.0/tcp/{port} --announce /ip4/{ip}/tcp/{port}"
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


async def _probe_daemon(target: str, *, use_relay: bool, timeout_s: float) -> Any:
    """A fresh daemon that listens nowhere and knows no one but `target`, which it must connect to to start
    (raises P2PDaemonError otherwise): what others see when they dial that address."""
    return await P2P.create(
        initial_peers=[target],
        dht_mode="client",
        use_relay=use_relay,
        auto_nat=False,
        nat_port_map=False,
        no_listen=True,
        startup_timeout=timeout_s,
        check_if_identity_free=False,
    )


async def probe_dial(maddr: str, peer_id: str, timeout_s: float) -> bool | None:
    """Whether a fresh daemon, with no relay and no other connection, can open a secure connection to `peer_id`
    at `maddr` (the handshake checks the peer id). None when the probe itself failed (our daemon did not start in
    time, say): that says nothing about the peer, and must not make it give up serving."""
    try:
        probe = await _probe_daemon(f"{maddr}/p2p/{peer_id}", use_relay=False, timeout_s=timeout_s)
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


REACH_ATTEMPTS = (
    3  # inconclusive checks (a probe daemon that did not start in time, a timeout) are asked again
)
REACH_RETRY_PAUSE_S = 2.0


async def check_reachability(
    dht: hivemind.DHT, entry_points: Sequence[str], *, timeout_s: float
) -> Reachability:
    """Ask the first bootstrap of `entry_points` that answers to dial us back at our announced addresses; when
    none could tell (its probe failed, the call timed out), ask again, `REACH_ATTEMPTS` rounds in all."""
    ours = [_without_peer_id(str(m)) for m in dht.get_visible_maddrs()][:MAX_REACH_MADDRS]
    ours = [m for m in ours if "p2p-circuit" not in m]
    if not ours:
        return Reachability(False)
    p2p = await dht.replicate_p2p()
    try:
        for attempt in range(1, REACH_ATTEMPTS + 1):
            reach = await _ask_bootstraps(p2p, entry_points, ours, timeout_s)
            if reach is not None:
                return reach
            if attempt < REACH_ATTEMPTS:
                logger.info(
                    "no bootstrap could tell whether we are reachable (check %d of %d); asking again in %.0f s",
                    attempt,
                    REACH_ATTEMPTS,
                    REACH_RETRY_PAUSE_S,
                )
                await asyncio.sleep(REACH_RETRY_PAUSE_S)
    finally:
        await p2p.shutdown()
    return Reachability(None, tuple(ours))


async def _ask_bootstraps(
    p2p: Any, entry_points: Sequence[str], ours: list[str], timeout_s: float
) -> Reachability | None:
    """One round of `check_reachability`: the first bootstrap's conclusive answer, None if none gave one."""
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
            logger.info("reach check via %s failed: %r", checker[-8:], e)
            continue
        if not dialable and unknown:
            logger.info("reach check via %s: its probe of %s failed", checker[-8:], ", ".join(unknown))
            continue  # its probe failed, not ours to judge: ask the next bootstrap
        return Reachability(bool(dialable), tuple(ours), dialable, observed, checker)
    return None


def circuit_addresses(entry_points: Sequence[str], peer_id: str) -> list[str]:
    """Where others reach `peer_id` through each bootstrap's relay: `<entry>/p2p-circuit/p2p/<peer_id>`."""
    return [
        f"{e}/{CIRCUIT}/p2p/{peer_id}" for e in entry_points if _maddr_part(e, "p2p") and CIRCUIT not in e
    ]


async def probe_circuit(circuit: str, timeout_s: float) -> bool:
    """Whether a fresh daemon opens a secure connection to us through `circuit`: the relay holds our reservation
    and relays for us (a relay that refuses answers NO_RESERVATION at once). Only a connection over the circuit
    counts: when the relay refuses, p2pd looks us up in its DHT and may dial our own address, which a probe on
    our machine reaches and nobody else does."""
    target = circuit.rsplit("/p2p/", 1)[1]
    try:
        probe = await _probe_daemon(circuit, use_relay=True, timeout_s=timeout_s)
    except Exception as e:  # P2PDaemonError: the relay refused, or no reservation yet
        logger.debug("relay probe of %s failed: %s", circuit, _daemon_message(e))
        return False
    try:
        peers = await probe.list_peers()
    finally:
        await probe.shutdown()
    return any(
        info.peer_id.to_base58() == target and any(CIRCUIT in str(a) for a in info.addrs) for info in peers
    )


async def relay_circuits(entry_points: Sequence[str], peer_id: str, wait_s: float) -> tuple[str, ...]:
    """The circuits through which a probe reached us, polling until one works or `wait_s` ran out (the
    reservation is usually there in tens of milliseconds; a probe costs a daemon start, ~0.5 s)."""
    candidates = circuit_addresses(entry_points, peer_id)
    deadline = time.monotonic() + wait_s
    while candidates:
        for circuit in candidates:
            left = deadline - time.monotonic()
            if left <= 0:
                return ()
            if await probe_circuit(circuit, timeout_s=min(left, REACH_PROBE_TIMEOUT_S)):
                return (circuit,)
        await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    return ()


def _unchecked(
    network: NetworkConfig, entry_points: Sequence[str], ours: Sequence[str]
) -> Connectivity | None:
    """The connectivity of a node no bootstrap is asked about (client mode asked for, checks off, no bootstrap,
    all on loopback), with the reason; None when a reach check should run."""
    if network.client_mode:
        return decide_connectivity(
            reachable=None, checked=False, dialed=ours, circuits=(), relay_tried=False, client_mode_asked=True
        )
    if needs_reach_check(network, entry_points):
        return None
    if not network.check_reachability:
        because = "network.check_reachability is off"
    elif not entry_points:
        because = "no bootstrap to ask"
    else:
        because = "every peer is on this machine's loopback"
    return decide_connectivity(
        reachable=None, checked=False, dialed=ours, circuits=(), relay_tried=False, unchecked_because=because
    )


RESTART_ATTEMPTS = 3
RESTART_PAUSE_S = 1.0


async def _start_again(
    identity: NodeIdentity, entry_points: Sequence[str], network: NetworkConfig, *, relayed: bool
) -> hivemind.DHT:
    """The DHT again, after the reach check, with the same identity: the bootstrap may still hold the connection
    of our first daemon for a moment, and p2pd then answered "failed to connect to bootstrap peers" (seen once in
    test_relay_netns), so a failed start is tried again after a pause."""
    for attempt in range(1, RESTART_ATTEMPTS + 1):
        try:
            return start_dht(identity, entry_points, network, HivenodeRecordValidator(), relayed=relayed)
        except JoinError as e:
            if attempt == RESTART_ATTEMPTS:
                raise
            logger.info("restarting the DHT failed (%s); again in %.0f s", e, RESTART_PAUSE_S)
            await asyncio.sleep(RESTART_PAUSE_S)
    raise AssertionError("unreachable")  # the loop returns or raises


async def start_reachable_dht(
    identity: NodeIdentity, entry_points: Sequence[str], network: NetworkConfig
) -> tuple[hivemind.DHT, Reachability | None, Connectivity]:
    """Start the DHT, then ask a bootstrap to dial us back (Petals' pattern). If it cannot, say in one line what
    to open or set, and restart with a reservation on the bootstraps' relays (DHT client mode: our records are
    stored, we serve no DHT requests); a probe through a relay decides relay mode, else client mode (it still
    trains, but serves nothing). Raises JoinError like `start_dht`; on failure nothing is left running."""
    dht = start_dht(identity, entry_points, network, HivenodeRecordValidator())
    try:
        ours = tuple(str(m) for m in network.announce) or tuple(str(m) for m in dht.get_visible_maddrs())
        unchecked = _unchecked(network, entry_points, ours)
        if unchecked is not None:
            return dht, None, unchecked
        reach = await check_reachability(dht, entry_points, timeout_s=network.join_timeout_s)
    except BaseException:
        dht.shutdown()
        raise
    if reach.reachable is not False:
        connectivity = decide_connectivity(
            reachable=reach.reachable, checked=True, dialed=reach.checked, circuits=(), relay_tried=False
        )
        return dht, reach, connectivity
    logger.warning(reach.advice(network.listen))
    dht.shutdown()
    client = dataclasses.replace(network, client_mode=True)
    relayed = network.use_auto_relay and network.use_relay
    dht = await _start_again(identity, entry_points, client, relayed=relayed)
    try:
        circuits = (
            await relay_circuits(entry_points, identity.peer_id, network.relay_wait_s) if relayed else ()
        )
    except BaseException:
        dht.shutdown()
        raise
    connectivity = decide_connectivity(
        reachable=False, checked=True, dialed=reach.checked, circuits=circuits, relay_tried=relayed
    )
    return dht, reach, connectivity
