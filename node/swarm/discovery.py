"""Finding and trusting the run: `join` reaches the swarm, finds the run's signed manifest (`discover_run`), refuses
a tampered one by name, pins its owner per run id (`OwnerPins`), and hands back a `Joined` with the DHT and a
`SwarmRecords` client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import hivemind
from hivemind.utils import get_dht_time

from node.config import NodeConfig
from node.swarm.reachability import Reachability, start_reachable_dht
from node.swarm.relay import Connectivity, Mode
from node.swarm.targets import JoinPlan, resolve_join
from protocol.dht_io import SwarmRecords, fetch_discovery, fetch_manifest, manifest_rejections
from protocol.errors import JoinError, ManifestRejected
from protocol.identity import NodeIdentity
from protocol.manifest import OwnerPins, RunManifest, SignedManifest, run_bootstraps
from protocol.records import HivenodeRecordValidator, RunRules

logger = logging.getLogger(__name__)

_DISCOVERY_RETRY_S = (0.2, 2.0)  # first and longest pause between manifest lookups while joining


@dataclass(frozen=True, slots=True)
class Joined:
    dht: hivemind.DHT
    signed: SignedManifest
    manifest: RunManifest
    records: SwarmRecords
    maddrs: tuple[str, ...]
    now: float  # DHT time when the join completed
    entry_points: tuple[
        str, ...
    ] = ()  # the bootstrap multiaddrs we joined through (re-dialed if peers are lost)
    reachability: Reachability | None = None  # None: not checked (see `needs_reach_check`)
    connectivity: Connectivity | None = None  # direct / relay / client, and why

    @property
    def relayed(self) -> bool:
        """True when others reach us only through a relay's circuit (libp2p's limits: 128 KiB, 2 min each)."""
        return self.connectivity is not None and self.connectivity.mode is Mode.RELAY

    @property
    def client_mode(self) -> bool:
        """True when nobody can reach us, not even through a relay: our roles should serve nothing."""
        if self.connectivity is not None:
            return self.connectivity.mode is Mode.CLIENT
        return self.reachability is not None and self.reachability.reachable is False


def pick_run(
    candidates: Sequence[SignedManifest],
    *,
    run_id: str | None,
    pins: OwnerPins,
    entry_ids: frozenset[str] = frozenset(),
) -> SignedManifest | None:
    """Choose among verified manifests: the requested run id; else, when some were signed by (or name as a
    bootstrap) a peer we dialled (`entry_ids`, the /p2p/ ids of --join), only those: anyone can publish a
    discovery record of a run of their own, and it must not stand in for the run of the bootstrap the user
    named. Among what is left: the only one, else the only one whose run id is pinned to the owner signing it."""
    if run_id is not None:
        return next((c for c in candidates if c.run_id == run_id), None)
    vouched = [c for c in candidates if entry_ids & run_bootstraps(c, c.verify())]
    if vouched and len(vouched) < len(candidates):
        logger.info(
            "the DHT holds %d run(s) that no entry point vouches for (ignored)",
            len(candidates) - len(vouched),
        )
    unique = list({c.run_id: c for c in vouched or candidates}.values())
    if len(unique) <= 1:
        return unique[0] if unique else None
    pinned = [c for c in unique if pins.pinned(c.run_id) == c.owner]
    if len(pinned) == 1:
        return pinned[0]
    listing = ", ".join(f"{c.verify().name!r} ({c.run_id})" for c in unique)
    raise JoinError(f"this DHT hosts several runs: {listing}; set run_id in node.toml to pick one")


async def discover_run(
    dht: hivemind.DHT, plan: JoinPlan, config: NodeConfig, pins: OwnerPins
) -> SignedManifest:
    """Find the run's signed manifest, retrying until `join_timeout_s` (a bootstrap may publish a moment late)."""
    if plan.hinted is not None and (config.run_id is None or plan.hinted.run_id == config.run_id):
        return plan.hinted
    deadline = time.monotonic() + config.network.join_timeout_s
    pause_s = _DISCOVERY_RETRY_S[0]
    timeout_s = config.network.request_timeout_s
    while True:
        try:
            candidates = await fetch_discovery(dht, timeout_s=timeout_s, now=get_dht_time())
            if config.run_id is not None:
                direct = await fetch_manifest(dht, config.run_id, timeout_s=timeout_s, now=get_dht_time())
                candidates += [direct] if direct is not None else []
        except asyncio.TimeoutError:
            candidates = []  # a slow DHT answer is "not found yet": retry until the deadline
        chosen = pick_run(candidates, run_id=config.run_id, pins=pins, entry_ids=plan.entry_ids)
        if chosen is not None:
            return chosen
        await _refuse_tampered_manifests(dht, timeout_s)
        if time.monotonic() + pause_s > deadline:
            wanted = f"manifest of run {config.run_id}" if config.run_id else "run manifest"
            raise JoinError(
                f"reached the DHT but found no {wanted} within {config.network.join_timeout_s:g} s; "
                "is the entry point a hivenode bootstrap, or connected to one?"
            )
        await asyncio.sleep(pause_s)
        pause_s = min(2 * pause_s, _DISCOVERY_RETRY_S[1])


async def _refuse_tampered_manifests(dht: hivemind.DHT, timeout_s: float) -> None:
    """No valid manifest found, but our DHT's validator refused manifest records: say so now (ManifestRejected),
    rather than "found no run manifest" after the join timeout. A valid one, when there is, is always taken first."""
    try:
        rejected = await manifest_rejections(dht, timeout_s=timeout_s)
    except asyncio.TimeoutError:
        return
    if rejected:
        raise ManifestRejected(
            f"the DHT holds no valid run manifest but refused {len(set(rejected))} manifest record(s), latest: "
            f"{rejected[-1]}; refusing to join"
        )


async def join(
    config: NodeConfig, identity: NodeIdentity, on_phase: Callable[[str, str], None] | None = None
) -> Joined:
    """Reach the swarm, find and verify the run, pin its owner. Raises ConfigError/JoinError/ManifestRejected/
    OwnerPinMismatch with one-line messages; on failure nothing is left running. `on_phase("manifest", mode)`
    once the swarm is reached (the join's progress, node.status.progress)."""
    pins = OwnerPins(config.state_dir / OwnerPins.FILENAME)
    plan = await resolve_join(config.join, config.network.request_timeout_s, pins)
    dht, reachability, connectivity = await start_reachable_dht(identity, plan.maddrs, config.network)
    if on_phase is not None:
        on_phase("manifest", f"reached the swarm ({connectivity.mode.value})")
    try:
        signed = await discover_run(dht, plan, config, pins)
        manifest = signed.verify()
        pins.check_and_pin(signed.run_id, signed.owner, run_name=manifest.name)  # logs a new pin itself
        rules = RunRules.from_manifest(signed, manifest)
        dht.add_validators([HivenodeRecordValidator([rules])])
        records = SwarmRecords(dht, rules, identity, timeout_s=config.network.request_timeout_s)
        maddrs = tuple(str(m) for m in dht.get_visible_maddrs())
        if connectivity.mode is Mode.RELAY:  # our own addresses reach nobody: peers dial the relay circuits
            maddrs = connectivity.addresses
    except BaseException:
        dht.shutdown()
        raise
    logger.info(
        "joined run %r (%s) through %d entry point(s)", manifest.name, signed.run_id, len(plan.maddrs)
    )
    logger.info("connectivity: %s (%s)", connectivity.mode.value, connectivity.reason)
    return Joined(
        dht, signed, manifest, records, maddrs, get_dht_time(), plan.maddrs, reachability, connectivity
    )
