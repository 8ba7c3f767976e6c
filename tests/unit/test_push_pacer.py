"""The sender's pacing of throttled pushes (`node.diloco.push_pacer`) against the syncer's real flood rule
(`protocol.limits.PeerLimiter`): a syncer that refuses a learner for bytes in flight (retry_after_s 0) while a probe
holds its earlier push, then has room. With the pacing the learner never counts as flooding and its push goes
through within one backoff cap of the room freeing; with the old fixed `deferred_retry_s` (the negative controls)
the same learner is reported as flooding. No sockets: the limiter is the syncer's decision core."""

from __future__ import annotations

import asyncio
import math
import random
import time

import pytest

from node.diloco.push_pacer import BUDGET_MARGIN_S, PushPacer
from node.diloco.sync_client import FragmentSync, run_fragment_plan
from node.diloco.sync_types import OutgoingContribution, PushReceipt, SyncClientConfig, SyncDeferred
from node.ml.model import ModelConfig, build_model
from protocol.limits import LimitsConfig, PeerLimiter
from tests.unit.test_sync_client import FakeSyncer, bump, manifest, until

LEARNER = "learner-a"
FRAME = 1 << 20  # one push's bytes; the syncer's per-peer cap holds exactly one


def probing_syncer_limiter(*, flood_window_s: float = 10.0) -> PeerLimiter:
    """The syncer's limiter with its flood rule (20 own-fault throttles in the window), one push of room per peer."""
    config = LimitsConfig(
        max_bytes_in_flight_per_peer=FRAME, max_bytes_in_flight_total=4 * FRAME, flood_window_s=flood_window_s
    )
    return PeerLimiter(config)


# ---- the pure policy, in virtual time ----


def simulate(
    config: SyncClientConfig, *, held_s: float, accept_every: int = 0, horizon_s: float = 120.0
) -> tuple[PeerLimiter, list[float], float | None]:
    """A sender that pushes whenever the pacer lets it (one attempt every 0.01 s of its own otherwise) against a
    syncer whose probe holds the learner's earlier push for `held_s`: each attempt meets the limiter's
    per-peer bytes-in-flight cap until then. `accept_every` > 0: a handler answer (acked) after every that many
    throttles, as an adversary resetting the backoff would arrange. Returns the limiter, the throttle times and
    when the first push after the room freed was admitted (None: never)."""
    limiter = probing_syncer_limiter(flood_window_s=config.flood_window_s)
    pacer = PushPacer(config, random.Random(7))
    assert limiter.reserve_bytes(LEARNER, FRAME, 0.0)
    now, throttles, admitted_at = 0.01, [], None
    while now < horizon_s:
        if now >= held_s and limiter.stats().peers[LEARNER].bytes_in_flight:
            limiter.release_bytes(LEARNER, FRAME)
        if (wait := pacer.wait_s(now)) > 0:
            now += wait
            continue
        if accept_every and throttles and len(throttles) % accept_every == 0 and now < held_s:
            pacer.answered()
        admission = limiter.admit_bytes(LEARNER, FRAME, now)
        if admission:
            admitted_at = now
            break
        throttles.append(now)
        if config.pace_throttles:
            now += pacer.throttled(now, admission.retry_after_s)
        else:
            # the old schedule: a fixed pause after the refused push (its batch of one)
            now += config.deferred_retry_s
    return limiter, throttles, admitted_at


def most_in_window(times: list[float], window_s: float) -> int:
    return max((sum(1 for u in times if t - window_s <= u <= t) for t in times), default=0)


def test_paced_learner_never_floods_a_slow_syncer_and_pushes_soon_after_room_frees() -> None:
    """A 60 s hold (two 28 s probes and more): the backoff caps at 8 s, 5 throttles at most in any 10 s, and the
    push that finds room comes less than one cap after the hold ends."""
    config = SyncClientConfig()
    limiter, throttles, admitted_at = simulate(config, held_s=60.0)
    assert limiter.stats().num_flood_reports == 0
    assert most_in_window(throttles, config.flood_window_s) <= 5
    assert len(throttles) < 15  # against 120 at the fixed 0.5 s
    assert admitted_at is not None and 60.0 <= admitted_at < 60.0 + config.throttle_backoff_max_s


