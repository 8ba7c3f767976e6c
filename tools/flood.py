"""An RPC flood (reliability.md §6, D4) against a `FramedServer` route, over real hivemind P2P daemons on loopback.

Three peers, each a child process with its own p2pd: the VICTIM serves a route whose handler burns ~4 ms of CPU, as
a real one (a signature check and a small forward) would; the HONEST peer calls it at a steady 40 requests a second
(at most 4 in flight), the rate a verifier drives one stage replica at; the FLOODER is ONE identity (one p2pd)
that asks for 10,000 requests a second, open loop, with one of two engines:

- "answered" (the CI tests): hivemind's client, `call_framed`, up to 512 calls in flight, each waiting for its
  answer. The interpreter caps it at a few hundred to ~1,000 streams a second;
- "hangup" (benchmarks/flood.py): `FLOOD_PROCS` processes of a small C loop (`FLOOD_C`, built with the system's
  C compiler) send the daemon's StreamOpen request over its control socket, then the framed request, and hang up
  without reading the answer. It reaches the rate the attacker's core allows (thousands a second).

The box has two cores and the flood must not win by starving the victim of CPU on a shared machine: the flooder
and its daemon are pinned to one core ("the attacker's machine": it never gets more), and the victim and the
honest peer run at a higher priority than the rest of the box where the OS allows it (each stands for a machine
of its own). They are not pinned: pinned to the other core, they measured 10-15 of their 40 req/s without any
flood on a box at load 18-22 (other work on that core). The victim's memory is measured alone, in its own process.

With the limiter (the route's per-peer rate 50/s, burst 50) the flooder's excess is refused before a byte of its
requests is read, so the victim's handler loop stays free and the honest peer keeps >= 80 % of its no-flood
throughput; the flooder is counted, logged once per window, and struck for flooding. Negative control: the same
flood against a victim whose limits nobody can reach; the flood's requests all run the handler and the honest
peer's throughput collapses. Every injection is counted: the flooder reports the streams its daemon opened, the
victim what reached our layer (admitted or throttled); the rest never did (`dropped_below_us`: reset in the
daemons, or still queued there when counted). A run whose no-flood baseline or flood
rate shows the box could not carry the experiment is repeated, and the test skips (saying why) if none could.

The limiter holds the goal against the "answered" flood only: the "hangup" flood left the honest peer 0.36-0.78
of its throughput with the limiter on in the benchmark's runs (docs/security.md, "Not covered").

`test_flood_*` (CI) flood for 4 s; `benchmarks/flood.py` runs the full 10,000/s flood and the control, and a sweep.
The flood harness (tests/integration/test_flood.py and benchmarks/flood.py run it).
Run a child by hand: `python -m tools.flood victim|honest|flood ...` (see the `_*_main`s).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.errors import RemoteRefused
from protocol.limits import LimitsConfig, RateLimit
from protocol.rpc import (
    _CHUNK_HEADER,
    FramedServer,
    PeerThrottled,
    Route,
    Status,
    StreamConfig,
    call_framed,
    encode_preamble,
    protocol_name,
)
from tools.proctree import cpu_seconds, status_bytes

logger = logging.getLogger(__name__)

ROUTE = "work"
WORK_BYTES = 2 << 20  # hashed once per admitted request: ~3-5 ms on one core here
HONEST_RATE_PER_S = 40.0
HONEST_IN_FLIGHT = 4
ROUTE_RATE = RateLimit(rate_per_s=50.0, burst=50.0)  # per peer; the honest peer stays below it
FLOOD_RATE_PER_S = 10_000.0  # asked for; what the attacker's core reaches is measured and reported
MIN_FLOOD_RATE_PER_S = 4 * ROUTE_RATE.rate_per_s  # a flood must at least be one: well above the route's rate
FLOOD_S = 4.0
FLOOD_PROCS = 32  # flooder processes sharing the one daemon (each waits for its StreamOpen answer)
PY_FLOOD_IN_FLIGHT = 512  # the answered flood's calls in flight (what its daemon keeps open)
ATTACKER_CPU = 0  # the flooder's one core ("its machine"); no pinning on a single core
DEFENDER_NICE = -5  # the victim's and honest peer's "machines" ahead of the rest of a shared box (root only)
WINDOW_S = 2.5  # honest throughput is measured over this long, inside the flood
REQUEST = b"x" * 64
MIN_RATIO = 0.8
RSS_BUDGET_MIB = (
    64  # the victim's resident memory may grow at most this much during the flood (reliability M6)
)
CHILD_START_S = 40.0
MEASURE_ATTEMPTS = 3


def _limits(defended: bool) -> LimitsConfig:
    if defended:
        return LimitsConfig(rpc_rates={ROUTE: ROUTE_RATE})
    # The negative control: limits that no flood on this machine reaches (a server "without" a limiter).
    huge = RateLimit(rate_per_s=1e9, burst=1e9)
    return LimitsConfig(
        default_rate=huge,
        rpc_rates={ROUTE: huge},
        global_rate=None,
        max_streams_per_peer=100_000,
        max_streams_total=100_000,
    )


# ---- the children ----------------------------------------------------------------------------------------------


def _children_cpu_s() -> float:
    total = 0.0
    for child in Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split():
        total += cpu_seconds(child)  # 0 for a daemon that exited meanwhile
    return total


async def _start_p2p(initial_peers: list[str] | None = None) -> Any:
    from hivemind.p2p import P2P

    return await P2P.create(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])


def _prioritize(increment: int) -> None:
    """Renice this process (its daemon inherits it). The victim and the honest peer each stand for a machine of
    their own: ahead of other work on a shared box, so what is measured is the flood, not the box's load. Only
    root may raise priority; elsewhere this is a no-op."""
    with contextlib.suppress(PermissionError, OSError):
        os.nice(increment)


def _pin(cpu: int) -> None:
    """Keep this process (and the daemon it starts next) on one core, standing for a machine of its own."""
    with contextlib.suppress(AttributeError, OSError):
        if len(os.sched_getaffinity(0)) >= 2 and cpu < (os.cpu_count() or 1):
            os.sched_setaffinity(0, {cpu})


def _victim_main(defended: bool) -> None:
    """Serve ROUTE; print {"maddrs": [...]} once up, then one JSON stats line per line read on stdin."""
    _prioritize(DEFENDER_NICE)

    async def main() -> None:
        p2p = await _start_p2p()
        blob = os.urandom(WORK_BYTES)
        handled: dict[str, int] = {}

        async def work(frame: bytearray, remote_peer: str) -> bytes:
            handled[remote_peer] = handled.get(remote_peer, 0) + 1
            return hashlib.sha256(blob + bytes(frame)).digest()

        # Unlimited concurrent streams in the control (the limits decide); the defended server keeps its defaults.
        config = (
            StreamConfig() if defended else StreamConfig(max_streams_per_peer=100_000, max_streams=100_000)
        )
        server = FramedServer(p2p, {ROUTE: Route(work, 4096)}, config=config, limits=_limits(defended))
        await server.start()
        maddrs = [f"{m}/p2p/{p2p.peer_id.to_base58()}" for m in await p2p.get_visible_maddrs()]
        print(json.dumps({"maddrs": maddrs}), flush=True)
        loop = asyncio.get_running_loop()

        def stats() -> dict[str, Any]:
            limiter = server.limiter.stats()
            return {
                "rss_kib": status_bytes("VmRSS") // 1024,
                "hwm_kib": status_bytes("VmHWM") // 1024,
                "handled": dict(handled),
                "admitted": limiter.num_admitted,
                "throttled": {p: dict(s.throttled_by_reason) for p, s in limiter.peers.items()},
                "throttled_by_reason": dict(limiter.throttled_by_reason),
                "flood_reports": limiter.num_flood_reports,
                "floods_logged": dict(server.floods),
                "strikes": server.strikes.snapshot(),
                "tasks": len(asyncio.all_tasks()),
                "cpu_s": cpu_seconds("self"),
                "daemon_cpu_s": _children_cpu_s(),
            }

        while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
            if line == "reset":
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
            print(json.dumps(stats()), flush=True)
        await server.stop()
        await p2p.shutdown()

    asyncio.run(main())


def _honest_main(target: str) -> None:
    """The honest peer: print {"peer_id": ...} once connected, then run one `_honest_window` per "window <s>" line
    read on stdin and print it as JSON."""
    _prioritize(DEFENDER_NICE)

    async def main() -> None:
        p2p = await _start_p2p([target])
        victim = target.rsplit("/p2p/", 1)[1]
        print(json.dumps({"peer_id": p2p.peer_id.to_base58()}), flush=True)
        loop = asyncio.get_running_loop()
        while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
            window = await _honest_window(p2p, victim, float(line.split()[1]))
            print(json.dumps(dataclasses.asdict(window)), flush=True)
        await p2p.shutdown()

    asyncio.run(main())


FLOOD_C = r"""
/* Open framed-RPC streams through one p2pd (one identity) at a given rate, and hang up without waiting for the
   answers. argv: control socket, hex of the varint-delimited StreamOpen request, hex of the framed request, rate
   per second, duration in seconds, processes. Prints {"sent": streams opened and written, "failed": ...}. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>

static size_t unhex(const char *hex, unsigned char *out, size_t cap) {
    size_t n = strlen(hex) / 2;
    for (size_t i = 0; i < n && i < cap; i++) sscanf(hex + 2 * i, "%2hhx", &out[i]);
    return n < cap ? n : cap;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int read_full(int fd, unsigned char *buf, size_t n) {
    for (size_t got = 0; got < n;) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r <= 0) return -1;
        got += (size_t)r;
    }
    return 0;
}

static int one(const struct sockaddr_un *addr, const unsigned char *open_req, size_t open_len,
               const unsigned char *frame, size_t frame_len) {
    unsigned char buf[4096], b;
    size_t len = 0;
    int shift = 0, ok = -1, fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    if (connect(fd, (const struct sockaddr *)addr, sizeof(*addr)) != 0) goto done;
    if (write(fd, open_req, open_len) != (ssize_t)open_len) goto done;
    do { /* the daemon's answer: a varint length, then a Response whose type must be OK (field 1 = 0) */
        if (read_full(fd, &b, 1) < 0) goto done;
        len |= (size_t)(b & 0x7f) << shift;
        shift += 7;
    } while ((b & 0x80) && shift < 28);
    if (len < 2 || len > sizeof(buf) || read_full(fd, buf, len) < 0 || buf[0] != 0x08 || buf[1] != 0x00) goto done;
    if (write(fd, frame, frame_len) == (ssize_t)frame_len) ok = 0;
