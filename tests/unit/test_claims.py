"""Claims bounded by what the syncer measured, copycats and free-riders, and the winsorized merge (issue 18,
part 2), through SyncerCore's public API and merge_fragment; each attack with its negative control (the defence
off, the attack gains weight or moves the merge) and honest rounds as the false-positive control."""

from __future__ import annotations

import pytest
import torch

from node.diloco.claims import CLAIM, COPYCAT, FREE_RIDER, ClaimBound, copy_of
from node.diloco.learner_ledger import LearnerLedger
from node.diloco.merge import Contribution, merge_fragment
from node.diloco.quorum import QuorumConfig
from node.diloco.screening import ScreeningConfig
from node.diloco.sync_client import run_fragment_plan
from node.ml.model import ModelConfig, build_model, embedding_param_names
from node.roles.syncer import Refusal, SyncerCore
from protocol.manifest import DilocoSpec, RunManifest
from tests.unit.test_probation import no_ramp

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("params_mode")]

MODEL = {"vocab_size": 256, "context_len": 16, "num_layers": 2, "width": 16, "num_heads": 2}
RUN = RunManifest(model=dict(MODEL), num_stages=1, diloco=DilocoSpec(num_fragments=2, sync_every_steps=4))
PLAN = run_fragment_plan(RUN)
CFG = ModelConfig.from_dict(MODEL)
Tensors = dict[str, torch.Tensor]
OFF = ScreeningConfig(
    claim_rate_factor=1e9, claim_violation_factor=0.0, copy_tolerance=0.0, trim_fraction=0.0
)


def core(screening: ScreeningConfig | None = None) -> SyncerCore:
    return SyncerCore(
        PLAN,
        dict(build_model(CFG, seed=0).named_parameters()),
        quorum=QuorumConfig.decoupled(1, grace_gamma=0.0),
        embedding_names=embedding_param_names(CFG),
        outer_lr=0.7,
        outer_momentum=0.0,
        clip_factor=3.0,
        max_staleness=2,
        max_steps_per_s=10.0,
        tokens_per_step=64,
        now=0.0,
        # the probation ramp (test_probation.py) off: these weights are the claims' and copy checks' alone
        screening=no_ramp(screening or ScreeningConfig()),
    )


class Swarm:
    """Honest peers whose deltas share one direction plus noise; each round is 10 s of 4 steps (0.4 steps/s)."""

    def __init__(self, c: SyncerCore, peers: int = 3) -> None:
        self.c, self.peers = c, [f"honest{i}" for i in range(peers)]
        self.gen = torch.Generator().manual_seed(0)
        self.direction = {
            n: torch.randn(t.shape, generator=self.gen) for n, t in c.fragment_tensors(0).items()
        }
        self.now, self.nonce = 0.0, 0

    def honest(self) -> Tensors:
        current = self.c.fragment_tensors(0)
        return {
            n: current[n] - 0.01 * (u + torch.randn(u.shape, generator=self.gen))
            for n, u in self.direction.items()
        }

    def push(self, peer: str, params: Tensors, *, steps: int = 4) -> None:
        self.nonce += 1
        self.c.accept(
            peer,
            0,
            params,
            base_version=self.c.versions[0],
            steps=steps,
            tokens=steps * 64,
            sched_step=self.nonce,
            step_time_s=0.1,
            nonce=self.nonce.to_bytes(16, "big"),
            now=self.now,
        )

    def round(self, extra: dict[str, tuple[Tensors, int]] | None = None) -> dict[str, float]:
        """Honest peers then `extra` (peer -> (params, steps claimed)) push; the round merges; the weights."""
        self.now += 10.0
        for peer in self.peers:
            self.push(peer, self.honest())
        for peer, (params, steps) in (extra or {}).items():
            self.push(peer, params, steps=steps)
        record = self.c.merge_now(0, len(self.peers) + len(extra or {}), self.now)
        assert record is not None
        return record.weights


# ---- inflated claims ----


def test_an_inflated_step_claim_is_capped_at_the_swarms_measured_rate() -> None:
    swarm = Swarm(core())
    for _ in range(3):
        swarm.round()  # honest peers' rates: 4 steps / 10 s
    weights = swarm.round(
        {"inflator": (swarm.honest(), 100)}
    )  # 100 steps in 10 s: allowed by max_steps_per_s
    # capped at 2 x 0.4 steps/s x 10 s = 8 steps: at most twice an honest peer's weight
    assert weights["inflator"] <= 2 * weights["honest0"] + 1e-9
    assert weights["inflator"] < 0.45


def test_negative_control_without_the_measured_rate_the_inflator_takes_most_of_the_weight() -> None:
    swarm = Swarm(core(OFF))
    for _ in range(3):
        swarm.round()
    weights = swarm.round({"inflator": (swarm.honest(), 100)})
    assert weights["inflator"] > 0.8  # 100 / (100 + 3 x 4)