def test_control_the_fixed_retry_is_reported_as_flooding() -> None:
    """Negative control: the same hold with the old schedule (a fixed 0.5 s after each refusal) crosses the
    flood rule (21 throttles within 10 s)."""
    config = SyncClientConfig(pace_throttles=False)
    limiter, throttles, _ = simulate(config, held_s=60.0)
    assert limiter.stats().num_flood_reports >= 1
    assert most_in_window(throttles, config.flood_window_s) > LimitsConfig().flood_threshold


def test_the_budget_holds_when_answers_keep_resetting_the_backoff() -> None:
    """An answer after every throttle resets the backoff to 0.375-0.5 s; the budget alone then keeps the
    throttles to `flood_budget` in any window (the docstring's bound), so the syncer sees no flood."""
    config = SyncClientConfig()
    limiter, throttles, _ = simulate(config, held_s=100.0, accept_every=1)
    assert limiter.stats().num_flood_reports == 0
    assert most_in_window(throttles, config.flood_window_s) <= config.flood_budget
    # and the budget is what bound it: it was reached
    assert most_in_window(throttles, config.flood_window_s + BUDGET_MARGIN_S) == config.flood_budget


def test_control_without_the_budget_resets_let_the_backoff_flood() -> None:
    """Negative control: the same resets with the budget out of reach (flood_budget 1000) trip the flood rule."""
    config = SyncClientConfig(flood_budget=1000)
    limiter, _, _ = simulate(config, held_s=100.0, accept_every=1)
    assert limiter.stats().num_flood_reports >= 1


def test_backoff_doubles_with_jitter_below_the_nominal_honours_the_hint_and_resets() -> None:
    config = SyncClientConfig(deferred_retry_s=0.5, throttle_backoff_max_s=4.0, throttle_jitter=0.25)
    pacer = PushPacer(config, random.Random(1))
    delays = [pacer.throttled(float(i), 0.0) for i in range(6)]
    for delay, nominal in zip(delays, [0.5, 1.0, 2.0, 4.0, 4.0, 4.0], strict=True):
        assert 0.75 * nominal < delay <= nominal
    assert pacer.throttled(10.0, 30.0) == 30.0  # a rate refusal's hint, longer than the backoff, wins
    assert pacer.wait_s(10.0) == 30.0
    pacer.answered()
    assert pacer.wait_s(10.0) == 0.0  # the budget (10) is not reached by 7 throttles
    assert 0.375 < pacer.throttled(11.0, 0.0) <= 0.5


def test_an_unthrottled_sender_never_waits_and_a_final_refusal_is_not_retried() -> None:
    pacer = PushPacer(SyncClientConfig(), random.Random(0))
    assert pacer.wait_s(0.0) == 0.0 and pacer.wait_s(1e9) == 0.0
    with pytest.raises(ValueError, match="final"):
        pacer.throttled(0.0, math.inf)
    assert pacer.wait_s(0.0) == 0.0


# ---- the real sender loop, time scaled down 10x ----


class ProbingSyncer(FakeSyncer):
    """A fake syncer whose push route asks the syncer's limiter first: until `room_at` the learner's earlier push is
    held (a probe), so every push is throttled for bytes in flight with retry_after_s 0, as `FramedSyncTransport`
    raises it; then it takes them."""

    def __init__(self, plan_size: int, limiter: PeerLimiter, room_at: float) -> None:
        super().__init__(plan_size)
        self.limiter, self.room_at = limiter, room_at
        self.attempts: list[float] = []
        self.accepted_at: float | None = None
        assert limiter.reserve_bytes(LEARNER, FRAME, time.monotonic())

    async def push(self, contribution: OutgoingContribution) -> PushReceipt:
        now = time.monotonic()
        self.attempts.append(now)
        if now >= self.room_at and self.limiter.stats().peers[LEARNER].bytes_in_flight:
            self.limiter.release_bytes(LEARNER, FRAME)
        admission = self.limiter.admit_bytes(LEARNER, FRAME, now)
        if not admission:
            raise SyncDeferred(
                "throttled: bytes in flight",
                reason="throttled: bytes in flight",
                retry_after_s=admission.retry_after_s,
            )
        self.accepted_at = self.accepted_at or now
        return await super().push(contribution)


