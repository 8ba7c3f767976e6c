"""SENTINEL on the running pipeline: a lying middle-stage replica is banned, traffic reroutes, training goes on.

The pipeline runs in process through the production stage and verifier code (`DirectTransport`: the same
sealing, signing, opening, ledgers and `StageService` handlers as over the network, minus sockets); the ban
travels through `BanWatcher` and an in-memory stand-in of the DHT ban records, and is enforced by the driver
(`banned=`) and by every stage service (`is_banned`). 3 stages x (2, 3, 2) replicas: the middle stage has 3
so that the per-stage ban cap allows a ban and a spot check can find a third opinion. Every `SYNC_EVERY`
microbatches each stage's replicas adopt their mean (the DiLoCo syncer's part, in process). The model is
trained from scratch, with verification on from the first microbatch: the fastest-moving, most turbulent
traffic a verifier sees.

Negative control: the same attack with verification off hurts the held-out loss. Clean control: nobody is
banned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from tools.pipeline_harness import (
    Arm,
    HarnessConfig,
    build_arm,
    drive,
    seeded_identity,
    set_lr,
    shift_weights,
)
from verification.sentinel import SentinelConfig

MODEL = {"vocab_size": 256, "context_len": 32, "num_layers": 3, "width": 64, "num_heads": 2}
RUN_ID = "0" * 40
VERIFIER = seeded_identity(
    0, -1
)  # with the replicas' seeded identities: a run of one seed is the same run every time
REPLICAS = (2, 3, 2)
ATTACK_START = 50  # the attacker's own steps sent honestly first (monitors warm up, spot checks calibrate)
BAN_WITHIN = 15  # own attacked microbatches before the ban, at most
# Noise at half the signal's scale sits at 1.2-1.7 spot-check tolerances from honest replicas, where an honest
# replica running ahead can also sit (1.2 measured): convictions within
# SpotCheckConfig.ban_margin (1.5) tolerances are marginal and a ban takes 4 of them instead of 2
# (LedgerConfig.marginal_convictions_to_ban), so the noise attacker's ban may take longer.
BAN_WITHIN_BY_KIND = {"noise": 40}
SYNC_EVERY = 10  # driven microbatches between replica averages (the stand-in syncer)


# The pipeline, the attackers' counting, the replica averages (the stand-in syncer, every SYNC_EVERY) and the
# driving loop live in tools.pipeline_harness, shared with benchmarks/sentinel_table.py.
HARNESS = HarnessConfig(
    model=MODEL,
    replicas=REPLICAS,
    sentinel=SentinelConfig(warmup_checks=60, min_window_checks=24),
    merge_every=SYNC_EVERY,
    # Every replica gets its share: with the production router, which learns timings of one shared CPU here,
    # a replica not measured in the first microbatches was never chosen again, and when that was the attacker
    # it never attacked (the negative control then measured nothing: 2.475 against 2.475 clean).
    even_routing=True,
)


def build(*, attack: str | None, verify: bool, seed: int = 0) -> Arm:
    return build_arm(HARNESS, attack=attack, verify=verify, seed=seed, verifier=VERIFIER)


@pytest.fixture(autouse=True)
def one_torch_thread() -> object:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def attack_spec(kind: str) -> str:
    return f"{kind},start_after={ATTACK_START}"


def assert_liar_banned_alone(arm: Arm, result: dict[str, object], microbatches: int, kind: str) -> None:
    within = BAN_WITHIN_BY_KIND.get(kind.split(":")[0], BAN_WITHIN)
    attacker = arm.attacker
    assert attacker is not None
    assert [b["offender"] for b in arm.tap.ban_log] == [attacker], arm.tap.ban_log  # banned, nobody else
    assert arm.attacked_before_ban is not None and 0 < arm.attacked_before_ban <= within, (
        arm.attacked_before_ban,
        arm.tap.ban_log,
    )
    assert arm.watcher.active() == {attacker}  # swarm-wide, through the DHT records
    # every stage replica refuses the banned peer as a caller from now on (the same hook in each service)
    assert all(s.is_banned(attacker) for s in arm.services.values())
    assert result["attacker_routes_after_ban"] == 0  # traffic rerouted
    assert min(arm.min_usable_per_stage.values()) >= 2  # no stage ever lost its replicas
    assert result["completed"] >= microbatches * 0.8  # training went on on the honest middle replicas
    losses = [loss for _, loss in result["losses"]]  # type: ignore[union-attr]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 1.0 and losses[-1] <= min(losses[:-1]) + 0.05, result["losses"]


# The attacks of the CI variant: blatant in both directions, and a gradient sign flip that keeps the
# gradient's scale (invisible to the paper's batch-mean statistics; spot checks recompute it).
CI_ATTACKS = ["random:direction=both", "scaling:strength=-1,direction=backward"]
SLOW_ATTACKS = [
    "zeros:direction=forward",
    "noise:strength=0.5,direction=forward",
    "mimic:direction=forward",
    "delay:direction=backward,delay_steps=30",
    "random:direction=backward",
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", CI_ATTACKS)
def test_liar_is_banned_everywhere_traffic_reroutes_and_training_goes_on(kind: str) -> None:
    arm = build(attack=attack_spec(kind), verify=True)
    result = drive(arm, 400)
    assert_liar_banned_alone(arm, result, 400, kind)
    assert arm.tap.stats.skipped_cascade + arm.tap.stats.dropped + arm.tap.stats.replaced > 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", CI_ATTACKS + SLOW_ATTACKS)
def test_liar_is_banned_for_more_attacks_and_seeds(kind: str, seed: int) -> None:
    arm = build(attack=attack_spec(kind), verify=True, seed=seed)
    result = drive(arm, 400, seed=seed)
    assert_liar_banned_alone(arm, result, 400, kind)


@pytest.mark.timeout(300)
def test_clean_run_bans_nobody() -> None:
    arm = build(attack=None, verify=True, seed=1)
    result = drive(arm, 400, seed=1)
    assert arm.tap.ban_log == [] and arm.watcher.active() == frozenset()
    assert min(arm.min_usable_per_stage.values()) >= 2
    assert result["completed"] >= 400 * 0.9  # false flags cost a few dropped microbatches at most
    losses = [loss for _, loss in result["losses"]]  # type: ignore[union-attr]
    assert losses[-1] < losses[0] - 1.0, result["losses"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("disguised", [True, False])
def test_honest_shifts_ban_nobody_and_keep_every_stage(disguised: bool) -> None:
    """The issue's honest shifts on the running pipeline: a learning-rate change (x8 on every replica for 50
    microbatches, as in benchmarks/sentinel_offline.py, then back) and a new merged version that moved far (every
    replica of every stage adopts the same weight jump, std 100 % of each tensor's RMS, on top of the regular
    averages). Both are real: the monitors flag them (the jump stage-wide: storms, re-warms) and the jump sets the
    held-out loss back; and nobody is banned and no stage loses a replica. (That cross-replica centring is what
    keeps such shifts from locking the verifier out: tests/unit/test_sentinel.py, with history-only fences as the
    control.) With disguised spot checks (the default) and marked ones: a backward check is then a duplicated
    microbatch on its checker (docs/sentinel.md, "Disguised spot checks"), which moves the run elsewhere; in
    the disguised run of seed 1 the x8 learning rate raised no flag at all (the marked one: 1), so only the
    jump is asserted visible there."""
    lr = HARNESS.lr
    seen: dict[str, tuple[int, int]] = {}

    def note(name: str) -> Callable[[Arm], None]:
        return lambda a: seen.__setitem__(name, (a.tap.stats.flagged, a.tap.stats.rewarms))

    events = {
        150: lambda a: (note("before lr")(a), set_lr(a, 8 * lr)),
        200: lambda a: (note("after lr")(a), set_lr(a, lr)),
        300: lambda a: (note("before jump")(a), shift_weights(a, 1.0, seed=1)),
        350: note("after jump"),
    }
    config = dataclasses.replace(HARNESS, disguised_spot_checks=disguised)
    arm = build_arm(config, attack=None, verify=True, seed=1, verifier=VERIFIER)
    result = drive(arm, 400, seed=1, eval_every=50, events=events)
    assert arm.tap.ban_log == [] and arm.watcher.active() == frozenset(), arm.tap.ban_log
    assert min(arm.min_usable_per_stage.values()) >= 2  # every stage kept all its replicas
    assert result["completed"] >= 400 * 0.85
    shifts = (("before lr", "after lr"),) if not disguised else ()
    for before, after in (*shifts, ("before jump", "after jump")):
        assert seen[after][0] > seen[before][0], seen  # flagged: the shift was visible to the monitors
    # the jump is stage-wide (storms, re-warms); on the Llama stages an x8 learning rate is flagged on some
    # replicas but not on a stage's majority at once (re-warms 1 -> 1 and 2 -> 2 seen; the jump 1 -> 4, 2 -> 5)
    assert seen["after jump"][1] > seen["before jump"][1], seen
    losses = dict(result["losses"])  # type: ignore[arg-type]
    assert losses[300] > losses[250] + 0.1, losses  # the jump set training back ...
    assert losses[400] < losses[300] - 0.1 and losses[400] < losses[0] - 1.0, losses  # ... and it recovered


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed", [0, 2, 3])
def test_long_clean_runs_ban_nobody(seed: int) -> None:
    arm = build(attack=None, verify=True, seed=seed)
    result = drive(arm, 1000, seed=seed)
    assert arm.tap.ban_log == [] and arm.watcher.active() == frozenset()
    assert result["completed"] >= 1000 * 0.9


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("kind", [*CI_ATTACKS, "scaling:strength=-10,direction=both"])
def test_without_verification_the_same_attack_hurts_the_held_out_loss(kind: str) -> None:
    # Measured (400 microbatches, held-out loss clean / unverified / verified): random both 2.488 / 2.636
    # / 2.494; gradient sign flip 2.482 / 2.588 / 2.499; x(-10) both 2.491 / 2.922 / 2.512. Run-to-run
    # noise of the clean loss is about 0.01 (the replicas are averaged every 10 microbatches, which bounds
    # what one liar among three can do).
    spec = attack_spec(kind)
    verified = drive(build(attack=spec, verify=True), 400)
    unverified = drive(build(attack=spec, verify=False), 400)
    clean = drive(build(attack=None, verify=False), 400)
    print({"clean": clean["losses"], "unverified": unverified["losses"], "verified": verified["losses"]})
    harm = unverified["loss"] - clean["loss"]
    left = verified["loss"] - clean["loss"]
    assert harm > 0.08, (unverified, clean)
    assert left < 0.04 and left < harm / 3, (verified, unverified, clean)
