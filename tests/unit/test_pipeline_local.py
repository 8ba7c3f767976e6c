"""The pipeline driven in process through the real stage and verifier code (sealing, opening, ledgers), no network.

`DirectTransport` hands each signed request frame to a `StageService` handler exactly as a `FramedServer` would, so
everything but the sockets is the production path. Gradient equality of the cut model by hand is in
test_model.py; here the same property is checked through `StageCore` (snapshots, explicit autograd, accumulation).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from node.ml.data import DataConfig, evaluate, load_corpus, validation_batches
from node.ml.model import ModelConfig, build_model, load_state_subset
from node.pipeline.accounting import ReceiptBook
from node.pipeline.driver import PipelineDriver
from node.pipeline.routing import ReplicaInfo, ReplicaRouter, RetryPolicy, RoutingConfig
from node.pipeline.transport import DirectTransport
from node.roles.stage import StageConfig, StageCore, StageService, build_core
from protocol.boundary_codec import rounding_generator
from protocol.envelope import Context, Direction, Kind, Opened, StreamingFrame, open_envelope, seal
from protocol.errors import ProtocolError, RemoteRefused, SignerMismatch, StreamClosed
from protocol.identity import NodeIdentity
from protocol.manifest import InnerOptimizerSpec, RunManifest, WireSpec
from protocol.pipeline import (
    ALREADY_APPLIED,
    BACKWARD_RPC,
    EVAL_META,
    FORWARD_RPC,
    INPUT_DIGEST_META,
    NO_CONTEXT,
    UNAUTHORIZED,
    BoundaryShape,
    StageRefusal,
)
from protocol.receipts import open_receipt
from protocol.replay import ReplayGuard
from tools.train_local import train_local_run
from verification.tap import BoundaryTap, Drop, PassThroughTap

MODEL = {"vocab_size": 256, "context_len": 32, "num_layers": 2, "width": 64, "num_heads": 2}
RUN_ID = "0" * 40
VERIFIER = NodeIdentity.generate()


def manifest(*, batch_size: int = 8, lr: float = 3e-3, num_stages: int = 2, layers: int = 2) -> RunManifest:
    return RunManifest(
        model={**MODEL, "num_layers": layers},
        num_stages=num_stages,
        inner=InnerOptimizerSpec(lr=lr, batch_size=batch_size, weight_decay=0.01),
        wire=WireSpec(max_batch=8),
        authorized_verifiers=(VERIFIER.peer_id,),
    )


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Small tensors: one thread is faster, and immune to OpenMP stalls when other work fills the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class Pipeline:
    driver: PipelineDriver
    services: dict[str, StageService]
    stages: dict[str, int]
    transport: DirectTransport

    def cores(self, stage: int) -> list[StageCore]:
        return [s.core for peer, s in self.services.items() if self.stages[peer] == stage]


def build_pipeline(
    run: RunManifest,
    replicas_per_stage: int = 1,
    *,
    config: StageConfig | None = None,
    retry: RetryPolicy | None = None,
    tap: BoundaryTap | None = None,
) -> Pipeline:
    services: dict[str, StageService] = {}
    stages: dict[str, int] = {}
    for stage in range(run.num_stages):
        for _ in range(replicas_per_stage):
            identity = NodeIdentity.generate()
            core = build_core(run, RUN_ID, stage, config or StageConfig())
            services[identity.peer_id] = (
                StageService(  # seeded rounding noise: a low-bit codec's run reproduces
                    identity,
                    RUN_ID,
                    core,
                    authorized=run.authorized_verifiers,
                    rounding=rounding_generator(len(services)),
                )
            )
            stages[identity.peer_id] = stage
    transport = DirectTransport(VERIFIER.peer_id, services)

    def replicas() -> list[ReplicaInfo]:
        return [ReplicaInfo(peer_id=p, stage=s) for p, s in stages.items() if p in services]

    driver = PipelineDriver(
        identity=VERIFIER,
        run_id=RUN_ID,
        num_stages=run.num_stages,
        shape=BoundaryShape.from_manifest(run),
        transport=transport,
        replicas=replicas,
        router=ReplicaRouter(RoutingConfig(failure_cooldown_s=60.0)),
        retry=retry,
        tap=tap,
        rng=random.Random(0),
    )
    driver.hops.rounding = rounding_generator(len(services))
    return Pipeline(driver, services, stages, transport)


def batch(seed: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, 256, (size, MODEL["context_len"] + 1), generator=g)
    return window[:, :-1], window[:, 1:]


def run(coro):  # noqa: ANN001, ANN201 - test helper
    return asyncio.run(coro)


def drive_all(pipe: Pipeline, ids: range | tuple[int, ...]) -> list:  # noqa: ANN001
    """Drive microbatches `ids` concurrently (all in flight at once); their outcomes in order."""

    async def together() -> list:
        return list(await asyncio.gather(*(pipe.driver.run_microbatch(i, *batch(i)) for i in ids)))

    return run(together())


def assemble(pipe: Pipeline, cfg: ModelConfig) -> torch.nn.Module:
    """The full model made of the first replica of every stage."""
    full = build_model(cfg, seed=123)
    state = {}
    for stage in sorted(set(pipe.stages.values())):
        state.update(pipe.cores(stage)[0].module.state_dict())
    load_state_subset(full, state)
    return full


# ---------------------------------------------------------------------------------------------------- training


@pytest.mark.timeout(300)  # 20 s alone; it timed out at 120 s beside a loaded integration module
def test_pipeline_training_matches_one_learner_at_equal_tokens() -> None:
    run_manifest = manifest(batch_size=8, lr=3e-3)
    cfg = ModelConfig.from_dict(run_manifest.model)
    corpus = load_corpus(None, DataConfig(builtin_max_bytes=1 << 20))
    held_out = validation_batches(corpus, batch_size=8, context_len=cfg.context_len, num_batches=8)
    steps, microbatch = 80, 4
    pipe = build_pipeline(run_manifest)
    from node.ml.data import BatchSampler

    sampler = BatchSampler(
        corpus.train_stream(),
        batch_size=microbatch,
        context_len=cfg.context_len,
        generator=torch.Generator().manual_seed(1),
    )

    async def drive() -> float:
        in_flight = 2  # weight stashing keeps this exact except for one step of staleness
        ids = iter(range(1, 10**6))
        total = steps * run_manifest.inner.batch_size // microbatch
        done = 0
        while done < total:
            wave = [pipe.driver.run_microbatch(next(ids), *sampler.next_batch()) for _ in range(in_flight)]
            outcomes = await asyncio.gather(*wave)
            assert all(o.completed for o in outcomes)
            done += len(outcomes)
        return await pipe.driver.evaluate(held_out[:2], first_id=10**7)

    pipeline_eval = run(drive())
    pipe_model = assemble(pipe, cfg)
    pipeline_loss = evaluate(pipe_model, held_out)
    single = train_local_run(
        cfg,
        corpus,
        steps=steps,
        batch_size=8,
        lr=3e-3,
        seed=run_manifest.seed,
        num_val_batches=8,
        weight_decay=0.01,
    )
    single_loss = single.losses[-1]
    assert all(core.inner_step == steps for s in (0, 1) for core in pipe.cores(s))
    assert pipeline_loss < 4.0 and single_loss < 4.0  # both trained well below the ~5.5 of a fresh model
    assert abs(pipeline_loss - single_loss) / single_loss < 0.05, (pipeline_loss, single_loss)
    torch.testing.assert_close(pipeline_eval, evaluate(pipe_model, held_out[:2]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_gradients_through_the_stage_code_equal_the_uncut_model(num_stages: int) -> None:
    run_manifest = manifest(
        batch_size=64, num_stages=num_stages, layers=3
    )  # no step: gradients stay readable
    cfg = ModelConfig.from_dict(run_manifest.model)
    pipe = build_pipeline(run_manifest)
    inputs, targets = batch(5)
    outcome = run(pipe.driver.run_microbatch(7, inputs, targets))
    assert outcome.completed

    full = build_model(cfg, run_manifest.seed)
    _, loss = full(inputs, targets)
    loss.backward()
    assert outcome.loss == pytest.approx(loss.item(), abs=1e-5)
    checked = 0
    for stage in range(num_stages):
        (core,) = pipe.cores(stage)
        for name, grad in core.accumulated_gradients().items():
            torch.testing.assert_close(grad, dict(full.named_parameters())[name].grad, rtol=1e-4, atol=1e-6)
            checked += 1
    assert checked == len(list(full.parameters()))


def test_an_optimizer_step_between_forward_and_backward_keeps_the_held_graph() -> None:
    run_manifest = manifest(batch_size=4)
    pipe = build_pipeline(run_manifest)
    (first,) = pipe.cores(0)

    async def overlapped() -> list[bool]:
        # two microbatches in flight, each a whole inner batch: each backward steps while the other is held
        outcomes = await asyncio.gather(*(pipe.driver.run_microbatch(i, *batch(i)) for i in (1, 2, 3, 4)))
        return [o.completed for o in outcomes]

    assert run(overlapped()) == [True] * 4
    assert first.inner_step == 4 and first.num_contexts == 0


# ---------------------------------------------------------------------------------------------------- idempotency


def service_pair() -> tuple[Pipeline, StageService, StageService]:
    pipe = build_pipeline(manifest(batch_size=64))
    first, last = (next(s for p, s in pipe.services.items() if pipe.stages[p] == st) for st in (0, 1))
    return pipe, first, last


def request(
    service: StageService, kind: Kind, direction: Direction, mb: int, tensor: torch.Tensor, *, signer=VERIFIER
) -> bytearray:  # noqa: ANN001
    ctx = Context(
        run_id=RUN_ID, kind=kind, receiver=service.identity.peer_id, stage=service.stage, direction=direction
    )
    return bytearray(seal(signer, ctx, microbatch=mb, step=0, now=service.wall_clock(), tensor=tensor))


def answer(
    service: StageService, frame: StreamingFrame, kind: Kind, direction: Direction
) -> torch.Tensor | None:
    ctx = Context(
        run_id=RUN_ID, kind=kind, receiver=VERIFIER.peer_id, stage=service.stage, direction=direction
    )
    opened = open_envelope(
        frame.to_bytes(),  # answers are signed while they stream; laid out whole here
        remote_peer=service.identity.peer_id,
        expect=ctx,
        limits=service.limits,
        replay=ReplayGuard(),
        now=service.wall_clock(),
    )
    return opened.tensors.get("")


def test_a_retried_backward_is_answered_from_cache_and_applied_once() -> None:
    _, first, _ = service_pair()
    tokens, _ = batch(1)
    handlers = first.routes()
    out = run(
        handlers[FORWARD_RPC].handler(
            request(first, Kind.TOKENS, Direction.FORWARD, 9, tokens), VERIFIER.peer_id
        )
    )
    activation = answer(first, out, Kind.ACTIVATION, Direction.FORWARD)
    again = run(
        handlers[FORWARD_RPC].handler(
            request(first, Kind.TOKENS, Direction.FORWARD, 9, tokens), VERIFIER.peer_id
        )
    )
    torch.testing.assert_close(
        answer(first, again, Kind.ACTIVATION, Direction.FORWARD), activation
    )  # from cache
    assert first.core.counters.microbatches_served == 1

    grad = torch.randn_like(activation)
    for _ in range(3):  # the answer was "lost" twice: each retry gets the same confirmation
        frame = run(
            handlers[BACKWARD_RPC].handler(
                request(first, Kind.GRADIENT, Direction.BACKWARD, 9, grad), VERIFIER.peer_id
            )
        )
        answer(first, frame, Kind.CONTROL, Direction.BACKWARD)
    assert first.core.counters.microbatches_applied == 1
    assert first.core.counters.answered_from_cache == 3
    with pytest.raises(StageRefusal) as refused:  # a forward after the applied backward is refused
        run(
            handlers[FORWARD_RPC].handler(
                request(first, Kind.TOKENS, Direction.FORWARD, 9, tokens), VERIFIER.peer_id
            )
        )
    assert refused.value.reason == ALREADY_APPLIED and not refused.value.blame_sender


def test_backward_without_context_and_unauthorized_callers_are_refused() -> None:
    _, first, last = service_pair()
    grad = torch.randn(4, MODEL["context_len"], MODEL["width"])
    with pytest.raises(StageRefusal) as refused:
        run(first.rpc_backward(request(first, Kind.GRADIENT, Direction.BACKWARD, 3, grad), VERIFIER.peer_id))
    assert refused.value.reason == NO_CONTEXT
    stranger = NodeIdentity.generate()
    tokens, _ = batch(2)
    with pytest.raises(ProtocolError) as unauthorized:
        run(
            first.rpc_forward(
                request(first, Kind.TOKENS, Direction.FORWARD, 3, tokens, signer=stranger), stranger.peer_id
            )
        )
    assert unauthorized.value.reason == UNAUTHORIZED and unauthorized.value.blame_sender
    assert first.core.counters.microbatches_served == 0


def test_a_context_past_the_cap_is_dropped_and_the_driver_rebuilds_it() -> None:
    pipe = build_pipeline(manifest(batch_size=64), config=StageConfig(max_contexts=1))
    (first,) = pipe.cores(0)

    async def two() -> list[bool]:
        outcomes = await asyncio.gather(*(pipe.driver.run_microbatch(i, *batch(i)) for i in (1, 2)))
        return [o.completed for o in outcomes]

    assert run(two()) == [True, True]
    assert first.counters.contexts_dropped.get("too many in flight", 0) >= 1
    assert pipe.driver.stats.recomputed >= 1 and pipe.driver.stats.double_applied == 0
    assert first.counters.microbatches_applied == 2


# ---------------------------------------------------------------------------------------------------- failover


def test_a_dead_context_holder_is_replaced_and_nothing_is_applied_twice() -> None:
    pipe = build_pipeline(manifest(batch_size=64), replicas_per_stage=2)
    stage0 = [p for p, s in pipe.stages.items() if s == 0]
    victim_and_kill: dict[str, Callable[[], None]] = {}
    held: list[int] = []

    class KillAfterLoss(PassThroughTap):
        """Kill the stage-0 replica that served a microbatch once the last stage answered it."""

        def check(self, stage, direction, replica, microbatch_id, tensor, header, **_):  # noqa: ANN001, ANN201
            if stage == 1 and direction is Direction.BACKWARD and not victim_and_kill:
                # this microbatch's own holder: `last_route` is whichever replica the latest of the six
                # concurrent forwards chose, which varies with the router's measured times (a loaded CI run)
                holder = pipe.driver.context_holders(microbatch_id)[0]
                held.append(pipe.driver.holding(holder))  # its backward is due there (status "holding")
                victim_and_kill[holder] = lambda: None
                pipe.services.pop(holder)
            return tensor

    pipe.driver.tap = KillAfterLoss()
    outcomes = drive_all(pipe, range(1, 7))
    assert all(o.completed for o in outcomes)
    assert held and held[0] >= 1 and all(pipe.driver.holding(p) == 0 for p in stage0)
    (victim,) = victim_and_kill
    survivor = next(p for p in stage0 if p != victim)
    recovered = [o for o in outcomes if o.retries]
    assert recovered and all(o.replicas[0] == survivor for o in recovered)
    assert pipe.driver.stats.double_applied == 0
    assert pipe.driver.stats.applied_per_stage == {0: 6, 1: 6}
    applied_on_survivor = pipe.services[survivor].core.counters.microbatches_applied
    assert applied_on_survivor == sum(o.replicas[0] == survivor for o in outcomes)
    assert sum(c.counters.microbatches_applied for c in pipe.cores(1)) == 6


class LosesAnswers(DirectTransport):
    """Once armed with the last stage's replicas, the first of them asked a forward (the loss hop) becomes `lossy`:
    every answer it gives to a forward is lost after the handler ran (it applied the microbatch)."""

    armed: set[str] = set()
    lossy = ""

    async def call(self, peer_id: str, rpc: str, frame, **kwargs):  # noqa: ANN001, ANN003, ANN201
        if not self.lossy and peer_id in self.armed and rpc == FORWARD_RPC:
            self.lossy = peer_id  # whichever the router picked (its choice weighs measured times)
        answer = await super().call(peer_id, rpc, frame, **kwargs)
        if peer_id == self.lossy and rpc == FORWARD_RPC:
            raise StreamClosed("stream ended while reading the answer")
        return answer


def test_a_loss_hop_moved_on_after_lost_answers_is_counted_as_maybe_applied_twice() -> None:
    pipe = build_pipeline(manifest(batch_size=64), replicas_per_stage=2)
    transport = LosesAnswers(pipe.transport.caller, pipe.transport.services)
    pipe.driver.hops.transport = transport
    last = [p for p, s in pipe.stages.items() if s == 1]
    outcomes = drive_all(pipe, range(1, 5))
    assert all(o.completed for o in outcomes) and pipe.driver.stats.maybe_applied_twice == 0  # the control

    transport.armed = set(last)
    outcome = run(pipe.driver.run_microbatch(9, *batch(9)))
    survivor = next(p for p in last if p != transport.lossy)
    assert outcome.completed and outcome.replicas[1] == survivor
    # it was applied on both last-stage replicas: the driver cannot tell, so it says it may have been
    applied = [9 in pipe.services[p].core.recent_applied(64) for p in last]
    assert applied == [True, True]
    assert pipe.driver.stats.maybe_applied_twice == 1
    assert outcome.maybe_twice == [{"stage": 1, "replica": transport.lossy, "moved_to": survivor}]
    assert pipe.driver.stats.double_applied == 0  # one acknowledgement reached the driver


def test_a_reply_signed_by_another_key_is_rejected_and_retried_elsewhere() -> None:
    pipe = build_pipeline(manifest(batch_size=64), replicas_per_stage=2)
    forger_peer = next(p for p, s in pipe.stages.items() if s == 1)
    honest = pipe.services[forger_peer]
    someone_else = NodeIdentity.generate()

    class Forger(StageService):
        async def rpc_forward(self, frame: bytearray, remote_peer: str) -> bytes:  # type: ignore[override]
            genuine = await honest.rpc_forward(frame, remote_peer)
            opened = open_envelope(  # re-sign the genuine answer with another key
                genuine.to_bytes(),
                remote_peer=self.identity.peer_id,
                expect=Context(
                    run_id=RUN_ID,
                    kind=Kind.GRADIENT,
                    receiver=remote_peer,
                    stage=1,
                    direction=Direction.BACKWARD,
                ),
                limits=self.limits,
                replay=ReplayGuard(),
                now=self.wall_clock(),
            )
            ctx = Context(
                run_id=RUN_ID, kind=Kind.GRADIENT, receiver=remote_peer, stage=1, direction=Direction.BACKWARD
            )
            return seal(
                someone_else,
                ctx,
                microbatch=opened.header.microbatch,
                step=0,
                now=self.wall_clock(),
                tensor=opened.tensors[""],
                meta=dict(opened.meta),
            )

    forger = Forger(honest.identity, RUN_ID, honest.core, authorized=honest.authorized())
    pipe.services[forger_peer] = forger
    pipe.driver.rng = random.Random(3)
    outcomes: list = []
    for first in range(
        1, 33, 4
    ):  # the router weighs measured times: on a loaded box the forger may come later
        outcomes += drive_all(pipe, range(first, first + 4))
        if pipe.driver.stats.bad_replies:
            break
    assert all(o.completed for o in outcomes)
    assert all(o.replicas[1] != forger_peer for o in outcomes)
    assert pipe.driver.stats.bad_replies >= 1
    assert pipe.driver.strikes.count(forger_peer, SignerMismatch.reason) >= 1


def rewriting_stage0(
    honest: StageService, rewrite: Callable[[Opened], tuple[torch.Tensor, dict]]
) -> StageService:
    """A stage-0 replica that opens each honest forward answer of `honest` and signs `rewrite(opened)` (the tensor
    and meta it sends instead) under its own key, at the answer's microbatch and step."""

    class Rewriter(StageService):
        async def rpc_forward(self, frame: bytearray, remote_peer: str) -> StreamingFrame:  # type: ignore[override]
            genuine = await honest.rpc_forward(frame, remote_peer)
            ctx = Context(
                run_id=RUN_ID,
                kind=Kind.ACTIVATION,
                receiver=remote_peer,
                stage=0,
                direction=Direction.FORWARD,
            )
            opened = open_envelope(
                genuine.to_bytes(),
                remote_peer=self.identity.peer_id,
                expect=ctx,
                limits=self.limits,
                replay=ReplayGuard(),
                now=self.wall_clock(),
            )
            tensor, meta = rewrite(opened)
            header = opened.header
            return seal(
                self.identity,
                ctx,
                microbatch=header.microbatch,
                step=header.step,
                now=self.wall_clock(),
                tensor=tensor,
                meta=meta,
            )

    return Rewriter(honest.identity, RUN_ID, honest.core, authorized=honest.authorized())


