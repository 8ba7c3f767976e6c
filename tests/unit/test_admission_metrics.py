"""Admission refusals on /metrics (issue 18): a push refused for want of the run's proof-of-work, through the
syncer's real push route, counts in `hivenode_admission_refused_total` under its cause, and in /api/status's
`admission.refused_by_reason`. Negative control: in an open run the same push is admitted and nothing counts."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from node.diloco.sync_client import PUSH_ROUTE
from node.diloco.syncer_core import AdmissionGate, Refusal
from protocol.admission import ADMISSION_CAUSES, AdmissionSpec
from protocol.identity import NodeIdentity
from tests.unit.test_syncer_ban_push import RUN_ID, Host, live_learner, push_frame

pytestmark = pytest.mark.timeout(60)


def _scrape(host: Host) -> str:
    return generate_latest(host.ctx.metrics.registry).decode()


def _count(host: Host, cause: str) -> float:
    for line in _scrape(host).splitlines():
        if line.startswith(f'hivenode_admission_refused_total{{reason="{cause}"}} '):
            return float(line.split()[-1])
    raise AssertionError(f"no sample for {cause}")


def test_a_push_without_a_proof_is_counted_on_metrics_by_cause() -> None:
    learner = NodeIdentity.generate()
    host = Host(swarm_banned=set())
    host.core.gate = AdmissionGate(AdmissionSpec(mode="pow", pow_bits=12), RUN_ID, 100)
    live_learner(host, learner)
    assert all(_count(host, cause) == 0 for cause in ADMISSION_CAUSES)  # exported before any refusal
    for _ in range(2):
        with pytest.raises(Refusal) as refused:
            asyncio.run(host.service._handle_push(push_frame(host, learner), learner.peer_id))
        assert refused.value.reason == "admission" and refused.value.cause == "no_proof"
        host.service._on_reject(learner.peer_id, PUSH_ROUTE, refused.value)  # what the FramedServer calls
    assert _count(host, "no_proof") == 2 and _count(host, "weak_proof") == 0
    admission = host.service.status()["admission"]
    assert admission["refused_by_reason"] == {"no_proof": 2}
    assert admission["refused_by_peer"] == {learner.peer_id: 2}
    assert not host.core.rounds


def test_negative_control_in_an_open_run_the_same_push_is_admitted_and_nothing_counts() -> None:
    learner = NodeIdentity.generate()
    host = Host(swarm_banned=set())
    live_learner(host, learner)
    assert asyncio.run(host.service._handle_push(push_frame(host, learner), learner.peer_id))
    assert all(_count(host, cause) == 0 for cause in ADMISSION_CAUSES)
    assert host.service.status()["admission"]["refused_by_reason"] == {}
