"""FragmentSync against a fake in-process syncer: snapshots, tau-delayed overwrite, retries while the syncer is
away, refusals, the synchronous barrier, late join, failover offers, and the run-wide fragment plan."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Sequence

import pytest
import torch

from node.diloco.fragments import FragmentSchedule, SyncFloor, SyncFloorConfig, covered_fragments
from node.diloco.sync_client import FragmentSync, contribution_meta, run_fragment_plan
from node.diloco.sync_types import (
    ContributionRefused,
    FragmentVersion,
    OutgoingContribution,
    PushReceipt,
    SyncClientConfig,
    SyncDeferred,
    SyncUnavailable,
    VersionsView,
)
from node.ml.model import ModelConfig, build_model, build_stage
from protocol.manifest import DilocoSpec, RunManifest

MODEL = {"vocab_size": 256, "context_len": 16, "num_layers": 2, "width": 16, "num_heads": 2}


def manifest(**diloco: object) -> RunManifest:
    spec = {"num_fragments": 2, "sync_every_steps": 4, "overlap_steps": 1, "min_sync_interval_s": 0.0}
    spec.update(diloco)
    return RunManifest(model=dict(MODEL), num_stages=2, diloco=DilocoSpec(**spec))


class FakeSyncer:
    """Holds one version per fragment; `publish` makes a new one; `down` makes every call fail."""

    def __init__(self, plan_size: int, peer: str = "syncer-a", term: int = 1, barrier: bool = False) -> None:
        self.current = [0] * plan_size
        self.store: dict[int, FragmentVersion] = {}
        self.pushed: list[OutgoingContribution] = []
        self.offers: list[FragmentVersion] = []
        self.peer, self.term, self.barrier = peer, term, barrier
        self.down = False
        self.refuse: str | None = None
        self.changed = asyncio.Event()

    def publish(
        self, fragment: int, params: dict[str, torch.Tensor], *, envelope: bytes | None = b"sig"
    ) -> None:
        self.current[fragment] += 1
        self.store[fragment] = FragmentVersion(
            fragment=fragment,
            version=self.current[fragment],
            params={k: v.clone() for k, v in params.items()},
            term=self.term,
            signer=self.peer,
            envelope=envelope,
        )
        self.changed.set()

    def _check(self) -> None:
        if self.down:
            raise SyncUnavailable("down")

    async def push(self, contribution: OutgoingContribution) -> PushReceipt:
        self._check()
        if self.refuse:
            raise ContributionRefused("no", reason=self.refuse)
        self.pushed.append(contribution)
        return PushReceipt(target_version=self.current[contribution.fragment] + 1, term=self.term)

    async def versions(self, known: Sequence[int], wait_s: float) -> VersionsView:
        self._check()
        if not any(c > k for c, k in zip(self.current, known, strict=True)) and wait_s > 0:
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), wait_s)
            self._check()
        return VersionsView(
            versions=tuple(self.current), term=self.term, syncer=self.peer, barrier=self.barrier
        )

    async def fetch(self, fragment: int) -> FragmentVersion:
        self._check()
        return self.store[fragment]

    async def offer(self, held: Sequence[FragmentVersion]) -> int:
        self._check()
        self.offers.extend(held)
        return len(held)


def learner_sync(
    syncer: FakeSyncer | None = None, *, barrier: bool = False, **diloco: object
) -> tuple[FragmentSync, torch.nn.Module, FakeSyncer]:
    run = manifest(**diloco)
    plan = run_fragment_plan(run)
    model = build_model(ModelConfig.from_dict(run.model), seed=0)
    syncer = syncer or FakeSyncer(plan.num_fragments)
    config = SyncClientConfig(
        poll_wait_s=0.2, retry_min_s=0.01, retry_max_s=0.05, join_timeout_s=0.3, barrier=barrier
    )
    sync = FragmentSync.create(dict(model.named_parameters()), plan, run.diloco, syncer, config=config)
    return sync, model, syncer


def bump(model: torch.nn.Module, amount: float = 0.01) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(amount)


async def until(predicate, timeout_s: float = 3.0) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


# ---- the plan ----


def test_run_plan_is_the_union_of_per_stage_plans_and_stages_cover_a_subset() -> None:
    run = manifest()
    plan = run_fragment_plan(run)
    assert plan.num_fragments == 2 * 2 + 1  # two stages x P, plus the embedding fragment of stage 0
    cfg = ModelConfig.from_dict(run.model)
    model = build_model(cfg, seed=0)
    assert set(plan.names()) == {n for n, _ in model.named_parameters()}
    assert covered_fragments(plan, dict(model.named_parameters())) == list(range(plan.num_fragments))
    first = covered_fragments(plan, dict(build_stage(cfg, 0, 0, 2).named_parameters()))
    last = covered_fragments(plan, dict(build_stage(cfg, 0, 1, 2).named_parameters()))
    assert sorted(first + last) == list(range(plan.num_fragments)) and not set(first) & set(last)
    assert any(plan.fragments[i].is_embedding for i in first)
    with pytest.raises(ValueError, match="partly"):
        covered_fragments(plan, [plan.fragments[0].names[0]])  # one tensor of a many-tensor fragment


def test_a_stage_replica_syncs_only_its_span() -> None:
    run = manifest()
    plan = run_fragment_plan(run)
    stage = build_stage(ModelConfig.from_dict(run.model), 0, 1, 2)
    sync = FragmentSync.create(
        dict(stage.named_parameters()), plan, run.diloco, FakeSyncer(plan.num_fragments)
    )
    assert sync.fragment_ids == covered_fragments(plan, dict(stage.named_parameters()))
    assert sync.schedule.num_fragments == len(sync.fragment_ids)


# ---- snapshots and overwrite ----


def test_due_fragments_are_snapshotted_with_counters_and_the_copy_is_private() -> None:
    sync, model, _ = learner_sync()
    name_of = {fid: sync.plan.fragments[fid].names[0] for fid in sync.fragment_ids}
    due_at: dict[int, int] = {}
    for step in range(1, 5):
        bump(model)
        sync.after_inner_step(step, tokens=32)
        for index in sync.schedule.due_to_send(step):
            due_at[sync.fragment_ids[index]] = step
    assert set(due_at) == set(sync.fragment_ids)  # every fragment is due once within H = 4 steps
    outbox = {c.fragment: c for c in sync.ledger.outbox.values()}
    for fid, contribution in outbox.items():
        assert contribution.steps == due_at[fid] and contribution.tokens == 32 * due_at[fid]
        assert contribution.base_version == 0
        name = name_of[fid]
        before = contribution.params[name].clone()
        bump(model, 1.0)
        assert torch.equal(contribution.params[name], before)  # a clone, not a view of the live tensor


def test_merged_version_is_applied_tau_steps_after_the_send_and_resets_counters() -> None:
    async def scenario() -> None:
        sync, model, syncer = learner_sync()
        stop = asyncio.Event()
        tasks = [asyncio.create_task(sync.run_sender(stop)), asyncio.create_task(sync.run_watcher(stop))]
        fid = sync.fragment_ids[sync.schedule.due_to_send(1)[0]] if sync.schedule.due_to_send(1) else None
        step = 1
        while fid is None:
            step += 1
            due = sync.schedule.due_to_send(step)
            fid = sync.fragment_ids[due[0]] if due else None
        for s in range(1, step + 1):
            bump(model)
            sync.after_inner_step(s, tokens=8)
        await until(lambda: any(c.fragment == fid for c in syncer.pushed))
        names = sync.plan.fragments[fid].names
        merged = {n: torch.full_like(dict(model.named_parameters())[n], 7.0) for n in names}
        syncer.publish(fid, merged)
        await until(lambda: sync.ledger.inbox)
        params = dict(model.named_parameters())
        assert not torch.equal(params[names[0]], merged[names[0]])  # arrived, but tau = 1 step not yet over
        sync.after_inner_step(step + 1, tokens=8)
        assert torch.equal(params[names[0]].detach(), merged[names[0]])
        assert sync.versions()[fid] == 1
        assert sync.ledger.counters[sync.ledger.local[fid]].steps == 0
        stop.set()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_training_goes_on_while_the_syncer_is_away_and_the_newest_snapshot_is_sent_on_return() -> None:
    async def scenario() -> None:
        sync, model, syncer = learner_sync()
        syncer.down = True
        stop = asyncio.Event()
        sender = asyncio.create_task(sync.run_sender(stop))
        for step in range(1, 13):  # three rounds of every fragment
            bump(model)
            sync.after_inner_step(step, tokens=4)
            await asyncio.sleep(0)
        await until(lambda: sync.status()["retries"] >= 2)
        assert not syncer.pushed and sync.status()["in_flight"] == len(sync.fragment_ids)
        syncer.down = False
        await until(lambda: len(syncer.pushed) == len(sync.fragment_ids))
        assert all(c.steps > 4 for c in syncer.pushed)  # counters kept growing: the later snapshot won
        stop.set()
        await sender

    asyncio.run(scenario())


def test_a_refused_contribution_is_dropped_and_does_not_hold_the_barrier() -> None:
    async def scenario() -> None:
        sync, model, syncer = learner_sync(barrier=True)
        syncer.refuse = "stale base"
        stop = asyncio.Event()
        sender = asyncio.create_task(sync.run_sender(stop))
        step = 1
        while not sync.schedule.due_to_send(step):
            step += 1
        for s in range(1, step + 1):
            bump(model)
            sync.after_inner_step(s, tokens=4)
        assert sync.blocked_at(step + 1)
        await until(lambda: sync.status()["refused"] >= 1)
        await asyncio.wait_for(sync.wait_barrier(step + 1, stop), 2.0)
        assert sync.status()["refusals"] == {"stale base": sync.status()["refused"]}
        stop.set()
        await sender

    asyncio.run(scenario())


def test_barrier_waits_for_the_round_version_then_releases() -> None:
    async def scenario() -> None:
        sync, model, syncer = learner_sync(barrier=True)
        stop = asyncio.Event()
        tasks = [asyncio.create_task(sync.run_sender(stop)), asyncio.create_task(sync.run_watcher(stop))]
        step = 1
        while not sync.schedule.due_to_send(step):
            step += 1
        for s in range(1, step + 2):
            bump(model)
            sync.after_inner_step(s, tokens=4)
        fid = sync.fragment_ids[sync.schedule.due_to_send(step)[0]]
        waiter = asyncio.create_task(sync.wait_barrier(step + 1, stop))
        await asyncio.sleep(0.1)
        assert not waiter.done()  # the round of `fid` has not merged
        await until(lambda: any(c.fragment == fid for c in syncer.pushed))
        assert not waiter.done() and sync.versions()[fid] == 0  # still held, right before the version comes
        names = sync.plan.fragments[fid].names
        syncer.publish(fid, {n: dict(model.named_parameters())[n].detach().clone() for n in names})
        # (not how long it waited: on a loaded box another task can hold the loop past the sleep above before the
        # waiter starts its clock; CI saw 1 ms)
        waited = await asyncio.wait_for(waiter, 2.0)
        assert waited >= 0.0 and sync.versions()[fid] == 1
        stop.set()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_inner_steps_on_a_worker_thread_while_the_loops_run() -> None:
    async def scenario() -> None:
        sync, model, syncer = learner_sync()
        stop = asyncio.Event()
        tasks = [asyncio.create_task(sync.run_sender(stop)), asyncio.create_task(sync.run_watcher(stop))]
        threads: set[str] = set()

        def step(s: int) -> None:
            threads.add(threading.current_thread().name)
            bump(model)
            sync.after_inner_step(s, tokens=4)

        for s in range(1, 9):
            await asyncio.to_thread(step, s)
        await until(lambda: len(syncer.pushed) >= len(sync.fragment_ids))
        assert threading.current_thread().name not in threads
        stop.set()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


# ---- joining and failover ----


def test_late_joiner_loads_the_global_fragments_before_its_first_step() -> None:
    async def scenario() -> None:
        sync, model, syncer = learner_sync()
        fid = sync.fragment_ids[0]
        names = sync.plan.fragments[fid].names
        for _ in range(3):
            syncer.publish(fid, {n: torch.full_like(dict(model.named_parameters())[n], 3.0) for n in names})
        assert await sync.join_global(asyncio.Event())
        assert sync.versions()[fid] == 3
        assert torch.equal(
            dict(model.named_parameters())[names[0]].detach(), syncer.store[fid].params[names[0]]
        )
        other = sync.fragment_ids[1]
        assert sync.versions()[other] == 0

    asyncio.run(scenario())


class CountingSyncer(FakeSyncer):
    """Answers every fetch with a fresh copy of its version (as the wire does: a frame decoded anew) and, at each
    fetch, counts the tensors of earlier answers still alive somewhere in the learner; `fail_at`: that fetch
    (1-based, counted over all tries) fails once, as if the syncer went away half-way."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.answered: list[weakref.ref[torch.Tensor]] = []
        self.alive_at_fetch: list[int] = []
        self.fetched: list[int] = []
        self.fail_at: int | None = None

    async def fetch(self, fragment: int) -> FragmentVersion:
        self._check()
        self.alive_at_fetch.append(sum(ref() is not None for ref in self.answered))
        self.fetched.append(fragment)
        if len(self.fetched) == self.fail_at:
            raise SyncUnavailable("went away")
        stored = self.store[fragment]
        params = {k: v.clone() for k, v in stored.params.items()}
        self.answered.extend(weakref.ref(t) for t in params.values())
        return dataclasses.replace(stored, params=params)