@pytest.mark.parametrize("checked", [True, False])
def test_a_training_answer_flagged_eval_by_the_replica_is_refused(checked: bool) -> None:
    """Whether an answer is an evaluation is the verifier's to say: a replica that flags its training answers
    `eval` would keep its signed headers out of the evidence a ban needs (#18). Control: with the check off, the
    liar's answers are used and it is never struck."""
    pipe = build_pipeline(manifest(batch_size=64), replicas_per_stage=2)
    liar_peer = next(p for p, s in pipe.stages.items() if s == 0)
    honest = pipe.services[liar_peer]

    # its own key, its own answer, one more flag
    pipe.services[liar_peer] = rewriting_stage0(
        honest, lambda opened: (opened.tensors[""], {**opened.meta, EVAL_META: True})
    )
    pipe.driver.hops.check_eval_flag = checked
    pipe.driver.rng = random.Random(3)
    outcomes = drive_all(pipe, range(1, 5))
    assert all(o.completed for o in outcomes)
    through_liar = sum(o.replicas[0] == liar_peer for o in outcomes)
    if checked:
        assert through_liar == 0  # every microbatch went through the honest one
        assert pipe.driver.strikes.count(liar_peer, "eval flag mismatch") >= 1
    else:  # the eval-flagged training answers were used, their liar never struck
        assert through_liar >= 1 and pipe.driver.strikes.count(liar_peer, "eval flag mismatch") == 0


