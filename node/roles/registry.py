"""Roles: the `Role` protocol, the registry from role name to factory, and how `--role auto` chooses.

Each role module `node/roles/<name>.py` defines `create_role(ctx: NodeContext) -> Role`; the registry imports it
when the role is built (so a learner never imports the syncer's code).

`--role auto` picks, in order:
1. `syncer` if this node's key is an authorized syncer of the run and no live peer announces the syncer role;
2. `stage` if the run is a pipeline run (more than one stage and at least one authorized verifier to drive it),
   on the stage with the least throughput per layer (`node.pipeline.routing.choose_stage`), each replica counted
   at its announced throughput clamped around what the run's verifiers measured of it
   (`node.pipeline.routing.effective_throughputs`: a replica lying about its speed does not steer newcomers);
3. `learner` otherwise.
(Verifiers are chosen explicitly: `--role verifier`; `--role stage` without `--stage` places as in 2.)

A node in client mode (others cannot dial it: behind NAT, `node.swarm.Joined.client_mode`) skips 1 and 2: a syncer
and a stage replica serve RPCs (learners push to the syncer, verifiers call the stages), which such a node cannot
answer. It becomes a learner, which only dials out, and says so in one log line. An explicit `--role stage` or
`--role syncer` is kept (the owner may know better, e.g. a relay), with a warning.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from node.pipeline.routing import (
    Measurement,
    RebalanceConfig,
    ReplicaInfo,
    choose_stage,
    effective_throughputs,
    stage_loads,
)
from protocol.errors import ConfigError
from protocol.manifest import RunManifest
from protocol.records import MeasuredRecord, PeerRecord

if TYPE_CHECKING:
    from node.context import NodeContext

logger = logging.getLogger(__name__)

ROLE_NAMES = ("learner", "stage", "verifier", "syncer")


class Role(Protocol):
    name: str

    async def run(self, ctx: NodeContext, stop: asyncio.Event) -> None:
        """Do the role's work until `stop` is set (returning early ends the node, e.g. at --max-steps)."""

    def status(self) -> dict[str, Any]:
        """Fields for /api/status and the heartbeat: state, stage, span, inner_step, tokens, loss, throughput,
        load, device... (whatever the role fills)."""


RoleFactory = Callable[["NodeContext"], Role]


def _module_factory(module_name: str) -> RoleFactory:
    def create(ctx: NodeContext) -> Role:
        factory: RoleFactory = importlib.import_module(module_name).create_role
        return factory(ctx)

    return create


ROLE_FACTORIES: dict[str, RoleFactory] = {name: _module_factory(f"node.roles.{name}") for name in ROLE_NAMES}


def register_role(name: str, factory: RoleFactory) -> None:
    """Point `name` at another factory (the demo and tests use this to run roles in-process)."""
    if name not in ROLE_NAMES:
        raise ValueError(f"unknown role {name!r}; roles are {ROLE_NAMES}")
    ROLE_FACTORIES[name] = factory


def build_role(name: str, ctx: NodeContext) -> Role:
    return ROLE_FACTORIES[name](ctx)


@dataclass(frozen=True, slots=True)
class RoleChoice:
    role: str
    stage: int | None
    reason: str


def _live(peers: Sequence[PeerRecord], role: str, now: float) -> list[PeerRecord]:
    return [p for p in peers if p.heartbeat.role == role and not p.heartbeat.leaving and p.expires_at > now]


