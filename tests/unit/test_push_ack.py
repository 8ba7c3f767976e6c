"""A push the syncer judges for longer than the learner's call timeout is still acknowledged (issue 17).

At llama-350m the syncer's loss probe held each push 37-48 s, longer than the learner's push timeout (10 s + bytes
at 8 MiB/s): the learner gave up, the syncer accepted the push anyway, and its answer found the stream closed:
`acked` 0 in every round (docs/scale.md, "Push pacing"). Reproduced here in seconds, end to end in one process: the
learner's real `FragmentSync` (sender and watcher) over the real `FramedSyncTransport` and stream layer
(`protocol.rpc`), through in-memory streams, to the real `SyncerService` push route, whose loss probe is made slow
(its score is a stand-in; the screen that judges it is the core's own). With the syncer's announced hold
(node.diloco.push_wait) the learner waits for its answer and every push is acked; the negative control
(`push_wait_factor` 0: the old timeout alone) reproduces the bug: the syncer takes every push, the learner hears of
none. A bad push under the same slow probe is still refused, and the learner hears the refusal."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import protocol.rpc
from node.diloco.loss_probe import LossScore
from node.diloco.push_wait import PushWaits, push_deadline_s
from node.diloco.sync_client import (
    FragmentSync,
    FramedSyncTransport,
    answer_within,
    parse_versions_meta,
    run_fragment_plan,
)
from node.diloco.sync_types import (
    ContributionRefused,
    OutgoingContribution,
    SyncClientConfig,
    SyncUnavailable,
)
from node.ml.model import ModelConfig, build_model
from protocol.identity import NodeIdentity
from protocol.rpc import StreamConfig
from tests.unit.test_sync_client import bump, until
from tests.unit.test_syncer_ban_push import MODEL, RUN, RUN_ID, Host, live_learner

pytestmark = pytest.mark.timeout(90)

HOLD_S = 2.0  # the slow probe's seconds a push: 4 x the learner's call timeout below, 2 x the stream's chunk timeout
CALL_TIMEOUT_S = 0.5
CHUNK_TIMEOUT_S = (
    1.0  # the stream layer's wait for any read (10 s deployed): the answer's first bytes included
)


@pytest.fixture(autouse=True)
def short_chunk_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both sides' stream layer with a 1 s chunk timeout: a push held 2 s meets it as a llama-350m push (a 343 MB
    frame and a 20-67 s probe) met the deployed 10 s one."""
    monkeypatch.setattr(
        protocol.rpc, "StreamConfig", functools.partial(StreamConfig, chunk_timeout_s=CHUNK_TIMEOUT_S)
    )


def without_answer_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream layer as before the fix: a call's answer awaited the chunk timeout whatever the call asked."""
    call = protocol.rpc.call_framed

    async def old(*args: Any, answer_wait_s: float | None = None, **kwargs: Any) -> bytearray:
        return await call(*args, **kwargs)

    monkeypatch.setattr(protocol.rpc, "call_framed", old)


BAD_NORM = 1.0  # a delta this long is an ascent step to the stand-in probe (honest pushes here are ~0.1)


class SlowProbe:
    """The loss probe's interface, `HOLD_S` a score (in the probe's worker thread, as the real one runs): the loss
    rises by 1 (over any bound) for a delta longer than `BAD_NORM`, else stays flat."""

    def __init__(self) -> None:
        self.scored = 0

    def measure(
        self,
        context: Any,
        versions: Any,
        base: Mapping[str, torch.Tensor],
        params: Mapping[str, Any],
        *_: Any,
    ) -> LossScore:
        norm = sum(float((params[n].float() - base[n].float()).pow(2).sum()) for n in params) ** 0.5
        # the probe's cost, what the test reproduces: a thread busy for longer than the learner's call timeout
        time.sleep(HOLD_S)
        self.scored += 1
        return LossScore(before=2.0, after=2.0 + (1.0 if norm > BAD_NORM else 0.0), cost_s=HOLD_S, norm=norm)

    def status(self) -> dict[str, Any]:
        return {"scored": self.scored}


