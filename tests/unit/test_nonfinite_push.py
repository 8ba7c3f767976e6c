"""A learner's push holding NaN/Inf (issue 18, the poisoning benchmark's `nan` arm): the wire codec refuses the frame
before it is decoded into a contribution, and that refusal is a blamed violation in the syncer's learner ledger that
bans at once, with the digest of the signed frame as its evidence; a banned learner no longer counts as a holder a
round waits for. Negative controls: with bans off the same pushes are refused but never ban (and the learner stays
a holder); a finite push from the same learner is admitted."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from node.diloco.learner_ledger import WIRE_NON_FINITE, LearnerLedger
from node.diloco.sync_client import PUSH_ROUTE, contribution_meta
from node.diloco.sync_types import OutgoingContribution
from node.diloco.syncer_core import Refusal
from node.roles.syncer import SyncerRole
from node.roles.syncer_rpc import RefusedFrame
from protocol.envelope import Context, Kind, seal
from protocol.errors import TensorPolicyError
from protocol.identity import NodeIdentity
from tests.unit.test_syncer_ban_push import RUN_ID, Host, live_learner, push_frame

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("params_mode")]


class BanningHost(Host):
    """The test host, with the role's own `holders` (which leaves banned peers out)."""

    holders = SyncerRole.holders


def nan_frame(host: Host, learner: NodeIdentity) -> bytearray:
    """A signed push of fragment 0 whose tensors are all NaN (the `value:nan` attack)."""
    params = {n: torch.full_like(t, float("nan")) for n, t in host.core.fragment_tensors(0).items()}
    contribution = OutgoingContribution(
        fragment=0,
        params=params,
        base_version=0,
        steps=2,
        tokens=64,
        sent_step=2,
        sched_step=2,
        step_time_s=0.1,
    )
    context = Context(run_id=RUN_ID, kind=Kind.FRAGMENT, receiver=host.identity.peer_id)
    return seal(
        learner,
        context,
        microbatch=0,
        step=0,
        now=time.time(),
        tensors=params,
        meta=contribution_meta(contribution),
    )


def push_nan(host: Host, learner: NodeIdentity) -> TensorPolicyError:
    """Push a NaN frame through the real route; returns the refusal after the FramedServer's hook saw it."""
    with pytest.raises(TensorPolicyError) as refused:
        asyncio.run(host.service._handle_push(nan_frame(host, learner), learner.peer_id))
    host.service._on_reject(learner.peer_id, PUSH_ROUTE, refused.value)  # what the FramedServer calls
    return refused.value


def test_a_non_finite_push_bans_its_learner_at_once_with_the_frame_digest_as_evidence() -> None:
    learner = NodeIdentity.generate()
    host = BanningHost(swarm_banned=set())
    live_learner(host, learner)
    assert host.holders(0) == {learner.peer_id}
    error = push_nan(host, learner)
    assert isinstance(error, RefusedFrame) and error.reason == WIRE_NON_FINITE and error.blame_sender
    ledger: LearnerLedger = host.service.ledger
    assert ledger.banned(learner.peer_id, time.time()) is not None  # one push, no training step makes one
    evidence = ledger.status(time.time())[learner.peer_id]["evidence"]
    assert len(evidence) == 1 and evidence[0]["tag"] == WIRE_NON_FINITE
    assert evidence[0]["digest"] == error.digest and len(error.digest) == 32
    assert len(host.ban_outbox) == 1  # published through the signed ban gossip
    assert host.holders(0) == set()  # rounds no longer wait for it
    with pytest.raises(Refusal) as again:  # its next push is refused before anything of it is decoded
        asyncio.run(host.service._handle_push(nan_frame(host, learner), learner.peer_id))
    assert again.value.reason == "banned" and not again.value.blame_sender
    host.service._on_reject(learner.peer_id, PUSH_ROUTE, again.value)
    assert (
        len(ledger.status(time.time())[learner.peer_id]["evidence"]) == 1
    )  # the evidence stays the first push's
    assert not host.core.rounds


def test_negative_control_with_bans_off_the_same_pushes_are_refused_but_never_ban() -> None:
    learner = NodeIdentity.generate()
    host = BanningHost(swarm_banned=set())
    host.service.ledger = LearnerLedger(ban_after=0.0, forgive_half_life_s=600.0, ban_s=3600.0)
    live_learner(host, learner)
    for _ in range(5):
        assert push_nan(host, learner).reason == WIRE_NON_FINITE
    assert host.service.ledger.banned(learner.peer_id, time.time()) is None and not host.ban_outbox
    assert host.holders(0) == {learner.peer_id}
    assert host.service.ledger.status(time.time())[learner.peer_id]["refused"] == 5


def test_negative_control_a_finite_push_of_the_same_learner_is_admitted_and_recorded_nowhere() -> None:
    learner = NodeIdentity.generate()
    host = BanningHost(swarm_banned=set())
    live_learner(host, learner)
    assert asyncio.run(host.service._handle_push(push_frame(host, learner), learner.peer_id))
    assert len(host.core.rounds[0].entries) == 1 and host.service.ledger.status(time.time()) == {}