def publish_all(sync: FragmentSync, model: torch.nn.Module, syncer: FakeSyncer, value: float) -> None:
    params = dict(model.named_parameters())
    for fid in sync.fragment_ids:
        syncer.publish(fid, {n: torch.full_like(params[n], value) for n in sync.plan.fragments[fid].names})


def test_a_joiner_loads_each_version_as_it_arrives_and_holds_no_earlier_one() -> None:
    """The join streams: when a fragment is fetched, no earlier fetched version's tensors are held any more (they
    were copied into the model). Gathered first (the rejoin's `_fetch_current`, the join before), every earlier
    version is alive at each fetch: the negative control that the count sees what is held."""

    async def scenario() -> None:
        sync, model, syncer = learner_sync(CountingSyncer(run_fragment_plan(manifest()).num_fragments))
        assert isinstance(syncer, CountingSyncer)
        publish_all(sync, model, syncer, 3.0)
        assert await sync.join_global(asyncio.Event())
        assert syncer.alive_at_fetch == [0] * len(sync.fragment_ids)
        assert all(bool((p.detach() == 3.0).all()) for p in model.parameters())
        assert set(sync.versions().values()) == {1}
        syncer.alive_at_fetch.clear()
        _, gathered = await sync.watcher._fetch_current()  # noqa: SLF001 - the negative control
        assert syncer.alive_at_fetch[1:] and all(n > 0 for n in syncer.alive_at_fetch[1:])
        del gathered

    asyncio.run(scenario())


