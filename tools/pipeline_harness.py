"""An in-process pipeline through the production stage and verifier code, for tests and benchmarks.

`build_arm` wires one verifier's `PipelineDriver` to `StageService`s through `DirectTransport` (the same sealing,
signing, opening, idempotency ledgers and handlers as over the network, minus sockets), with a `SentinelTap` at
every boundary and a `BanWatcher` over an in-memory stand-in of the DHT ban records; bans are enforced by the
driver (`banned=`) and by every stage service (`is_banned`). Replicas chosen as attackers apply a
`verification.attacks` behaviour to what they send, exactly as a node started with `HIVENODE_UNSAFE_ATTACK`.

`drive` pushes microbatches through it (`concurrency` at a time, one clock second per microbatch; their ids, and
the held-out evaluations', come from the driver's own counter, `MicrobatchIds`, as a verifier's do, so that a
disguised spot check is not told from them by its id), publishes and
polls bans, optionally averages each stage's unbanned replicas every `merge_every` microbatches (a stand-in for
the syncer's DiLoCo merge: plain mean, outer learning rate 1, no outer momentum) and measures the held-out loss
through the pipeline. `pretrained_state` trains the whole model centrally first, so that verification can start
from a model past its first, fastest-moving steps (the paper's honest warm-up on a model already in training).

Not a role and never started by a node: the harness exists so that tests and `benchmarks/sentinel_table.py`
exercise the same production path without processes or sockets.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
import random
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node.ml.data import Batch, BatchSampler, Corpus, load_corpus, validation_batches
from node.ml.model import CausalLM, ModelConfig, build_model, lm_loss, load_state_subset, stage_state_subset
from node.pipeline.accounting import MicrobatchOutcome
from node.pipeline.driver import PipelineDriver
from node.pipeline.ids import MicrobatchIds
from node.pipeline.routing import ReplicaInfo, ReplicaRouter, RoutingConfig
from node.pipeline.transport import DirectTransport
from node.roles.stage import StageConfig, StageService, build_core
from node.swarm.bans import BanWatchConfig, BanWatcher
from protocol.boundary_codec import BoundaryCodecName, BoundaryCodecSpec, rounding_generator
from protocol.envelope import Direction, Header
from protocol.identity import NodeIdentity
from protocol.manifest import InnerOptimizerSpec, RunManifest, WireSpec
from protocol.pipeline import BoundaryShape
from protocol.records import BanNotice, BanRecord
from verification.attacks import Attack, AttackConfig, parse_attack
from verification.bans import SignedBoundaryHeader
from verification.ledger import LedgerConfig
from verification.sentinel import SentinelConfig
from verification.tap import SentinelTap, SentinelTapConfig

logger = logging.getLogger(__name__)

MODEL: dict[str, int] = {"vocab_size": 256, "context_len": 32, "num_layers": 3, "width": 64, "num_heads": 2}
RUN_ID = "0" * 40
# The wall clock (s) the harness's microbatch counter starts from (`MicrobatchIds.from_clock`): ids of the same
# size as a verifier's, fixed so that two runs of one seed send the same ids.
IDS_EPOCH_S = 1_800_000_000.0
# every arm's stochastic-rounding streams (each replica's and the driver's own, `rounding_generator`) are seeded
# _ROUNDING_SEEDS x seed + i: reproducible from the arm's seed, distinct between owners and between arms
_ROUNDING_SEEDS = 1000


@dataclass(frozen=True, kw_only=True, slots=True)
class HarnessConfig:
    """One in-process pipeline; the defaults are the integration test's."""

    model: Mapping[str, int] = field(default_factory=lambda: dict(MODEL))
    replicas: tuple[int, ...] = (2, 3, 2)  # per stage
    attacked_stage: int = 1
    attackers: int = 1  # replicas 0..attackers-1 of attacked_stage lie (when an attack is given)
    lr: float = 1e-3
    batch_size: int = 8  # sequences per microbatch (= the inner batch: one optimizer step per microbatch)
    sentinel: SentinelConfig = field(default_factory=SentinelConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    concurrency: int = 2  # microbatches in flight at once
    poll_every: int = 10  # microbatches between ban publishing/polling rounds
    merge_every: int = 0  # microbatches between stage-wide averages of the unbanned replicas; 0: never
    held_out_batches: int = 4
    # True: every replica of a stage gets an equal share of the traffic (see `EvenRouter`); False: the
    # production router, which in one process learns timings of a shared CPU and keeps to the replicas it
    # measured first.
    even_routing: bool = False
    # Compute on the event loop's thread, in an order fixed by the seed; False: a thread per replica, as a node
    # runs it, whose timing decides when each replica steps (runs of one seed then differ).
    inline_compute: bool = True
    activation_codec: BoundaryCodecName = "fp32"  # the manifest's [activation_codec]
    # spot-check recomputations as ordinary training requests (VerifierConfig.disguised_spot_checks)
    disguised_spot_checks: bool = True

    def __post_init__(self) -> None:
        if len(self.replicas) < 2 or min(self.replicas) < 1:
            raise ValueError(f"need at least 2 stages with at least one replica each, got {self.replicas}")
        if not 0 <= self.attacked_stage < len(self.replicas):
            raise ValueError(f"attacked_stage {self.attacked_stage} is not a stage of {self.replicas}")
        if not 0 <= self.attackers < self.replicas[self.attacked_stage]:
            raise ValueError("attackers must leave at least one honest replica in the attacked stage")
        for name in ("concurrency", "poll_every", "held_out_batches", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.merge_every < 0:
            raise ValueError("merge_every must be >= 0")


class MemoryBanRecords:
    """The two calls BanWatcher makes on protocol.dht_io.SwarmRecords, kept in memory (one verifier signs)."""

    def __init__(self, signer: str) -> None:
        self.signer = signer
        self.rows: dict[str, BanRecord] = {}

    async def publish_ban(self, notice: BanNotice, *, expiration: float) -> bool:
        self.rows[notice.offender] = BanRecord(verifier=self.signer, notice=notice, expires_at=expiration)
        return True

    async def list_bans(self, offenders: object) -> dict[str, list[BanRecord]]:
        wanted = set(offenders)  # type: ignore[call-overload]
        return {o: [r] for o, r in self.rows.items() if o in wanted}


def seeded_identity(seed: int, index: int) -> NodeIdentity:
    """The same identity for the same (seed, index) in every run: peer ids order replicas and break ties, so
    random ones would make two runs of one seed differ."""
    secret = hashlib.sha256(f"pipeline-harness/{seed}/{index}".encode()).digest()
    return NodeIdentity(private_key=Ed25519PrivateKey.from_private_bytes(secret))


class InlineExecutor(Executor):
    """Runs each job at once on the event loop's thread. A replica's compute thread would let the order in which
    replicas step and answer follow thread timing (under load, runs of one seed differed: an honest replica was
    banned in one of four); in process there is one CPU to share anyway."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # handed to the awaiting coroutine, as a thread pool would
            future.set_exception(e)
        return future


class EvenRouter(ReplicaRouter):
    """The production router without throughput learning: all replicas of a stage share one CPU here, so
    their measured speeds say nothing about them; every replica keeps the prior speed, and the router's own
    rule (least projected time, in-flight counted, ties broken at random) spreads microbatches evenly."""

    def record_success(self, peer_id: str, *, tokens: int, seconds: float) -> None:
        super().record_success(peer_id, tokens=0, seconds=seconds)  # clears failures, measures nothing


class CountingAttack(Attack):
    """The attack, remembering which microbatches it corrupted (the attacker's own attacked microbatches).

    `training` (the arm's ids of driven training microbatches, filled as they are sent): the attack's schedule
    (`start_after`, on/off periods, drift) then ticks on the attacker's own training microbatches only, as the
    benchmarks define it, not on every answer: with disguised spot checks an attacker also answers the checks
    it is asked to make, which would otherwise move its start earlier in the run than with marked checks (into
    the monitors' warm-up: in `sentinel_table --quick`, driven microbatch 90-113 instead of 111-129) and make
    the two runs start different attacks. It still corrupts those answers once active: it cannot tell them."""

    def __init__(self, config: AttackConfig, training: Collection[int] | None = None) -> None:
        super().__init__(config)
        self.attacked: set[int] = set()
        self.training = training
        self._training_steps = {"forward": 0, "backward": 0}

    def apply(self, tensor: torch.Tensor, *, direction: str, microbatch_id: int, step: int) -> torch.Tensor:
        if self.training is not None and direction in self._training_steps:
            step = self._training_steps[direction]
            if microbatch_id in self.training:
                self._training_steps[direction] = step + 1
        if self.is_active(direction, step):
            self.attacked.add(microbatch_id)
        return super().apply(tensor, direction=direction, microbatch_id=microbatch_id, step=step)


@dataclass(slots=True)
class ReplicaChecks:
    """What the verifier's tap judged from one replica (for benchmarks' microbatch-level accounting)."""

    checks: int = 0
    flags: int = 0
    attacked_checks: int = 0  # checks of tensors the replica corrupted (attackers only)
    attacked_flags: int = 0
    skipped: int = 0  # not judged: the microbatch was already handled upstream (cascade)


class RecordingTap(SentinelTap):
    """A SentinelTap that also counts, per replica, what it judged and flagged; behaviour unchanged."""

    def __init__(
        self, *args: Any, attacks: Mapping[str, CountingAttack] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.attacks = dict(attacks or {})
        self.per_replica: dict[str, ReplicaChecks] = {}

    def check(
        self,
        stage: int,
        direction: Direction,
        replica: str,
        microbatch_id: int,
        tensor: torch.Tensor,
        header: Header,
        *,
        context: torch.Tensor | None = None,
        signed: SignedBoundaryHeader | None = None,
    ) -> torch.Tensor | Any:
        row = self.per_replica.setdefault(replica, ReplicaChecks())
        flagged, checked, skipped = self.stats.flagged, self.stats.checked, self.stats.skipped_cascade
        out = super().check(
            stage, direction, replica, microbatch_id, tensor, header, context=context, signed=signed
        )
        attack = self.attacks.get(replica)
        attacked = attack is not None and microbatch_id in attack.attacked
        if self.stats.checked > checked:
            row.checks += 1
            row.attacked_checks += int(attacked)
        if self.stats.flagged > flagged:
            row.flags += 1
            row.attacked_flags += int(attacked)
        row.skipped += self.stats.skipped_cascade - skipped
        return out


@dataclass
class Arm:
    """One pipeline (verifier, stage replicas, ban plumbing) and its simulated clock."""

    config: HarnessConfig
    driver: PipelineDriver
    services: dict[str, StageService]
    stages: dict[str, int]  # replica -> stage
    tap: RecordingTap
    watcher: BanWatcher
    attacks: dict[str, CountingAttack]  # attacker -> its attack
    clock: dict[str, float]
    # attacker -> its own attacked training microbatches when its ban took effect (checked after every round)
    attacked_at_ban: dict[str, int] = field(default_factory=dict)
    # ids of the training microbatches driven: an attacker cannot tell a disguised check from training and
    # corrupts its answers to checks too, which are not its own microbatches and harm no training
    training: set[int] = field(default_factory=set)
    min_usable_per_stage: dict[int, int] = field(default_factory=dict)  # fewest unbanned replicas seen

    @property
    def attackers(self) -> tuple[str, ...]:
        return tuple(self.attacks)

    @property
    def attacker(self) -> str | None:
        return self.attackers[0] if self.attackers else None

    @property
    def attack(self) -> CountingAttack | None:
        return self.attacks[self.attackers[0]] if self.attackers else None

    @property
    def attacked_before_ban(self) -> int | None:
        """The first attacker's own attacked microbatches when its ban took effect (None: not banned)."""
        return self.attacked_at_ban.get(self.attacker) if self.attacker is not None else None

    def banned(self) -> frozenset[str]:
        return self.tap.banned() | self.watcher.active()

    def attacked_checks(self) -> int:
        """Answers the attackers corrupted that were not training microbatches: disguised checks they made."""
        return sum(len(attack.attacked - self.training) for attack in self.attacks.values())

    def account_bans(self) -> None:
        banned = self.banned()
        for attacker, attack in self.attacks.items():
            if attacker in banned and attacker not in self.attacked_at_ban:
                self.attacked_at_ban[attacker] = len(attack.attacked & self.training)
        for stage in range(len(self.config.replicas)):
            usable = sum(1 for p, s in self.stages.items() if s == stage and p not in banned)
            self.min_usable_per_stage[stage] = min(self.min_usable_per_stage.get(stage, usable), usable)


@functools.cache
def corpus() -> Corpus:
    return load_corpus(None)


def manifest_for(config: HarnessConfig, verifier: NodeIdentity) -> RunManifest:
    return RunManifest(
        model=dict(config.model),
        num_stages=len(config.replicas),
        inner=InnerOptimizerSpec(lr=config.lr, batch_size=config.batch_size, weight_decay=0.01),
        wire=WireSpec(max_batch=config.batch_size),
        authorized_verifiers=(verifier.peer_id,),
        activation_codec=BoundaryCodecSpec(codec=config.activation_codec),
    )


def pretrained_state(
    config: HarnessConfig, *, steps: int, seed: int, lr: float = 3e-3
) -> dict[str, torch.Tensor]:
    """The whole model (same init as the stage cores: the run seed) trained `steps` steps centrally."""
    cfg = ModelConfig.from_dict(dict(config.model))
    model = build_model(cfg, 0)
    model.train()
    if steps > 0:
        sampler = BatchSampler(
            corpus().train_stream(0, 1),
            batch_size=config.batch_size,
            context_len=cfg.context_len,
            generator=torch.Generator().manual_seed(10_000 + seed),
        )
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        for _ in range(steps):
            inputs, targets = sampler.next_batch()
            loss = lm_loss(model(inputs), targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


ReplicaPlan = tuple[NodeIdentity, int, CountingAttack | None]  # identity, stage, its attack (attackers only)


def build_arm(
    config: HarnessConfig,
    *,
    attack: str | None,
    verify: bool,
    seed: int = 0,
    weights: Mapping[str, torch.Tensor] | None = None,
    verifier: NodeIdentity | None = None,
) -> Arm:
    """A fresh pipeline; `attack` is a `verification.attacks` spec applied by the attackers, `weights` a full
    model state every replica starts from (default: the run seed's init)."""
    torch.manual_seed(seed)
    verifier = verifier or seeded_identity(seed, -1)
    run = manifest_for(config, verifier)
    clock = {"t": 0.0}
    training: set[int] = set()
    replicas = plan_replicas(config, parse_attack(attack) if attack is not None else None, seed, training)
    attacks = {identity.peer_id: a for identity, _, a in replicas if a is not None}
    tap = RecordingTap(
        verifier=verifier.peer_id,
        run_id=RUN_ID,
        config=SentinelTapConfig(
            enabled=verify, sentinel=config.sentinel, ledger=config.ledger, spot_seed=seed
        ),
        clock=lambda: clock["t"],
        attacks=attacks,
    )
    watcher = BanWatcher(
        MemoryBanRecords(verifier.peer_id),
        authorized_verifiers=run.authorized_verifiers,
        bans_required=1,
        run_id=RUN_ID,
        config=BanWatchConfig(ban_ttl_s=3600.0),
        outbox=tap.pending,
        clock=lambda: clock["t"],
    )
    services = stage_services(run, replicas, weights, watcher, inline=config.inline_compute, seed=seed)
    stages = {identity.peer_id: stage for identity, stage, _ in replicas}
    tap.stage_replicas = lambda s: [p for p, st in stages.items() if st == s]
    driver = PipelineDriver(
        identity=verifier,
        run_id=RUN_ID,
        num_stages=len(config.replicas),
        shape=BoundaryShape.from_manifest(run),
        transport=DirectTransport(verifier.peer_id, services),
        replicas=lambda: [ReplicaInfo(peer_id=p, stage=s) for p, s in stages.items()],
        router=EvenRouter(RoutingConfig()) if config.even_routing else ReplicaRouter(RoutingConfig()),
        tap=tap,
        banned=lambda: tap.banned() | watcher.active(),
        rng=random.Random(seed),
        clock=lambda: clock["t"],
        ids=MicrobatchIds.from_clock(lambda: IDS_EPOCH_S),
        disguised_spot_checks=config.disguised_spot_checks,
    )
    driver.hops.rounding = rounding_generator(_ROUNDING_SEEDS * seed + _ROUNDING_SEEDS - 1)
    return Arm(config, driver, services, stages, tap, watcher, attacks, clock, training=training)


def plan_replicas(
    config: HarnessConfig, spec: AttackConfig | None, seed: int = 0, training: Collection[int] | None = None
) -> list[ReplicaPlan]:
    """Every replica's identity and stage, stage by stage; replicas 0..attackers-1 of the attacked stage get
    the attack (when one is given), each with its own noise stream and its schedule on `training` ids."""
    replicas: list[ReplicaPlan] = []
    for stage, count in enumerate(config.replicas):
        for index in range(count):
            attack_obj = None
            if spec is not None and stage == config.attacked_stage and index < config.attackers:
                attack_obj = CountingAttack(dataclasses.replace(spec, seed=spec.seed + 101 * index), training)
            replicas.append((seeded_identity(seed, len(replicas)), stage, attack_obj))
    return replicas


def stage_services(
    run: RunManifest,
    replicas: list[ReplicaPlan],
    weights: Mapping[str, torch.Tensor] | None,
    watcher: BanWatcher,
    *,
    inline: bool,
    seed: int,
) -> dict[str, StageService]:
    """Every replica's service (`stage_service`), replica i's rounding noise seeded _ROUNDING_SEEDS x seed + i."""
    return {
        identity.peer_id: stage_service(
            run,
            identity,
            stage,
            attack,
            weights,
            watcher,
            inline=inline,
            rounding=rounding_generator(_ROUNDING_SEEDS * seed + index),
        )
        for index, (identity, stage, attack) in enumerate(replicas)
    }


def stage_service(
    run: RunManifest,
    identity: NodeIdentity,
    stage: int,
    attack: CountingAttack | None,
    weights: Mapping[str, torch.Tensor] | None,
    watcher: BanWatcher,
    *,
    inline: bool = True,
    rounding: torch.Generator | None = None,
) -> StageService:
    """One replica: the production stage core and service, from `weights` if given, enforcing `watcher`'s bans."""
    core = build_core(run, RUN_ID, stage, StageConfig())
    if weights is not None:
        with torch.no_grad():
            load_state_subset(core.module, stage_state_subset(core.module, weights))
        core.weights_changed()
    return StageService(
        identity,
        RUN_ID,
        core,
        authorized=run.authorized_verifiers,
        is_banned=watcher.is_banned,
        attack=attack,
        executor=InlineExecutor() if inline else None,
        rounding=rounding,
    )


def merge_stages(arm: Arm) -> None:
    """Every stage's replicas not banned swarm-wide adopt the mean of their weights (the syncer's merge,
    simplified; the attacker's too: it trains on honest gradients and lies only on the wire)."""
    banned = arm.watcher.active()
    for stage in range(len(arm.config.replicas)):
        cores = [arm.services[p].core for p, s in arm.stages.items() if s == stage and p not in banned]
        if len(cores) < 2:
            continue
        with torch.no_grad():
            for name in cores[0].params:
                mean = torch.stack([c.params[name].detach() for c in cores]).mean(0)
                for c in cores:
                    c.params[name].copy_(mean)
        for c in cores:
            c.weights_changed()


def set_lr(arm: Arm, lr: float, *, stages: Collection[int] | None = None) -> None:
    """An honest learning-rate change: every replica of `stages` (default all) steps with `lr` from now on."""
    for peer, stage in arm.stages.items():
        if stages is None or stage in stages:
            for group in arm.services[peer].core.optimizer.param_groups:
                group["lr"] = lr


def shift_weights(arm: Arm, std: float, *, seed: int = 0, stages: Collection[int] | None = None) -> None:
    """An honest new merged version that moved far: every unbanned replica of a stage gets the same weight jump
    (std `std` relative to each tensor's RMS), as when all adopt a merge after a large outer step."""
    gen = torch.Generator().manual_seed(seed)
    banned = arm.watcher.active()
    for stage in range(len(arm.config.replicas)):
        if stages is not None and stage not in stages:
            continue
        cores = [arm.services[p].core for p, s in arm.stages.items() if s == stage and p not in banned]
        if not cores:
            continue
        with torch.no_grad():
            for name in sorted(cores[0].params):
                ref = cores[0].params[name]
                scale = float(ref.detach().pow(2).mean().sqrt()) or 1.0
                jump = torch.randn(ref.shape, generator=gen) * (std * scale)
                for c in cores:
                    c.params[name].add_(jump)
        for c in cores:
            c.weights_changed()


@dataclass(slots=True)
class Checkpoint:
    microbatches: int  # driven so far
    tokens: int  # trained so far (tokens of completed microbatches)
    loss: float  # held-out


def drive(
    arm: Arm,
    microbatches: int,
    seed: int = 0,
    *,
    eval_every: int = 100,
    progress: Callable[[int, Arm], None] | None = None,
    events: Mapping[int, Callable[[Arm], None]] | None = None,
) -> dict[str, Any]:
    """Drive `microbatches` microbatches, `concurrency` at a time (one clock second each); after each round:
    merge every `merge_every`, publish and poll bans every `poll_every`, note bans, and measure the held-out
    loss every `eval_every` and at the end (also before the first microbatch). Put `eval_every` on a
    multiple of `merge_every` to measure right after a merge, when every replica of a stage holds the same
    weights and routing does not matter. `events` maps a microbatch count to a call made once that many
    microbatches are done (honest shifts for tests: `set_lr`, `shift_weights`)."""
    cfg = arm.config
    context_len = int(cfg.model["context_len"])
    data = corpus()
    sampler = BatchSampler(
        data.train_stream(0, 1),
        batch_size=cfg.batch_size,
        context_len=context_len,
        generator=torch.Generator().manual_seed(seed),
    )
    held_out = held_out_batches(cfg)
    tally = DriveTally()
    schedule = DriveSchedule(microbatches, eval_every, sorted((events or {}).items()), progress)
    asyncio.run(drive_rounds(arm, sampler, held_out, tally, schedule))
    return {
        "loss": tally.checkpoints[-1].loss,
        "losses": [(c.microbatches, c.loss) for c in tally.checkpoints],
        "completed": tally.completed,
        "attacker_routes_after_ban": tally.attacker_routes_after_ban,
        "tokens": arm.driver.stats.tokens,
        "checkpoints": tally.checkpoints,
        "outcomes": tally.outcomes,
    }


def held_out_batches(config: HarnessConfig) -> list[Batch]:
    """The held-out batches `drive` measures on (the same for every arm of one config)."""
    return validation_batches(
        corpus(),
        batch_size=config.batch_size,
        context_len=int(config.model["context_len"]),
        num_batches=config.held_out_batches,
    )


def assembled_model(arm: Arm) -> CausalLM:
    """The whole model from the arm's trained stage weights, one replica per stage (the first not banned, in
    plan order; after `merge_stages` every one of a stage holds the same): what a user would export and run
    with no pipeline and no boundary codec in between."""
    banned = arm.banned()
    state: dict[str, torch.Tensor] = {}
    for stage in range(len(arm.config.replicas)):
        peer = next(p for p, s in arm.stages.items() if s == stage and p not in banned)
        state |= {k: v.detach().clone() for k, v in arm.services[peer].core.module.state_dict().items()}
    model = build_model(ModelConfig.from_dict(dict(arm.config.model)), 0)
    model.load_state_dict(state, strict=True)  # strict: the stages together hold exactly the whole model
    model.eval()
    return model


def model_held_out_loss(arm: Arm, held_out: list[Batch] | None = None) -> float:
    """Mean held-out loss of `assembled_model(arm)` run directly, in fp32: the trained weights' own quality,
    without the codec's quantization of the evaluation's forward (`drive`'s loss goes through the pipeline and
    its codec). Summed as `PipelineDriver.evaluate` sums, so an fp32 arm gives the same number."""
    model = assembled_model(arm)
    batches = held_out_batches(arm.config) if held_out is None else held_out
    total = 0.0
    with torch.no_grad():
        for inputs, targets in batches:
            logits = model(inputs)
            assert isinstance(logits, torch.Tensor)  # no targets given: the logits alone
            total += float(lm_loss(logits, targets))
    return total / len(batches)


@dataclass(slots=True)
class DriveSchedule:
    """What `drive` does when: how many microbatches, held-out loss every `eval_every`, the pending events
    (microbatch count -> call, in order) and the progress callback."""

    microbatches: int
    eval_every: int
    events: list[tuple[int, Callable[[Arm], None]]]
    progress: Callable[[int, Arm], None] | None


@dataclass(slots=True)
class DriveTally:
    """What `drive` counts while it runs."""

    completed: int = 0
    attacker_routes_after_ban: int = 0  # microbatches applied by an attacker banned by the end of their round
    outcomes: list[MicrobatchOutcome] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)

    def add(self, arm: Arm, results: list[MicrobatchOutcome]) -> None:
        banned_now = arm.watcher.active()
        for o in results:
            self.completed += o.completed
            if any(a in banned_now and a in o.replicas for a in arm.attackers):
                self.attacker_routes_after_ban += 1
        self.outcomes.extend(results)


async def drive_rounds(
    arm: Arm, sampler: BatchSampler, held_out: list[Batch], tally: DriveTally, schedule: DriveSchedule
) -> None:
    """`drive`'s loop: one round of `concurrency` microbatches per clock second, then what is due after it."""
    cfg, total = arm.config, schedule.microbatches
    await evaluate_held_out(arm, held_out, tally, 0)
    for first in range(0, total, cfg.concurrency):
        arm.clock["t"] = float(first)
        done = min(first + cfg.concurrency, total)
        # one id per microbatch from the verifier's counter, as VerifierRole._one takes them (disguised checks
        # launched meanwhile take theirs from the same counter)
        batches = [(arm.driver.ids.take(), *sampler.next_batch()) for _ in range(first, done)]
        arm.training.update(b[0] for b in batches)
        results = await asyncio.gather(*(arm.driver.run_microbatch(*b) for b in batches))
        tally.add(arm, results)
        if cfg.merge_every and done % cfg.merge_every == 0:
            merge_stages(arm)
        while schedule.events and schedule.events[0][0] <= done:
            schedule.events.pop(0)[1](arm)
        if first % cfg.poll_every == 0:
            await exchange_bans(arm)
        arm.account_bans()
        if (schedule.eval_every and done % schedule.eval_every == 0) or done >= total:
            await evaluate_held_out(arm, held_out, tally, done)
        if schedule.progress is not None:
            schedule.progress(done, arm)
    await exchange_bans(arm)
    arm.account_bans()


async def evaluate_held_out(arm: Arm, held_out: list[Batch], tally: DriveTally, done: int) -> None:
    """The held-out loss through the pipeline after `done` microbatches, as a new checkpoint."""
    first_id = arm.driver.ids.take(len(held_out))  # as VerifierRole._evaluate
    loss = await arm.driver.evaluate(held_out, first_id)
    tally.checkpoints.append(Checkpoint(done, arm.driver.stats.tokens, loss))


async def exchange_bans(arm: Arm) -> None:
    """Publish the tap's pending ban notices and poll the ban records (the stages enforce what is active)."""
    await arm.watcher.publish_pending()
    await arm.watcher.poll(arm.services)


__all__ = [
    "IDS_EPOCH_S",
    "MODEL",
    "RUN_ID",
    "Arm",
    "Checkpoint",
    "CountingAttack",
    "EvenRouter",
    "HarnessConfig",
    "InlineExecutor",
    "MemoryBanRecords",
    "RecordingTap",
    "assembled_model",
    "ReplicaChecks",
    "build_arm",
    "corpus",
    "drive",
    "held_out_batches",
    "merge_stages",
    "model_held_out_loss",
    "pretrained_state",
    "seeded_identity",
    "set_lr",
    "shift_weights",
]
