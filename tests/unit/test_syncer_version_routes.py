"""Offers through the syncer's real offer route (`SyncerService._handle_offer`): a learner offers the signed
version of an earlier syncer one fragment per request, so an offer is never larger than a push and the syncer's
bytes in flight stay ~2 fragments whatever the fragment count (`offer_limits`). An offer of a newer version is
adopted; a frame carrying two versions at once is refused by the route's caps before anything is adopted. And the
fetch route, which sends a version from the published tensors themselves (`seal_streaming`)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch

from node.diloco.fragment_ledger import HeldVersions
from node.diloco.sync_client import OFFER_PREFIX, FramedSyncTransport, open_version_envelope
from node.diloco.sync_types import FragmentVersion, VersionsView
from node.roles import syncer_rpc
from protocol.envelope import Context, Kind, StreamingFrame, seal
from protocol.errors import ProtocolError
from protocol.identity import NodeIdentity
from tests.unit.test_syncer_ban_push import RUN, RUN_ID, Host, live_learner

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("params_mode")]


def old_version(host: Host, old: NodeIdentity, learner: NodeIdentity, fragment: int, version: int) -> bytes:
    """What the earlier syncer `old` sent `learner` when it fetched `fragment` at `version`."""
    tensors = {n: t + 0.5 for n, t in host.core.fragment_tensors(fragment).items()}
    context = Context(run_id=RUN_ID, kind=Kind.VERSION, receiver=learner.peer_id)
    return bytes(
        seal(
            old,
            context,
            microbatch=fragment,
            step=version,
            now=time.time(),
            tensors=tensors,
            meta={"term": 1},
        )
    )


def offer_frame(host: Host, learner: NodeIdentity, envelopes: dict[int, bytes]) -> bytearray:
    tensors = {
        f"{OFFER_PREFIX}{fragment}": torch.frombuffer(bytearray(envelope), dtype=torch.uint8)
        for fragment, envelope in envelopes.items()
    }
    context = Context(run_id=RUN_ID, kind=Kind.CONTROL, receiver=host.identity.peer_id)
    return seal(learner, context, microbatch=0, step=0, now=time.time(), tensors=tensors)


def offering_host() -> tuple[Host, NodeIdentity, NodeIdentity]:
    old, learner = NodeIdentity.generate(), NodeIdentity.generate()
    host = Host(swarm_banned=set())
    host.ctx.manifest = dataclasses.replace(RUN, authorized_syncers=(old.peer_id, host.identity.peer_id))
    live_learner(host, learner)
    return host, old, learner


def test_an_offer_of_one_newer_version_is_adopted() -> None:
    host, old, learner = offering_host()
    frame = offer_frame(host, learner, {1: old_version(host, old, learner, 1, 3)})
    asyncio.run(host.service._handle_offer(frame, learner.peer_id))
    assert host.core.versions[1] == 3 and host.adopted == 1
    assert host.core.versions[0] == 0


def test_an_offer_of_two_versions_in_one_request_is_refused_and_nothing_is_adopted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host, old, learner = offering_host()
    envelopes = {f: old_version(host, old, learner, f, 3) for f in (0, 1)}
    with pytest.raises(ProtocolError):
        asyncio.run(host.service._handle_offer(offer_frame(host, learner, envelopes), learner.peer_id))
    assert set(host.core.versions) == {0} and host.adopted == 0
    # the control: under caps that allow every fragment in one offer (as before), the same request is adopted
    one = syncer_rpc.offer_limits(host.plan)
    monkeypatch.setattr(
        syncer_rpc,
        "offer_limits",
        lambda plan: dataclasses.replace(one, max_bytes=2 * one.max_bytes, max_tensors=2),
    )
    asyncio.run(host.service._handle_offer(offer_frame(host, learner, envelopes), learner.peer_id))
    assert host.core.versions[:2] == [3, 3] and host.adopted == 2


def test_the_learner_offers_each_held_version_in_its_own_request() -> None:
    sent: list[tuple[int, bytes]] = []

    async def offer_one(fragment: int, envelope: bytes) -> int:
        sent.append((fragment, envelope))
        return fragment % 2  # the syncer adopted the odd ones

    client = SimpleNamespace(_offer_one=offer_one)
    held = [
        FragmentVersion(fragment=f, version=2, params={}, envelope=None if f == 2 else bytes([f]))
        for f in range(4)
    ]
    adopted = asyncio.run(FramedSyncTransport.offer(client, held))  # type: ignore[arg-type]
    assert sent == [(0, b"\x00"), (1, b"\x01"), (3, b"\x03")]  # not the one without an envelope
    assert adopted == 2


def test_a_fetch_streams_the_published_version_and_a_later_merge_does_not_tear_it() -> None:
    """The fetch answer holds views of the published tensors (no copy of the fragment per fetch): a version
    published while it is on its way replaces those tensors instead of writing them, so the answer still carries
    the version it names."""
    host, _, learner = offering_host()
    context = Context(run_id=RUN_ID, kind=Kind.CONTROL, receiver=host.identity.peer_id)
    request = seal(learner, context, microbatch=0, step=0, now=time.time(), meta={"fragment": 1})
    answer = asyncio.run(host.service._handle_fetch(request, learner.peer_id))
    assert isinstance(answer, StreamingFrame)
    sent = {n: t.clone() for n, t in host.core.fragment_tensors(1).items()}
    newer = {n: t + 1.0 for n, t in sent.items()}
    assert host.core.adopt(1, 4, newer, time.monotonic())  # published before the answer went out
    opened = open_version_envelope(
        answer.to_bytes(),
        run_id=RUN_ID,
        receiver=learner.peer_id,
        signer_candidates=[host.identity.peer_id],
        limits=host.limits,
        now=time.time(),
        max_age_s=60.0,
    )
    assert opened.header.step == 0 and opened.header.microbatch == 1
    for name, tensor in sent.items():
        torch.testing.assert_close(opened.tensors[name], tensor)


def test_a_held_version_keeps_its_signed_frame_for_offers_but_not_its_tensors() -> None:
    held = HeldVersions()
    tensors = {"w": torch.ones(1024)}
    held.keep(
        0, FragmentVersion(fragment=3, version=7, params=tensors, term=1, signer="old", envelope=b"frame")
    )
    held.keep(1, FragmentVersion(fragment=4, version=2, params=tensors, envelope=None))  # nothing to offer
    view = VersionsView(versions=(0,) * 5, term=2, syncer="new")
    (offer,) = held.to_offer(view, [(3, 0), (4, 1)])
    assert (offer.fragment, offer.version, offer.envelope, offer.signer) == (3, 7, b"frame", "old")
    assert offer.params == {}  # the tensors are in the model; the frame holds them once more
    assert held.to_offer(view, [(3, 0)]) == []  # offered once per syncer