def test_a_join_retried_after_the_syncer_went_away_fetches_only_what_it_had_not_loaded() -> None:
    async def scenario() -> None:
        sync, model, syncer = learner_sync(CountingSyncer(run_fragment_plan(manifest()).num_fragments))
        assert isinstance(syncer, CountingSyncer)
        publish_all(sync, model, syncer, 2.0)
        syncer.fail_at = 3
        assert await sync.join_global(asyncio.Event())
        ids = sync.fragment_ids
        assert syncer.fetched == ids[:3] + ids[2:]  # the third failed; the retry starts there
        assert all(bool((p.detach() == 2.0).all()) for p in model.parameters())
        assert set(sync.versions().values()) == {1}

    asyncio.run(scenario())


def test_join_without_any_syncer_gives_up_at_the_timeout() -> None:
    async def scenario() -> None:
        sync, _, syncer = learner_sync()
        syncer.down = True
        assert not await sync.join_global(asyncio.Event())

    asyncio.run(scenario())


def test_after_a_failover_held_signed_versions_are_offered_to_a_syncer_that_is_behind() -> None:
    async def scenario() -> None:
        sync, model, old = learner_sync()
        fid = sync.fragment_ids[0]
        names = sync.plan.fragments[fid].names
        old.publish(fid, {n: dict(model.named_parameters())[n].detach().clone() for n in names})
        old.publish(fid, {n: dict(model.named_parameters())[n].detach().clone() for n in names})
        assert await sync.join_global(asyncio.Event())
        new = FakeSyncer(sync.plan.num_fragments, peer="syncer-b", term=2)
        new.current[fid] = 1  # its checkpoint is one merge behind what the old syncer published
        sync.transport = new
        stop = asyncio.Event()
        watcher = asyncio.create_task(sync.run_watcher(stop))
        await until(lambda: new.offers)
        assert [(v.fragment, v.version, v.signer) for v in new.offers] == [(fid, 2, "syncer-a")]
        stop.set()
        await watcher

    asyncio.run(scenario())


