"""Equivocation through the pipeline (issue 18 item 4: a proof only from two statements the accused signed for one
context), over real daemons on loopback: the production stage services (`build_pipeline` of
tests/unit/test_pipeline_local.py), each served by a `FramedServer` on its own daemon under its own key, and the
verifier's `PipelineDriver` with its SENTINEL tap calling them over `FramedTransport` from its daemon.

A stage that holds one context (`max_contexts = 1`) and steps after every microbatch (an inner batch of 4): two
microbatches in flight drop each other's contexts, and the driver rebuilds them on the same replica after it
stepped, so the replica honestly answers one input twice with different weights and different payloads. Each
answer's signed header carries the step it was computed at, and the tap's slot is bound to it: no proof, no ban,
every microbatch completes. Negative control: the slot without the step (the rule before the fix) calls the
honest rebuild equivocation, bans the honest replica and loses the microbatches; the notice it queues still proves
nothing to the swarm (`proves_equivocation` checks the signed steps). And the defence is not blind: a replica that
answers one input at one step twice with different payloads is proven, and its notice bans it on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from node.roles.stage import StageConfig, StageService
from protocol.envelope import Opened, StreamingFrame
from protocol.records import BanNotice
from tests.integration.procs import pipeline_over_daemons
from tests.unit.test_pipeline_local import (  # noqa: F401 - one_torch_thread: autouse
    RUN_ID,
    VERIFIER,
    Pipeline,
    batch,
    build_pipeline,
    manifest,
    one_torch_thread,
    rewriting_stage0,
)
from verification.bans import BanEvidence, BanVote, decide_bans, proves_equivocation
from verification.equivocation import EquivocationDetector, SignedHeader, Slot
from verification.tap import SentinelTap, SentinelTapConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
SCENARIO_S = 90.0

# two in flight with one context held: each drops the other's, and the rebuilt one is answered after a step
# (four in flight thrash: a microbatch may run out of tries, `no context`)
IN_FLIGHT = (1, 2)
GATE_S = 10.0  # the last stage holds the first forwards this long at most (see `_gated`)


class Recording(EquivocationDetector):
    """The tap's detector, recording the steps each replica's answers to each (microbatch, stage, direction) were
    signed at; `step_bound=False`: the slot before it was bound to the signed step (the negative control), where a
    rebuilt context answered with new weights conflicts with the first answer."""

    def __init__(self, *, step_bound: bool) -> None:
        super().__init__()
        self.step_bound = step_bound
        self.steps: dict[tuple[str, int, int, str], set[int]] = {}

    def observe(self, signer: str, slot: Slot, signed: SignedHeader, now: float) -> Any:
        key = (signer, slot.microbatch_id, slot.stage, slot.direction)
        self.steps.setdefault(key, set()).add(slot.step)
        return super().observe(
            signer, slot if self.step_bound else dataclasses.replace(slot, step=-1), signed, now
        )


def _tap(step_bound: bool) -> tuple[SentinelTap, Recording]:
    # no spot checks: what decides here is the equivocation detector alone
    tap = SentinelTap(verifier=VERIFIER.peer_id, run_id=RUN_ID, config=SentinelTapConfig(spot=None))
    tap.equivocation = detector = Recording(step_bound=step_bound)
    return tap, detector


def _gated(honest: StageService) -> StageService:
    """The last stage's replica, holding each forward until every microbatch in flight has reached it: so that
    all of them were answered at stage 0 (each dropping the other's context there) before any backward comes back,
    and a context is rebuilt whatever the network's timing (without it, one run in five had none)."""
    arrived: list[int] = []
    everyone = asyncio.Event()

    class Gated(StageService):
        async def rpc_forward(self, frame: bytearray, remote_peer: str) -> StreamingFrame:  # type: ignore[override]
            arrived.append(1)
            if len(arrived) >= len(IN_FLIGHT):
                everyone.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(everyone.wait(), GATE_S)
            return await honest.rpc_forward(frame, remote_peer)

    return Gated(honest.identity, RUN_ID, honest.core, authorized=honest.authorized())


def _drive(loop_thread: Any, pipe: Pipeline, tmp: Path) -> list[bool]:
    """The microbatches `IN_FLIGHT`, all in flight at once over the daemons (the last stage gated); which
    completed."""
    (last,) = (p for p, s in pipe.stages.items() if s == max(pipe.stages.values()))
    pipe.services[last] = _gated(pipe.services[last])

    async def together() -> list[bool]:
        async with pipeline_over_daemons(pipe.services, pipe.driver, VERIFIER, tmp):
            outcomes = await asyncio.gather(*(pipe.driver.run_microbatch(i, *batch(i)) for i in IN_FLIGHT))
        return [o.completed for o in outcomes]

    completed: list[bool] = loop_thread.run(together(), timeout_s=SCENARIO_S)
    return completed


def _swarm_bans(notice: BanNotice) -> list[Any]:
    """What the swarm decides from this one notice (two signatures are required; a valid proof bans alone)."""
    vote = BanVote(
        verifier=VERIFIER.peer_id,
        offender=notice.offender,
        reason=notice.reason,
        evidence=notice.evidence,
        expires_at=1e12,
    )
    return decide_bans([vote], authorized=(VERIFIER.peer_id,), required=2, run_id=RUN_ID, now=0.0)


@pytest.mark.parametrize("step_bound", [True, False], ids=["step-bound", "step-blind-control"])
def test_a_context_rebuilt_after_a_step_never_frames_the_honest_replica(
    loop_thread: Any, tmp_path: Path, step_bound: bool
) -> None:
    tap, detector = _tap(step_bound)
    pipe = build_pipeline(manifest(batch_size=4), config=StageConfig(max_contexts=1), tap=tap)
    (replica,) = (p for p, s in pipe.stages.items() if s == 0)
    completed = _drive(loop_thread, pipe, tmp_path)
    # the scenario happened: a context was rebuilt on the replica after it stepped, so it answered one input
    # (one microbatch at stage 0) at two steps
    rebuilt = [k for k, steps in detector.steps.items() if k[0] == replica and len(steps) >= 2]
    assert rebuilt, detector.steps
    if step_bound:
        assert completed == [True] * len(IN_FLIGHT) and pipe.driver.stats.recomputed >= 1
        assert tap.stats.equivocations == 0 and not tap.banned_locally and not tap.pending
        assert pipe.cores(0)[0].inner_step == len(IN_FLIGHT)
    else:
        # the control: the honest rebuild reads as equivocation; the replica is banned, microbatches are lost
        assert tap.stats.equivocations >= 1 and replica in tap.banned_locally
        assert not all(completed)
        notice = tap.pending[0]
        evidence = BanEvidence.from_bytes(notice.evidence)
        assert notice.offender == replica and evidence.kind == "equivocation"
        # ... but the swarm re-checks the signed headers: two steps are two contexts, no proof, no ban
        assert not proves_equivocation(evidence, RUN_ID) and _swarm_bans(notice) == []


def _equivocator(honest: StageService) -> StageService:
    """A stage-0 replica that answers a microbatch it has answered before (a rebuilt context, at the same step)
    with another payload: its own key, the same step and input digest, the activation shifted."""
    answered: set[int] = set()

    def shifted(opened: Opened) -> tuple[torch.Tensor, dict]:
        microbatch = opened.header.microbatch
        shift = 1.0 if microbatch in answered else 0.0
        answered.add(microbatch)
        return opened.tensors[""] + shift, dict(opened.meta)

    return rewriting_stage0(honest, shifted)


def test_a_replica_answering_one_input_at_one_step_twice_differently_is_proven(
    loop_thread: Any, tmp_path: Path
) -> None:
    tap, _ = _tap(step_bound=True)
    # an inner batch of 64: nobody steps, so every rebuilt context is answered at the step of the first answer
    pipe = build_pipeline(manifest(batch_size=64), config=StageConfig(max_contexts=1), tap=tap)
    (liar,) = (p for p, s in pipe.stages.items() if s == 0)
    pipe.services[liar] = _equivocator(pipe.services[liar])
    pipe.driver.rng = random.Random(3)
    _drive(loop_thread, pipe, tmp_path)
    assert pipe.cores(0)[0].inner_step == 0
    assert tap.stats.equivocations >= 1 and liar in tap.banned_locally
    notice = tap.pending[0]
    evidence = BanEvidence.from_bytes(notice.evidence)
    # two headers it signed for one context: a proof anyone can check, and it bans on one notice
    assert proves_equivocation(evidence, RUN_ID)
    assert [d.offender for d in _swarm_bans(notice)] == [liar]
