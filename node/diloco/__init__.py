"""Pure Decoupled DiLoCo cores: fragments and schedule, counters and weights, merge, outer step, quorum.

No sockets, no asyncio, no global clock: the networked learner and syncer roles wrap these.
"""

from node.diloco.counters import CounterBank, Counters, cap_counters, token_weight
from node.diloco.fragments import (
    Fragment,
    FragmentPlan,
    FragmentSchedule,
    SyncFloor,
    SyncFloorConfig,
    min_sync_interval_s,
    plan_fragments,
)
from node.diloco.merge import Contribution, MergeResult, NothingToMerge, merge_fragment
from node.diloco.outer import OuterNesterov
from node.diloco.quorum import Decision, QuorumConfig, QuorumPolicy

__all__ = [
    "Contribution",
    "CounterBank",
    "Counters",
    "Decision",
    "Fragment",
    "FragmentPlan",
    "FragmentSchedule",
    "MergeResult",
    "NothingToMerge",
    "OuterNesterov",
    "QuorumConfig",
    "QuorumPolicy",
    "SyncFloor",
    "SyncFloorConfig",
    "cap_counters",
    "merge_fragment",
    "min_sync_interval_s",
    "plan_fragments",
    "token_weight",
]