class RecoveringSyncer(FakeSyncer):
    """A syncer just taken over: it defers a push built on a version it lacks until a learner offers that
    version (then adopts it); its versions route can be made to fail on its own."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.versions_down = False
        self.deferred: list[int] = []

    async def push(self, contribution: OutgoingContribution) -> PushReceipt:
        if contribution.base_version > self.current[contribution.fragment]:
            self.deferred.append(contribution.fragment)
            raise SyncDeferred("ahead of syncer", reason="ahead of syncer")
        return await super().push(contribution)

    async def versions(self, known: Sequence[int], wait_s: float) -> VersionsView:
        if self.versions_down:
            raise SyncUnavailable("versions down")
        return await super().versions(known, wait_s)

    async def offer(self, held: Sequence[FragmentVersion]) -> int:
        for version in held:
            self.current[version.fragment] = max(self.current[version.fragment], version.version)
        return await super().offer(held)


def test_after_a_takeover_a_deferred_push_holds_back_nothing_and_the_watcher_offers_at_once() -> None:
    """The new syncer lacks the version one fragment's contribution is built on. The other fragments go
    through at once, and the deferral wakes the watcher (in a 30 s backoff after a failed poll) to offer the
    held version, so the deferred contribution is taken seconds before either backoff would have ended; on
    the new term every fragment's progress goes out afresh."""

    async def scenario() -> None:
        sync, model, old = learner_sync()
        sync.config = dataclasses.replace(
            sync.config, retry_min_s=30.0, retry_max_s=30.0, deferred_retry_s=0.05
        )
        fid = sync.fragment_ids[0]
        names = sync.plan.fragments[fid].names
        old.publish(fid, {n: dict(model.named_parameters())[n].detach().clone() for n in names})
        assert await sync.join_global(asyncio.Event())
        new = RecoveringSyncer(sync.plan.num_fragments, peer="syncer-b", term=2)  # fid is at 0 there
        new.versions_down = True
        sync.transport = new
        stop = asyncio.Event()
        watcher = asyncio.create_task(sync.run_watcher(stop))
        await until(lambda: sync.status()["last_error"] == "versions down")  # the watcher now backs off 30 s
        new.versions_down = False
        sender = asyncio.create_task(sync.run_sender(stop))
        for step in range(1, sync.schedule.sync_every_steps + 1):  # every fragment falls due once
            bump(model)
            sync.after_inner_step(step, tokens=4)
        await until(lambda: {c.fragment for c in new.pushed} == set(sync.fragment_ids), timeout_s=5.0)
        assert new.deferred and set(new.deferred) == {fid}
        assert [(v.fragment, v.version) for v in new.offers] == [(fid, 1)]
        order = [c.fragment for c in new.pushed]
        assert all(order.index(f) < order.index(fid) for f in set(order) - {fid})  # none held behind it
        # seeing the new term, the learner sent every fragment's progress afresh, snapshotted for term 2
        latest = {c.fragment: c for c in new.pushed}
        assert {f: c.seen_term for f, c in latest.items()} == dict.fromkeys(sync.fragment_ids, 2)
        stop.set()
        await asyncio.gather(watcher, sender)

    asyncio.run(scenario())


