"""The WAN proxy on loopback: delay, jitter without reordering, bandwidth, stalls, resets, partitions, and a real
hivemind DHT pair talking through it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import random
import socket
import statistics
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from tools.wan_proxy import LinkProfile, ProxyThread, WanProxy

logger = logging.getLogger(__name__)

pytestmark = pytest.mark.integration

TEST_TIMEOUT_S = 30.0
PING = b"ping-0123456789!"  # 16 bytes


def bounded(test: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run an async test body on a fresh event loop with a hard deadline."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), TEST_TIMEOUT_S))

    return run


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def echo_server() -> AsyncIterator[int]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


@contextlib.asynccontextmanager
async def proxied_echo(profile: LinkProfile) -> AsyncIterator[WanProxy]:
    async with echo_server() as port:
        proxy = WanProxy(target_host="127.0.0.1", target_port=port, profile=profile)
        await proxy.start()
        try:
            yield proxy
        finally:
            await proxy.stop()


async def _rtt(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes = PING) -> float:
    start = time.perf_counter()
    writer.write(payload)
    await writer.drain()
    assert await reader.readexactly(len(payload)) == payload
    return time.perf_counter() - start


# ---- delay, jitter, ordering ----------------------------------------------------------------------------------


@bounded
async def test_round_trip_matches_twice_the_one_way_delay() -> None:
    delay_s = 0.1
    async with proxied_echo(LinkProfile(delay_s=delay_s)) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        rtts = [await _rtt(reader, writer) for _ in range(10)]
        writer.close()
    one_way_error_s = statistics.median(rtts) / 2 - delay_s
    logger.info(
        "delay %.3f s: median one-way %.4f s (error %+.4f s)",
        delay_s,
        statistics.median(rtts) / 2,
        one_way_error_s,
    )
    assert min(rtts) >= 2 * delay_s - 0.002, "no byte may arrive before its delay"
    assert one_way_error_s < 0.025, f"median RTT {statistics.median(rtts):.3f} s for a 2 x {delay_s} s link"
    assert proxy.stats.bytes_to_target == proxy.stats.bytes_to_client == 10 * len(PING)


@bounded
async def test_jitter_spreads_delays_but_never_reorders_bytes() -> None:
    delay_s, jitter_s, num_messages = 0.05, 0.04, 150
    async with proxied_echo(LinkProfile(delay_s=delay_s, jitter_s=jitter_s, seed=7)) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        sent_at: list[float] = []

        async def send() -> None:
            for i in range(num_messages):
                sent_at.append(time.perf_counter())
                writer.write(struct.pack("!I", i))
                await writer.drain()
                await asyncio.sleep(0.003)  # separate chunks, each with its own jitter draw

        sender = asyncio.create_task(send())
        received, rtts = [], []
        for _ in range(num_messages):
            (i,) = struct.unpack("!I", await reader.readexactly(4))
            received.append(i)
            rtts.append(time.perf_counter() - sent_at[i])
        await sender
        writer.close()
    assert received == list(range(num_messages)), "bytes were reordered"
    logger.info("jitter: RTT min %.3f mean %.3f max %.3f s", min(rtts), statistics.mean(rtts), max(rtts))
    assert min(rtts) >= 2 * (delay_s - jitter_s) - 0.002
    assert max(rtts) <= 2 * (delay_s + jitter_s) + 0.05  # each one-way delay is at most delay + jitter
    assert statistics.pstdev(rtts) > 0.005, "jitter had no visible effect"


@bounded
async def test_bulk_bytes_survive_jitter_and_a_bandwidth_cap_intact() -> None:
    payload = random.Random(3).randbytes(1 << 20)
    profile = LinkProfile(
        delay_s=0.02, jitter_s=0.02, bandwidth_bytes_per_s=8 << 20, burst_bytes=16 << 10, seed=1
    )
    async with proxied_echo(profile) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(payload)
        writer.write_eof()
        echoed = await reader.read(-1)  # to EOF: the half-close travels through both directions
        writer.close()
    assert hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()


# ---- bandwidth ---------------------------------------------------------------------------------------------


@bounded
async def test_throughput_follows_the_bandwidth_cap() -> None:
    rate, burst, total = 1 << 20, 64 << 10, 2 << 20  # 1 MiB/s, 64 KiB burst, 2 MiB
    arrivals: list[tuple[float, int]] = []
    done = asyncio.Event()

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received = 0
        while data := await reader.read(65536):
            received += len(data)
            arrivals.append((time.perf_counter(), received))
        done.set()
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    proxy = WanProxy(
        target_host="127.0.0.1",
        target_port=server.sockets[0].getsockname()[1],
        profile=LinkProfile(bandwidth_bytes_per_s=rate, burst_bytes=burst),
    )
    await proxy.start()
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        start = time.perf_counter()
        writer.write(random.Random(0).randbytes(total))
        writer.write_eof()
        await done.wait()
        writer.close()
    finally:
        await proxy.stop()
        server.close()
    elapsed_s = arrivals[-1][0] - start
    # The first `burst` bytes may leave at once; the rest at `rate`.
    expected_s = (total - burst) / rate
    steady = [(t, n) for t, n in arrivals if n > burst]
    steady_rate = (steady[-1][1] - steady[0][1]) / (steady[-1][0] - steady[0][0])
    logger.info(
        "bandwidth cap %d B/s: steady %.0f B/s (%.3f x), total %.3f s vs %.3f s",
        rate,
        steady_rate,
        steady_rate / rate,
        elapsed_s,
        expected_s,
    )
    assert arrivals[-1][1] == total
    assert 0.85 * rate <= steady_rate <= 1.05 * rate
    assert expected_s * 0.97 <= elapsed_s <= expected_s * 1.25


# ---- stalls and resets ------------------------------------------------------------------------------------


@bounded
async def test_stalls_hold_traffic_and_are_counted() -> None:
    profile = LinkProfile(stall_every_s=0.25, stall_s=0.15, seed=5)
    async with proxied_echo(profile) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 1.5
        rtts = []
        while loop.time() < deadline:
            rtts.append(await _rtt(reader, writer))
            await asyncio.sleep(0.01)  # a steady trickle, not a busy loop on a shared machine
        writer.close()
        stats = proxy.stats
    slow = [rtt for rtt in rtts if rtt > 0.05]
    logger.info(
        "stalls: %d injected, %d of %d pings slowed, worst %.3f s",
        stats.stalls_injected,
        len(slow),
        len(rtts),
        max(rtts),
    )
    assert stats.stalls_injected >= 3  # 1.5 s at one per 0.125-0.375 s
    assert len(slow) >= 2 and max(rtts) <= 0.15 + 0.1


@bounded
async def test_resets_are_injected_on_schedule_counted_and_seen_by_the_client() -> None:
    reset_every_s, num_connections = 0.2, 5
    async with proxied_echo(LinkProfile(reset_every_s=reset_every_s, seed=11)) as proxy:
        lifetimes, observed = [], 0
        for _ in range(num_connections):
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            opened = time.perf_counter()
            try:
                while True:
                    await _rtt(reader, writer)
                    await asyncio.sleep(0.005)
            except (ConnectionResetError, asyncio.IncompleteReadError, BrokenPipeError):
                observed += 1
                lifetimes.append(time.perf_counter() - opened)
            writer.close()
        stats = proxy.stats
    assert observed == stats.resets_injected == num_connections
    assert all(0.5 * reset_every_s - 0.01 <= t <= 1.5 * reset_every_s + 0.1 for t in lifetimes), lifetimes


# ---- partitions -------------------------------------------------------------------------------------------


@bounded
async def test_refusing_partition_cuts_and_refuses_then_heals() -> None:
    async with proxied_echo(LinkProfile(delay_s=0.01)) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        await _rtt(reader, writer)

        proxy.partition(True)
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await _rtt(reader, writer)
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError, BrokenPipeError)):
            await _rtt(reader, writer)
        writer.close()

        proxy.partition(False)
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await _rtt(reader, writer) >= 0.02
        writer.close()
        stats = proxy.stats
    assert (stats.partition_cut, stats.partition_refused, stats.partition_drops) == (1, 1, 2)


@bounded
async def test_blackhole_partition_holds_bytes_until_healed() -> None:
    async with proxied_echo(LinkProfile()) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        await _rtt(reader, writer)
        proxy.partition(True, mode="blackhole")
        held = asyncio.create_task(_rtt(reader, writer))
        late_reader, late_writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        late = asyncio.create_task(_rtt(late_reader, late_writer))
        done, _ = await asyncio.wait({held, late}, timeout=0.5)
        assert not done, "nothing may cross a blackholed link"
        proxy.partition(False)
        assert (await held) >= 0.5 and (await late) >= 0.5
        writer.close()
        late_writer.close()
        stats = proxy.stats
    assert stats.partition_held_chunks >= 1 and stats.partition_held_connections == 1


def test_only_loopback_is_allowed() -> None:
    with pytest.raises(ValueError):
        WanProxy(target_host="10.0.0.1", target_port=1)
    with pytest.raises(ValueError):
        WanProxy(target_host="127.0.0.1", target_port=1, listen_host="0.0.0.0")
    with pytest.raises(ValueError):
        LinkProfile(stall_every_s=1.0)  # a stall schedule without a stall length


# ---- ProxyThread from synchronous code --------------------------------------------------------------------


def _blocking_echo_server() -> tuple[socket.socket, threading.Thread]:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    thread = threading.Thread(target=serve, name="echo", daemon=True)
    thread.start()
    return listener, thread


def test_proxy_thread_serves_synchronous_code_and_stops_cleanly() -> None:
    listener, echo_thread = _blocking_echo_server()
    profile = LinkProfile(delay_s=0.05)
    try:
        with ProxyThread(
            target_host="127.0.0.1", target_port=listener.getsockname()[1], profile=profile
        ) as proxy:
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as client:
                start = time.perf_counter()
                client.sendall(PING)
                assert client.recv(64) == PING
                rtt = time.perf_counter() - start
            assert 0.098 <= rtt < 0.2
            assert proxy.stats.bytes_to_client == len(PING)
        assert not proxy.running
        assert proxy.stats.connections_accepted == 1
    finally:
        listener.close()
        echo_thread.join(5)


# ---- a real hivemind DHT pair through the proxy -----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def _ping_peer(dht: Any, node: Any, peer_id: Any) -> bool:
    """Runs inside the DHT process: what a node's re-bootstrap does after hivemind dropped a silent peer."""
    return await node.protocol.call_ping(peer_id) is not None