def test_the_claim_bound_uses_the_median_over_peers_and_waits_for_min_peers() -> None:
    bound = ClaimBound(factor=2.0, min_peers=2)
    bound.observe("a", 4, 10.0, now=0.0)
    assert bound.cap(100, 6400, 10.0, now=0.0) == (100, 6400, False)  # one peer: no bound yet
    bound.observe("b", 4, 10.0, now=0.0)
    bound.observe("liar", 1000, 1.0, now=0.0)  # a minority's own samples do not move the median
    assert bound.rate(0.0) == pytest.approx(0.8)
    assert bound.cap(100, 6400, 10.0, now=0.0) == (8, 512, True)
    assert bound.cap(5, 320, 10.0, now=0.0) == (5, 320, False)  # an honest claim is untouched


def test_judge_names_a_claim_far_above_the_median_rate_and_lets_honest_spread_pass() -> None:
    bound = ClaimBound(factor=2.0, min_peers=2, violation_factor=5.0)
    assert bound.judge(400, 10.0, now=0.0) is None  # no median yet: nothing to judge against
    for peer in ("a", "b", "c"):
        bound.observe(peer, 4, 10.0, now=0.0)  # 0.4 steps/s: 4 steps in 10 s is plausible
    found = bound.judge(80, 10.0, now=0.0)  # inflate:20
    assert found is not None
    reason, numbers = found
    assert "20 x the peers' median rate" in reason
    assert numbers == {"claimed_steps": 80.0, "plausible_steps": 4.0}
    assert bound.judge(4, 10.0, now=0.0) is None  # an honest peer
    assert bound.judge(16, 10.0, now=0.0) is None  # an honest peer 4x faster: capped, never judged
    assert bound.judge(3, 0.5, now=0.0) is None  # a few steps in a short time: at least one step is plausible


def test_negative_control_with_the_check_off_judge_names_nothing() -> None:
    bound = ClaimBound(factor=2.0, min_peers=2, violation_factor=0.0)
    for peer in ("a", "b", "c"):
        bound.observe(peer, 4, 10.0, now=0.0)
    assert bound.judge(10_000, 10.0, now=0.0) is None
    with pytest.raises(ValueError):
        ClaimBound(factor=2.0, min_peers=2, violation_factor=0.5)  # below the median itself


def _push(swarm: Swarm, peer: str, steps: int, trust: float = 1.0) -> tuple[str, dict[str, float]] | None:
    swarm.nonce += 1
    admission = swarm.c.accept(
        peer,
        0,
        swarm.honest(),
        base_version=swarm.c.versions[0],
        steps=steps,
        tokens=steps * 64,
        sched_step=swarm.nonce,
        step_time_s=0.1,
        nonce=swarm.nonce.to_bytes(16, "big"),
        now=swarm.now,
        trust=trust,
    )
    return admission.claim_violation


def test_an_inflator_is_judged_every_push_loses_its_weight_and_is_banned_while_honest_peers_never_are() -> (
    None
):
    """The syncer's loop through the core: each implausible claim is a ledger violation, the ledger's trust scales
    the next pushes' tokens, the third bans (the shell then refuses it)."""
    swarm, ledger = Swarm(core()), LearnerLedger(ban_after=2.5, forgive_half_life_s=600.0, ban_s=3600.0)
    for _ in range(3):
        swarm.round()  # honest rates: 0.4 steps/s
    rate = swarm.c.claims.median(swarm.now)
    shares, banned = [], None
    for _ in range(3):
        swarm.now += 10.0
        for peer in swarm.peers:
            assert _push(swarm, peer, 4) is None  # no honest peer is ever judged
        violation = _push(swarm, "inflator", 80, trust=ledger.trust("inflator", swarm.now))
        assert violation is not None
        banned = ledger.record("inflator", CLAIM, violation[0], "d", swarm.now, violation[1])
        record = swarm.c.merge_now(0, 4, swarm.now)
        assert record is not None
        shares.append(record.weights["inflator"])
    assert swarm.c.claims.median(swarm.now) == rate  # the inflator's samples never entered the median
    # credited at the median rate (an honest weight), then trust 0.6 and 0.2: the weight falls with trust squared
    assert shares[0] == pytest.approx(1 / 4, abs=0.01)
    assert shares[1] < 0.15 and shares[2] < 0.04
    assert banned is not None and "3 refused contributions" in banned.reason
    assert all(ledger.weight(p, swarm.now) == 0.0 for p in swarm.peers)


