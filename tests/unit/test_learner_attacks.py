"""The poisoning learner's transforms (node.diloco.attack_transport; tests and benchmarks only) do what the
poisoning benchmark says they do, and only the loudly named environment variable turns one on."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import pytest
import torch

from node.diloco.attack_transport import (
    UNSAFE_LEARNER_ATTACK_ENV,
    AttackingTransport,
    learner_attack_from_env,
    parse_learner_attack,
    poisoned,
)
from node.diloco.sync_types import FragmentVersion, OutgoingContribution, PushReceipt

BASE = {"w": torch.ones(4)}
HONEST = {"w": torch.tensor([0.9, 0.8, 1.0, 1.1])}  # delta (base - params) = [0.1, 0.2, 0, -0.1]


def norm(t: dict[str, torch.Tensor]) -> float:
    return float(t["w"].norm())


def delta(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"w": BASE["w"] - params["w"]}


def test_the_transforms() -> None:
    gen = torch.Generator().manual_seed(0)
    assert torch.allclose(
        delta(poisoned("scale", 1e3, HONEST, BASE, gen))["w"], 1e3 * delta(HONEST)["w"], rtol=1e-4
    )
    assert torch.allclose(delta(poisoned("signflip", 1, HONEST, BASE, gen))["w"], -delta(HONEST)["w"])
    assert math.isclose(
        norm(delta(poisoned("noise", 1, HONEST, BASE, gen))), norm(delta(HONEST)), rel_tol=1e-5
    )
    assert bool(poisoned("value", math.nan, HONEST, BASE, gen)["w"].isnan().all())
    assert parse_learner_attack("scale:1e30") == ("scale", 1e30)
    with pytest.raises(ValueError):
        parse_learner_attack("bogus")


class Inner:
    def __init__(self) -> None:
        self.pushed: list[OutgoingContribution] = []

    async def push(self, contribution: OutgoingContribution) -> PushReceipt:
        self.pushed.append(contribution)
        return PushReceipt(target_version=1, term=1)

    async def fetch(self, fragment: int) -> FragmentVersion:
        return FragmentVersion(fragment=fragment, version=3, params=dict(BASE))

    async def versions(self, known: Any, wait_s: float) -> Any:
        raise NotImplementedError

    async def offer(self, held: Any) -> int:
        return 0


def contribution(base_version: int = 3) -> OutgoingContribution:
    return OutgoingContribution(
        fragment=0,
        params=dict(HONEST),
        base_version=base_version,
        steps=4,
        tokens=100,
        sent_step=4,
        sched_step=4,
        step_time_s=0.1,
    )


def test_the_wrapper_poisons_pushes_on_the_current_base_and_inflates_or_replays() -> None:
    inner = Inner()
    asyncio.run(AttackingTransport(inner, "signflip", 1.0).push(contribution()))
    assert torch.allclose(inner.pushed[-1].params["w"], BASE["w"] + delta(HONEST)["w"])
    asyncio.run(AttackingTransport(inner, "inflate", 10.0).push(contribution()))
    assert (inner.pushed[-1].steps, inner.pushed[-1].tokens) == (40, 1000)
    replayer = AttackingTransport(inner, "replay", 1.0)
    asyncio.run(replayer.push(contribution(base_version=1)))
    assert inner.pushed[-1].base_version == 3 and torch.equal(inner.pushed[-1].params["w"], HONEST["w"])


def test_only_the_unsafe_variable_turns_an_attack_on() -> None:
    inner = Inner()
    assert learner_attack_from_env(inner, {}) is inner  # type: ignore[arg-type]
    wrapped = learner_attack_from_env(inner, {UNSAFE_LEARNER_ATTACK_ENV: "scale:1e3"})  # type: ignore[arg-type]
    assert isinstance(wrapped, AttackingTransport) and wrapped.strength == 1e3


class Publishing(Inner):
    """An inner transport whose fragment 0 moves by `step` per version fetched (versions 1, 2, ...)."""

    def __init__(self, step: torch.Tensor) -> None:
        super().__init__()
        self.step, self.version = step, 0

    async def fetch(self, fragment: int) -> FragmentVersion:
        self.version += 1
        return FragmentVersion(
            fragment=fragment, version=self.version, params={"w": -self.version * self.step}
        )


def test_aligned_noise_adds_the_public_direction_it_computed_from_the_versions_it_fetched() -> None:
    """`aligned` (cosine gaming): plain noise until two versions were fetched, then noise at the honest norm plus
    0.2 x that norm along the updates between them (old - new: the merged descent, as a delta)."""
    step = torch.tensor(
        [0.0, 0.0, 0.0, 1.0]
    )  # every merge moves w by -step: the public descent direction is +step
    inner = Publishing(step)
    attacker = AttackingTransport(inner, "aligned", 0.2, seed=1)
    assert parse_learner_attack("aligned") == ("aligned", 0.2)
    version = asyncio.run(attacker.fetch(0))
    assert attacker.public.get(0) is None  # one version: no update seen yet
    honest = {"w": version.params["w"] - delta(HONEST)["w"]}
    c = dataclasses.replace(contribution(base_version=1), params=honest, base=version.params)
    asyncio.run(attacker.push(c))
    first = version.params["w"] - inner.pushed[-1].params["w"]
    assert math.isclose(float(first.norm()), norm(delta(HONEST)), rel_tol=1e-5)  # plain noise
    asyncio.run(attacker.fetch(0))
    version = asyncio.run(attacker.fetch(0))  # two updates, both along +step
    direction = attacker.public.get(0)
    assert direction is not None and torch.allclose(direction["w"] / direction["w"].norm(), step)
    sent = []
    for _ in range(200):  # the public part is 0.2 x the honest norm along +step; the noise averages out
        honest = {"w": version.params["w"] - delta(HONEST)["w"]}
        c = dataclasses.replace(c, params=honest, base=version.params, base_version=version.version)
        asyncio.run(attacker.push(c))
        sent.append(version.params["w"] - inner.pushed[-1].params["w"])
    mean = torch.stack(sent).mean(0)
    assert float(mean[3]) == pytest.approx(0.2 * norm(delta(HONEST)), rel=0.15)
    assert float(mean[:3].abs().max()) < 0.05