class LockStepSyncer(FakeSyncer):
    """A lock-step syncer whose rounds went on without us: a push on an older base is taken, `late`."""

    async def push(self, contribution: OutgoingContribution) -> PushReceipt:
        self._check()
        self.pushed.append(contribution)
        current = self.current[contribution.fragment]
        late = contribution.base_version < current
        return PushReceipt(target_version=current if late else current + 1, term=self.term, late=late)


def test_a_lock_step_learner_told_it_was_late_loads_the_current_versions_and_sends_to_the_open_round() -> (
    None
):
    """While we were stopped every fragment's rounds 1 and 2 merged without us. Our next send is late; we must
    not wait at the barrier for that fragment's round 3 (the others reach it only after rounds that need us):
    we load version 2 of everything and our next send is the earliest open round's, on the current base."""

    async def scenario() -> None:
        run = manifest()
        plan = run_fragment_plan(run)
        syncer = LockStepSyncer(plan.num_fragments, barrier=True)
        sync, model, _ = learner_sync(syncer, barrier=True)
        params = dict(model.named_parameters())
        for fid in sync.fragment_ids:
            for _ in range(2):
                syncer.publish(fid, {n: params[n].detach() + 1.0 for n in plan.fragments[fid].names})
        stop = asyncio.Event()
        tasks = [asyncio.create_task(sync.run_sender(stop)), asyncio.create_task(sync.run_watcher(stop))]
        step = 1
        while not syncer.pushed:
            bump(model)
            sync.after_inner_step(step, tokens=4)
            step += 1
            await asyncio.sleep(0.01)
        assert syncer.pushed[0].base_version == 0  # late: its round merged without us
        await until(lambda: sync.ledger.rejoin_with is not None)  # the watcher fetched the current versions
        # ... but parameters are only written on the inner loop's side (a step may be running meanwhile)
        assert set(sync.versions().values()) == {0} and sync.status()["rejoins"] == 0
        sync.apply_arrived(step)
        assert sync.status()["rejoins"] == 1
        assert set(sync.versions().values()) == {2}
        await asyncio.wait_for(sync.wait_barrier(step + sync.schedule.sync_every_steps, stop), 2.0)
        first_open = min(range(len(sync.fragment_ids)), key=lambda i: sync.schedule.next_send(i, 0))
        while len(syncer.pushed) < 2:
            bump(model)
            sync.after_inner_step(step, tokens=4)
            step += 1
            await asyncio.sleep(0.01)
        nxt = syncer.pushed[1]
        # the earliest open round (every fragment is at version 2: the first fragment of the cycle), on time
        assert nxt.base_version == 2 and nxt.fragment == sync.fragment_ids[first_open]
        assert sync.status()["rejoins"] == 1
        stop.set()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_a_lock_step_learner_with_nothing_in_flight_realigns_when_rounds_merged_without_it() -> None:
    """Stopped between rounds, we come back to versions of rounds merged without us. The others wait on the
    earliest round still open; our next send must be that round's, not the next one by our own step count."""
    sync, model, syncer = learner_sync(barrier=True)  # H = 4
    params = dict(model.named_parameters())
    ahead = sync.fragment_ids[:2]  # the rounds of the first two fragments of the cycle merged without us
    for fid in ahead:
        syncer.publish(fid, {n: params[n].detach() + 1.0 for n in sync.plan.fragments[fid].names})
        sync.ledger.inbox[sync.ledger.local[fid]] = syncer.store[fid]
    assert not sync.ledger.pending
    sync.after_inner_step(1, tokens=4)
    assert sync.status()["rejoins"] == 1
    step, first = 1, None
    while first is None:
        step += 1
        bump(model)
        sync.after_inner_step(step, tokens=4)
        first = next(iter(sync.ledger.outbox.values()), None)
    # the open round that comes first: the third fragment's first (the two before it are at version 1)
    assert first.fragment == sync.fragment_ids[2] and first.base_version == 0


def test_versions_only_move_forward() -> None:
    sync, model, _ = learner_sync()
    fid = sync.fragment_ids[0]
    names = sync.plan.fragments[fid].names
    params = dict(model.named_parameters())
    newer = FragmentVersion(fragment=fid, version=5, params={n: params[n].detach() + 1 for n in names})
    older = FragmentVersion(fragment=fid, version=4, params={n: params[n].detach() + 2 for n in names})
    assert sync.load_global([newer]) == 1
    sync.ledger.inbox[sync.ledger.local[fid]] = older
    sync.after_inner_step(1, tokens=4)
    assert sync.versions()[fid] == 5
    assert torch.equal(params[names[0]].detach(), newer.params[names[0]])


def test_schedule_floor_and_config_are_checked() -> None:
    run = manifest()
    plan = run_fragment_plan(run)
    model = build_model(ModelConfig.from_dict(run.model), seed=0)
    wrong = FragmentSchedule(num_fragments=2, sync_every_steps=4, overlap_steps=1)
    floor = SyncFloor(SyncFloorConfig(min_interval_s=0.0))
    with pytest.raises(ValueError, match="schedule"):
        FragmentSync(dict(model.named_parameters()), plan, wrong, floor, FakeSyncer(plan.num_fragments))
    with pytest.raises(ValueError):
        SyncClientConfig(poll_wait_s=0)