def test_work_on_the_seed_is_neither_judged_nor_sampled_so_a_slow_start_sets_no_median() -> None:
    """Learners start from the seed whenever they join: the time since the syncer published it says nothing of their
    work. Sampled, a slow start (here 4 steps in 100 s) set a median that judged every later honest claim
    implausible (all 4 honest learners were banned in a check run of the benchmark)."""
    swarm = Swarm(core())
    swarm.now = 100.0
    for peer in swarm.peers:
        assert _push(swarm, peer, 4) is None
    assert swarm.c.claims.median(swarm.now) is None
    assert swarm.c.merge_now(0, 3, swarm.now) is not None
    swarm.now += 10.0  # on the version we published: 4 steps in 10 s, sampled; judged against nothing yet
    for peer in swarm.peers:
        assert _push(swarm, peer, 4) is None
    assert swarm.c.claims.median(swarm.now) == pytest.approx(0.4)


def test_negative_control_with_the_check_off_the_inflator_keeps_twice_an_honest_weight_and_is_never_judged() -> (
    None
):
    swarm = Swarm(core(ScreeningConfig(claim_violation_factor=0.0)))
    for _ in range(3):
        swarm.round()
    for _ in range(3):
        swarm.now += 10.0
        for peer in swarm.peers:
            _push(swarm, peer, 4)
        assert _push(swarm, "inflator", 80) is None
        record = swarm.c.merge_now(0, 4, swarm.now)
        assert record is not None and record.weights["inflator"] == pytest.approx(2 / 5, abs=0.01)


# ---- copycats and free-riders ----


def test_a_copycat_of_another_peers_contribution_in_the_round_is_refused() -> None:
    swarm = Swarm(core())
    swarm.round()
    swarm.now += 10.0
    original = swarm.honest()
    swarm.push("honest0", original)
    near_copy = {n: t + 1e-4 * torch.randn(t.shape, generator=swarm.gen) for n, t in original.items()}
    with pytest.raises(Refusal) as caught:
        swarm.push("copycat", near_copy)
    assert caught.value.reason == COPYCAT and caught.value.blame_sender
    swarm.push(
        "honest1", swarm.honest()
    )  # honest peers' deltas are never that close (false-positive control)


def test_negative_control_without_the_copy_check_a_copycat_earns_as_much_as_the_original() -> None:
    swarm = Swarm(core(OFF))
    swarm.round()
    swarm.now += 10.0
    original = swarm.honest()
    swarm.push("honest0", original)
    swarm.push("copycat", dict(original))
    record = swarm.c.merge_now(0, 2, swarm.now)
    assert record is not None and record.weights["copycat"] == pytest.approx(0.5)


def test_free_riders_returning_the_base_or_replaying_a_published_version_are_refused() -> None:
    swarm = Swarm(core())
    swarm.round()
    old = swarm.c.fragment_tensors(0)  # version 1
    swarm.round()
    swarm.now += 10.0
    with pytest.raises(Refusal) as caught:
        swarm.push("rider", swarm.c.fragment_tensors(0))  # its base, unchanged, claiming 4 steps
    assert caught.value.reason == FREE_RIDER
    with pytest.raises(Refusal) as caught:
        swarm.push("replay", old)  # a stale version replayed as work on the current base
    assert caught.value.reason == FREE_RIDER and "published version 1" in str(caught.value)
    swarm.push("idle", swarm.c.fragment_tensors(0), steps=0)  # no claim, no strike: it weighs nothing anyway


def test_a_free_rider_adding_noise_to_the_current_version_is_refused_after_warm_up() -> None:
    def rider(swarm: Swarm) -> Tensors:
        current = swarm.c.fragment_tensors(0)  # the current version plus 1 % of a round's work, as noise
        return {n: t + 1e-4 * torch.randn(t.shape, generator=swarm.gen) for n, t in current.items()}

    swarm = Swarm(core())
    for _ in range(ScreeningConfig().min_history):
        swarm.round()
    swarm.now += 10.0
    with pytest.raises(Refusal) as caught:
        swarm.push("rider", rider(swarm))
    assert caught.value.reason == FREE_RIDER and "a round's work" in str(caught.value)
    swarm.push("honest0", swarm.honest())  # false-positive control: honest work on the same base passes
    # negative control: with the copy check off the rider is merged and earns a share of the round
    off = Swarm(core(OFF))
    for _ in range(ScreeningConfig().min_history):
        off.round()
    off.now += 10.0
    off.push("rider", rider(off))
    off.push("honest0", off.honest())
    record = off.c.merge_now(0, 2, off.now)
    assert record is not None and record.weights["rider"] > 0.2


