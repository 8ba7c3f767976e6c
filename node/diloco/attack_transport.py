"""A poisoning learner, for tests and benchmarks only (issue 18): a `SyncTransport` wrapper that rewrites each
contribution before it is pushed. A learner applies one solely through the loudly named environment variable
`HIVENODE_UNSAFE_LEARNER_ATTACK=KIND[:STRENGTH]` (`learner_attack_from_env`); the stage replicas' attacks are
verification.attacks.

Kinds (`delta` is the learner's honest progress, base - params, on the base version it names):

* `scale:F` sends base - F x delta (x1e3, x1e30);
* `value:V` sends every tensor filled with V (1e38, nan, inf);
* `signflip` sends base + delta (an ascent step at the honest norm);
* `noise` sends base - (gaussian noise at the honest delta's norm);
* `replay` sends its first contribution of each fragment again and again, on whatever base is current (stale);
* `inflate:F` sends honest parameters but claims F x the steps and tokens;
* `no_admission` sends honest contributions without the admission proof (a Sybil that did not pay).

The base is the syncer's own copy of the version (one fetch per push when the learner's base is not the current
one: then the contribution goes honest). Only the syncer's checks stand between these and the model.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from node.diloco.sync_types import (
    FragmentVersion,
    OutgoingContribution,
    PushReceipt,
    SyncTransport,
    VersionsView,
)

logger = logging.getLogger(__name__)

UNSAFE_LEARNER_ATTACK_ENV = "HIVENODE_UNSAFE_LEARNER_ATTACK"
KINDS = ("scale", "value", "signflip", "noise", "replay", "inflate", "no_admission")


def parse_learner_attack(spec: str) -> tuple[str, float]:
    kind, _, strength = spec.partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown learner attack {kind!r}; known: {KINDS}")
    return kind, float(strength) if strength else 1.0


def poisoned(
    kind: str,
    strength: float,
    params: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    gen: torch.Generator,
) -> dict[str, torch.Tensor]:
    """The tensors `kind` sends instead of `params` (built on `base`); `replay` and `inflate` leave them."""
    delta = {n: base[n].float() - t.float() for n, t in params.items()}
    if kind == "scale":
        return {n: base[n].float() - strength * d for n, d in delta.items()}
    if kind == "value":
        return {n: torch.full_like(t, strength, dtype=torch.float32) for n, t in params.items()}
    if kind == "signflip":
        return {n: base[n].float() + d for n, d in delta.items()}
    if kind == "noise":
        norm = math.sqrt(sum(float(d.double().pow(2).sum()) for d in delta.values()))
        noise = {n: torch.randn(d.shape, generator=gen) for n, d in delta.items()}
        scale = norm / max(math.sqrt(sum(float(x.double().pow(2).sum()) for x in noise.values())), 1e-12)
        return {n: base[n].float() - scale * x for n, x in noise.items()}
    return {n: t.detach().clone() for n, t in params.items()}


class AttackingTransport:
    """`SyncTransport` that poisons every push (see the module docstring); the other calls pass through."""

    def __init__(self, inner: SyncTransport, kind: str, strength: float, seed: int = 0) -> None:
        self.inner, self.kind, self.strength = inner, kind, strength
        self.gen = torch.Generator().manual_seed(seed)
        self._first: dict[int, dict[str, torch.Tensor]] = {}  # replay: the first contribution per fragment
        self.poisoned = 0
        if kind == "no_admission" and hasattr(inner, "admission"):
            inner.admission = None  # the framed transport sends no proof

    async def push(self, contribution: OutgoingContribution) -> PushReceipt:
        c = contribution
        if self.kind == "no_admission":
            self.poisoned += 1
            return await self.inner.push(c)
        if self.kind == "inflate":
            factor = max(1, int(self.strength))
            c = dataclasses.replace(c, steps=c.steps * factor, tokens=c.tokens * factor)
        elif self.kind == "replay":
            first = self._first.setdefault(c.fragment, {n: t.clone() for n, t in c.params.items()})
            current = await self.inner.fetch(c.fragment)
            c = dataclasses.replace(c, params=first, base_version=current.version)
        elif c.base is None:
            current = await self.inner.fetch(c.fragment)
            if current.version == c.base_version:
                c = dataclasses.replace(
                    c, params=poisoned(self.kind, self.strength, c.params, current.params, self.gen)
                )
        else:
            c = dataclasses.replace(c, params=poisoned(self.kind, self.strength, c.params, c.base, self.gen))
        self.poisoned += c is not contribution
        return await self.inner.push(c)

    async def versions(self, known: Sequence[int], wait_s: float) -> VersionsView:
        return await self.inner.versions(known, wait_s)

    async def fetch(self, fragment: int) -> FragmentVersion:
        return await self.inner.fetch(fragment)

    async def offer(self, held: Sequence[FragmentVersion]) -> int:
        return await self.inner.offer(held)

    def __getattr__(self, name: str) -> Any:  # current_syncer, forget_syncer, ... of the framed transport
        return getattr(self.inner, name)


def learner_attack_from_env(inner: SyncTransport, environ: Mapping[str, str] | None = None) -> SyncTransport:
    """`inner`, wrapped in an AttackingTransport only when `HIVENODE_UNSAFE_LEARNER_ATTACK` names an attack."""
    spec = (os.environ if environ is None else environ).get(UNSAFE_LEARNER_ATTACK_ENV, "").strip()
    if not spec:
        return inner
    kind, strength = parse_learner_attack(spec)
    banner = "!" * 78
    logger.warning(
        "%s\nUNSAFE: this learner POISONS the run (%s=%s). Tests and benchmarks only.\n%s",
        banner,
        UNSAFE_LEARNER_ATTACK_ENV,
        spec,
        banner,
    )
    return AttackingTransport(inner, kind, strength)