def _digest_liar(honest: StageService) -> StageService:
    """A stage-0 replica whose answers are honest but name a made-up input digest (each one another), so that no
    two of its answers ever share an equivocation slot (#18)."""
    counter = iter(range(1 << 30))

    return rewriting_stage0(
        honest,
        lambda opened: (opened.tensors[""], {**opened.meta, INPUT_DIGEST_META: f"{next(counter):064x}"}),
    )


@pytest.mark.parametrize("checked", [True, False])
def test_an_answer_naming_another_input_digest_is_refused(checked: bool) -> None:
    """Which request an answer answers is the verifier's to say (#18). Control: with the check off, the liar's
    answers are used."""
    pipe = build_pipeline(manifest(batch_size=64), replicas_per_stage=2)
    liar_peer = next(p for p, s in pipe.stages.items() if s == 0)
    pipe.services[liar_peer] = _digest_liar(pipe.services[liar_peer])
    pipe.driver.hops.check_input_digest = checked
    pipe.driver.rng = random.Random(3)
    outcomes = drive_all(pipe, range(1, 7))
    assert all(o.completed for o in outcomes)
    through_liar = sum(o.replicas[0] == liar_peer for o in outcomes)
    if checked:
        assert through_liar == 0
        assert pipe.driver.strikes.count(liar_peer, "input digest mismatch") >= 1
    else:
        assert through_liar >= 1 and pipe.driver.strikes.count(liar_peer, "input digest mismatch") == 0