def choose_role(
    requested: str,
    requested_stage: int | None,
    peer_id: str,
    manifest: RunManifest,
    peers: Sequence[PeerRecord],
    now: float,
    *,
    client_mode: bool = False,
    relayed: bool = False,
    measured: Sequence[Measurement] = (),
    placement: RebalanceConfig | None = None,
) -> RoleChoice:
    """What this node will be (see the module docstring); raise ConfigError for a request the run does not allow.

    `client_mode`: others cannot dial this node, so `auto` never makes it a role that serves RPCs; `relayed`:
    others reach it only through a relay, whose circuits carry 128 KiB each (a relayed stage replica measured
    0.2-0.3 microbatches/s), so `auto` does not either; `--role stage` still may, `--role syncer` may not (the
    lease holder every learner must reach: ConfigError). `measured`: the authorized verifiers' measurements of
    the stage replicas, clamped into placement with `placement`'s slack (`RebalanceConfig.measured_slack`)."""
    place = _Placer(manifest, peers, now, tuple(measured), placement or RebalanceConfig())
    if requested_stage is not None and requested != "stage":
        raise ConfigError("--stage only applies to --role stage")
    authorized = {"syncer": manifest.authorized_syncers, "verifier": manifest.authorized_verifiers}
    if requested in authorized and peer_id not in authorized[requested]:
        raise ConfigError(
            f"this node's key {peer_id} is not an authorized {requested} of run {manifest.name!r}; the owner can "
            f"add it with `python -m bootstrap --authorize-{requested} {peer_id}`"
        )
    if requested == "auto":
        return _auto(peer_id, manifest, peers, now, place, client_mode=client_mode, relayed=relayed)
    if requested == "syncer" and (client_mode or relayed):
        raise ConfigError(
            f"--role syncer: peers cannot dial this node directly ({'relay' if relayed else 'client'} mode), and "
            "every learner pushes its fragments to the syncer (megabytes each; a relay circuit carries 128 KiB): "
            "as the lease holder it would stall the run. Open the TCP port named in the reachability line above "
            "(--listen/--announce) or run the syncer on a machine others can dial"
        )
    if client_mode and requested in SERVING_ROLES:
        logger.warning(
            "--role %s: peers cannot dial this node (client mode), so it will not get their requests",
            requested,
        )
    if requested != "stage":
        return RoleChoice(requested, None, "asked for")
    if requested_stage is None:
        return RoleChoice("stage", *place())
    if requested_stage >= manifest.num_stages:
        raise ConfigError(
            f"--stage {requested_stage}: run {manifest.name!r} has {manifest.num_stages} stages"
        )
    return RoleChoice("stage", requested_stage, "asked for")


SERVING_ROLES = ("stage", "syncer")  # roles whose work arrives as RPCs from other peers


def _auto(
    peer_id: str,
    manifest: RunManifest,
    peers: Sequence[PeerRecord],
    now: float,
    place: Callable[[], tuple[int, str]],
    *,
    client_mode: bool,
    relayed: bool = False,
) -> RoleChoice:
    if peer_id in manifest.authorized_syncers and not _live(peers, "syncer", now):
        choice = RoleChoice("syncer", None, "authorized syncer and no syncer is alive")
    elif manifest.num_stages > 1 and manifest.authorized_verifiers:
        choice = RoleChoice("stage", *place())
    else:
        return RoleChoice("learner", None, "default for volunteers")
    if not (client_mode or relayed):
        return choice
    how = (
        "client mode (peers cannot dial this node)"
        if client_mode
        else "relay mode (peers reach this node only through a relay's 128 KiB circuits)"
    )
    reason = f"{how}: learner instead of {choice.role}, whose work arrives as requests from other peers"
    logger.info("role auto: %s", reason)
    return RoleChoice("learner", None, reason)


def measurements_of(records: Sequence[MeasuredRecord]) -> list[Measurement]:
    """The pure core's view of checked `measured` records (the validator let only authorized verifiers write)."""
    return [
        Measurement(verifier=r.verifier, sent_at=r.measured.sent_at, rates=r.measured.rates) for r in records
    ]


@dataclass(frozen=True, slots=True)
class _Placer:
    """Where a new stage replica goes: the stage with the least effective throughput per layer among live,
    non-leaving stage replicas (announced figures clamped around the verifiers' measurements)."""

    manifest: RunManifest
    peers: Sequence[PeerRecord]
    now: float
    measured: tuple[Measurement, ...]
    config: RebalanceConfig

    def __call__(self) -> tuple[int, str]:
        from node.ml.model import stage_spans  # imports torch: only when a stage is being placed

        announced = [
            ReplicaInfo(peer_id=p.peer_id, stage=p.heartbeat.stage, throughput=p.heartbeat.throughput)
            for p in _live(self.peers, "stage", self.now)
            if p.heartbeat.stage is not None
        ]
        cfg = self.config
        replicas = effective_throughputs(
            announced, self.measured, now=self.now, slack=cfg.measured_slack, max_age_s=cfg.measured_max_age_s
        )
        spans = stage_spans(self.manifest.model["num_layers"], self.manifest.num_stages)
        stage, reason = choose_stage(stage_loads(replicas, spans))
        clamped = sum(a.throughput != r.throughput for a, r in zip(announced, replicas, strict=True))
        return stage, (
            f"{reason}; {len(self.measured)} verifier measurement record(s), {clamped} announced throughput(s) "
            f"clamped to them (slack {cfg.measured_slack:g})"
        )
