"""A push from a banned peer gets the typed `banned` refusal through the syncer's real push route
(`SyncerService._handle_push` -> `SyncerRole.check_known`), whichever ban holds it: the swarm-wide ban hook
(`is_banned`, SENTINEL's signed gossip) or the syncer's own learner ledger. Before the fix a swarm-wide ban
short-circuited the assignment of the ledger's reason and the refusal raised UnboundLocalError, which the stream
layer answers as "internal error": a refusal the learner retries for good. Negative control: with no ban the same
signed push is admitted."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from node.context import NodeMetrics
from node.diloco.learner_ledger import LearnerLedger
from node.diloco.quorum import QuorumConfig
from node.diloco.screening import ScreeningConfig
from node.diloco.sync_client import (
    PUSH_ROUTE,
    VERSIONS_ROUTE,
    contribution_meta,
    fragment_limits,
    run_fragment_plan,
)
from node.diloco.sync_types import OutgoingContribution
from node.diloco.syncer_core import Refusal, SyncerCore
from node.ml.model import ModelConfig, build_model, embedding_param_names
from node.roles.syncer import SyncerConfig, SyncerRole
from node.roles.syncer_rpc import SyncerService
from protocol.envelope import Context, Kind, seal
from protocol.identity import NodeIdentity
from protocol.keys import RUN_ID_HEX_CHARS
from protocol.limits import GLOBAL_STREAMS
from protocol.manifest import DilocoSpec, RunManifest
from protocol.rpc import PeerStrikes

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("params_mode")]

MODEL = {"vocab_size": 256, "context_len": 16, "num_layers": 2, "width": 16, "num_heads": 2}
RUN = RunManifest(model=dict(MODEL), num_stages=1, diloco=DilocoSpec(num_fragments=2, sync_every_steps=4))
RUN_ID = "ab" * (RUN_ID_HEX_CHARS // 2)


class Host:
    """What the push route reads of the syncer role, with the role's own `check_known`."""

    check_known = SyncerRole.check_known

    def __init__(self, *, swarm_banned: set[str]) -> None:
        cfg = ModelConfig.from_dict(MODEL)
        self.identity = NodeIdentity.generate()
        self.ctx = SimpleNamespace(
            manifest=RUN,
            run_id=RUN_ID,
            identity=self.identity,
            peer_id=self.identity.peer_id,
            events=SimpleNamespace(emit=lambda *a, **k: None),
            metrics=NodeMetrics(),
        )
        self.config = SyncerConfig(screening=ScreeningConfig(loss_probe=False))
        self.mode = "decoupled"
        self.plan = run_fragment_plan(RUN)
        self.limits = fragment_limits(self.plan)
        self.fragment_stage = [0] * self.plan.num_fragments
        self.strikes = PeerStrikes()
        self.core = SyncerCore(
            self.plan,
            dict(build_model(cfg, seed=0).named_parameters()),
            quorum=QuorumConfig.decoupled(1, grace_gamma=0.0),
            embedding_names=embedding_param_names(cfg),
            outer_lr=0.7,
            outer_momentum=0.0,
            clip_factor=None,
            max_staleness=2,
            max_steps_per_s=10.0,
            tokens_per_step=64,
            now=time.monotonic(),
            screening=self.config.screening,
        )
        self.active, self.term, self.primary, self.recovering_until = True, 1, None, 0.0
        self.fresh: set[tuple[str, int]] = set()
        self.adopted = 0
        self.merge_lock, self.probe_lock = asyncio.Lock(), asyncio.Lock()
        self.core_free = asyncio.Event()
        self.core_free.set()
        self.probe = None
        self.ban_outbox: deque[Any] = deque()
        self.wake, self.published = asyncio.Event(), asyncio.Event()
        self.p2p = None
        self.is_banned = lambda peer: peer in swarm_banned
        self.watch = SimpleNamespace(live_read_at=time.monotonic())
        self.service = SyncerService(self)  # type: ignore[arg-type]
        self.live: dict[str, Any] = {}

    def holders(self, fragment: int) -> set[str]:
        return set(self.live)

    def notify(self) -> None:
        pass

    async def _refresh_members(self) -> None:
        self.watch.live_read_at = time.monotonic()


def push_frame(host: Host, learner: NodeIdentity, scale: float = 1e-3) -> bytearray:
    """A learner's signed push of fragment 0 on version 0 (its parameters moved by about `scale`: honest at the
    default)."""
    params = {n: t + scale * torch.randn_like(t) for n, t in host.core.fragment_tensors(0).items()}
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