def test_the_real_time_floor_skips_a_due_send_and_counters_keep_growing() -> None:
    now = [0.0]
    run = manifest(min_sync_interval_s=100.0)
    plan = run_fragment_plan(run)
    model = build_model(ModelConfig.from_dict(run.model), seed=0)
    sync = FragmentSync.create(
        dict(model.named_parameters()), plan, run.diloco, FakeSyncer(plan.num_fragments), clock=lambda: now[0]
    )
    for step in range(1, 5):
        sync.after_inner_step(step, tokens=2)
    first = {c.fragment: c.steps for c in sync.ledger.outbox.values()}
    sync.ledger.outbox.clear()
    for step in range(5, 9):
        now[0] += 1.0
        sync.after_inner_step(step, tokens=2)
    assert not sync.ledger.outbox  # every fragment was due again, but 100 s have not passed
    now[0] += 200.0
    for step in range(9, 13):
        sync.after_inner_step(step, tokens=2)
    assert all(c.steps == first[c.fragment] + 8 for c in sync.ledger.outbox.values())


def test_a_decoupled_learner_aligns_its_schedule_to_the_run_clock() -> None:
    async def scenario() -> None:
        sync, model, syncer = learner_sync(sync_every_steps=12)

        def view(clock: int) -> VersionsView:
            return VersionsView(versions=tuple(syncer.current), term=1, syncer="s", clock=clock)

        def position() -> int:
            return sync.ledger.timer.sched_step(sync.ledger.step)

        for step in range(1, 4):
            sync.after_inner_step(step, tokens=4)
        await sync.watcher.absorb(view(20))
        assert position() == 20  # 17 steps off (>= H/2): a restart or a long stall, aligned at once
        for clock in (22, 18, 23, 19):
            await sync.watcher.absorb(view(clock))
        assert position() == 20  # jitter around our position: no move
        for clock in (23, 22, 24, 22):
            await sync.watcher.absorb(view(clock))
        assert position() == 20
        await sync.watcher.absorb(view(23))
        assert position() == 22  # five answers in a row ahead of us: shift by the smallest lead (2)

    asyncio.run(scenario())


def test_a_synchronous_joiner_starts_at_the_earliest_open_round() -> None:
    sync, _, _ = learner_sync(barrier=True)
    h = sync.schedule.sync_every_steps
    sync.ledger.versions = [2, 1, 2, 2, 2][: len(sync.fragment_ids)]
    first = [sync.schedule.next_send(i, 0) for i in range(len(sync.fragment_ids))]
    expected = min(f + v * h for f, v in zip(first, sync.ledger.versions, strict=True)) - 1
    assert sync.align_to_rounds() == expected


def test_a_stage_relays_its_newest_verifier_receipts_with_every_push() -> None:
    async def scenario() -> None:
        run = manifest()
        plan = run_fragment_plan(run)
        stage = build_stage(ModelConfig.from_dict(run.model), 0, 1, 2)
        syncer = FakeSyncer(plan.num_fragments)
        held = [b"r1", b"r2"]  # what StageService.receipts holds (the frames, oldest first)
        calls = {"n": 0}

        def provider() -> list[bytes]:
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("a broken provider costs one push its receipts, not the push")
            return list(held)

        sync = FragmentSync.create(
            dict(stage.named_parameters()),
            plan,
            run.diloco,
            syncer,
            config=SyncClientConfig(retry_min_s=0.01, retry_max_s=0.05),
            receipts=provider,
        )
        stop = asyncio.Event()
        sender = asyncio.create_task(sync.run_sender(stop))
        for step in range(1, 5):
            sync.after_inner_step(step, tokens=4)
            held.append(f"r{step + 2}".encode())
            await asyncio.sleep(0)
        await until(lambda: len(syncer.pushed) == len(sync.fragment_ids))
        stop.set()
        await sender
        with_receipts = [c for c in syncer.pushed if c.receipts]
        assert with_receipts and all(c.receipts[0] == b"r1" for c in with_receipts)
        assert len(with_receipts) == len(syncer.pushed) - 1  # the push whose provider call failed
        meta = contribution_meta(with_receipts[0])
        assert meta["receipts"][0] == b"r1".hex() and len(meta["receipts"]) == len(with_receipts[0].receipts)

    asyncio.run(scenario())


