"""Fragment planning and the staggered sync schedule of Decoupled DiLoCo.

Owns three pure decisions:

* which parameter tensors make up each fragment (`plan_fragments`): tensors are bin-packed greedily,
  largest first, into the least loaded of P fragments (LPT), so the largest fragment is at most 4/3 of
  the best possible packing. Embedding tensors never share a fragment with the others: they all go into
  one extra fragment (index P), because the merge treats them differently (weighted mean instead of
  RDA) and a fragment is merged as a unit. A stage that holds no embedding simply gets P fragments.
* when each fragment is sent and when its merged version is applied (`FragmentSchedule`): fragment p is
  due every H local steps at its own offset, offsets spread evenly over H, and the merged version is
  applied tau steps after the send (the overlap window).
* whether real time allows a send (`SyncFloor`): a floor on the wall-clock interval between two sends of
  the same fragment, so a fast link or a fast learner cannot shrink the effective H that the outer
  learning rate was tuned for (the digest's yeto note: H~2 over-drives Nesterov 0.7/0.9).

Nothing here touches tensors, sockets or clocks; sizes are element counts and time is passed in.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Fragment:
    """One unit of synchronisation: a set of whole parameter tensors."""

    index: int  # position in FragmentPlan.fragments; also the schedule's fragment id
    names: tuple[str, ...]  # parameter names, sorted
    num_params: int  # elements over all tensors
    is_embedding: bool  # True for the embedding fragment (merged by weighted mean, not RDA)


@dataclass(frozen=True, kw_only=True, slots=True)
class FragmentPlan:
    """How a model's parameters are cut into fragments; build it with `plan_fragments`."""

    fragments: tuple[Fragment, ...]
    _owner: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        owner: dict[str, int] = {}
        for position, fragment in enumerate(self.fragments):
            if fragment.index != position:
                raise ValueError(f"fragment at position {position} has index {fragment.index}")
            for name in fragment.names:
                if name in owner:
                    raise ValueError(f"parameter {name!r} is in fragments {owner[name]} and {position}")
                owner[name] = position
        object.__setattr__(self, "_owner", owner)

    @property
    def num_fragments(self) -> int:
        """All fragments, the embedding fragment included; this is what a FragmentSchedule needs."""
        return len(self.fragments)

    @property
    def total_params(self) -> int:
        return sum(f.num_params for f in self.fragments)

    def fragment_of(self, name: str) -> int:
        """Index of the fragment that holds parameter `name` (KeyError if none does)."""
        return self._owner[name]

    def names(self) -> Iterator[str]:
        """Every parameter name in the plan, fragment by fragment."""
        for fragment in self.fragments:
            yield from fragment.names

    def imbalance(self) -> float:
        """Largest non-embedding fragment over the ideal (non-embedding total / their count); 1.0 is perfect."""
        packed = [f.num_params for f in self.fragments if not f.is_embedding]
        if not packed:
            return 1.0
        return max(packed) / (sum(packed) / len(packed))


def plan_fragments(
    named_sizes: Mapping[str, int], num_fragments: int, embedding_names: Collection[str]
) -> FragmentPlan:
    """Bin-pack parameter tensors into `num_fragments` balanced fragments plus one embedding fragment.

    `named_sizes` maps parameter name to element count. Names in `embedding_names` that the mapping does
    not hold are ignored (a pipeline stage without the embedding passes the model-wide set). The result
    depends only on the contents of the arguments, not on their iteration order: tensors are placed in
    order of decreasing size, ties broken by name, each into the least loaded fragment, ties broken by
    the lowest index. Raises ValueError if there are fewer non-embedding tensors than fragments (a
    fragment would be empty) or a size is not a positive int.
    """
    if not isinstance(num_fragments, int) or isinstance(num_fragments, bool) or num_fragments < 1:
        raise ValueError(f"num_fragments must be a positive int, got {num_fragments!r}")
    for name, size in named_sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"size of {name!r} must be a positive int, got {size!r}")
    embedding = sorted(name for name in named_sizes if name in embedding_names)
    others = [name for name in named_sizes if name not in embedding_names]
    if len(others) < num_fragments:
        raise ValueError(
            f"{len(others)} non-embedding tensors cannot fill {num_fragments} fragments; lower num_fragments"
        )
    bins = _lpt(others, named_sizes, num_fragments)
    fragments = [
        Fragment(
            index=i,
            names=tuple(sorted(bin_names)),
            num_params=sum(named_sizes[n] for n in bin_names),
            is_embedding=False,
        )
        for i, bin_names in enumerate(bins)
    ]
    if embedding:
        fragments.append(
            Fragment(
                index=num_fragments,
                names=tuple(embedding),
                num_params=sum(named_sizes[n] for n in embedding),
                is_embedding=True,
            )
        )
    plan = FragmentPlan(fragments=tuple(fragments))
    logger.debug(
        "planned %d fragments over %d params, imbalance %.3f",
        plan.num_fragments,
        plan.total_params,
        plan.imbalance(),
    )
    return plan