def live_learner(host: Host, learner: NodeIdentity) -> None:
    host.live[learner.peer_id] = SimpleNamespace(role="learner", stage=-1, admission=None)


@pytest.mark.parametrize("ban", ["swarm", "ledger"])
def test_a_banned_learners_push_gets_the_typed_banned_refusal(ban: str) -> None:
    learner = NodeIdentity.generate()
    host = Host(swarm_banned={learner.peer_id} if ban == "swarm" else set())
    live_learner(host, learner)
    if ban == "ledger":  # the syncer's own ledger banned it for refused contributions
        ledger: LearnerLedger = host.service.ledger
        for _ in range(10):
            if ledger.banned(learner.peer_id, time.time()) is not None:
                break
            ledger.record(learner.peer_id, "screen: norm", "too large", "-", time.time())
        assert ledger.banned(learner.peer_id, time.time()) is not None
    with pytest.raises(Refusal) as refused:
        asyncio.run(host.service._handle_push(push_frame(host, learner), learner.peer_id))
    assert refused.value.reason == "banned"
    assert "banned" in str(refused.value)
    assert not host.core.rounds  # nothing entered a round


def test_negative_control_without_a_ban_the_same_push_is_admitted() -> None:
    learner = NodeIdentity.generate()
    host = Host(swarm_banned=set())
    live_learner(host, learner)
    answer = asyncio.run(host.service._handle_push(push_frame(host, learner), learner.peer_id))
    assert answer and len(host.core.rounds[0].entries) == 1


def test_a_refused_push_is_recorded_with_its_fragment(caplog: pytest.LogCaptureFixture) -> None:
    # refusals cluster by fragment (the loss screen's honest ones were the embedding's, docs/security.md): the
    # ledger's evidence and the log line name it
    learner = NodeIdentity.generate()
    host = Host(swarm_banned=set())
    live_learner(host, learner)
    frame = push_frame(host, learner, scale=1e30)
    with pytest.raises(Refusal) as refused, caplog.at_level("WARNING"):
        asyncio.run(host.service._handle_push(frame, learner.peer_id))
    assert refused.value.reason == "screen: norm"
    violations = host.service.ledger.status(time.time())[learner.peer_id]["evidence"]
    assert [v["reason"][: len("fragment 0: norm")] for v in violations] == ["fragment 0: norm"]
    assert "fragment 0: norm" in caplog.text


class FakeP2P:
    """Registers nothing: the test opens streams on the server's limiter directly."""

    async def add_binary_stream_handler(self, name: str, handler: Any) -> None:
        pass

    async def remove_binary_stream_handler(self, name: str) -> None:
        pass


@pytest.mark.parametrize("preferred", [True, False], ids=["syncer-prefers", "nobody-preferred-control"])
def test_fresh_identities_cannot_take_the_syncers_stream_slots_from_merged_learners(preferred: bool) -> None:
    """Issue 18 item 4: 16 fresh identities hold every stream they can at the syncer (versions long-polls). The
    syncer reserves slots for the run's syncers and for learners a merge took: the merged learner and a standby
    still get in. Control: nobody preferred (the syncer before this), the Sybils hold all 64 slots and the merged
    learner is refused."""
    host = Host(swarm_banned=set())
    standby = NodeIdentity.generate().peer_id
    host.ctx.manifest = dataclasses.replace(RUN, authorized_syncers=(standby,))
    host.core.seniority.observe_merge(["learner"], time.monotonic())
    asyncio.run(host.service.start(FakeP2P(), lambda *a, **k: None))
    limiter = host.service._server.limiter  # type: ignore[union-attr]
    if not preferred:
        limiter.prefer(None)
    held = sum(
        bool(limiter.open_stream(f"sybil{i}", VERSIONS_ROUTE, 0.0)) for i in range(16) for _ in range(8)
    )
    learner = limiter.open_stream("learner", PUSH_ROUTE, 0.0)
    mirror = limiter.open_stream(standby, VERSIONS_ROUTE, 0.0)
    newcomer = limiter.open_stream("fresh", VERSIONS_ROUTE, 0.0)
    if preferred:
        assert held == 48  # 4 streams per guest, 16 slots reserved
        assert learner and mirror
        assert not newcomer  # the guests' share is full: a fresh identity waits, a merged one does not
    else:
        assert held == 64
        assert not learner and learner.reason == GLOBAL_STREAMS
        assert not mirror
