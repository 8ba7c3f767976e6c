"""The syncer's push route gives the freed heap back to the kernel once an accepted push's decoded tensors are
dropped (`SyncerService._handle_push` -> `release_freed_memory`): without it, glibc kept up to 0.17 GiB of a llama-1b
push's freed tensors resident until the next merge's trim, under the next push (docs/scale.md). The trim must come after the tensors are gone (trimmed while they are alive, it frees nothing of
theirs): each test tracks the decoded tensors by weak reference."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

import pytest

import node.roles.syncer_rpc as syncer_rpc
from node.diloco.syncer_core import Refusal
from protocol.identity import NodeIdentity
from tests.unit.test_syncer_ban_push import Host, live_learner, push_frame

pytestmark = pytest.mark.timeout(60)


class Tracked:
    """Weak references to every tensor the push route decodes, and whether they were alive at each trim."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.refs: list[weakref.ref[Any]] = []
        self.alive_at_trim: list[int] = []
        decode = syncer_rpc.wire_params

        def wire_params(*args: Any, **kwargs: Any) -> Any:
            params = decode(*args, **kwargs)
            self.refs.extend(weakref.ref(t) for t in params.values())
            return params

        monkeypatch.setattr(syncer_rpc, "wire_params", wire_params)
        monkeypatch.setattr(syncer_rpc, "release_freed_memory", self.trim)

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.refs)

    def trim(self) -> None:
        self.alive_at_trim.append(self.alive())


def test_an_accepted_push_is_dropped_then_trimmed(monkeypatch: pytest.MonkeyPatch) -> None:
    tracked = Tracked(monkeypatch)
    learner = NodeIdentity.generate()
    host = Host(swarm_banned=set())
    live_learner(host, learner)
    accept, during = host.core.accept, []

    def watched(*args: Any, **kwargs: Any) -> Any:
        during.append(tracked.alive())  # control: the tracking sees the push alive while the core takes it
        return accept(*args, **kwargs)

    monkeypatch.setattr(host.core, "accept", watched)
    answer = asyncio.run(host.service._handle_push(push_frame(host, learner), learner.peer_id))
    assert answer and len(host.core.rounds[0].entries) == 1
    assert during and during[0] == len(tracked.refs) > 0  # the decoded push was alive in the core's accept
    assert tracked.alive_at_trim == [0]  # one trim, once every decoded tensor was gone


def test_a_refused_push_is_not_trimmed_by_its_route(monkeypatch: pytest.MonkeyPatch) -> None:
    # its tensors are still held by the refusal's traceback there: the next accept or merge trims them
    tracked = Tracked(monkeypatch)
    learner = NodeIdentity.generate()
    host = Host(swarm_banned={learner.peer_id})
    live_learner(host, learner)
    with pytest.raises(Refusal):
        asyncio.run(host.service._handle_push(push_frame(host, learner), learner.peer_id))
    assert tracked.alive_at_trim == []
