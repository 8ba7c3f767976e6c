"""The syncer's contribution screen (issue 18, part 1), through SyncerCore's public API: finiteness, the norm bound
from merged history (so a lone contribution at K = 1 is bounded too), the direction check, and the rollback of an
outer step that is not finite; each attack with its negative control (the defence off, the attack wins) and honest
rounds as the false-positive control."""

from __future__ import annotations

import math

import pytest
import torch

from node.diloco.merge import NothingToMerge
from node.diloco.quorum import QuorumConfig
from node.diloco.screening import (
    ACCEPTED,
    CLIPPED,
    DIRECTION,
    NON_FINITE,
    NORM,
    ROLLBACK,
    ContributionScreen,
    ScreeningConfig,
)
from node.diloco.sync_client import run_fragment_plan
from node.ml.model import ModelConfig, build_model, embedding_param_names
from node.roles.syncer import Refusal, SyncerConfig, SyncerCore
from protocol.manifest import DilocoSpec, RunManifest

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("params_mode")]

MODEL = {"vocab_size": 256, "context_len": 16, "num_layers": 2, "width": 16, "num_heads": 2}
RUN = RunManifest(model=dict(MODEL), num_stages=1, diloco=DilocoSpec(num_fragments=2, sync_every_steps=4))
PLAN = run_fragment_plan(RUN)
CFG = ModelConfig.from_dict(MODEL)
OFF = ScreeningConfig(enabled=False, rollback=False)
WITH_DIRECTION = ScreeningConfig(min_cosine=-0.5)  # the direction check is opt-in
REJECTIONS = (NON_FINITE, NORM, DIRECTION, ROLLBACK)
Tensors = dict[str, torch.Tensor]


def core(screening: ScreeningConfig = WITH_DIRECTION) -> SyncerCore:
    return SyncerCore(
        PLAN,
        dict(build_model(CFG, seed=0).named_parameters()),
        quorum=QuorumConfig.decoupled(1, grace_gamma=0.0),
        embedding_names=embedding_param_names(CFG),
        outer_lr=0.7,
        outer_momentum=0.9,
        clip_factor=3.0,
        max_staleness=2,
        max_steps_per_s=10.0,
        tokens_per_step=64,
        now=0.0,
        screening=screening,
    )


class Swarm:
    """Honest learners whose deltas share one direction plus noise, pushing fragment 0 each round (10 s apart)."""

    def __init__(self, c: SyncerCore, peers: int = 3, *, noise: float = 1.0, seed: int = 0) -> None:
        self.c, self.peers, self.noise = c, [f"honest{i}" for i in range(peers)], noise
        self.gen = torch.Generator().manual_seed(seed)
        self.direction = {
            n: torch.randn(t.shape, generator=self.gen) for n, t in c.fragment_tensors(0).items()
        }
        self.now, self.nonce = 0.0, 0

    def delta(self, scale: float = 0.01) -> Tensors:
        return {
            n: scale * (u + self.noise * torch.randn(u.shape, generator=self.gen))
            for n, u in self.direction.items()
        }

    def push(self, peer: str, delta: Tensors, *, base: int | None = None) -> None:
        self.nonce += 1
        params = {n: t - delta[n] for n, t in self.c.fragment_tensors(0).items()}
        self.c.accept(
            peer,
            0,
            params,
            base_version=self.c.versions[0] if base is None else base,
            steps=4,
            tokens=4 * 64,
            sched_step=self.nonce,
            step_time_s=0.1,
            nonce=self.nonce.to_bytes(16, "big"),
            now=self.now,
        )

    def round(self, extra: dict[str, Tensors] | None = None) -> None:
        """Every honest peer (and `extra` peer -> delta) pushes, then the round merges."""
        self.now += 10.0
        for peer in self.peers:
            self.push(peer, self.delta())
        for peer, delta in (extra or {}).items():
            self.push(peer, delta)
        self.c.merge_now(0, len(self.peers) + len(extra or {}), self.now)


def norm(tensors: Tensors) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors.values()))


def diff(a: Tensors, b: Tensors) -> Tensors:
    return {n: a[n] - b[n] for n in a}


def huge(c: SyncerCore, value: float) -> Tensors:
    return {n: torch.full_like(t, value) for n, t in c.fragment_tensors(0).items()}


