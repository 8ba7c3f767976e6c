"""Disguised spot checks (node/pipeline/checks.py): a recomputation travels as an ordinary training request
under a fresh microbatch id, so a checker colluding with the checked replica cannot answer checks alone falsely.

In process through the production driver, stage cores and services (`tools.pipeline_harness`, `DirectTransport`):
what the stages received is read where they open it, and colluding replicas lie only on the requests they
recognise as checks. Negative control: the marked path (`disguised_spot_checks=False`), where the same
colluders clear a liar and frame an honest replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from node.ml.data import BatchSampler
from node.pipeline import checks
from node.pipeline.ids import MicrobatchIds
from node.roles.stage import StageService
from protocol.envelope import Header, Opened
from protocol.pipeline import EVAL_META, RECOMPUTE_GRAD_META
from tools.pipeline_harness import (
    IDS_EPOCH_S,
    Arm,
    CountingAttack,
    HarnessConfig,
    build_arm,
    corpus,
    drive,
)
from verification.attacks import parse_attack
from verification.sentinel import SentinelConfig
from verification.spotcheck import SpotCheckConfig, SpotCheckVerdict

MODEL = {"vocab_size": 256, "context_len": 16, "num_layers": 3, "width": 32, "num_heads": 2}
LIE = (
    -1.0
)  # the colluders' shared lie: every answer they lie on is negated (relative difference 2 to the truth)
# A fixed tolerance: honest replicas of this run, each stepping on its own microbatches from scratch, differed by
# up to 0.29 (relative L2) here, a lie by 2; the adaptive tolerance (tested in test_spotcheck.py) would first
# need 16 honest pairs per boundary, which a short run does not give.
TOLERANCE = 0.35


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is 4x faster here than torch's default on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def always_checked(config: HarnessConfig) -> Arm:
    """An arm whose tap recomputes every answer (at a fixed tolerance, `TOLERANCE`) and whose monitor never flags
    (its warm-up never ends): what decides is the spot checks alone."""
    return always_checked_arm(config, attack=None)


def always_checked_arm(config: HarnessConfig, attack: str | None) -> Arm:
    """`always_checked`, its attackers (`config.attackers` of `config.attacked_stage`) applying `attack`."""
    arm = build_arm(config, attack=attack, verify=True)
    every = SpotCheckConfig(base_rate=1.0, new_peer_rate=1.0, adaptive_tolerance=False, rtol=TOLERANCE)
    arm.tap.config = dataclasses.replace(arm.tap.config, spot=every)
    choose, turns = arm.driver.picker.choose, {s: itertools.count() for s in range(len(config.replicas))}

    def in_turn(stage: int, tokens: int, tried: set[str]) -> str:
        """Every stage in turn through its usable replicas (ties at random gave one replica 1 microbatch in 24)."""
        usable = sorted(p for p, s in arm.stages.items() if s == stage and p not in tried | arm.banned())
        return usable[next(turns[stage]) % len(usable)] if usable else choose(stage, tokens, tried)

    arm.driver.picker.choose = in_turn  # type: ignore[method-assign]
    return arm


def harness(replicas: tuple[int, ...], disguised: bool) -> HarnessConfig:
    return HarnessConfig(
        model=MODEL,
        replicas=replicas,
        sentinel=SentinelConfig(warmup_checks=1_000_000),
        even_routing=True,
        concurrency=1,
        disguised_spot_checks=disguised,
    )


def record_requests(service: StageService, log: list[tuple[str, Header]]) -> None:
    """Log the header of every request `service` opens (what the replica itself can see of it)."""
    opened_by = service._open

    def recording(*args: Any, **kwargs: Any) -> Opened:
        opened = opened_by(*args, **kwargs)
        log.append((service.identity.peer_id, opened.header))
        return opened

    service._open = recording  # type: ignore[method-assign]


async def drive_training(arm: Arm, microbatches: int) -> list[int]:
    """Drive `microbatches` training microbatches, ids from the driver's own counter, on the running loop; their
    ids."""
    batches = BatchSampler(
        corpus().train_stream(0, 1),
        batch_size=arm.config.batch_size,
        context_len=MODEL["context_len"],
        generator=torch.Generator().manual_seed(0),
    )
    ids = []
    for i in range(microbatches):
        arm.clock["t"] = float(i)
        microbatch = arm.driver.ids.take()
        ids.append(microbatch)
        await arm.driver.run_microbatch(microbatch, *batches.next_batch())
    return ids


def run(arm: Arm, microbatches: int) -> list[int]:
    """`drive_training` on a loop of its own."""
    return asyncio.run(drive_training(arm, microbatches))


def shape_of(header: Header) -> tuple[Any, ...]:
    """Everything a replica sees of a request but its id, nonce, time and payload digest."""
    specs = tuple((t.name, t.dtype, tuple(t.shape)) for t in header.tensors)
    return (
        header.kind,
        header.direction,
        header.stage,
        header.step,
        tuple(sorted(header.meta.items())),
        specs,
    )


def test_microbatch_ids_are_fresh_and_increasing() -> None:
    ids = MicrobatchIds(5)
    assert [ids.take(), ids.take(3), ids.take()] == [5, 6, 9] and ids.next == 10
    assert MicrobatchIds.from_clock(lambda: 1.0).next == 1000 << 16
    with pytest.raises(ValueError):
        ids.take(0)


@pytest.mark.parametrize("disguised", [True, False])
def test_a_disguised_check_is_an_ordinary_training_request(disguised: bool) -> None:
    """Stage 1 (2 replicas) is checked forward and backward, the last stage (2 replicas) backward; every check
    request must look like the ordinary one it recomputes, bar a fresh id from the training counter.
    Negative control: the marked path's requests carry `eval` and the original's id."""
    arm = always_checked(harness((1, 2, 2), disguised))
    log: list[tuple[str, Header]] = []
    for service in arm.services.values():
        record_requests(service, log)
    (original,) = run(arm, 1)
    stats = arm.driver.stats
    assert stats.spot_checks == 3  # stage 1 forward and backward, stage 2 backward (stage 0 has no peer)
    ordinary = [(peer, h) for peer, h in log if h.microbatch == original]
    checks = [(peer, h) for peer, h in log if h.microbatch != original or EVAL_META in h.meta]
    holders = {h.stage: peer for peer, h in ordinary}
    if not disguised:
        assert len(checks) == 3 and all(h.meta.get(EVAL_META) is True for _, h in checks)
        assert {h.microbatch for _, h in checks} == {original}  # linkable: the original's own id
        assert sum(RECOMPUTE_GRAD_META in h.meta for _, h in checks) == 2
        return
    # forward at 1; the last stage's forward; forward and backward at 1 (the backward check): 4 requests
    assert len(checks) == 4 and stats.disguised_checks == 3 and stats.duplicate_gradients == 2
    seen_shapes = {shape_of(h) for _, h in ordinary}
    for peer, header in checks:
        assert peer != holders[header.stage]  # recomputed on the other replica of the stage
        assert EVAL_META not in header.meta and RECOMPUTE_GRAD_META not in header.meta
        assert shape_of(header) in seen_shapes  # identical to an ordinary request of the same hop
        assert original < header.microbatch < arm.driver.ids.next  # the training counter's next ids
    assert len({h.microbatch for _, h in checks}) == 3  # one fresh id per check (forward + backward share)
    # side effects, as for abandoned and ordinary microbatches: the forward check's context waits for its
    # timeout at the stage-1 checker, which applied only the backward check's microbatch; the last stage's
    # checker applied its check (a duplicated microbatch); no checker was credited tokens for them
    checker1 = next(peer for peer, h in checks if h.stage == 1)
    checker2 = next(peer for peer, h in checks if h.stage == 2)
    core1, core2 = arm.services[checker1].core, arm.services[checker2].core
    assert core1.num_contexts == 1 and core1.counters.microbatches_applied == 1
    assert core2.counters.microbatches_applied == 1
    credited = arm.driver.receipts.tokens_by_replica()
    assert set(credited) == set(holders.values()) and checker1 not in credited and checker2 not in credited


def id_classes(log: list[tuple[str, Header]], training: set[int]) -> tuple[set[int], set[int], set[int]]:
    """The ids the stages saw: training microbatches, held-out evaluations (marked), and the rest (checks)."""
    seen = {h.microbatch for _, h in log}
    evaluations = {h.microbatch for _, h in log if h.meta.get(EVAL_META) is True}
    return seen & training, evaluations, seen - training - evaluations


def separable(training: set[int], checks: set[int]) -> bool:
    """Whether one threshold on the id tells every check from every training microbatch."""
    return max(training) < min(checks) or max(checks) < min(training)


def test_the_harness_drives_ids_from_the_verifiers_counter() -> None:
    """`drive` takes training and evaluation ids from the driver's own counter, as a verifier does, so the
    disguised checks' ids fall among the training ids. Negative control: a loop numbering its microbatches
    0..N itself (what `drive` did) lets one threshold on the id pick out every check."""
    arm = always_checked(harness((1, 2, 2), disguised=True))
    log: list[tuple[str, Header]] = []
    for service in arm.services.values():
        record_requests(service, log)
    first = arm.driver.ids.next
    result = drive(arm, 4, eval_every=0)
    training, evaluations, checked = id_classes(log, {o.microbatch for o in result["outcomes"]})
    assert first == MicrobatchIds.from_clock(lambda: IDS_EPOCH_S).next  # a verifier-sized id, fixed per run
    assert len(training) == 4 and len(evaluations) == 2 * arm.config.held_out_batches and checked
    assert all(first <= i < arm.driver.ids.next for i in training | evaluations | checked)
    assert not separable(training, checked)

    arm = always_checked(harness((1, 2, 2), disguised=True))
    log.clear()
    for service in arm.services.values():
        record_requests(service, log)
    sampler = BatchSampler(
        corpus().train_stream(0, 1),
        batch_size=arm.config.batch_size,
        context_len=MODEL["context_len"],
        generator=torch.Generator().manual_seed(0),
    )

    async def own_numbering() -> None:
        for i in range(4):
            await arm.driver.run_microbatch(i, *sampler.next_batch())

    asyncio.run(own_numbering())
    training, _, checked = id_classes(log, set(range(4)))
    assert len(training) == 4 and checked and separable(training, checked)


@pytest.mark.parametrize("disguised", [True, False])
def test_an_attackers_time_to_ban_counts_its_training_microbatches_only(disguised: bool) -> None:
    """An attacker cannot tell a disguised check it is asked to make from training and corrupts that answer
    too; `Arm.attacked_at_ban` (the benchmarks' "own attacked microbatches to ban") counts only the training
    microbatches it corrupted, since a check's answer trains nothing. Negative control: marked checks, which the
    simulated attacker answers honestly, leave nothing to tell apart."""
    config = dataclasses.replace(harness((1, 3, 1), disguised), attackers=1)
    arm = always_checked_arm(config, attack="random:start_after=0")
    # the attacker asked to check after its first conviction too (suspects are otherwise drawn last)
    spot = dataclasses.replace(arm.tap.config.spot, unsuspected_checkers_first=False)
    arm.tap.config = dataclasses.replace(arm.tap.config, spot=spot)
    drive(arm, 12, eval_every=0)
    assert arm.attack is not None and arm.attacker is not None
    own = arm.attack.attacked & arm.training
    assert own and arm.attacker in arm.banned()
    assert arm.attacked_at_ban[arm.attacker] <= len(own)
    if disguised:
        assert arm.attacked_checks() > 0 and arm.attack.attacked - arm.training
    else:
        assert arm.attacked_checks() == 0 and arm.attack.attacked <= arm.training


def test_the_harness_attack_schedule_ticks_on_training_microbatches() -> None:
    """The harness's attackers start after `start_after` own *training* microbatches, however many disguised
    checks they answer meanwhile (the benchmarks' `attack_start`; marked checks never reach the attack). Negative
    control: without the training ids, the schedule ticks on every answer, checks included, as the stage's
    own step counter passes it."""
    answers = [(1, 0), (100, 1), (2, 2), (101, 3), (3, 4)]  # (microbatch id, the service's step): 100+ checks
    for training, attacked in (({1, 2, 3}, {101, 3}), (None, {2, 101, 3})):
        attack = CountingAttack(parse_attack("random:start_after=2"), training)
        for microbatch, step in answers:
            attack.apply(torch.ones(2, 2, 4), direction="forward", microbatch_id=microbatch, step=step)
        assert attack.attacked == attacked, training


def test_the_harness_delay_attack_replays_across_check_answers() -> None:
    """`delay` replays its output from `delay_steps` training microbatches ago although the harness's
    schedule keeps the step on check answers (its history was bounded by entries: with a check answer
    between every two training microbatches the wanted step had left it, and the attacker sent honest
    tensors, counted as attacked: `sentinel_table` delay F1 0.80, an attacker never banned)."""
    training = set(range(0, 100, 2))  # even ids: training microbatches, odd: check answers in between
    attack = CountingAttack(parse_attack("delay:delay_steps=3,start_after=3"), training)
    sent = [
        attack.apply(torch.full((1, 2, 2), float(i)), direction="forward", microbatch_id=i, step=i)
        for i in range(20)
    ]
    # from its 4th training microbatch on, every answer is an old one (3 training steps back), never honest
    late = [(i, int(t[0, 0, 0])) for i, t in enumerate(sent) if i in training and i >= 6]
    assert late and all(i - 7 <= value <= i - 5 for i, value in late), late


def test_a_disguised_backward_check_waits_the_checked_microbatchs_own_gap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between its forward and its backward, a middle-stage backward check waits as long as the checked
    microbatch's backward came after its forward there (here the last stage's forward and its check, each
    `last_stage_s` of the clock), so a backward one round trip after its forward does not give the check away;
    capped at MAX_CHECK_GAP_S."""
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(checks.asyncio, "sleep", sleep)
    for last_stage_s, expected in ((5.0, 10.0), (100.0, checks.MAX_CHECK_GAP_S)):
        arm = always_checked(harness((1, 2, 2), disguised=True))
        for peer, stage in arm.stages.items():
            if stage == 2:
                service = arm.services[peer]
                service.core.forward_loss = slow(service.core.forward_loss, arm, last_stage_s)  # type: ignore[method-assign]
        slept.clear()
        run(arm, 1)
        assert slept == [
            expected
        ]  # one middle-stage backward check; forward and last-stage checks do not wait


def slow(fn: Callable[..., Any], arm: Arm, seconds: float) -> Callable[..., Any]:
    """`fn`, taking `seconds` of the arm's clock."""

    def slowed(*args: Any) -> Any:
        arm.clock["t"] += seconds
        return fn(*args)

    return slowed


# ---- colluders


class Ring:
    """What colluding replicas share: the microbatch ids their partner was asked for, so that a colluder lies only
    on recomputations of its partner's answers (lying on other checks would get it convicted as a checker)."""

    def __init__(self) -> None:
        self.partner_ids: set[int] = set()
        # digests of the tensors each side was sent (the input tell): the partner's, and its vouchers'
        self.partner_inputs: set[bytes] = set()
        self.voucher_inputs: set[bytes] = set()


Liar = Callable[[Header, "Ring"], bool]  # which requests a replica answers falsely


def collude(service: StageService, ring: Ring, *, partner: bool, lies_on: Liar) -> None:
    """Make `service` negate (LIE) every tensor it answers to a request `lies_on` picks; `partner`: the ids of
    its training requests go to the ring."""
    seal = service._seal

    def colluding(receiver: str, kind: Any, direction: Any, request: Header, **kwargs: Any) -> Any:
        if partner and not marked(request):  # its own answers (not the checks it is asked to make)
            ring.partner_ids.add(request.microbatch)
        (ring.partner_inputs if partner else ring.voucher_inputs).add(request.digest)
        tensor = kwargs.get("tensor")
        if tensor is not None and lies_on(request, ring):
            kwargs["tensor"] = tensor * LIE
        return seal(receiver, kind, direction, request, **kwargs)

    service._seal = colluding  # type: ignore[method-assign]


def marked(request: Header) -> bool:
    return request.meta.get(EVAL_META) is True


def check_of_partner(request: Header, ring: Ring) -> bool:
    """The colluder's lie: only on what it recognises as a check of its partner's answer."""
    return marked(request) and request.microbatch in ring.partner_ids


def all_but_checks(request: Header, ring: Ring) -> bool:
    """The partner's lie in "clear": on all its traffic but what it recognises as checks (where a lie would
    convict it as a checker)."""
    del ring
    return not marked(request)


def same_input_as_partner(request: Header, ring: Ring) -> bool:
    """The input tell: a request carrying exactly the tensors the partner was sent (a recomputation of its
    answer, or of an answer it is checking) is a check, whatever its id and meta."""
    return request.digest in ring.partner_inputs


def all_but_vouchers_inputs(request: Header, ring: Ring) -> bool:
    """The partner's lie when the ring compares inputs: on all its traffic but the recomputations of its
    vouchers' answers (which it recognises by their input)."""
    return request.digest not in ring.voucher_inputs


def never(request: Header, ring: Ring) -> bool:
    del request, ring
    return False


def collusion(
    scenario: str,
    disguised: bool,
    microbatches: int = 24,
    spots: Liar = check_of_partner,
    unsuspected_first: bool = False,
) -> dict[str, Any]:
    """`collusion_arm`, driven `microbatches` training microbatches in process; its tally."""
    arm, tally = collusion_arm(scenario, disguised, spots, unsuspected_first)
    run(arm, microbatches)
    return tally()


def collusion_arm(
    scenario: str,
    disguised: bool,
    spots: Liar = check_of_partner,
    unsuspected_first: bool = False,
) -> tuple[Arm, Callable[[], dict[str, Any]]]:
    """Stage 1 has replicas A (the partner), B and C; every answer is spot-checked. "clear": A lies on its
    traffic, B vouches for it, C is honest ("clear_by_input": A spares what it recognises by their input as checks
    of B's answers). "frame": A is honest, B and C lie against it. `spots`: how the colluders recognise a check of
    A (the flag and id, or the input). Returns the arm to drive and its tally: convictions per replica (as the
    original or as the checker), how many checks of A matched, and who was banned. `unsuspected_first`:
    `SpotCheckConfig.unsuspected_checkers_first` (off by default here, to measure the disguise alone)."""
    arm = always_checked(harness((1, 3, 1), disguised))
    spot = dataclasses.replace(arm.tap.config.spot, unsuspected_checkers_first=unsuspected_first)
    arm.tap.config = dataclasses.replace(arm.tap.config, spot=spot)
    ring = Ring()
    a, b, c = sorted(p for p, s in arm.stages.items() if s == 1)
    partner_lies = {"clear": all_but_checks, "clear_by_input": all_but_vouchers_inputs}.get(scenario, never)
    collude(arm.services[a], ring, partner=True, lies_on=partner_lies)
    for peer in [b, c][: 2 if scenario == "frame" else 1]:
        collude(arm.services[peer], ring, partner=False, lies_on=spots)
    verdicts: list[tuple[str, str, SpotCheckVerdict]] = []
    judge = arm.tap.spot_check

    def recording(stage: int, direction: Any, replica: str, microbatch: int, *args: Any, **kw: Any) -> Any:
        verdict = judge(stage, direction, replica, microbatch, *args, **kw)
        if stage == 1 and verdict.outcome != "need_third":
            verdicts.append((replica, args[1], verdict))
        return verdict

    arm.tap.spot_check = recording  # type: ignore[method-assign]
    names = {a: "A", b: "B", c: "C"}

    def tally() -> dict[str, Any]:
        got: dict[str, Any] = {f"{n}_convicted": 0 for n in "ABC"} | {"A_checked": 0, "A_matched": 0}
        for replica, checker, verdict in verdicts:
            culprit = {"original": replica, "checker": checker}.get(verdict.culprit or "")
            if culprit is not None:
                got[f"{names[culprit]}_convicted"] += 1
            if replica == a:
                got["A_checked"] += 1
                got["A_matched"] += int(verdict.outcome == "match")
        got["banned"] = sorted(names[p] for p in arm.banned() if p in names)
        return got

    return arm, tally


def test_marked_checks_let_a_colluder_clear_a_liar_and_frame_the_honest_replica() -> None:
    """Negative control: with checks marked, B vouches for every lie of A it is asked to check, and makes the
    third opinion against C when C checks A: the honest replica is convicted, and the liar never."""
    got = collusion("clear", disguised=False)  # measured: 18 of A's 22 checks matched, C banned at t=6
    assert got["A_matched"] >= 8 and got["A_convicted"] == 0, got
    assert got["C_convicted"] >= 1 and got["banned"] == ["C"], got


def test_disguised_checks_convict_the_liar_and_never_the_honest_replica() -> None:
    """The same replicas with checks disguised: B cannot tell a check of A, nor A a check it makes, from
    training traffic; A's lies are convicted (as an original or as a checker) and A is banned, C never."""
    got = collusion("clear", disguised=True)  # measured: A convicted 3 times (as a checker), banned at t=2
    assert got["A_convicted"] >= 1 and got["A_matched"] == 0 and got["banned"] == ["A"], got
    assert got["B_convicted"] == got["C_convicted"] == 0, got


def test_marked_checks_let_two_colluders_frame_an_honest_replica() -> None:
    """Negative control: B and C lie on checks of A; two against one, the honest A is convicted."""
    got = collusion("frame", disguised=False)  # measured: A convicted twice, banned at t=3
    assert got["A_convicted"] >= 1 and got["banned"] == ["A"], got


def test_disguised_checks_leave_colluders_nothing_to_frame_with() -> None:
    got = collusion("frame", disguised=True)  # measured: 16 checks of A, all matches
    assert got["A_checked"] >= 8 and got["A_matched"] == got["A_checked"], got
    assert got["A_convicted"] == got["B_convicted"] == got["C_convicted"] == 0 and got["banned"] == [], got


def test_known_limit_colluders_comparing_inputs_see_through_the_disguise() -> None:
    """A documented limit (docs/sentinel.md, "The same-input tell"): a recomputation carries the original's
    input, so B, told the digest of every request A receives, recognises every disguised check of A (and every
    third opinion on a check A makes) and vouches for A's lies; A, lying on everything, is never convicted and
    the honest C is. The disguise holds against this ring only without the shared digests
    (`test_disguised_checks_convict_the_liar_and_never_the_honest_replica`: A banned, C never)."""
    got = collusion("clear_by_input", disguised=True, spots=same_input_as_partner)
    assert got["A_checked"] >= 8 and got["A_convicted"] == 0 and got["A_matched"] >= 1, got
    assert got["C_convicted"] >= 1 and got["banned"] == ["C"], got


def identical_liars(unsuspected_first: bool) -> dict[str, Any]:
    """Stage 1 of a (1, 4, 1) pipeline: two attackers negate every answer (their own and the disguised checks
    they cannot tell from it), every answer checked, monitor off, 24 microbatches. Two identical lies agree: an
    attacker checking the other vouches for it, and as a third opinion makes two against an honest replica.
    Returns convictions of attackers and of honest replicas, and who was banned."""
    config = dataclasses.replace(harness((1, 4, 1), disguised=True), attackers=2)
    arm = always_checked_arm(config, attack="scaling:strength=-1,start_after=0")
    spot = dataclasses.replace(arm.tap.config.spot, unsuspected_checkers_first=unsuspected_first)
    arm.tap.config = dataclasses.replace(arm.tap.config, spot=spot)
    got: dict[str, Any] = {"attackers_convicted": 0, "honest_convicted": 0}
    judge = arm.tap.spot_check

    def recording(stage: int, direction: Any, replica: str, microbatch: int, *args: Any, **kw: Any) -> Any:
        verdict = judge(stage, direction, replica, microbatch, *args, **kw)
        culprit = {"original": replica, "checker": args[1]}.get(verdict.culprit or "")
        if stage == 1 and verdict.outcome != "need_third" and culprit is not None:
            got["attackers_convicted" if culprit in arm.attackers else "honest_convicted"] += 1
        return verdict

    arm.tap.spot_check = recording  # type: ignore[method-assign]
    drive(arm, 24, eval_every=0)
    got["banned"] = sorted("attacker" if p in arm.attackers else "honest" for p in arm.banned())
    return got


def test_suspects_recompute_last_so_identical_liars_cannot_outvote_the_honest() -> None:
    """`SpotCheckConfig.unsuspected_checkers_first`: once convicted (quarantined), an attacker is asked to
    recompute only when no unsuspected peer is left, so identical liars stop vouching for each other and
    stop making the third opinion against honest replicas (measured: attackers convicted 6 times, honest 0)."""
    got = identical_liars(unsuspected_first=True)
    assert got["honest_convicted"] == 0 and got["attackers_convicted"] >= 2, got
    assert got["banned"] == ["attacker", "attacker"], got


def test_negative_control_suspects_drawn_as_checkers_convict_honest_replicas() -> None:
    """The switch off: checkers drawn at random among all peers; the two liars, two against one, convict
    honest replicas (measured: 3 honest convictions beside 7 of the attackers)."""
    got = identical_liars(unsuspected_first=False)
    assert got["honest_convicted"] >= 1, got
