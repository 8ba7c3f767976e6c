"""The pipeline with real processes on loopback: a bootstrap, 2 stages x 2 replicas, 1 verifier (and a syncer when
the DiLoCo syncer role exists). Training lowers the held-out loss; a SIGKILLed replica's microbatches complete on
the other replica, none applied twice; stages refuse requests from non-verifiers; a reply signed by someone other
than the replica asked is rejected.

Tiny model (2 layers x 64, context 32), microbatches of 4: the module runs in about two minutes on 2 busy cores.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P

from node.pipeline.checks import MAX_CHECK_GAP_S
from node.pipeline.driver import PipelineDriver
from node.pipeline.routing import ReplicaInfo
from node.pipeline.transport import FramedTransport
from protocol.envelope import Context, Direction, Kind, max_frame_bytes, seal
from protocol.errors import RemoteRefused, SignerMismatch
from protocol.identity import NodeIdentity
from protocol.manifest import RunManifest
from protocol.pipeline import FORWARD_RPC, RECEIPT_RPC, UNAUTHORIZED, BoundaryShape
from protocol.rpc import FramedServer, Route
from tests.integration.procs import (
    PIPELINE_RUN,
    Bootstrap,
    Node,
    Procs,
    call_framed_once_found,
    environment,
    free_port,
    get_text,
    procs,
    read_events,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
MODEL = PIPELINE_RUN.model
STAGE_ENV = "context_timeout_s=30,compute_threads=1"
VERIFIER_ENV = (
    "microbatch_size=4,max_in_flight=4,eval_every_s=3,eval_batches=2,receipt_every_s=2,"
    "retry.hop_timeout_s=5,routing.failure_cooldown_s=30"
)


@dataclass
class Swarm:
    group: Procs
    bootstrap: Bootstrap
    stages: list[Node]  # stage 0, stage 0, stage 1, stage 1
    verifier: Node
    verifier_state: Path
    syncer: Node


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    root = tmp_path_factory.mktemp("pipeline")
    run_path = PIPELINE_RUN.write_authorizing(root, syncers=["syncer"], verifiers=["verifier"])
    with procs(root) as group, environment(HIVENODE_STAGE=STAGE_ENV, HIVENODE_VERIFIER=VERIFIER_ENV):
        bootstrap = group.start_bootstrap("--run", str(run_path))
        syncer = group.join_node(bootstrap, "syncer", state="syncer", wait=False)
        stages = [group.join_node(bootstrap, "stage", stage=s, wait=False) for s in (0, 0, 1, 1)]
        for node in stages:
            group.wait_node(node, timeout_s=90)
        # the verifier once every replica serves: started together, a replica still loading when the other had
        # trained on the first microbatches answered with the seed's activations, SENTINEL flagged and
        # quarantined it at once, and it served nothing for the rest of the module (a CI run)
        verifier = group.join_node(bootstrap, "verifier", state="verifier", wait=False)
        for node in [verifier, syncer]:
            group.wait_node(node, timeout_s=90)
        yield Swarm(group, bootstrap, stages, verifier, root / "verifier", syncer)


def stage_statuses(swarm: Swarm) -> list[dict[str, Any]]:
    return [node.status() for node in swarm.stages if node.popen.poll() is None]


# ---------------------------------------------------------------------------------------------------- training


@pytest.mark.timeout(330)  # the module's swarm starts in this test's time, then up to 120 + 60 s of waits
def test_training_lowers_held_out_loss_and_uses_every_replica(swarm: Swarm) -> None:
    def trained() -> list[dict[str, Any]] | None:
        # An evaluation after 100 microbatches or more, 1.0 nat below the untrained model's. Not necessarily
        # the newest: the first merges of single-replica rounds (outer Nesterov) can spike the held-out loss
        # for one or two evaluations (seen up to 9.0 at 234 microbatches, back to 3.0 after; docs/diloco.md, "Known")
        history = swarm.verifier.status()["val_history"]
        first = history[0] if history else None
        if first is None or len(history) < 3:
            return None
        return (
            history
            if any(h["microbatches"] >= 100 and h["loss"] < first["loss"] - 1.0 for h in history)
            else None
        )

    history = wait_until(
        trained,
        120,
        what="three held-out evaluations, one after 100 microbatches 1.0 below the first",
        interval_s=0.5,
    )
    first = history[0]
    best = min((h for h in history if h["microbatches"] >= 100), key=lambda h: h["loss"])
    print(
        f"\nheld-out loss {first['loss']:.3f} -> {best['loss']:.3f} after {best['microbatches']} microbatches "
        f"(highest since: {max(h['loss'] for h in history[1:]):.3f})"
    )
    assert first["microbatches"] == 0 and best["loss"] < first["loss"] - 1.0
    last = history[-1]
    status = swarm.verifier.status()
    assert status["double_applied"] == 0
    # A loaded 2-core box occasionally times a hop out past every retry; abandoned is never applied, and rare.
    # SENTINEL drops (a flagged activation drops its microbatch, the paper's rule) are counted apart: early in
    # training the two replicas of a stage drift apart, one is sometimes flagged for seconds, and as it answers
    # fastest (no backward to run) it draws microbatch after microbatch meanwhile: up to 250 in 3 s (CI; see
    # docs/pipeline.md). That is the SENTINEL issue's to fix; this test is about transport failures.
    dropped = status["failures"].get("dropped", 0)
    print(f"microbatches dropped by SENTINEL: {dropped}")
    assert status["microbatches_abandoned"] - dropped <= max(2, last["microbatches"] // 50), status

    # The router spreads microbatches over both replicas of each stage. Not necessarily by the time the loss fell:
    # a replica whose first answer came slow (a cold call on 2 loaded cores) loses every choice until the router
    # re-measures it (`RoutingConfig.reprobe_after_s`, 20 s). A CI run passed here with [63, 59, 0, 125].
    def applied_everywhere() -> list[int] | None:
        applied = [s["microbatches_applied"] for s in stage_statuses(swarm)]
        return applied if all(n > 0 for n in applied) else None

    try:
        applied = wait_until(
            applied_everywhere, 60, what="every replica applied a microbatch", interval_s=0.5
        )
    except AssertionError as e:
        replicas = swarm.verifier.status().get("replicas")
        raise AssertionError(
            f"{e}: {[s['microbatches_applied'] for s in stage_statuses(swarm)]}; {replicas}"
        ) from None
    status = swarm.verifier.status()
    assert sum(applied[:2]) <= status["applied_per_stage"]["0"] + status["in_flight"]
    wait_until(lambda: sum(s["verified_tokens"] for s in stage_statuses(swarm)) > 0, 10, what="receipts")
    # the stage routes' per-verifier rates (StageConfig.route_rates) leave an honest verifier's traffic alone
    assert all(s["throttled"] == {} for s in stage_statuses(swarm)), [
        s["throttled"] for s in stage_statuses(swarm)
    ]


# ---------------------------------------------------------------------------------------------------- failover


def test_a_sigkilled_replica_microbatches_complete_on_the_other_one_once(swarm: Swarm) -> None:
    replicas = swarm.stages[:2]  # both serve stage 0
    peer_ids = [node.status()["peer_id"] for node in replicas]
    before = swarm.verifier.status()["microbatches_completed"]

    seen: list[str] = []  # the last stage-0 view, for the failure message

    def busy() -> Node | None:
        # The victim holds the context of a training microbatch in flight (`holding`): its backward is due
        # there, so it fails and is recomputed on the other replica. Not a replica whose only hop in flight is a
        # spot-check recomputation (its failure ends no microbatch, so nothing would be recovered), nor one
        # holding stage contexts, which may be of microbatches dropped later on. And only while neither replica
        # sits out a routing cooldown (30 s here, after a failed hop) and the survivor has no SENTINEL flags in
        # its window: a survivor that sat one out, or was the odd one of the two, trained while the victim wrote
        # the history, so SENTINEL would drop the recomputations on it for a while (the lock-out rule,
        # docs/sentinel.md). A flagged victim is fine (it is killed). Waiting for both to be unflagged timed out
        # after 120 s once in a fresh-clone CI run (2 loaded cores).
        status = swarm.verifier.status()
        stage0, sentinel = status["replicas"]["0"], status["sentinel"]
        suspect = set(sentinel["quarantined"]) | set(sentinel["flags_in_window"])
        by_peer = {r["peer_id"]: r for r in stage0}
        seen[:] = [repr({p[-6:]: (r["holding"], r["blocked"], p in suspect) for p, r in by_peer.items()})]
        if len(stage0) != 2 or any(r["blocked"] for r in stage0):
            return None
        for node, peer in zip(replicas, peer_ids, strict=True):
            other = next(p for p in peer_ids if p != peer)
            if peer in by_peer and by_peer[peer]["holding"] > 0 and other in by_peer and other not in suspect:
                return node
        return None

    try:
        victim = wait_until(
            busy,
            120,
            what="a stage-0 replica holding a microbatch in flight, neither cooling down, the other unflagged",
            interval_s=0.02,
        )
    except AssertionError as e:
        raise AssertionError(f"{e}; stage 0 (holding, blocked, suspect): {seen}") from None
    index = 0 if victim is replicas[0] else 1
    survivor, victim_id = replicas[1 - index], peer_ids[index]
    victim.signal(signal.SIGKILL)
    killed_at = time.time()  # event times are wall-clock

    def since_kill() -> list[dict[str, Any]]:
        # The events file holds the whole module's run: a hop of the victim that failed and was retried while it
        # was alive (an answer lost on a loaded box) is not this test's business, nor are the abandoned
        # microbatches the training test tolerates.
        return [e for e in read_events(swarm.verifier_state) if e["t"] >= killed_at]

    def recovered() -> list[dict[str, Any]]:
        return [
            e
            for e in since_kill()
            if e["event"] == "microbatch_recovered" and any(f["replica"] == victim_id for f in e["failures"])
        ]

    # a microbatch's backward may first wait out a disguised backward check's gap (MAX_CHECK_GAP_S) at a later stage
    found = wait_until(
        recovered, 45 + MAX_CHECK_GAP_S, what="microbatches recovered from the victim", interval_s=0.2
    )
    wait_until(
        lambda: swarm.verifier.status()["microbatches_completed"] >= before + 40, 60, what="training going on"
    )
    print(
        f"\n{len(found)} microbatch(es) in flight on the killed replica completed elsewhere, "
        f"the first {found[0]['t'] - killed_at:.1f} s after the kill"
    )
    failed = {
        e["microbatch"] for e in since_kill() if e["event"] == "hop_failed" and e["replica"] == victim_id
    }

    def settled() -> bool:
        # a microbatch whose backward failed on the victim is recomputed on the survivor, which can take a
        # while on a loaded box: wait for every one to end, recovered or abandoned
        ended = {e["microbatch"] for e in since_kill() if e["event"].startswith("microbatch_")}
        return failed <= ended

    wait_until(settled, 30, what="every microbatch that failed on the victim to end", interval_s=0.2)
    abandoned = [e for e in since_kill() if e["event"] == "microbatch_abandoned"]
    # one that SENTINEL dropped on the survivor was not lost in transport: the drop is the paper's rule (a flag
    # drops its microbatch), and the survivor is flagged now and then early in training (see the training test)
    sentinel_dropped = {
        e["microbatch"] for e in abandoned if e["failures"] and e["failures"][-1]["failure"] == "dropped"
    }
    sentinel = swarm.verifier.status().get("sentinel", {})
    print(
        f"dropped by SENTINEL on the survivor: {len(sentinel_dropped)}; "
        f"histories started again after a lock-out: {sentinel.get('reanchors', 0)}"
    )
    abandoned = [e for e in abandoned if e["microbatch"] not in sentinel_dropped]
    assert not abandoned, abandoned
    recovered_ids = {e["microbatch"] for e in recovered()}
    assert (
        failed - sentinel_dropped <= recovered_ids
    )  # every other microbatch that failed on the victim completed
    status = swarm.verifier.status()
    assert status["double_applied"] == 0
    survivor_applied = survivor.status()["applied_recent"]
    assert len(survivor_applied) == len(set(survivor_applied))  # never twice on one replica
    assert recovered_ids <= set(survivor_applied)  # the stage-0 part of each recovered microbatch ran there
    last_stage = [node.status()["applied_recent"] for node in swarm.stages[2:]]
    # and each microbatch reached one last-stage replica, but one whose answer there timed out or was lost twice
    # and that moved on to the other (at-least-once: the driver counts it in maybe_applied_twice)
    moved_on = {
        e["microbatch"]
        for e in read_events(swarm.verifier_state)
        if e["event"] in ("microbatch_recovered", "microbatch_abandoned")
        and any(m["stage"] == len(e["replicas"]) - 1 for m in e.get("maybe_twice", []))
    }
    twice = set(last_stage[0]) & set(last_stage[1])
    assert twice <= moved_on, (twice, moved_on)
    assert status["maybe_applied_twice"] >= len(twice)
    assert all(e["replicas"][0] == survivor.status()["peer_id"] for e in recovered())


def test_a_replica_joining_mid_run_starts_from_the_global_version(swarm: Swarm) -> None:

    def merged() -> dict[str, int] | None:
        versions = swarm.stages[2].status().get("diloco", {}).get("versions", {})
        return versions if versions and max(versions.values()) > 0 else None

    held = wait_until(merged, 90, what="a merged global version of stage 1's fragments", interval_s=0.5)
    receipts = swarm.syncer.status()[
        "receipts"
    ]  # a stage's tokens count only as far as verifier receipts show
    assert receipts["verified"] > 0 and not receipts["rejected"], receipts
    late = swarm.group.join_node(swarm.bootstrap, "stage", stage=1, state="late")
    try:
        late_events = wait_until(
            lambda: read_events(swarm.group.root / "late", "stage_joined_global"),
            60,
            what="the late replica loading the global version",
        )
        assert late_events[0]["loaded"] is True
        versions = late.status()["diloco"]["versions"]
        assert all(versions[f] >= held[f] for f in held)  # at least the version that existed before it joined
    finally:
        late.signal(signal.SIGTERM)
        late.wait_exit(timeout_s=15)


# ---------------------------------------------------------------------------------------------------- placement


def test_auto_makes_a_node_peers_cannot_dial_a_learner_not_a_stage(swarm: Swarm) -> None:
    """`--role auto` in this pipeline run places a node on a stage, unless the reachability check finds that
    peers cannot dial it (it announces a port nobody listens on): then it is a learner, and says so once, whether
    it then reaches peers through the bootstrap's relay (relay mode) or not at all (client mode).
    The dialable case is unit tested (tests/unit/test_routing.py): starting another replica here would change
    the swarm the other tests measure."""
    dead_port = free_port()  # nothing listens here: the bootstrap's dial-back is refused
    node = swarm.group.start_node(
        "--join", swarm.bootstrap.maddr, "--announce", f"/ip4/127.0.0.1/tcp/{dead_port}", state="natted"
    )
    try:
        assert node.wait_line(r"^joined run \S+ \(\w+\) as (\w+)$").group(1) == "learner"
        said = [line for line in node.stderr().splitlines() if "role auto:" in line]
        assert len(said) == 1 and "learner instead of stage" in said[0], said
        joined = read_events(swarm.group.root / "natted", "joined")
        assert joined[0]["role"] == "learner", joined
        assert "relay mode" in joined[0]["why"] or "client mode" in joined[0]["why"], joined
    finally:
        node.signal(signal.SIGKILL)  # its orderly shutdown is not this test's business (a learner mid-step)
        node.wait_exit(timeout_s=20)


# ---------------------------------------------------------------------------------------------------- trust


def test_a_request_from_a_non_verifier_is_refused(swarm: Swarm, loop_thread, tmp_path: Path) -> None:  # noqa: ANN001
    target = swarm.stages[2].status()
    stranger = NodeIdentity.load_or_create(tmp_path / "stranger.key")
    run_id = target["run_id"]
    activation = torch.zeros(1, MODEL["context_len"], MODEL["width"])

    async def attempt() -> str:
        p2p = await P2P.create(
            initial_peers=[swarm.bootstrap.maddr],
            identity_path=str(stranger.path),
            check_if_identity_free=False,
            host_maddrs=LOOPBACK,
        )
        try:
            ctx = Context(
                run_id=run_id,
                kind=Kind.ACTIVATION,
                receiver=target["peer_id"],
                stage=1,
                direction=Direction.FORWARD,
            )
            frame = seal(stranger, ctx, microbatch=1, step=0, now=time.time(), tensor=activation)
            try:
                await call_framed_once_found(
                    p2p, target["peer_id"], FORWARD_RPC, frame, max_response_bytes=4096
                )
            except RemoteRefused as e:
                return e.reason
            return "accepted"
        finally:
            await p2p.shutdown()

    assert loop_thread.run(attempt(), timeout_s=60) == UNAUTHORIZED
    strikes = swarm.stages[2].status()["strikes"]
    assert strikes.get(stranger.peer_id, {}).get(UNAUTHORIZED) == 1


def test_a_caller_over_a_stage_routes_rate_is_throttled_and_counted(
    swarm: Swarm, loop_thread, tmp_path: Path
) -> None:  # noqa: ANN001
    """`stage.receipt` takes 1/s per caller with a burst of 10 (StageConfig.route_rates): of 40 back-to-back calls,
    those past the burst are throttled before they are read, and the stage counts them in status and /metrics."""
    target = swarm.stages[3]
    target_id = target.status()["peer_id"]
    flooder = NodeIdentity.load_or_create(tmp_path / "flooder.key")

    async def flood() -> list[str]:
        p2p = await P2P.create(
            initial_peers=[swarm.bootstrap.maddr],
            identity_path=str(flooder.path),
            check_if_identity_free=False,
            host_maddrs=LOOPBACK,
        )
        reasons = []
        try:
            for _ in range(40):
                try:
                    await call_framed_once_found(p2p, target_id, RECEIPT_RPC, b"x", max_response_bytes=4096)
                    reasons.append("accepted")
                except RemoteRefused as e:
                    reasons.append(e.reason)
            return reasons
        finally:
            await p2p.shutdown()

    reasons = loop_thread.run(flood(), timeout_s=120)
    throttled = [r for r in reasons if r.startswith("throttled: rate")]
    assert reasons[:10] == [UNAUTHORIZED] * 10, reasons  # the burst is read (and refused: not a verifier)
    assert len(throttled) >= 10 and set(reasons) == {UNAUTHORIZED, *throttled}, reasons
    counted = target.status()["throttled"]
    assert counted.get(f"{RECEIPT_RPC}: rate", 0) >= len(throttled), counted
    metrics = get_text(target.status_url.replace("/api/status", "/metrics")).splitlines()
    lines = [line for line in metrics if line.startswith("hivenode_rpc_throttled_total{")]
    assert any(f'route="{RECEIPT_RPC}"' in line and 'reason="rate"' in line for line in lines), lines


def test_a_reply_signed_by_another_key_than_the_replica_asked_is_rejected(
    loop_thread, tmp_path: Path
) -> None:  # noqa: ANN001
    verifier = NodeIdentity.load_or_create(tmp_path / "verifier.key")
    replica = NodeIdentity.load_or_create(tmp_path / "replica.key")
    impostor = NodeIdentity.generate()
    run = RunManifest(model=dict(MODEL), num_stages=2, authorized_verifiers=(verifier.peer_id,))
    run_id = "1" * 40
    shape = BoundaryShape.from_manifest(run)

    async def forged_forward(frame: bytearray, remote_peer: str) -> bytes:
        ctx = Context(
            run_id=run_id, kind=Kind.ACTIVATION, receiver=remote_peer, stage=0, direction=Direction.FORWARD
        )
        return seal(impostor, ctx, microbatch=7, step=0, now=time.time(), tensor=torch.zeros(2, 32, 64))

    async def scenario() -> tuple[bool, int, int]:
        server_p2p = await P2P.create(
            identity_path=str(replica.path), check_if_identity_free=False, host_maddrs=LOOPBACK
        )
        client_p2p = await P2P.create(
            initial_peers=await server_p2p.get_visible_maddrs(),
            identity_path=str(verifier.path),
            check_if_identity_free=False,
            host_maddrs=LOOPBACK,
        )
        server = FramedServer(server_p2p, {FORWARD_RPC: Route(forged_forward, max_frame_bytes(shape.limits))})
        await server.start()
        try:
            driver = PipelineDriver(
                identity=verifier,
                run_id=run_id,
                num_stages=2,
                shape=shape,
                transport=FramedTransport(client_p2p),
                replicas=lambda: [
                    ReplicaInfo(peer_id=replica.peer_id, stage=0),
                    ReplicaInfo(peer_id="x", stage=1),
                ],
                rng=random.Random(0),
            )
            tokens = torch.randint(0, 256, (2, 33))
            outcome = await driver.run_microbatch(7, tokens[:, :-1], tokens[:, 1:])
            return (
                outcome.completed,
                driver.stats.bad_replies,
                driver.strikes.count(replica.peer_id, SignerMismatch.reason),
            )
        finally:
            await server.stop()
            await client_p2p.shutdown()
            await server_p2p.shutdown()

    completed, bad_replies, strikes = loop_thread.run(scenario(), timeout_s=60)
    assert not completed and bad_replies == 1 and strikes == 1