def lone_push(c: SyncerCore, params: Tensors, *, now: float = 10.0) -> None:
    c.accept(
        "evil",
        0,
        params,
        base_version=c.versions[0],
        steps=4,
        tokens=256,
        sched_step=1,
        step_time_s=0.1,
        nonce=b"e" * 16,
        now=now,
    )


def finite(tensors: Tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values())


# ---- huge values at K = 1 ----


def test_a_lone_1e38_contribution_at_k1_is_rejected_and_the_fragment_stays_finite_and_unchanged() -> None:
    c = core()
    before = c.fragment_tensors(0)
    with pytest.raises(Refusal) as caught:
        lone_push(c, huge(c, 1e38))
    assert caught.value.reason == NORM and caught.value.blame_sender  # the shell strikes the sender
    assert "over bound" in str(caught.value)
    assert c.merge_now(0, 1, 10.0) is None and c.versions[0] == 0
    after = c.fragment_tensors(0)
    assert finite(after) and all(torch.equal(before[n], after[n]) for n in before)
    assert c.screen.status() == {NORM: 1}


def test_negative_control_without_screening_a_lone_1e38_contribution_poisons_the_fragment() -> None:
    c = core(OFF)
    lone_push(c, huge(c, 1e38))
    record = c.merge_now(0, 1, 10.0)
    assert record is not None and record.participants == ("evil",)  # merge_fragment clips only at >= 2
    assert max(float(t.abs().max()) for t in c.fragment_tensors(0).values()) > 1e37  # the attack wins


def test_without_screening_the_finiteness_check_rolls_an_overflowing_outer_step_back() -> None:
    c = core(ScreeningConfig(enabled=False))  # rollback on
    swarm = Swarm(c, peers=1)
    swarm.round()  # an honest merge first, so there is momentum to keep intact
    before, momentum = c.fragment_tensors(0), c.fragment_momentum(0)
    lone_push(c, huge(c, 3e38), now=swarm.now + 10.0)  # finite, but the Nesterov step overflows float32
    taken = c.take_round(0, 1, swarm.now + 10.0)
    assert taken is not None
    with pytest.raises(NothingToMerge) as caught:
        c.compute_merge(0, taken[0], expected=taken[1], required=taken[2], started_at=swarm.now + 10.0)
    assert caught.value.rejected == {"evil": ROLLBACK}
    assert c.versions[0] == 1 and finite(c.fragment_tensors(0))
    assert all(torch.equal(before[n], t) for n, t in c.fragment_tensors(0).items())
    assert all(torch.equal(momentum[n], t) for n, t in c.fragment_momentum(0).items())
    assert c.screen.status() == {ROLLBACK: 1}
    swarm.round()  # nothing committed was lost: the next honest round merges as usual
    assert c.versions[0] == 2 and finite(c.fragment_tensors(0))


def test_negative_control_with_neither_check_an_overflowing_outer_step_publishes_inf() -> None:
    c = core(OFF)
    lone_push(c, huge(c, 3e38))
    assert c.merge_now(0, 1, 10.0) is not None
    assert not finite(c.fragment_tensors(0))  # the global model (and its next checkpoint) is poisoned


# ---- non-finite values ----


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_are_rejected_and_an_honest_peer_of_the_same_round_still_merges(bad: float) -> None:
    c = core()
    swarm = Swarm(c, peers=1)
    swarm.now = 10.0
    swarm.push("honest0", swarm.delta())
    params = dict(c.fragment_tensors(0))
    name = next(iter(params))
    params[name] = params[name].clone().view(-1).index_fill(0, torch.tensor([3]), bad).view_as(params[name])
    with pytest.raises(Refusal) as caught:
        lone_push(c, params)
    assert caught.value.reason == NON_FINITE and caught.value.blame_sender
    record = c.merge_now(0, 2, 10.0)
    assert record is not None and record.participants == ("honest0",) and finite(c.fragment_tensors(0))


# ---- scaled deltas after a history of honest ones ----