def test_an_activation_dropped_by_every_replica_drops_the_microbatch() -> None:
    class DropAll(PassThroughTap):
        def check(self, stage, direction, replica, microbatch_id, tensor, header, **_):  # noqa: ANN001, ANN201
            return Drop("test")

    pipe = build_pipeline(
        manifest(batch_size=64),
        replicas_per_stage=2,
        retry=RetryPolicy(retry_dropped_forward=True),
        tap=DropAll(),
    )
    outcome = run(pipe.driver.run_microbatch(1, *batch(1)))
    assert not outcome.completed and "no usable replica for stage 0" in outcome.reason
    assert [f["failure"] for f in outcome.failures] == ["dropped", "dropped"]  # each stage-0 replica once
    assert all(c.counters.microbatches_applied == 0 for s in (0, 1) for c in pipe.cores(s))


@pytest.mark.parametrize("retry_dropped", [True, False])
def test_an_activation_dropped_on_one_replica_is_recomputed_on_another(retry_dropped: bool) -> None:
    """With `retry_dropped_forward` (off by default, see RetryPolicy) a flagged forward answer is asked of
    another replica (nothing applied yet). Negative control: without it every microbatch it served is lost."""
    pipe = build_pipeline(
        manifest(batch_size=64), replicas_per_stage=2, retry=RetryPolicy(retry_dropped_forward=retry_dropped)
    )
    flagged = next(p for p, s in pipe.stages.items() if s == 0)

    class DropOne(PassThroughTap):
        def check(self, stage, direction, replica, microbatch_id, tensor, header, **_):  # noqa: ANN001, ANN201
            return Drop("flagged") if replica == flagged else tensor

    pipe.driver.tap = DropOne()
    pipe.driver.rng = random.Random(5)
    outcomes = drive_all(pipe, range(1, 9))
    served_by_flagged = [o for o in outcomes if any(f["replica"] == flagged for f in o.failures)]
    assert served_by_flagged  # the router sent it some (ties are broken at random)
    if retry_dropped:
        assert all(o.completed and o.replicas[0] != flagged for o in outcomes)
        assert pipe.driver.stats.double_applied == 0
    else:
        assert all(not o.completed for o in served_by_flagged)
    assert all(
        c.counters.microbatches_applied == 0 for c in pipe.cores(0) if c is pipe.services[flagged].core
    )