class PipeWriter:
    """The writing end of an in-memory stream: what it writes, the other side's reader reads."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader, self.closed = reader, False

    def write(self, data: Any) -> None:
        if not self.closed:
            self.reader.feed_data(bytes(data))

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.reader.feed_eof()

    async def wait_closed(self) -> None:
        pass


class Wire:
    """Both sides' p2p: the server registers its stream handlers, the client's calls run them on in-memory streams
    (the daemon is not needed for the stream layer's framing, timeouts and answers)."""

    def __init__(self, client: str) -> None:
        self.handlers: dict[str, Any] = {}
        self.client = client
        self.tasks: set[asyncio.Task[Any]] = set()

    async def add_binary_stream_handler(self, name: str, handler: Any) -> None:
        self.handlers[name] = handler

    async def remove_binary_stream_handler(self, name: str) -> None:
        self.handlers.pop(name, None)

    async def call_binary_stream_handler(self, peer: Any, name: str) -> tuple[Any, Any, Any]:
        to_server, to_client = asyncio.StreamReader(), asyncio.StreamReader()
        info = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: self.client))
        task = asyncio.create_task(self.handlers[name](info, to_server, PipeWriter(to_client)))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return info, to_client, PipeWriter(to_server)


def slow_syncer(learner: NodeIdentity) -> Host:
    host = Host(swarm_banned=set())
    screen = host.core.screen
    screen.config = dataclasses.replace(screen.config, loss_probe=True)
    host.probe = SlowProbe()
    live_learner(host, learner)
    return host


def transport_to(host: Host, learner: NodeIdentity, wire: Wire, factor: float) -> FramedSyncTransport:
    syncer = host.identity.peer_id

    class Direct(FramedSyncTransport):
        async def current_syncer(self) -> tuple[str, int]:
            return syncer, 1

    records = SimpleNamespace(run_id=RUN_ID, clock=time.time)
    plan = run_fragment_plan(RUN)
    return Direct(
        wire,  # type: ignore[arg-type]
        learner,
        records,  # type: ignore[arg-type]
        plan,
        authorized_syncers=[syncer],
        call_timeout_s=CALL_TIMEOUT_S,
        push_wait_factor=factor,
    )


def scored(host: Host) -> int:
    probe = host.probe
    assert isinstance(probe, SlowProbe)
    return probe.scored


def held(host: Host) -> int:
    """Pushes the syncer's rounds hold (accepted)."""
    return sum(len(r.entries) for r in host.core.rounds.values())


async def run_learner(factor: float, done: Callable[[Host, FragmentSync], bool]) -> tuple[Host, FragmentSync]:
    """A learner's sender and watcher against the slow syncer until `done` (deadline: the test's timeout)."""
    learner = NodeIdentity.generate()
    host = slow_syncer(learner)
    wire = Wire(learner.peer_id)
    await host.service.start(wire, on_throttle=lambda *a: None)
    model = build_model(ModelConfig.from_dict(MODEL), seed=0)  # the syncer's seed: version 0 is our base
    transport = transport_to(host, learner, wire, factor)
    config = SyncClientConfig(poll_wait_s=0.25, retry_min_s=0.05, retry_max_s=0.2)
    sync = FragmentSync.create(
        dict(model.named_parameters()), transport.plan, RUN.diloco, transport, config=config
    )
    stop = asyncio.Event()
    loops = [asyncio.create_task(sync.run_sender(stop)), asyncio.create_task(sync.run_watcher(stop))]
    try:
        for step in range(1, sync.schedule.sync_every_steps + 1):  # every fragment falls due once
            bump(model, 1e-3)
            sync.after_inner_step(step, tokens=4)
        await until(lambda: done(host, sync), timeout_s=8 * HOLD_S * len(sync.fragment_ids))
    finally:
        stop.set()
        for loop in loops:  # a push may be in judgement: the node's supervisor cancels its loops so too
            loop.cancel()
        await asyncio.wait_for(asyncio.gather(*loops, return_exceptions=True), 10.0)
        await host.service.stop()
        await asyncio.gather(*wire.tasks, return_exceptions=True)
    return host, sync