def test_a_1e3_scaled_delta_after_honest_history_is_rejected_and_merges_whole_when_disabled() -> None:
    changes = {}
    for screening in (None, OFF):
        c = core(screening)
        swarm = Swarm(c, peers=2)
        for _ in range(4):
            swarm.round()
        before = c.fragment_tensors(0)
        swarm.now += 10.0
        attack = {n: 1e3 * t for n, t in swarm.delta().items()}
        if screening is None:
            with pytest.raises(Refusal) as caught:
                swarm.push("evil", attack)
            assert caught.value.reason == NORM and "median merged norm" in str(caught.value)
            continue
        swarm.push("evil", attack)  # accepted as it is
        assert c.merge_now(0, 1, swarm.now) is not None
        changes["off"] = norm(diff(before, c.fragment_tensors(0)))
    assert changes["off"] > 100 * 0.01 * math.sqrt(
        5344
    )  # the lone attacker moved the model by its full delta


def test_a_mildly_large_delta_is_clipped_to_the_bound_not_rejected() -> None:
    c = core()
    swarm = Swarm(c, peers=2)
    for _ in range(4):
        swarm.round()
    clip_at, reject_at, _ = c.screen.bounds(0, norm(c.fragment_tensors(0)))
    assert clip_at < reject_at
    swarm.now += 10.0
    delta = swarm.delta()
    big = {n: t * (2 * clip_at / norm(delta)) for n, t in delta.items()}  # twice the clip bound
    swarm.push("big", big)
    entry = c.rounds[0].entries["big"].contribution
    assert math.isclose(norm(diff(c.fragment_tensors(0), dict(entry.params))), clip_at, rel_tol=1e-3)
    assert c.screen.status()[CLIPPED] == 1


# ---- direction ----


def test_a_sign_flipped_delta_at_honest_norm_is_rejected_after_warm_up_and_accepted_when_disabled() -> None:
    for screening in (WITH_DIRECTION, OFF):
        c = core(screening)
        swarm = Swarm(c, peers=2, noise=0.5)
        for _ in range(5):
            swarm.round()
        swarm.now += 10.0
        flipped = {n: -t for n, t in swarm.delta().items()}
        if screening is WITH_DIRECTION:
            with pytest.raises(Refusal) as caught:
                swarm.push("evil", flipped)
            assert caught.value.reason == DIRECTION and "direction cos -" in str(caught.value)
        else:
            swarm.push("evil", flipped)
            assert "evil" in c.rounds[0].entries


def test_the_direction_check_waits_for_its_warm_up() -> None:
    c = core()
    swarm = Swarm(c, peers=1, noise=0.5)
    for _ in range(c.screen.config.min_history - 1):
        swarm.round()
    swarm.now += 10.0
    swarm.push("early", {n: -t for n, t in swarm.delta().items()})  # too few merges to know a direction
    assert "early" in c.rounds[0].entries


# ---- false positives ----


def test_honest_rounds_are_never_rejected_over_50_rounds() -> None:
    c = core()
    swarm = Swarm(c, peers=3, noise=2.0, seed=1)
    scales = [0.5, 1.0, 2.0]  # learners of different speeds
    for r in range(50):
        swarm.now += 10.0
        for peer, scale in zip(swarm.peers, scales, strict=True):
            swarm.push(peer, swarm.delta(0.01 * scale * (2.0 if r % 7 == 0 else 1.0)))
        record = c.merge_now(0, 3, swarm.now)
        assert record is not None and len(record.participants) == 3
    counts = c.screen.status()
    assert not any(counts.get(tag) for tag in REJECTIONS), counts
    assert counts[ACCEPTED] + counts.get(CLIPPED, 0) == 150 and finite(c.fragment_tensors(0))


# ---- config ----


def test_screening_is_on_by_default_and_settable_from_the_syncer_table() -> None:
    assert SyncerConfig().screening.enabled and SyncerConfig().screening.rollback
    cfg = SyncerConfig.from_options(
        {"screening": {"min_cosine": "-0.9", "enabled": "false"}}, heartbeat_period_s=2
    )
    assert cfg.screening.min_cosine == -0.9 and not cfg.screening.enabled
    with pytest.raises(ValueError):
        ScreeningConfig(clip_factor=10.0, reject_factor=5.0)
    with pytest.raises(ValueError):
        ScreeningConfig(min_history=0)


def test_an_unknown_base_is_screened_against_the_current_fragment() -> None:
    screen = ContributionScreen()
    current = {"w": torch.ones(4)}
    verdict = screen.check(0, {"w": torch.ones(4) * 0.9}, None, current)
    assert verdict.accepted and verdict.tag == ACCEPTED and math.isclose(verdict.norm, 0.2, rel_tol=1e-5)