# ---------------------------------------------------------------------------------------------------- receipts


def test_receipts_count_verified_tokens_and_only_verifiers_can_issue_them() -> None:
    pipe = build_pipeline(manifest(batch_size=64))
    outcomes = drive_all(pipe, (1, 2))
    assert all(o.completed for o in outcomes)
    due = pipe.driver.receipts.due(now=1000.0)
    assert len(due) == 2
    for receipt, frame in due:
        opened = open_receipt(
            frame,
            run_id=RUN_ID,
            replica=receipt.replica,
            stage=receipt.stage,
            authorized_verifiers=[VERIFIER.peer_id],
            now=1000.0,
        )
        assert (
            opened == receipt and opened.tokens == 2 * 4 * MODEL["context_len"] and opened.microbatches == 2
        )
    assert pipe.driver.receipts.due(now=1001.0) == []  # nothing new to state
    receipt, frame = due[0]
    with pytest.raises(ProtocolError):  # relayed for another replica
        open_receipt(
            frame,
            run_id=RUN_ID,
            replica=due[1][0].replica,
            stage=receipt.stage,
            authorized_verifiers=[VERIFIER.peer_id],
            now=1000.0,
        )
    stranger = NodeIdentity.generate()
    forged = ReceiptBook(stranger, RUN_ID)
    forged.credit(receipt.replica, receipt.stage, tokens=10**9, microbatch=1)
    ((_, forged_frame),) = forged.due(now=1000.0)
    with pytest.raises(ProtocolError):
        open_receipt(
            forged_frame,
            run_id=RUN_ID,
            replica=receipt.replica,
            stage=receipt.stage,
            authorized_verifiers=[VERIFIER.peer_id],
            now=1000.0,
        )
    service = pipe.services[receipt.replica]
    service.wall_clock = lambda: 1000.0
    run(service.rpc_receipt(bytearray(frame), VERIFIER.peer_id))
    assert service.verified_tokens() == receipt.tokens
    with pytest.raises(RemoteRefused):
        run(
            DirectTransport(stranger.peer_id, pipe.services).call(
                receipt.replica, "stage.receipt", frame, timeout_s=5, max_response_bytes=1024
            )
        )