@pytest.mark.parametrize("barrier", [False, True])
def test_a_round_we_were_late_for_overwrites_and_the_near_empty_send_after_it_is_skipped(
    barrier: bool,
) -> None:
    sync, model, _ = learner_sync(barrier=barrier)  # H = 4, tau = 1
    index = next(i for i in range(len(sync.fragment_ids)) if sync.schedule.offset(i) == 3)  # due at step 3
    fid = sync.fragment_ids[index]
    names = sync.plan.fragments[fid].names
    params = dict(model.named_parameters())
    bump(model)
    sync.after_inner_step(1, tokens=8)
    merged = {n: torch.full_like(params[n], 7.0) for n in names}
    sync.ledger.inbox[index] = FragmentVersion(
        fragment=fid, version=1, params=merged
    )  # a round we were late for
    bump(model)
    sync.after_inner_step(2, tokens=8)
    assert torch.equal(params[names[0]].detach(), merged[names[0]])  # the paper's overwrite: weight 0
    bump(model)
    sync.after_inner_step(3, tokens=8)  # our scheduled send, one step after the overwrite
    if barrier:  # the lock-step baselines send whatever is due (with a send in flight, no realignment)
        assert sync.ledger.pending and sync.status()["rejoins"] == 0
        assert sync.ledger.outbox[index].steps == 1
        return
    assert index not in sync.ledger.outbox and sync.status()["sends_skipped"] == 1  # no round for one step
    for step in range(4, 8):  # the next period sends everything since the overwrite
        bump(model)
        sync.after_inner_step(step, tokens=8)
    sent = sync.ledger.outbox[index]
    assert (sent.sent_step, sent.base_version, sent.steps) == (7, 1, 5)


# ---- phase anchoring (decoupled): sends timed from the rounds' publications ----


def anchored_learner(
    now: list[float], *, barrier: bool = False, **diloco: object
) -> tuple[FragmentSync, torch.nn.Module, FakeSyncer]:
    run = manifest(sync_every_steps=12, overlap_steps=2, **diloco)
    plan = run_fragment_plan(run)
    model = build_model(ModelConfig.from_dict(run.model), seed=0)
    syncer = FakeSyncer(plan.num_fragments)
    config = SyncClientConfig(barrier=barrier, anchor_lead_steps=1.0)
    sync = FragmentSync.create(
        dict(model.named_parameters()), plan, run.diloco, syncer, config=config, clock=lambda: now[0]
    )
    return sync, model, syncer


def publish_round(sync: FragmentSync, model: torch.nn.Module, syncer: FakeSyncer, fid: int) -> None:
    params = dict(model.named_parameters())
    syncer.publish(fid, {n: params[n].detach() for n in sync.plan.fragments[fid].names})


def dated_view(syncer: FakeSyncer, ages: Sequence[float], step_time_s: float) -> VersionsView:
    return VersionsView(
        versions=tuple(syncer.current),
        term=1,
        syncer="s",
        ages=tuple(float(a) for a in ages),
        step_time_s=step_time_s,
    )


def send_times(
    sync: FragmentSync, now: list[float], step_s: float, steps: range, fragment: int
) -> list[float]:
    """Step the learner at its own pace; the wall times at which `fragment` (local index) was snapshotted."""
    out = []
    for step in steps:
        now[0] += step_s
        sync.ledger.outbox.clear()
        sync.after_inner_step(step, tokens=4)
        if fragment in sync.ledger.outbox:
            out.append(now[0])
    return out


def test_learners_of_different_speeds_send_a_fragment_together_after_a_round_is_published() -> None:
    """The phase drift the step schedule had: two learners 10 % apart in speed drift H/10 steps a period; timed
    from the same publication with the run's step time, both send within one of their own steps of it."""

    async def scenario() -> None:
        xi, h = 0.25, 12
        fast_now, slow_now = [100.0], [100.0]
        fast, model, syncer = anchored_learner(fast_now)
        slow, _, _ = anchored_learner(slow_now)
        slow.transport = syncer
        index = 0
        fid = fast.fragment_ids[index]
        # a round of fragment fid, published 0.1 s ago (the others: undated)
        publish_round(fast, model, syncer, fid)
        ages = [-1.0] * len(syncer.current)
        ages[fid] = 0.1
        for sync, now in ((fast, fast_now), (slow, slow_now)):
            await sync.watcher.absorb(dated_view(syncer, ages, xi))
            assert sync.ledger.timer.due_at[index] == pytest.approx(now[0] - 0.1 + (h - 1) * xi)
            assert sync.status()["phase_anchors"] == 1
        published = 100.0 - 0.1
        fast_sends = send_times(fast, fast_now, 0.24, range(1, 60), index)
        slow_sends = send_times(slow, slow_now, 0.27, range(1, 60), index)
        # the first sends: both within one of their own steps after the anchor (not H steps of their own)
        target = published + (h - 1) * xi
        assert target <= fast_sends[0] < target + 0.24 and target <= slow_sends[0] < target + 0.27
        # then every period of H run step times, from the anchor: no drift between the two learners
        for k in range(3):
            assert abs(fast_sends[k] - slow_sends[k]) < 0.27
            assert fast_sends[k] == pytest.approx(target + k * h * xi, abs=0.27)
        # a step schedule would have put the k-th sends H * k * (0.27 - 0.24) apart: 0.72 s by the third
        assert h * 2 * (0.27 - 0.24) > 0.7

    asyncio.run(scenario())


