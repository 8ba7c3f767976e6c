"""The sync calls' timeout grows with the bytes they move: base (10 s) + bytes / 8 MiB/s, so a llama-124m fragment's
push or fetch is not cut off on a slow link (a flat 10 s needs 10+ MiB/s for its ~100 MiB). The transport passes the
grown timeout to the stream layer for a push (the frame's bytes) and a fetch (the fragment's bytes coming back)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

import protocol.rpc
from node.diloco.push_wait import MAX_PUSH_WAIT_S
from node.diloco.sync_client import (
    TRANSFER_RATE_BYTES_S,
    FramedSyncTransport,
    fragment_bytes,
    run_fragment_plan,
    transfer_timeout_s,
)
from node.diloco.sync_types import OutgoingContribution, SyncUnavailable
from node.ml.model import ModelConfig, build_model
from protocol.identity import NodeIdentity
from protocol.keys import RUN_ID_HEX_CHARS
from protocol.manifest import DilocoSpec, RunManifest

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
MODEL = {"vocab_size": 256, "context_len": 16, "num_layers": 2, "width": 64, "num_heads": 2}
RUN = RunManifest(model=dict(MODEL), num_stages=1, diloco=DilocoSpec(num_fragments=2, sync_every_steps=4))


def test_the_timeout_is_base_plus_bytes_at_8_mib_per_second() -> None:
    assert 8 * MiB == TRANSFER_RATE_BYTES_S
    assert transfer_timeout_s(10.0, 0) == 10.0
    assert transfer_timeout_s(10.0, 80 * MiB) == pytest.approx(20.0)
    assert transfer_timeout_s(10.0, -5) == 10.0
    # a llama-124m layer fragment: the flat 10 s would need more than 10 MiB/s; the grown one allows 8 MiB/s
    big = run_fragment_plan(RunManifest(model={"preset": "llama-124m"}, num_stages=1))
    largest = max(range(big.num_fragments), key=lambda f: big.fragments[f].num_params)
    size = fragment_bytes(big, largest)
    assert size > 64 * MiB
    assert size / TRANSFER_RATE_BYTES_S > 10.0  # negative control: at 8 MiB/s the flat timeout cuts it off
    assert transfer_timeout_s(10.0, size) >= 10.0 + size / TRANSFER_RATE_BYTES_S


class Recorder:
    """Stands in for protocol.rpc.call_framed: records the timeout and times out itself."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    async def __call__(self, p2p: Any, peer: str, route: str, frame: Any, **kwargs: Any) -> bytearray:
        self.timeouts.append(kwargs["timeout_s"])
        raise asyncio.TimeoutError


def transport() -> FramedSyncTransport:
    records: Any = SimpleNamespace(run_id="cd" * (RUN_ID_HEX_CHARS // 2), clock=time.time)
    plan = run_fragment_plan(RUN)
    t = FramedSyncTransport(
        None,
        NodeIdentity.generate(),
        records,
        plan,
        authorized_syncers=["syncer"],
    )
    t._syncer, t._looked_up_at = (NodeIdentity.generate().peer_id, 1), time.monotonic()
    return t


def test_push_and_fetch_pass_a_timeout_grown_with_their_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder()
    monkeypatch.setattr(protocol.rpc, "call_framed", recorder)
    t = transport()
    fragment = max(range(t.plan.num_fragments), key=lambda f: t.plan.fragments[f].num_params)
    names = t.plan.fragments[fragment].names
    model = dict(build_model(ModelConfig.from_dict(MODEL), 0).named_parameters())
    params = {n: model[n].detach().clone() for n in names}
    push = OutgoingContribution(
        fragment=fragment,
        params=params,
        base_version=0,
        steps=1,
        tokens=16,
        sent_step=1,
        sched_step=1,
        step_time_s=0.1,
    )
    with pytest.raises(SyncUnavailable):
        asyncio.run(t.push(push))
    t._syncer, t._looked_up_at = (NodeIdentity.generate().peer_id, 1), time.monotonic()
    with pytest.raises(SyncUnavailable):
        asyncio.run(t.fetch(fragment))
    size = fragment_bytes(t.plan, fragment)
    push_timeout, fetch_timeout = recorder.timeouts
    # the push's call is bounded by its transfer timeout plus the most a syncer's announced hold may add
    # (node.diloco.push_wait); with none announced it waits the transfer timeout alone (`_deadline_s`)
    push_timeout -= MAX_PUSH_WAIT_S
    peer = t._syncer[0] if t._syncer is not None else ""
    assert t._deadline_s(peer, push_timeout, True) == push_timeout
    # the push frame holds the fragment plus a header: a little more than its bytes at the rate
    assert (
        10.0 + size / TRANSFER_RATE_BYTES_S < push_timeout < 10.0 + (size + 64 * 1024) / TRANSFER_RATE_BYTES_S
    )
    # the fetch request is a small control frame; the answer is the fragment
    assert (
        10.0 + size / TRANSFER_RATE_BYTES_S
        < fetch_timeout
        < 10.0 + (size + 64 * 1024) / TRANSFER_RATE_BYTES_S
    )
