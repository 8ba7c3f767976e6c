"""A user-space WAN emulator: an asyncio TCP proxy that shapes one loopback link.

These machines have no `tc netem`, so the shaping happens in the proxy. Put a `WanProxy` in front of a node's
listening port, have the node announce the proxy's address, and every byte to and from that node crosses an
emulated internet link:

- one-way delay with jitter, per direction, without ever reordering bytes within a TCP stream: a chunk is
  delivered at max(previous delivery, arrival + serialisation + delay + jitter). Keeping order biases the
  delay upwards when chunks come closer together than the jitter span (as on a real link);
- a bandwidth cap per direction (a token bucket of `burst_bytes`, so idle links send a first burst at once);
- a cap on bytes in flight per direction (the emulated TCP window), which keeps the proxy's memory bounded
  and throttles the sender through ordinary TCP back-pressure;
- stalls and connection resets on a seeded schedule (each connection draws its own `random.Random`);
- partitions: `partition(True, mode="refuse")` resets every connection and refuses new ones;
  `mode="blackhole"` lets connections open but delivers nothing until healed (held bytes then flow, as TCP
  retransmission would deliver them after a short outage). `from_pids` limits a partition to connections
  dialed by those processes (the proxy finds the owner of the client socket in /proc; Linux only), so a proxy
  per node that cuts the other side's processes splits a swarm into two sides. (p2pd dials from its listening
  port, but not always: a dial that would collide with an open connection falls back to an ephemeral port, so
  the source port alone does not name the dialer.)

Everything it does is counted in `stats`. It only ever binds and connects 127.0.0.1 or ::1.
`ProxyThread` runs a proxy on its own event loop in a background thread, for synchronous tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import socket
import struct
import threading
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1"})
MAX_CHUNK_BYTES = 64 * 1024
PartitionMode = Literal["refuse", "blackhole"]
_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkProfile:
    """How the emulated link behaves; the same profile applies to both directions."""

    delay_s: float = 0.0  # one-way propagation delay
    jitter_s: float = 0.0  # each chunk's delay is delay_s + uniform(-jitter_s, +jitter_s), floored at 0
    bandwidth_bytes_per_s: float | None = None  # per direction; None: unlimited
    burst_bytes: int = 64 * 1024  # token-bucket depth for the bandwidth cap; also the largest chunk
    max_in_flight_bytes: int = 4 * 1024 * 1024  # per direction; like a TCP window, bounds memory
    reset_every_s: float | None = None  # mean connection lifetime before an injected reset (uniform 0.5-1.5x)
    stall_every_s: float | None = None  # mean time between stalls (uniform 0.5-1.5x)
    stall_s: float = 0.0  # how long each stall holds both directions
    seed: int = 0  # schedules, jitter: connection i of a proxy uses random.Random(f"{seed}:{i}:...")
    connect_timeout_s: float = 5.0  # for the proxy's own connection to the target

    def __post_init__(self) -> None:
        if self.delay_s < 0 or self.jitter_s < 0 or self.stall_s < 0:
            raise ValueError("delay_s, jitter_s and stall_s must be >= 0")
        if self.bandwidth_bytes_per_s is not None and self.bandwidth_bytes_per_s <= 0:
            raise ValueError("bandwidth_bytes_per_s must be positive (or None for unlimited)")
        if self.burst_bytes < 1 or self.max_in_flight_bytes < 1:
            raise ValueError("burst_bytes and max_in_flight_bytes must be >= 1")
        for name in ("reset_every_s", "stall_every_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive (or None for never)")
        if self.stall_every_s is not None and self.stall_s <= 0:
            raise ValueError("stall_every_s needs stall_s > 0")
        if self.connect_timeout_s <= 0:
            raise ValueError("connect_timeout_s must be positive")

    @property
    def chunk_bytes(self) -> int:
        return min(MAX_CHUNK_BYTES, self.burst_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class ProxyStats:
    bytes_to_target: int  # delivered client -> target
    bytes_to_client: int  # delivered target -> client
    connections_accepted: int
    connections_open: int
    upstream_connect_failures: int
    resets_injected: int
    stalls_injected: int
    partition_refused: int  # connections refused while partitioned ("refuse")
    partition_cut: int  # open connections reset when a "refuse" partition began
    partition_held_chunks: int  # chunks held back by a "blackhole" partition
    partition_held_connections: int  # connections kept waiting by a "blackhole" partition

    @property
    def partition_drops(self) -> int:
        """Everything the partition switch did to traffic, in one number."""
        return self.partition_refused + self.partition_cut + self.partition_held_chunks


@dataclass(slots=True)
class _Counters:
    bytes_to_target: int = 0
    bytes_to_client: int = 0
    connections_accepted: int = 0
    upstream_connect_failures: int = 0
    resets_injected: int = 0
    stalls_injected: int = 0
    partition_refused: int = 0
    partition_cut: int = 0
    partition_held_chunks: int = 0
    partition_held_connections: int = 0


def _check_loopback(host: str) -> None:
    if host not in LOOPBACK_HOSTS:
        raise ValueError(
            f"the WAN proxy only binds and connects loopback ({sorted(LOOPBACK_HOSTS)}), got {host!r}"
        )


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST rather than a FIN, as a middlebox dropping the connection would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _peer_port(writer: asyncio.StreamWriter) -> int | None:
    peer = writer.get_extra_info("peername")
    return peer[1] if isinstance(peer, tuple) and len(peer) >= 2 else None


def _socket_inode(client_port: int, server_port: int) -> int | None:
    """The inode of the client end of a loopback TCP connection (from /proc/net/tcp{,6})."""
    ends = {(f"0100007F:{client_port:04X}", f"0100007F:{server_port:04X}")}
    ends.add((f"{'0' * 24}01000000:{client_port:04X}", f"{'0' * 24}01000000:{server_port:04X}"))
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in rows:
                fields = row.split()
                if len(fields) > 9 and (fields[1], fields[2]) in ends:
                    return int(fields[9])
    return None


def _owned_by(inode: int, pids: Collection[int]) -> bool:
    target = f"socket:[{inode}]"
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        return True
    return False


def _spread(rng: random.Random, mean_s: float) -> float:
    return mean_s * rng.uniform(0.5, 1.5)


class _Direction:
    """One direction of one connection: reads chunks, schedules them on the emulated link, delivers in order."""

    def __init__(
        self,
        conn: _Connection,
        name: Literal["to_target", "to_client"],
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        rng: random.Random,
    ) -> None:
        self.name = name
        self._conn, self._src, self._dst, self._rng = conn, src, dst, rng
        profile = conn.proxy.profile
        self._queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(
            maxsize=max(1, profile.max_in_flight_bytes // profile.chunk_bytes)
        )
        self._tokens = float(profile.burst_bytes)  # bandwidth bucket, in virtual (link) time
        self._tokens_at = 0.0
        self._last_delivery = 0.0

    async def run(self) -> None:
        reader = asyncio.create_task(self._read(), name=f"wan-{self.name}-read")
        try:
            await self._deliver()
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await self._src.read(self._conn.proxy.profile.chunk_bytes):
                await self._queue.put((self._schedule(loop.time(), len(data)), data))
        except (ConnectionError, OSError):
            self._conn.abort()  # the reset travels on to the other side
        await self._queue.put(None)

    def _schedule(self, arrival: float, num_bytes: int) -> float:
        profile = self._conn.proxy.profile
        sent = max(arrival, self._tokens_at)
        if profile.bandwidth_bytes_per_s is not None:
            rate = profile.bandwidth_bytes_per_s
            self._tokens = min(float(profile.burst_bytes), self._tokens + (sent - self._tokens_at) * rate)
            if self._tokens < num_bytes:
                sent += (num_bytes - self._tokens) / rate
                self._tokens = float(num_bytes)
            self._tokens -= num_bytes
        self._tokens_at = sent
        jitter = self._rng.uniform(-profile.jitter_s, profile.jitter_s) if profile.jitter_s else 0.0
        delivery = max(self._last_delivery, sent + max(0.0, profile.delay_s + jitter))
        self._last_delivery = delivery
        return delivery

    async def _deliver(self) -> None:
        loop = asyncio.get_running_loop()
        while (item := await self._queue.get()) is not None:
            deliver_at, data = item
            if (wait_s := deliver_at - loop.time()) > 0:
                await asyncio.sleep(wait_s)
            await self._conn.wait_link_up()
            if self._conn.closed:
                return
            try:
                self._dst.write(data)
                await self._dst.drain()
            except (ConnectionError, OSError):
                self._conn.abort()
                return
            self._conn.proxy.count_bytes(self.name, len(data))
        if not self._conn.closed and self._dst.can_write_eof():
            with contextlib.suppress(ConnectionError, OSError):
                self._dst.write_eof()  # pass the half-close on: the other direction may still carry a reply


class _Connection:
    def __init__(
        self,
        proxy: WanProxy,
        index: int,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        target: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy, self.index = proxy, index
        self.client_writer, self.target_writer = client[1], target[1]
        self.cut = proxy.cuts(_peer_port(client[1]))  # a partition, if on, applies to this connection
        seed = proxy.profile.seed
        self._directions = (
            _Direction(self, "to_target", client[0], target[1], random.Random(f"{seed}:{index}:to_target")),
            _Direction(self, "to_client", target[0], client[1], random.Random(f"{seed}:{index}:to_client")),
        )
        self._chaos_rng = random.Random(f"{seed}:{index}:chaos")
        self.stall_until = 0.0
        self.closed = False

    async def run(self) -> None:
        tasks = [
            asyncio.create_task(d.run(), name=f"wan-conn{self.index}-{d.name}") for d in self._directions
        ]
        chaos = [asyncio.create_task(coro) for coro in self._chaos()]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in (*tasks, *chaos):
                task.cancel()
            await asyncio.gather(*tasks, *chaos, return_exceptions=True)
            if not self.closed:
                self.closed = True
                self.client_writer.close()
                self.target_writer.close()

    def _chaos(self) -> list[Coroutine[None, None, None]]:
        profile = self.proxy.profile
        coros: list[Coroutine[None, None, None]] = []
        if profile.reset_every_s is not None:
            coros.append(self._reset_later(_spread(self._chaos_rng, profile.reset_every_s)))
        if profile.stall_every_s is not None:
            coros.append(self._stall_repeatedly(profile.stall_every_s, profile.stall_s))
        return coros

    async def _reset_later(self, after_s: float) -> None:
        await asyncio.sleep(after_s)
        if not self.closed:
            self.proxy.counters.resets_injected += 1
            self.abort()

    async def _stall_repeatedly(self, every_s: float, stall_s: float) -> None:
        loop = asyncio.get_running_loop()
        while not self.closed:
            await asyncio.sleep(_spread(self._chaos_rng, every_s))
            self.stall_until = max(self.stall_until, loop.time() + stall_s)
            self.proxy.counters.stalls_injected += 1

    async def wait_link_up(self) -> None:
        loop = asyncio.get_running_loop()
        counted = False
        while not self.closed:
            if self.proxy.blackholed and self.cut:
                if not counted:
                    self.proxy.counters.partition_held_chunks += 1
                    counted = True
                await self.proxy.healed.wait()
            elif (stall_left_s := self.stall_until - loop.time()) > 0:
                await asyncio.sleep(stall_left_s)
            else:
                return

    def abort(self) -> None:
        """Reset both sides at once (idempotent)."""
        if not self.closed:
            self.closed = True
            _reset(self.client_writer)
            _reset(self.target_writer)


class WanProxy:
    """An emulated WAN link in front of `target_host:target_port`. Use on one event loop; see `ProxyThread`."""

    def __init__(
        self,
        *,
        target_host: str,
        target_port: int,
        profile: LinkProfile | None = None,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        _check_loopback(listen_host)
        _check_loopback(target_host)
        self.target_host, self.target_port = target_host, target_port
        self.listen_host, self._listen_port = listen_host, listen_port
        self.profile = profile or LinkProfile()
        self.counters = _Counters()
        self.blackholed = False
        self._refusing = False
        self._cut_pids: frozenset[int] | None = None  # None: a partition cuts every connection
        self.healed = asyncio.Event()
        self.healed.set()
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task] = set()
        self._next_index = 0
        self._stopping = False

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        return self._server.sockets[0].getsockname()[1]

    @property
    def stats(self) -> ProxyStats:
        return ProxyStats(connections_open=len(self._connections), **dataclasses.asdict(self.counters))

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.listen_host, self._listen_port)
        logger.info(
            "WAN proxy %s:%d -> %s:%d with %s",
            self.listen_host,
            self.port,
            self.target_host,
            self.target_port,
            self.profile,
        )

    async def stop(self) -> None:
        """Stop listening, reset every connection, and wait for the handlers to finish."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        self.partition(
            False
        )  # wakes handlers and chunks held by a blackhole; they see `_stopping` or `closed`
        for conn in list(self._connections):
            conn.abort()
        if self._handlers:
            # Handlers end on their own once their connections are aborted (within one delay or connect timeout).
            # Cancelling them instead trips asyncio 3.11's start_server callback into logging CancelledError.
            _, pending = await asyncio.wait(self._handlers, timeout=self.profile.connect_timeout_s + 1.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def set_profile(self, profile: LinkProfile) -> None:
        """Applies to chunks read from now on; schedules of open connections keep their seed-drawn times."""
        self.profile = profile

    def partition(
        self, on: bool, *, mode: PartitionMode = "refuse", from_pids: Collection[int] | None = None
    ) -> None:
        """Switch the partition on or off; with `from_pids`, it only cuts connections those processes dialed.
        Call on the proxy's event loop."""
        if mode not in ("refuse", "blackhole"):
            raise ValueError(f"unknown partition mode {mode!r}")
        if not on:
            self._refusing = self.blackholed = False
            self._cut_pids = None
            self.healed.set()
            return
        self._cut_pids = None if from_pids is None else frozenset(from_pids)
        for conn in self._connections:
            conn.cut = self.cuts(_peer_port(conn.client_writer))
        self._refusing = mode == "refuse"
        self.blackholed = mode == "blackhole"
        if self.blackholed:
            self.healed.clear()
            return
        self.healed.set()
        for conn in list(self._connections):
            if not conn.closed and conn.cut:
                self.counters.partition_cut += 1
                conn.abort()

    def cuts(self, client_port: int | None) -> bool:
        """Whether the partition, if on, applies to a connection from `client_port` (a port of ours, on loopback)."""
        if self._cut_pids is None:
            return True
        if client_port is None or self._server is None:
            return False
        inode = _socket_inode(client_port, self.port)
        return inode is not None and _owned_by(inode, self._cut_pids)

    def count_bytes(self, direction: Literal["to_target", "to_client"], num_bytes: int) -> None:
        if direction == "to_target":
            self.counters.bytes_to_target += num_bytes
        else:
            self.counters.bytes_to_client += num_bytes

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._serve(client_reader, client_writer)
        finally:
            self._handlers.discard(task)

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.counters.connections_accepted += 1
        index, self._next_index = self._next_index, self._next_index + 1
        client_port = _peer_port(client_writer)
        if self._refusing and self.cuts(client_port):
            self.counters.partition_refused += 1
            _reset(client_writer)
            return
        if self.blackholed and self.cuts(client_port):
            self.counters.partition_held_connections += 1
            await self.healed.wait()
            if self._refusing and self.cuts(client_port):  # healed into a refusing partition
                self.counters.partition_refused += 1
                _reset(client_writer)
                return
        if self._stopping:
            _reset(client_writer)
            return
        try:
            target = await asyncio.wait_for(
                asyncio.open_connection(self.target_host, self.target_port), self.profile.connect_timeout_s
            )
        except (OSError, TimeoutError):
            self.counters.upstream_connect_failures += 1
            _reset(client_writer)
            return
        conn = _Connection(self, index, (client_reader, client_writer), target)
        refused = self._refusing and self.cuts(client_port)
        if refused or self._stopping:  # a partition or stop() began while we were connecting
            self.counters.partition_refused += refused
            conn.abort()
            return
        self._connections.add(conn)
        try:
            await conn.run()
        finally:
            self._connections.discard(conn)


class ProxyThread:
    """A `WanProxy` on its own event loop in a named daemon thread, driven from synchronous code.

    `with ProxyThread(target_host=..., target_port=..., profile=...) as proxy:` starts it and stops it cleanly.
    """

    def __init__(
        self,
        *,
        target_host: str,
        target_port: int,
        profile: LinkProfile | None = None,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        start_timeout_s: float = 10.0,
    ) -> None:
        _check_loopback(listen_host)
        _check_loopback(target_host)
        self._proxy_kwargs: dict[str, Any] = {
            "target_host": target_host,
            "target_port": target_port,
            "profile": profile,
            "listen_host": listen_host,
            "listen_port": listen_port,
        }
        self._start_timeout_s = start_timeout_s
        self._loop = asyncio.new_event_loop()
        self._proxy: WanProxy | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> int:
        """Start the proxy; return the port it listens on."""
        self._thread = threading.Thread(target=self._run, name="wan-proxy", daemon=True)
        self._thread.start()
        if not self._started.wait(self._start_timeout_s):
            raise TimeoutError("the WAN proxy did not start in time")
        if self._error is not None:
            raise RuntimeError("the WAN proxy failed to start") from self._error
        self._thread.name = f"wan-proxy-{self.port}"
        return self.port

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._proxy = WanProxy(
                **self._proxy_kwargs
            )  # built here so that its asyncio objects use this loop
            self._loop.run_until_complete(self._proxy.start())
        except BaseException as e:  # handed to start(), which re-raises it in the caller's thread
            self._error = e
            self._started.set()
            self._loop.close()
            return
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._proxy.stop())
            leftovers = asyncio.all_tasks(self._loop)
            for task in leftovers:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    def _call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """Run `fn` on the proxy's loop (the proxy is not thread-safe) and return its result."""

        async def call() -> _T:
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout=self._start_timeout_s)

    @property
    def proxy(self) -> WanProxy:
        if self._proxy is None:
            raise RuntimeError("the proxy is not started")
        return self._proxy

    @property
    def port(self) -> int:
        return self.proxy.port

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def stats(self) -> ProxyStats:
        """A snapshot; after `stop()` it is the final count."""
        if not self.running:
            return self.proxy.stats
        return self._call(lambda: self.proxy.stats)

    def partition(
        self, on: bool, *, mode: PartitionMode = "refuse", from_pids: Collection[int] | None = None
    ) -> None:
        self._call(self.proxy.partition, on, mode=mode, from_pids=from_pids)

    def set_profile(self, profile: LinkProfile) -> None:
        self._call(self.proxy.set_profile, profile)

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self.running:
            return
        assert self._thread is not None  # running
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError("the WAN proxy thread did not stop in time")

    def __enter__(self) -> ProxyThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