def _lpt(names: list[str], sizes: Mapping[str, int], num_bins: int) -> list[list[str]]:
    """Longest-processing-time greedy: each tensor, largest first, into the currently lightest bin."""
    loads = [0] * num_bins
    bins: list[list[str]] = [[] for _ in range(num_bins)]
    for name in sorted(names, key=lambda n: (-sizes[n], n)):
        lightest = min(range(num_bins), key=lambda i: (loads[i], i))
        bins[lightest].append(name)
        loads[lightest] += sizes[name]
    return bins


def covered_fragments(plan: FragmentPlan, names: Collection[str]) -> list[int]:
    """Global ids of the fragments whose tensors are all in `names` (parameter names, or a mapping keyed by
    them); ValueError if one is only partly in."""
    held = set(names)
    out = []
    for fragment in plan.fragments:
        inside = [n for n in fragment.names if n in held]
        if len(inside) == len(fragment.names):
            out.append(fragment.index)
        elif inside:
            raise ValueError(
                f"fragment {fragment.index} is only partly held ({len(inside)}/{len(fragment.names)} tensors)"
            )
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class FragmentSchedule:
    """When each fragment is sent and applied, in local inner steps (steps completed since start).

    Fragment p is due at steps s >= 1 with (s - offset_p) % H == 0, where offset_p = ((p + 1) * H) // P
    (the torchft Streaming DiLoCo offsets), so with P == H exactly one fragment is due per step and every
    fragment is first sent within the first H steps. Step 0 (no training yet) never sends. The merged
    version of a fragment sent at step s is applied at step s + tau.
    """

    num_fragments: int  # P, including an embedding fragment if the plan has one
    sync_every_steps: int  # H: local steps between two sends of the same fragment
    overlap_steps: int  # tau: steps the learner keeps computing before it applies the merge

    def __post_init__(self) -> None:
        for name in ("num_fragments", "sync_every_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"FragmentSchedule.{name} must be a positive int, got {value!r}")
        tau = self.overlap_steps
        if not isinstance(tau, int) or isinstance(tau, bool) or not 0 <= tau < self.sync_every_steps:
            raise ValueError(
                f"FragmentSchedule.overlap_steps must be an int in [0, sync_every_steps), got {tau!r}"
            )

    def offset(self, fragment: int) -> int:
        """Residue class mod H of the steps at which `fragment` is sent."""
        self._check_fragment(fragment)
        return ((fragment + 1) * self.sync_every_steps // self.num_fragments) % self.sync_every_steps

    def due_to_send(self, step: int) -> list[int]:
        """Fragments whose send falls on local step `step`, in increasing order."""
        if step < 1:
            return []
        residue = step % self.sync_every_steps
        return [p for p in range(self.num_fragments) if self.offset(p) == residue]

    def apply_at(self, sent_step: int) -> int:
        """Local step at which the merged version of a fragment sent at `sent_step` is applied."""
        return sent_step + self.overlap_steps

    def next_send(self, fragment: int, after_step: int) -> int:
        """First step strictly after `after_step` at which `fragment` is due."""
        h = self.sync_every_steps
        start = max(after_step + 1, 1)
        return start + (self.offset(fragment) - start) % h

    def _check_fragment(self, fragment: int) -> None:
        if not 0 <= fragment < self.num_fragments:
            raise ValueError(f"fragment {fragment} out of range [0, {self.num_fragments})")


def min_sync_interval_s(sync_every_steps: int, nominal_step_s: float) -> float:
    """Real-time floor between two sends of one fragment: H steps at the step time H was tuned for."""
    if sync_every_steps < 1 or not nominal_step_s > 0:
        raise ValueError("sync_every_steps must be >= 1 and nominal_step_s > 0")
    return sync_every_steps * nominal_step_s


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncFloorConfig:
    min_interval_s: float  # least wall-clock seconds between two sends of the same fragment; 0 = no floor

    def __post_init__(self) -> None:
        if not math.isfinite(self.min_interval_s) or self.min_interval_s < 0:
            raise ValueError(f"min_interval_s must be finite and >= 0, got {self.min_interval_s!r}")


class SyncFloor:
    """Remembers when each fragment was last sent and says whether it may be sent again at `now`.

    A learner whose schedule says a fragment is due but whose floor says not yet simply skips this send
    (keeps training; the fragment's counters keep growing) and sends at the next due step that the floor
    allows. The clock is passed in; times are seconds on any monotonic clock.
    """

    def __init__(self, config: SyncFloorConfig) -> None:
        self._config = config
        self._last_sent_at: dict[int, float] = {}

    @property
    def config(self) -> SyncFloorConfig:
        return self._config

    def may_send(self, fragment: int, now: float) -> bool:
        return self.wait_s(fragment, now) <= 0.0

    def wait_s(self, fragment: int, now: float) -> float:
        """Seconds until `fragment` may be sent again (<= 0 means now)."""
        last = self._last_sent_at.get(fragment)
        if last is None:
            return 0.0
        return last + self._config.min_interval_s - now

    def mark_sent(self, fragment: int, now: float) -> None:
        self._last_sent_at[fragment] = now

    def last_sent_at(self, fragment: int) -> float | None:
        return self._last_sent_at.get(fragment)