# ---------------------------------------------------------------------------------------------------- settings


def test_role_settings_come_from_a_table_then_the_environment() -> None:
    from node.roles.stage import stage_config
    from node.roles.verifier import verifier_config
    from protocol.errors import ConfigError

    cfg = verifier_config(
        {"microbatch_size": 4, "retry": {"hop_timeout_s": 5}},
        {"HIVENODE_VERIFIER": "max_in_flight=2, retry.max_attempts=5"},
    )
    assert (cfg.microbatch_size, cfg.max_in_flight, cfg.retry.hop_timeout_s, cfg.retry.max_attempts) == (
        4,
        2,
        5.0,
        5,
    )
    stage = stage_config(None, {"HIVENODE_STAGE": "rebalance_enabled=false,rebalance.dwell_s=7"})
    assert stage.rebalance_enabled is False and stage.rebalance.dwell_s == 7.0
    for bad in (
        {"HIVENODE_STAGE": "max_contexts=0"},
        {"HIVENODE_STAGE": "no_such=1"},
        {"HIVENODE_STAGE": "x"},
    ):
        with pytest.raises(ConfigError):
            stage_config(None, bad)
    with pytest.raises(ConfigError):
        verifier_config({"microbatch_size": "four"}, {})


def test_a_restarted_verifier_is_served_although_its_step_starts_again_at_zero() -> None:
    pipe = build_pipeline(manifest(batch_size=64))
    pipe.driver.step = 5000
    assert drive_all(pipe, (10**6,))[0].completed
    restarted = build_pipeline(manifest(batch_size=64))
    restarted.driver.transport = pipe.transport  # same stages, same verifier key, fresh driver state
    restarted.driver.replicas = pipe.driver.replicas
    restarted.driver.step = 0
    outcome = run(restarted.driver.run_microbatch(2 * 10**6, *batch(3)))
    assert outcome.completed, outcome.failures