def test_negative_control_without_the_copy_check_a_stale_replay_is_merged_and_undoes_a_round() -> None:
    swarm = Swarm(core(OFF))
    swarm.round()
    old = swarm.c.fragment_tensors(0)
    swarm.round()
    before = swarm.c.fragment_tensors(0)
    swarm.now += 10.0
    swarm.push("replay", old)
    assert swarm.c.merge_now(0, 1, swarm.now) is not None
    after = swarm.c.fragment_tensors(0)
    # the merge moved the fragment back towards version 1
    assert sum(float((after[n] - old[n]).norm()) for n in old) < sum(
        float((before[n] - old[n]).norm()) for n in old
    )


def test_copy_of_is_none_for_independent_work() -> None:
    base = {"w": torch.zeros(100)}
    mine = {"w": -torch.ones(100)}
    theirs = {"w": torch.randn(100, generator=torch.Generator().manual_seed(1))}
    assert copy_of(mine, base, [(0, base)], [("other", theirs)], 0.05) is None


# ---- the winsorized merge ----


def _contributions(spike: float) -> list[Contribution]:
    gen = torch.Generator().manual_seed(3)
    out = [
        Contribution(f"h{i}", {"w": -(1.0 + 0.1 * torch.randn(50, generator=gen))}, 0, 4, 256)
        for i in range(4)
    ]
    evil = -torch.ones(50)
    evil[7] = spike  # one coordinate far off, the norm still within the clip bound
    out.append(Contribution("evil", {"w": evil}, 0, 4, 256))
    return out


def test_with_three_or_more_contributions_one_cannot_pull_a_coordinate_past_the_honest_range() -> None:
    contributions = _contributions(spike=-5.0)
    honest = torch.stack([c.params["w"] for c in contributions[:4]])
    result = merge_fragment(
        {"w": torch.zeros(50)}, contributions, embedding_names=(), clip_factor=3.0, trim_fraction=0.25
    )
    merged = result.outer_grad["w"]  # deltas are 0 - params
    assert float(merged[7]) <= float((-honest[:, 7]).max()) * 1.05
    assert "winsorized" in result.reason


def test_negative_control_without_trimming_the_spike_moves_that_coordinate_far_past_the_honest_range() -> (
    None
):
    contributions = _contributions(spike=-5.0)
    honest = torch.stack([c.params["w"] for c in contributions[:4]])
    result = merge_fragment({"w": torch.zeros(50)}, contributions, embedding_names=(), clip_factor=3.0)
    assert float(result.outer_grad["w"][7]) > float((-honest[:, 7]).max()) * 1.3


def _sparse_contributions(spike: float) -> list[Contribution]:
    """Top-k-like deltas: each of 4 honest learners sends 10 of 50 coordinates (its own, plus 0..4 sent by all
    and 5 sent by three), the rest exact zeros; an attacker sends the shared ones with one spiked."""
    gen = torch.Generator().manual_seed(4)
    out = []
    for i in range(4):
        delta = torch.zeros(50)
        own = [*range(5), *range(10 + 5 * i, 15 + 5 * i)]
        delta[own] = 1.0 + 0.1 * torch.randn(len(own), generator=gen)
        if i < 3:
            delta[5] = 1.0
        out.append(Contribution(f"h{i}", {"w": -delta}, 0, 4, 256))
    evil = torch.zeros(50)
    evil[:5] = 1.0
    evil[3] = spike
    out.append(Contribution("evil", {"w": -evil}, 0, 4, 256))
    return out


def test_sparse_winsorizing_keeps_what_one_learner_sent_and_still_bounds_a_spike_on_a_shared_coordinate() -> (
    None
):
    contributions = _sparse_contributions(spike=8.0)
    sparse = merge_fragment(
        {"w": torch.zeros(50)},
        contributions,
        embedding_names=(),
        clip_factor=3.0,
        trim_fraction=0.25,
        sparse=True,
    )
    plain = merge_fragment(
        {"w": torch.zeros(50)}, contributions, embedding_names=(), clip_factor=3.0, trim_fraction=0.25
    )
    mean = merge_fragment({"w": torch.zeros(50)}, contributions, embedding_names=(), clip_factor=3.0)
    own = slice(10, 30)  # coordinates one learner sent each
    # negative control: the dense winsorizing ranks those among four zeros and clamps them all to zero
    assert float(plain.outer_grad["w"][own].abs().max()) == 0.0
    assert float(sparse.outer_grad["w"][own].abs().min()) > 0.0
    assert torch.equal(sparse.outer_grad["w"][30:], torch.zeros(20))  # nobody sent these: none is invented
    # the spike on a coordinate all five sent stays within the honest range, as without winsorizing it does not
    assert float(sparse.outer_grad["w"][3]) <= 1.2 * float(sparse.outer_grad["w"][:3].max())
    assert float(mean.outer_grad["w"][3]) > 1.5 * float(mean.outer_grad["w"][:3].max())
