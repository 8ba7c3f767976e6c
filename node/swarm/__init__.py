"""Swarm membership: reaching the swarm, finding and trusting the run, heartbeats, and stage balance.

One module per concern; this package re-exports what the rest of the node, the bootstrap and the tests use:

- `targets`: `--join` targets (multiaddrs, bootstrap URLs) to a `JoinPlan` (not `join.py`: `join` is the function)
- `dht`: the DHT process (`start_dht`, `DetachedDHT`) and its per-peer store quotas (`QuotaDHTProtocol`)
- `reachability`: can others dial us (`REACH_ROUTE`, `check_reachability`, `start_reachable_dht`)
- `redial`: re-dialing the bootstraps after losing every peer (`Redialer`)
- `discovery`: finding, verifying and pinning the run (`join`, `discover_run`, `Joined`)
- `membership`: this node's heartbeat (`Membership`, `build_heartbeat`) and stage balance

Patch a name where it is used (`node.swarm.discovery._refuse_tampered_manifests`), not here: the modules look up
their own globals.
"""

from __future__ import annotations

from node.swarm.dht import (
    PARENT_WATCH_PERIOD_S,
    DetachedDHT,
    QuotaDHTProtocol,
    dht_quota_stats,
    dht_store_quota,
    start_dht,
)
from node.swarm.discovery import Joined, discover_run, join, pick_run
from node.swarm.membership import (
    HEARTBEAT_JITTER,
    HEARTBEAT_TTL_PERIODS,
    Membership,
    build_heartbeat,
)
from node.swarm.reachability import (
    MAX_REACH_MADDRS,
    MAX_REACH_REQUEST_BYTES,
    REACH_GLOBAL_RATE,
    REACH_PROBE_TIMEOUT_S,
    REACH_RATE,
    REACH_ROUTE,
    Reachability,
    _tcp_port,
    _unpack_small,
    check_reachability,
    dial_targets,
    needs_reach_check,
    parse_reach_reply,
    probe_dial,
    reach_check_route,
    reach_limits,
    start_reachable_dht,
)
from node.swarm.redial import Redialer
from node.swarm.targets import JoinPlan, check_multiaddr, fetch_json, is_url, resolve_join, swarm_url

__all__ = [
    "HEARTBEAT_JITTER",
    "HEARTBEAT_TTL_PERIODS",
    "MAX_REACH_MADDRS",
    "MAX_REACH_REQUEST_BYTES",
    "PARENT_WATCH_PERIOD_S",
    "REACH_GLOBAL_RATE",
    "REACH_PROBE_TIMEOUT_S",
    "REACH_RATE",
    "REACH_ROUTE",
    "DetachedDHT",
    "JoinPlan",
    "Joined",
    "Membership",
    "QuotaDHTProtocol",
    "Reachability",
    "Redialer",
    "_tcp_port",
    "_unpack_small",
    "build_heartbeat",
    "check_multiaddr",
    "check_reachability",
    "dht_quota_stats",
    "dht_store_quota",
    "dial_targets",
    "discover_run",
    "fetch_json",
    "is_url",
    "join",
    "needs_reach_check",
    "parse_reach_reply",
    "pick_run",
    "probe_dial",
    "reach_check_route",
    "reach_limits",
    "resolve_join",
    "start_dht",
    "start_reachable_dht",
    "swarm_url",
]