async def drive_sender(pace: bool, hold_s: float = 2.0) -> tuple[ProbingSyncer, FragmentSync]:
    # every time of the defaults / 10: base 0.05 s, cap 0.8 s, flood window 1 s (the syncer's too)
    config = SyncClientConfig(
        retry_min_s=0.01,
        retry_max_s=0.05,
        deferred_retry_s=0.05,
        throttle_backoff_max_s=0.8,
        flood_window_s=1.0,
        pace_throttles=pace,
    )
    run = manifest()
    plan = run_fragment_plan(run)
    model = build_model(ModelConfig.from_dict(run.model), seed=0)
    limiter = probing_syncer_limiter(flood_window_s=1.0)
    syncer = ProbingSyncer(plan.num_fragments, limiter, room_at=time.monotonic() + hold_s)
    sync = FragmentSync.create(dict(model.named_parameters()), plan, run.diloco, syncer, config=config)
    stop = asyncio.Event()
    sender = asyncio.create_task(sync.run_sender(stop))
    try:
        for step in range(1, sync.schedule.sync_every_steps + 1):  # every fragment falls due once
            bump(model)
            sync.after_inner_step(step, tokens=4)
        await until(lambda: len(syncer.pushed) == len(sync.fragment_ids), timeout_s=hold_s + 5.0)
    finally:
        stop.set()
        await asyncio.wait_for(sender, 5.0)
    return syncer, sync


def test_sender_paces_throttled_pushes_under_the_flood_rule() -> None:
    syncer, sync = asyncio.run(drive_sender(pace=True))
    stats = syncer.limiter.stats()
    assert stats.num_flood_reports == 0
    throttled = [t for t in syncer.attempts if t < syncer.room_at]
    assert most_in_window(throttled, 1.0) <= 6  # 5 by the backoff, one more for scheduling slack
    assert sync.stats.throttled == len(throttled) and sync.stats.acked == len(sync.fragment_ids)
    assert syncer.accepted_at is not None and syncer.accepted_at - syncer.room_at < 0.8 + 0.2


def test_control_sender_on_the_fixed_retry_floods() -> None:
    """Negative control: the same sender and syncer with pacing off (every fragment of the batch retried each
    `deferred_retry_s`) is reported as flooding."""
    syncer, sync = asyncio.run(drive_sender(pace=False))
    assert syncer.limiter.stats().num_flood_reports >= 1
    assert sync.stats.throttled == 0  # the old path: plain deferrals


# ---- the transport: what the pacer learns from a refusal ----


def refused_push(error: Exception) -> Exception:
    """What `FramedSyncTransport.push` raises when the syncer's answer is `error` (the wire stubbed out)."""
    import torch

    from node.diloco.sync_client import FramedSyncTransport

    transport = object.__new__(FramedSyncTransport)
    transport.admission = None

    async def current_syncer() -> tuple[str, int]:
        return "syncer-a", 1

    async def call(*args: object, **kwargs: object) -> tuple[str, bytearray]:
        raise error

    transport.current_syncer = current_syncer  # type: ignore[method-assign]
    transport._seal = lambda *args, **kwargs: bytearray(b"frame")  # type: ignore[method-assign]
    transport._call = call  # type: ignore[method-assign]
    contribution = OutgoingContribution(
        fragment=0,
        params={"w": torch.zeros(2)},
        base_version=0,
        steps=1,
        tokens=4,
        sent_step=1,
        sched_step=1,
        step_time_s=0.1,
    )
    with pytest.raises(Exception) as caught:
        asyncio.run(transport.push(contribution))
    return caught.value


def test_transport_hands_the_throttle_and_its_hint_to_the_sender_and_keeps_final_refusals_final() -> None:
    from node.diloco.sync_types import ContributionRefused
    from protocol.errors import RemoteRefused
    from protocol.limits import BYTES_IN_FLIGHT, RATE
    from protocol.rpc import PeerThrottled

    def throttled(limit: str, retry_after_s: float) -> PeerThrottled:
        return PeerThrottled("x", reason=f"throttled: {limit}", limit=limit, retry_after_s=retry_after_s)

    in_flight = refused_push(throttled(BYTES_IN_FLIGHT, 0.0))
    assert isinstance(in_flight, SyncDeferred) and in_flight.throttled and in_flight.retry_after_s == 0.0
    rate = refused_push(throttled(RATE, 0.75))
    assert isinstance(rate, SyncDeferred) and rate.retry_after_s == 0.75
    # a refusal of the syncer's own state is a deferral the pacer does not see
    recovering = refused_push(RemoteRefused("x", reason="recovering"))
    assert isinstance(recovering, SyncDeferred) and not recovering.throttled
    # never retried: a push over the caps alone
    assert isinstance(refused_push(throttled(BYTES_IN_FLIGHT, math.inf)), ContributionRefused)