def _wait_for(condition: Callable[[], bool], timeout_s: float, period_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(period_s)
    return False


def test_hivemind_dht_through_a_delayed_link_and_across_a_partition() -> None:
    import hivemind
    from hivemind.utils import get_dht_time

    delay_s = 0.1
    ports = [_free_port(), _free_port()]
    proxies = [
        ProxyThread(target_host="127.0.0.1", target_port=port, profile=LinkProfile(delay_s=delay_s, seed=i))
        for i, port in enumerate(ports)
    ]
    dhts: list[Any] = []
    try:
        for proxy in proxies:
            proxy.start()
        common = {"blacklist_time": 0.5, "wait_timeout": 2.0}
        # Each node listens on its own port but announces its proxy, so every byte between them crosses a link.
        dhts.append(
            hivemind.DHT(
                start=True,
                host_maddrs=[f"/ip4/127.0.0.1/tcp/{ports[0]}"],
                announce_maddrs=[f"/ip4/127.0.0.1/tcp/{proxies[0].port}"],
                **common,
            )
        )
        first_peer = dhts[0].peer_id
        dhts.append(
            hivemind.DHT(
                start=True,
                initial_peers=[f"/ip4/127.0.0.1/tcp/{proxies[0].port}/p2p/{first_peer}"],
                host_maddrs=[f"/ip4/127.0.0.1/tcp/{ports[1]}"],
                announce_maddrs=[f"/ip4/127.0.0.1/tcp/{proxies[1].port}"],
                **common,
            )
        )
        first, second = dhts

        start = time.perf_counter()
        assert second.store("before", "v1", get_dht_time() + 60)
        store_s = time.perf_counter() - start
        assert first.get("before", latest=True).value == "v1"
        assert store_s >= 2 * delay_s, f"store took {store_s:.3f} s: it did not cross the 100 ms link"
        assert proxies[0].stats.bytes_to_target > 0

        for proxy in proxies:
            proxy.partition(True)
        first.store("during", "v2", get_dht_time() + 60)
        start = time.perf_counter()
        assert second.get("during", latest=True) is None, "a value crossed the partition"
        partitioned_get_s = time.perf_counter() - start
        assert sum(p.stats.partition_drops for p in proxies) >= 1

        for proxy in proxies:
            proxy.partition(False)
        healed_at = time.perf_counter()
        # hivemind drops a peer that failed a call from its routing table and never re-dials initial peers on
        # its own, so a two-node DHT stays split after a partition heals until one side pings the other.
        rejoined = _wait_for(
            lambda: second.run_coroutine(functools.partial(_ping_peer, peer_id=first_peer)), timeout_s=10.0
        )
        assert rejoined, "could not ping the first peer through the healed link"
        rejoined_s = time.perf_counter() - healed_at
        assert _wait_for(
            lambda: (r := second.get("during", latest=True)) is not None and r.value == "v2", 10.0
        )
        logger.info(
            "DHT over a %.0f ms link: store %.3f s; get during partition gave up after %.3f s; "
            "after healing: ping %.3f s, get %.3f s; %s",
            delay_s * 1000,
            store_s,
            partitioned_get_s,
            rejoined_s,
            time.perf_counter() - healed_at,
            [dataclasses.asdict(p.stats) for p in proxies],
        )
    finally:
        for dht in dhts:
            dht.shutdown()
        for proxy in proxies:
            proxy.stop()