done:
    close(fd);
    return ok;
}

int main(int argc, char **argv) {
    if (argc != 7) return 2;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    strncpy(addr.sun_path, argv[1], sizeof(addr.sun_path) - 1);
    unsigned char open_req[1024], frame[4096];
    size_t open_len = unhex(argv[2], open_req, sizeof(open_req)), frame_len = unhex(argv[3], frame, sizeof(frame));
    double rate = atof(argv[4]), duration = atof(argv[5]), start = now_s();
    int procs = atoi(argv[6]);
    long *counts = mmap(NULL, sizeof(long) * 2 * procs, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    for (int p = 0; p < procs; p++) {
        if (fork() != 0) continue;
        long sent = 0, failed = 0;
        double elapsed;
        while ((elapsed = now_s() - start) < duration) {
            if (sent + failed >= (long)(elapsed * rate / procs)) {
                struct timespec pause = {0, 100000};
                nanosleep(&pause, NULL);
            } else if (one(&addr, open_req, open_len, frame, frame_len) == 0) {
                sent++;
            } else {
                failed++;
            }
        }
        counts[2 * p] = sent;
        counts[2 * p + 1] = failed;
        _exit(0);
    }
    while (wait(NULL) > 0) {}
    long sent = 0, failed = 0;
    for (int p = 0; p < procs; p++) sent += counts[2 * p], failed += counts[2 * p + 1];
    printf("{\"sent\": %ld, \"failed\": %ld, \"sending_s\": %.3f}\n", sent, failed, now_s() - start);
    return 0;
}
"""


def _build_flooder() -> Path | None:
    """FLOOD_C compiled into a temp dir (once per source), or None without a C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    digest = hashlib.sha256(FLOOD_C.encode()).hexdigest()[:16]
    binary = Path(tempfile.gettempdir()) / f"hivenode-flood-{digest}"
    if not binary.exists():
        source = binary.with_suffix(".c")
        source.write_text(FLOOD_C)
        built = subprocess.run([compiler, "-O2", "-o", f"{binary}.tmp", str(source)], capture_output=True)
        if built.returncode != 0:
            logger.warning("cannot build the C flooder: %s", built.stderr.decode(errors="replace")[-500:])
            return None
        os.replace(f"{binary}.tmp", binary)
    return binary


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, low = n >> 7, n & 0x7F
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _flood_bytes(victim: str) -> tuple[bytes, bytes]:
    """The daemon's StreamOpen request for ROUTE on `victim` (varint-delimited) and the framed request."""
    from hivemind.p2p import PeerID
    from hivemind.proto import p2pd_pb2

    open_stream = p2pd_pb2.StreamOpenRequest(
        peer=PeerID.from_base58(victim).to_bytes(), proto=[protocol_name(ROUTE)]
    )
    body = p2pd_pb2.Request(type=p2pd_pb2.Request.STREAM_OPEN, streamOpen=open_stream).SerializeToString()
    frame = (
        encode_preamble(Status.REQUEST, len(REQUEST), 1 << 20) + _CHUNK_HEADER.pack(len(REQUEST)) + REQUEST
    )
    return _varint(len(body)) + body, frame


async def _answered_flood(p2p: Any, victim: str, rate_per_s: float, duration_s: float) -> dict[str, Any]:
    """The flood through hivemind's client, waiting for each answer (`call_framed`): every request makes the victim
    answer, but the interpreter caps it at a few hundred to ~1,000 streams a second. "sent": calls started."""
    counts = {"sent": 0, "ok": 0, "throttled": 0, "refused": 0, "failed": 0, "skipped": 0}
    in_flight: set[asyncio.Task[None]] = set()

    async def one() -> None:
        try:
            await call_framed(p2p, victim, ROUTE, REQUEST, max_response_bytes=64, timeout_s=10)
            counts["ok"] += 1
        except PeerThrottled:
            counts["throttled"] += 1
        except RemoteRefused:
            counts["refused"] += 1
        except Exception:  # a stream the daemon could not open, a reset: the flood goes on
            counts["failed"] += 1

    loop = asyncio.get_running_loop()
    start = loop.time()
    while (elapsed := loop.time() - start) < duration_s:
        due = int(elapsed * rate_per_s) - counts["sent"] - counts["skipped"]
        for _ in range(max(0, due)):
            if len(in_flight) >= PY_FLOOD_IN_FLIGHT:
                counts["skipped"] += 1  # more than we keep open: not sent at all
                continue
            task = asyncio.create_task(one())
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            counts["sent"] += 1
        await asyncio.sleep(0.001)
    sending_s = loop.time() - start
    if in_flight:
        await asyncio.wait(in_flight, timeout=15)
    return {**counts, "sending_s": sending_s}


def _flood_main(target: str, rate_per_s: float, duration_s: float, engine: str) -> None:
    """One identity floods ROUTE open loop at `rate_per_s` for `duration_s` with `engine` ("answered": Python,
    waiting for answers; "hangup": the C loop, which hangs up once the request is written, falling back to
    "answered" without a C compiler); print {"started": ...}, then the counts."""
    _pin(ATTACKER_CPU)

    async def main() -> None:
        p2p = await _start_p2p([target])
        victim = target.rsplit("/p2p/", 1)[1]
        open_req, frame = _flood_bytes(victim)
        socket_path = p2p.daemon_listen_maddr["unix"]
        binary = await asyncio.to_thread(_build_flooder) if engine == "hangup" else None
        print(json.dumps({"started": True}), flush=True)
        if binary is not None:
            argv = [str(binary), socket_path, open_req.hex(), frame.hex(), str(rate_per_s), str(duration_s)]
            proc = await asyncio.create_subprocess_exec(*argv, str(FLOOD_PROCS), stdout=subprocess.PIPE)
            out, _ = await asyncio.wait_for(proc.communicate(), duration_s + 30)
            counts = {**json.loads(out), "engine": "hangup"}
        else:
            counts = {**await _answered_flood(p2p, victim, rate_per_s, duration_s), "engine": "answered"}
        print(json.dumps(counts), flush=True)
        await p2p.shutdown()

    asyncio.run(main())


# ---- the test --------------------------------------------------------------------------------------------------


@dataclass
class Child:
    popen: subprocess.Popen[str]

    def reply(self, timeout_s: float = CHILD_START_S) -> dict[str, Any]:
        """The child's next JSON line (bounded: the read happens in a thread we can stop waiting for)."""
        assert self.popen.stdout is not None
        result: list[str] = []

        import threading

        reader = threading.Thread(target=lambda: result.append(self.popen.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout_s)
        if not result or not result[0]:
            raise AssertionError(f"child {self.popen.args!r} gave no answer within {timeout_s} s")
        return json.loads(result[0])

    def ask(self, command: str) -> dict[str, Any]:
        assert self.popen.stdin is not None
        self.popen.stdin.write(command + "\n")
        self.popen.stdin.flush()
        return self.reply()

    def stop(self) -> None:
        with _suppress():
            if self.popen.stdin is not None:
                self.popen.stdin.close()
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=5)


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


def _spawn(*args: str) -> Child:
    popen = subprocess.Popen(
        [sys.executable, "-m", "tools.flood", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    return Child(popen)


@dataclass(frozen=True)
class Window:
    completed: int
    throttled: int
    failed: int
    seconds: float
    p99_s: float

    @property
    def rate(self) -> float:
        return self.completed / self.seconds


async def _honest_window(p2p: Any, victim: str, seconds: float) -> Window:
    """Call ROUTE at HONEST_RATE_PER_S for `seconds`, at most HONEST_IN_FLIGHT at once (an honest caller waits for
    its answers rather than piling up streams); count what completes inside the window."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    latencies: list[float] = []
    counts = {"throttled": 0, "failed": 0}
    slots = asyncio.Semaphore(HONEST_IN_FLIGHT)
    tasks: list[asyncio.Task[None]] = []

    async def one() -> None:
        sent = loop.time()
        try:
            await call_framed(p2p, victim, ROUTE, REQUEST, max_response_bytes=64, timeout_s=seconds)
        except PeerThrottled:
            counts["throttled"] += 1
            return
        except Exception:
            counts["failed"] += 1
            return
        finally:
            slots.release()
        if loop.time() - start <= seconds:
            latencies.append(loop.time() - sent)

    for i in range(int(seconds * HONEST_RATE_PER_S)):
        await asyncio.sleep(max(0.0, start + i / HONEST_RATE_PER_S - loop.time()))
        await slots.acquire()
        if loop.time() - start > seconds:
            slots.release()
            break
        tasks.append(asyncio.create_task(one()))
    if tasks:
        await asyncio.wait(tasks, timeout=seconds + 5)
    for task in tasks:
        task.cancel()
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, math.ceil(0.99 * len(latencies)) - 1)] if latencies else math.inf
    return Window(len(latencies), counts["throttled"], counts["failed"], seconds, p99)


@dataclass(frozen=True)
class FloodResult:
    baseline: Window
    flooded: Window
    flood: dict[
        str, Any
    ]  # the flooder's counts: sent (streams opened and written), failed, sending_s, engine
    before: dict[str, Any]
    after: dict[str, Any]
    flooder_id: str
    in_flood: bool  # the honest window ended before the flood did
    defended: bool
    rate_asked: float

    @property
    def offered_rps(self) -> float:
        """Streams the flooder's daemon opened for it, per second it sent."""
        return self.flood["sent"] / self.flood["sending_s"]

    @property
    def reached_us(self) -> int:
        """Flood requests our layer saw: run by the handler or throttled."""
        return self.after["handled"].get(self.flooder_id, 0) + sum(self.throttled.values())

    @property
    def throttled(self) -> dict[str, int]:
        return self.after["throttled"].get(self.flooder_id, {})

    @property
    def measurable(self) -> str:
        """Why this run cannot judge anything ("" if it can): the box could not carry the honest load without a
        flood, or could not produce a flood, or the window outlasted it. Other work on a shared box does that."""
        if self.baseline.rate < 0.9 * HONEST_RATE_PER_S:
            return f"no-flood honest throughput {self.baseline.rate:.1f} of {HONEST_RATE_PER_S:g} req/s"
        if self.offered_rps < MIN_FLOOD_RATE_PER_S:
            return f"the flooder reached {self.offered_rps:.0f} req/s"
        # (without limits, a swamped victim makes the window outlast the flood)
        if self.defended and not self.in_flood:
            return "the honest window outlasted the flood"
        return ""

    @property
    def ratio(self) -> float:
        return self.flooded.rate / self.baseline.rate

    @property
    def rss_growth_mib(self) -> float:
        return (self.after["hwm_kib"] - self.before["rss_kib"]) / 1024

    def summary(self) -> dict[str, Any]:
        """The figures a benchmark records."""
        return {
            "limiter": self.defended,
            "rate_asked": self.rate_asked,
            "offered_rps": round(self.offered_rps, 1),
            "flood_engine": self.flood.get("engine"),
            "flood_sent": self.flood["sent"],
            "flood_failed": self.flood["failed"],
            "flood_s": round(self.flood["sending_s"], 3),
            "reached_us": self.reached_us,
            "dropped_below_us": self.flood["sent"] - self.reached_us,
            "handled": self.after["handled"].get(self.flooder_id, 0),
            "throttled": self.throttled,
            "floods_logged": self.after["floods_logged"].get(self.flooder_id, 0),
            "honest_rps_baseline": round(self.baseline.rate, 2),
            "honest_rps_flood": round(self.flooded.rate, 2),
            "honest_ratio": round(self.ratio, 3),
            "honest_failed_in_flood": self.flooded.failed,
            "honest_p99_ms": [round(self.baseline.p99_s * 1e3, 1), round(self.flooded.p99_s * 1e3, 1)],
            "victim_rss_growth_mib": round(self.rss_growth_mib, 2),
            "victim_cpu_s": round(self.after["cpu_s"] - self.before["cpu_s"], 2),
            "victim_daemon_cpu_s": round(self.after["daemon_cpu_s"] - self.before["daemon_cpu_s"], 2),
        }


def run_flood(
    defended: bool, rate_per_s: float = FLOOD_RATE_PER_S, flood_s: float = FLOOD_S, engine: str = "answered"
) -> FloodResult:
    """One run: the honest peer's no-flood window, then a flood of `rate_per_s` for `flood_s` (see `_flood_main`
    for `engine`) with a window inside."""
    victim = _spawn("victim", "on" if defended else "off")
    children = [victim]
    try:
        target = victim.reply()["maddrs"][0]
        honest = _spawn("honest", target)
        children.append(honest)
        honest_id = honest.reply()["peer_id"]
        honest.ask("window 0.5")  # warm the connection up
        baseline = Window(**honest.ask(f"window {WINDOW_S}"))
        before = victim.ask("reset")
        flooder = _spawn("flood", target, str(rate_per_s), str(flood_s), engine)
        children.append(flooder)
        assert flooder.reply().get("started")
        flood_started = time.monotonic()
        # Let the flood reach full speed (its daemon's first streams), then measure inside it.
        time.sleep(0.5)
        flooded = Window(**honest.ask(f"window {WINDOW_S}"))
        in_flood = time.monotonic() - flood_started <= flood_s + 0.5
        flood = flooder.reply(timeout_s=60)
        time.sleep(1.0)  # what the victim's daemon still holds reaches it (or is dropped) before we count
        after = victim.ask("stats")
        flooder_ids = [p for p in [*after["throttled"], *after["handled"]] if p != honest_id]
        flooder_id = flooder_ids[0] if flooder_ids else ""
        return FloodResult(
            baseline, flooded, flood, before, after, flooder_id, in_flood, defended, rate_per_s
        )
    finally:
        for child in reversed(children):
            child.stop()


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "victim":
        _victim_main(sys.argv[2] == "on")
    elif role == "honest":
        _honest_main(sys.argv[2])
    elif role == "flood":
        _flood_main(sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
    else:
        raise SystemExit(f"unknown role {role!r}")