def test_a_newer_version_reanchors_and_undated_or_old_ones_do_not() -> None:
    async def scenario() -> None:
        now = [50.0]
        sync, model, syncer = anchored_learner(now)
        fid = sync.fragment_ids[1]
        ages = [-1.0] * len(syncer.current)
        publish_round(sync, model, syncer, fid)
        await sync.watcher.absorb(dated_view(syncer, ages, 0.25))
        assert (
            1 not in sync.ledger.timer.due_at
        )  # a version the syncer cannot date (restored, adopted) anchors nothing
        ages[fid] = 0.0
        await sync.watcher.absorb(dated_view(syncer, ages, 0.25))
        first = sync.ledger.timer.due_at[1]
        now[0] += 1.0
        await sync.watcher.absorb(dated_view(syncer, ages, 0.25))
        assert sync.ledger.timer.due_at[1] == first  # the same version again: no move
        publish_round(sync, model, syncer, fid)
        await sync.watcher.absorb(dated_view(syncer, ages, 0.25))
        assert sync.ledger.timer.due_at[1] == pytest.approx(now[0] + 11 * 0.25)
        ages[fid] = 7.0  # a joiner: published 7 s ago, more than a period (3 s): the next period from then
        publish_round(sync, model, syncer, fid)
        await sync.watcher.absorb(dated_view(syncer, ages, 0.25))
        due = sync.ledger.timer.due_at[1]
        assert now[0] <= due < now[0] + 3.0
        assert (due - (now[0] - 7.0 + 11 * 0.25)) / 3.0 == pytest.approx(round((due - (now[0] - 4.25)) / 3.0))

    asyncio.run(scenario())


def test_after_a_stall_the_missed_anchored_send_waits_for_the_next_period() -> None:
    """A learner SIGSTOPped past its send time must not open a round of its own out of phase when it resumes."""

    async def scenario() -> None:
        now = [10.0]
        sync, model, syncer = anchored_learner(now)
        fid = sync.fragment_ids[0]
        publish_round(sync, model, syncer, fid)
        ages = [-1.0] * len(syncer.current)
        ages[fid] = 0.0
        await sync.watcher.absorb(dated_view(syncer, ages, 0.25))
        due = sync.ledger.timer.due_at[0]
        step = 0
        while now[0] < due - 0.3:
            now[0] += 0.25
            step += 1
            sync.after_inner_step(step, tokens=4)
        sync.ledger.outbox.clear()
        now[0] = due + 2.0  # stopped for two seconds across the send time (period: 3 s)
        step += 1
        sync.after_inner_step(step, tokens=4)
        assert 0 not in sync.ledger.outbox and sync.status()["phase_skips"] == 1
        assert sync.ledger.timer.due_at[0] == pytest.approx(due + 3.0)  # the next period, from the anchor
        now[0] = due + 3.01
        step += 1
        sync.after_inner_step(step, tokens=4)
        sent = sync.ledger.outbox[
            0
        ]  # everything since the version overwrote us at step 1: the stall lost nothing
        assert (sent.base_version, sent.steps) == (1, step - 1)

    asyncio.run(scenario())


def test_the_synchronous_baselines_keep_the_lock_step_schedule() -> None:
    async def scenario() -> None:
        now = [0.0]
        sync, model, syncer = anchored_learner(now, barrier=True)
        publish_round(sync, model, syncer, sync.fragment_ids[0])
        await sync.watcher.absorb(dated_view(syncer, [0.0] * len(syncer.current), 0.25))
        assert (
            not sync.ledger.timer.due_at
        )  # lock-step rounds are numbered by steps: anchoring would break them

    asyncio.run(scenario())


def test_versions_meta_ages_are_parsed_and_malformed_ones_refused() -> None:
    from node.diloco.sync_client import parse_versions_meta

    base = {"versions": [1, 2], "term": 3, "barrier": False, "clock": 7}
    view = parse_versions_meta(
        {**base, "ages": [0.5, -1.0], "step_time_s": 0.25}, syncer="s", num_fragments=2
    )
    assert view.ages == (0.5, -1.0) and view.step_time_s == 0.25
    assert parse_versions_meta(base, syncer="s", num_fragments=2).ages == ()  # an older syncer: no anchors
    for bad in ({"ages": [0.5]}, {"ages": [1, 2]}, {"ages": "x"}, {"step_time_s": 1}):
        with pytest.raises(SyncUnavailable):
            parse_versions_meta({**base, **bad}, syncer="s", num_fragments=2)


def test_a_nonsense_step_time_or_age_anchors_nothing_and_never_breaks_the_step() -> None:
    async def scenario() -> None:
        now = [5.0]
        sync, model, syncer = anchored_learner(now)
        fid = sync.fragment_ids[0]
        publish_round(sync, model, syncer, fid)
        ages = [1e300] * len(syncer.current)
        await sync.watcher.absorb(dated_view(syncer, ages, 1e-300))  # a period of ~1e-299 s would overflow
        assert not sync.ledger.timer.due_at
        await sync.watcher.absorb(
            dated_view(syncer, ages, 0.25)
        )  # published 1e300 s ago: the next period from now
        assert now[0] <= sync.ledger.timer.due_at[0] <= now[0] + 12 * 0.25
        for step in range(1, 30):
            now[0] += 0.25
            sync.after_inner_step(step, tokens=4)

    asyncio.run(scenario())