def test_a_push_judged_longer_than_the_call_timeout_is_acked() -> None:
    """Each push is held 2 s by the probe, 4 x the call timeout; the learner waits for the answer and hears it."""

    def every_one_heard(host: Host, sync: FragmentSync) -> bool:
        return held(host) == len(sync.fragment_ids) and sync.stats.acked >= len(sync.fragment_ids)

    host, sync = asyncio.run(run_learner(1.5, every_one_heard))
    # every push sent was heard, none timed out (one fragment may have fallen due twice in the steps)
    assert sync.stats.acked == sync.stats.sent and sync.stats.unanswered == 0 and sync.stats.refused == 0
    assert held(host) == len(sync.fragment_ids)  # the one learner's, every fragment
    assert host.service.push_waits.announce_s(time.monotonic()) >= HOLD_S


def test_control_without_the_announced_hold_the_syncer_takes_pushes_and_the_learner_hears_of_none() -> None:
    """Negative control, the bug: the old timeout alone. The syncer judges and accepts pushes while the learner's
    calls time out; it re-sends, to be judged again or throttled by the pushes the syncer still holds (its stream
    slots: `busy`, as in the llama-350m round); no push is acked."""

    def reproduced(host: Host, sync: FragmentSync) -> bool:
        return held(host) >= 1 and scored(host) >= 2 and sync.stats.unanswered >= 4

    host, sync = asyncio.run(run_learner(0.0, reproduced))
    assert sync.stats.acked == 0 and sync.stats.unanswered >= 4
    assert held(host) >= 1 and scored(host) >= 2  # judged, accepted, unheard


async def push_bad(factor: float) -> tuple[Host, BaseException | None]:
    """One ascent step pushed straight through the transport, the watcher's long-polls beside it."""
    learner = NodeIdentity.generate()
    host = slow_syncer(learner)
    wire = Wire(learner.peer_id)
    await host.service.start(wire, on_throttle=lambda *a: None)
    transport = transport_to(host, learner, wire, factor)
    params = {n: t + 0.1 for n, t in host.core.fragment_tensors(0).items()}  # under the norm screen
    bad = OutgoingContribution(
        fragment=0,
        params=params,
        base_version=0,
        steps=2,
        tokens=64,
        sent_step=2,
        sched_step=2,
        step_time_s=0.1,
    )
    stop = asyncio.Event()

    async def poll() -> None:
        while not stop.is_set():
            await transport.versions([0] * transport.plan.num_fragments, 0.25)

    poller = asyncio.create_task(poll())
    error: BaseException | None = None
    try:
        await transport.push(bad)
    except (ContributionRefused, SyncUnavailable) as e:
        error = e
    finally:
        # the syncer's verdict, heard or not, before its route stops (which would cancel a push in judgement)
        await until(lambda: scored(host) == 1 and not host.service.push_waits.holding, timeout_s=4 * HOLD_S)
        stop.set()
        await asyncio.wait_for(poller, 5.0)
        await host.service.stop()
        await asyncio.gather(*wire.tasks, return_exceptions=True)
    return host, error


def test_control_with_the_hold_announced_but_the_answer_awaited_10_s_no_push_is_acked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Negative control, the cause the live round showed: the announced hold lengthens the call, but the stream
    layer gave the answer's first bytes only its chunk timeout; the pushes fail there, none is acked."""
    without_answer_wait(monkeypatch)

    def reproduced(host: Host, sync: FragmentSync) -> bool:
        return held(host) >= 1 and sync.stats.unanswered >= 2

    host, sync = asyncio.run(run_learner(1.5, reproduced))
    assert sync.stats.acked == 0 and "StreamTimeout" in sync.stats.last_error, sync.stats.last_error


def test_a_bad_push_under_the_slow_probe_is_still_refused_and_the_learner_hears_it() -> None:
    host, error = asyncio.run(push_bad(1.5))
    assert isinstance(error, ContributionRefused) and error.reason == "screen: loss", error
    assert held(host) == 0


def test_control_the_bad_push_is_refused_as_well_without_the_hold_but_the_learner_hears_nothing() -> None:
    host, error = asyncio.run(push_bad(0.0))
    assert isinstance(error, SyncUnavailable), error
    # the refusal came after the learner left: the syncer judged it all the same and took nothing
    assert held(host) == 0 and host.service.refusals, host.service.refusals


# ---- the pure parts ----


def test_the_announced_hold_counts_recent_and_open_pushes() -> None:
    waits = PushWaits(recent=2)
    assert waits.announce_s(0.0) == 0.0
    first = waits.started(0.0)
    assert waits.announce_s(3.0) == 3.0  # still in judgement: counted from its arrival
    waits.ended(first, 5.0)
    assert waits.announce_s(100.0) == 5.0
    for at in (100.0, 200.0):
        waits.ended(waits.started(at), at + 1.0)
    assert waits.announce_s(300.0) == 1.0  # the 5 s one left the recent window


def test_the_push_deadline_adds_the_announced_hold_capped_and_ignores_a_bad_one() -> None:
    assert push_deadline_s(12.0, 0.0, factor=1.5, cap_s=600.0) == 12.0
    assert push_deadline_s(12.0, 40.0, factor=1.5, cap_s=600.0) == 72.0
    assert push_deadline_s(12.0, 1e9, factor=1.5, cap_s=600.0) == 612.0
    assert push_deadline_s(12.0, float("nan"), factor=1.5, cap_s=600.0) == 12.0


def test_answer_within_extends_to_a_later_deadline_and_times_out_past_it() -> None:
    async def run() -> tuple[str, bool]:
        deadline = [0.1]
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        waiting = asyncio.create_task(answer_within(answer, lambda: deadline[0], time.monotonic))
        await asyncio.sleep(0.05)
        deadline[0] = 5.0  # announced while it waits
        await asyncio.sleep(0.2)  # past the first deadline
        answer.set_result("ok")
        got = await asyncio.wait_for(waiting, 5.0)
        never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        try:
            await answer_within(never, lambda: 0.05, time.monotonic)
        except asyncio.TimeoutError:
            return got, never.cancelled()
        return got, False

    assert asyncio.run(run()) == ("ok", True)


def test_the_versions_answer_carries_the_hold_and_a_malformed_one_is_refused() -> None:
    base = {"versions": [1, 2], "term": 3, "barrier": False, "clock": 7}
    assert parse_versions_meta({**base, "push_wait_s": 37.5}, syncer="s", num_fragments=2).push_wait_s == 37.5
    assert parse_versions_meta(base, syncer="s", num_fragments=2).push_wait_s == 0.0  # an older syncer
    assert parse_versions_meta({**base, "push_wait_s": -1.0}, syncer="s", num_fragments=2).push_wait_s == 0.0
    for bad in (1, "x", float("nan"), float("inf")):
        with pytest.raises(SyncUnavailable):
            parse_versions_meta({**base, "push_wait_s": bad}, syncer="s", num_fragments=2)


def test_a_push_waits_for_its_own_syncers_announcement_only() -> None:
    """A hold announced by one syncer does not lengthen pushes to another (a failover's new syncer), and a factor of
    0 is the old timeout."""
    learner = NodeIdentity.generate()
    host = Host(swarm_banned=set())
    transport = transport_to(host, learner, Wire(learner.peer_id), 1.5)
    transport._push_wait = ("syncer-a", 40.0)
    assert transport._deadline_s("syncer-a", 12.0, True) == 72.0
    assert transport._deadline_s("syncer-b", 12.0, True) == 12.0
    assert transport._deadline_s("syncer-a", 12.0, False) == 12.0  # fetches and offers: no judgement
    transport.push_wait_factor = 0.0
    assert transport._deadline_s("syncer-a", 12.0, True) == 12.0
