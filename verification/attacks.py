"""Attack behaviours of a malicious stage replica, as pure tensor transforms.

For tests and benchmarks only: a node may apply one of these solely through an explicit, loudly named
option (the environment variable `HIVENODE_UNSAFE_ATTACK=KIND[:key=value,...]`, read by `attack_from_env`).
Each attack rewrites the tensor a stage sends across a boundary, forward (activations), backward (activation
gradients) or both, from the attacker's own step `start_after` on.

Strengths are relative to the tensor being replaced (its RMS, or its within-batch spread) so that one
setting means the same thing for activations and for gradients, whose scales differ by orders of magnitude.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Literal

import torch

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    pass


AttackDirection = Literal["forward", "backward", "both"]

_EPS = 1e-12


@dataclass(frozen=True, kw_only=True, slots=True)
class AttackConfig:
    """One attack; `strength` None means the kind's default (see DEFAULT_STRENGTH)."""

    kind: str
    direction: AttackDirection = "both"
    strength: float | None = None
    start_after: int = 0  # attacker's own steps sent honestly before the attack starts
    seed: int = 0
    delay_steps: int = 100  # delay: how many of its own steps back the replayed tensor is
    period_steps: int = 10  # onoff: length of one on/off cycle
    duty: float = 0.3  # onoff: share of each cycle that is attacked (at the start of the cycle)
    inner: str = "random"  # onoff: the attack used while "on"
    mimic_beta: float = 0.9  # mimic: EMA momentum of the free-rider's estimate of the expected tensor

    def __post_init__(self) -> None:
        if self.kind not in ATTACKS:
            raise ValueError(f"unknown attack kind {self.kind!r}; known: {sorted(ATTACKS)}")
        if self.direction not in ("forward", "backward", "both"):
            raise ValueError(f"direction must be forward, backward or both, got {self.direction!r}")
        if self.start_after < 0 or self.delay_steps < 1 or self.period_steps < 1:
            raise ValueError("need start_after >= 0, delay_steps >= 1 and period_steps >= 1")
        if not 0.0 < self.duty <= 1.0:
            raise ValueError(f"duty must be in (0, 1], got {self.duty}")
        if self.inner not in ATTACKS or self.inner in ("onoff", "delay", "mimic"):
            raise ValueError(f"onoff inner attack must be a stateless kind, got {self.inner!r}")
        if not 0.0 <= self.mimic_beta < 1.0:
            raise ValueError(f"mimic_beta must be in [0, 1), got {self.mimic_beta}")

    @property
    def effective_strength(self) -> float:
        return DEFAULT_STRENGTH[self.kind] if self.strength is None else self.strength


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean().sqrt()


def _spread(x: torch.Tensor) -> torch.Tensor:
    """RMS of the deviation from the batch mean: the scale of honest sample-to-sample variation."""
    if x.dim() < 2 or x.shape[0] < 2:
        return _rms(x)
    return (x - x.mean(dim=0, keepdim=True)).pow(2).mean().sqrt()


@dataclass(slots=True)
class _DirectionState:
    history: deque[tuple[int, torch.Tensor]] = field(default_factory=deque)
    mean_ema: torch.Tensor | None = None  # mimic: EMA of the batch mean
    spread_ema: float = 0.0  # mimic: EMA of the within-batch spread


Transform = Callable[["Attack", torch.Tensor, str, int, float], torch.Tensor]


def _constant(attack: Attack, x: torch.Tensor, direction: str, step: int, s: float) -> torch.Tensor:
    return torch.full_like(x, float(s * _rms(x)))


def _zeros(attack: Attack, x: torch.Tensor, direction: str, step: int, s: float) -> torch.Tensor:
    return torch.zeros_like(x)


def _random(attack: Attack, x: torch.Tensor, direction: str, step: int, s: float) -> torch.Tensor:
    return attack.noise_like(x) * (s * _rms(x))


def _scaling(attack: Attack, x: torch.Tensor, direction: str, step: int, s: float) -> torch.Tensor:
    return x * s


def _sign_flip(attack: Attack, x: torch.Tensor, direction: str, step: int, s: float) -> torch.Tensor:
    return x * attack.flip_mask(x.shape[-1], s).to(x.dtype)


def _bias(attack: Attack, x: torch.Tensor, direction: str, step: int, s: float) -> torch.Tensor:
    return x + s * _rms(x)


def _noise(attack: Attack, x: torch.Tensor, direction: str, step: int, s: float) -> torch.Tensor:
    return x + attack.noise_like(x) * (s * _spread(x))


def _drift(attack: Attack, x: torch.Tensor, direction: str, step: int, s: float) -> torch.Tensor:
    attacked_steps = step - attack.config.start_after
    return x * (1.0 + s * attacked_steps)


def _delay(attack: Attack, x: torch.Tensor, direction: str, step: int, s: float) -> torch.Tensor:
    target = step - attack.config.delay_steps
    for old_step, old in attack.state(direction).history:
        if old_step == target and old.shape == x.shape:
            return old.clone()
    return x  # not enough history yet (or the shape changed): nothing older to replay


def _mimic(attack: Attack, x: torch.Tensor, direction: str, step: int, s: float) -> torch.Tensor:
    st = attack.state(direction)
    if st.mean_ema is None or st.mean_ema.numel() * x.shape[0] != x.numel():
        return x  # never saw honest work of this shape: nothing to imitate
    expected = st.mean_ema.unsqueeze(0).expand(x.shape[0], *st.mean_ema.shape).reshape(x.shape)
    return (expected + attack.noise_like(x).float() * (s * st.spread_ema)).to(x.dtype)


def _onoff(attack: Attack, x: torch.Tensor, direction: str, step: int, s: float) -> torch.Tensor:
    cfg = attack.config
    phase = (step - cfg.start_after) % cfg.period_steps
    if phase >= max(1, round(cfg.duty * cfg.period_steps)):
        return x
    return ATTACKS[cfg.inner](attack, x, direction, step, s)


ATTACKS: dict[str, Transform] = {
    "constant": _constant,  # every element = strength * RMS of the honest tensor
    "zeros": _zeros,
    "random": _random,  # Gaussian with std = strength * RMS, in place of the honest tensor
    "scaling": _scaling,  # x * strength (strength -1 is the classic sign attack)
    "sign_flip": _sign_flip,  # flip the sign of a fixed random share `strength` of the features
    "bias": _bias,  # x + strength * RMS
    "delay": _delay,  # replay the attacker's own tensor from delay_steps steps ago
    "noise": _noise,  # "invisible": x + Gaussian with std = strength * within-batch spread
    "onoff": _onoff,  # `inner` attack during the first duty share of every period
    "drift": _drift,  # x * (1 + strength * attacked steps): slow multiplicative drift
    "mimic": _mimic,  # free-rider: EMA of past honest batch means + strength * honest spread noise
}

DEFAULT_STRENGTH: dict[str, float] = {
    "constant": 1.0,
    "zeros": 0.0,
    "random": 1.0,
    "scaling": -1.0,
    "sign_flip": 0.5,
    "bias": 0.5,
    "delay": 0.0,
    "noise": 0.5,
    "onoff": 1.0,
    "drift": 0.002,
    "mimic": 0.0,
}


class Attack:
    """A configured attack with the little history some kinds need (delay, mimic)."""

    def __init__(self, config: AttackConfig) -> None:
        self.config = config
        self._gen = torch.Generator().manual_seed(config.seed)
        self._states: dict[str, _DirectionState] = {}
        self._flip_masks: dict[tuple[int, float], torch.Tensor] = {}
        logger.warning("UNSAFE attack behaviour enabled: %s", config)

    def applies_to(self, direction: str) -> bool:
        return self.config.direction in ("both", direction)

    def is_active(self, direction: str, step: int) -> bool:
        return self.applies_to(direction) and step >= self.config.start_after

    def apply(self, tensor: torch.Tensor, *, direction: str, microbatch_id: int, step: int) -> torch.Tensor:
        """The tensor the attacker sends instead of `tensor` (which is returned unchanged when idle)."""
        del microbatch_id  # attacks key on the attacker's own step; the id is for callers' logs
        if direction not in ("forward", "backward"):
            raise ValueError(f"direction must be forward or backward, got {direction!r}")
        with torch.no_grad():
            out = tensor
            if self.is_active(direction, step):
                out = ATTACKS[self.config.kind](self, tensor, direction, step, self.config.effective_strength)
            self._observe(direction, step, tensor)
        return out

    def state(self, direction: str) -> _DirectionState:
        return self._states.setdefault(direction, _DirectionState())

    def noise_like(self, x: torch.Tensor) -> torch.Tensor:
        return torch.randn(x.shape, generator=self._gen, dtype=torch.float32).to(x.dtype)

    def flip_mask(self, features: int, share: float) -> torch.Tensor:
        key = (features, share)
        if key not in self._flip_masks:
            gen = torch.Generator().manual_seed(self.config.seed + 1)
            chosen = torch.randperm(features, generator=gen)[: round(share * features)]
            mask = torch.ones(features)
            mask[chosen] = -1.0
            self._flip_masks[key] = mask
        return self._flip_masks[key]

    def _observe(self, direction: str, step: int, honest: torch.Tensor) -> None:
        """Keep what stateful kinds learn from the honest tensor (the attacker computed it anyway,
        except the free-rider, which only learns before its attack starts)."""
        kind = self.config.kind
        st = self.state(direction)
        if kind == "delay":
            st.history.append((step, honest.detach().clone()))
            # bounded by steps, not entries: a caller may pass one step more than once (the pipeline
            # harness's attackers keep their step on the disguised checks they answer)
            while st.history[0][0] < step - self.config.delay_steps:
                st.history.popleft()
        elif kind == "mimic" and not self.is_active(direction, step) and honest.dim() >= 2:
            beta = self.config.mimic_beta
            mean = honest.detach().float().mean(dim=0)
            spread = float(_spread(honest.detach().float()))
            if st.mean_ema is None or st.mean_ema.shape != mean.shape:
                st.mean_ema, st.spread_ema = mean.clone(), spread
            else:
                st.mean_ema.mul_(beta).add_(mean, alpha=1.0 - beta)
                st.spread_ema = beta * st.spread_ema + (1.0 - beta) * spread


_INT_FIELDS = {"start_after", "seed", "delay_steps", "period_steps"}
_FLOAT_FIELDS = {"strength", "duty", "mimic_beta"}


def parse_attack(spec: str) -> AttackConfig:
    """Parse `KIND[:key=value,...]`, e.g. `scaling:strength=-1,direction=backward,start_after=100`."""
    kind, _, rest = spec.strip().partition(":")
    kwargs: dict[str, object] = {"kind": kind.strip()}
    known = {f.name for f in fields(AttackConfig)} - {"kind"}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in known:
            raise ValueError(f"bad attack option {item!r} in {spec!r}; options: {sorted(known)}")
        try:
            if key in _INT_FIELDS:
                kwargs[key] = int(value)
            elif key in _FLOAT_FIELDS:
                kwargs[key] = float(value)
            else:
                kwargs[key] = value
        except ValueError as exc:
            raise ValueError(f"bad value for {key} in {spec!r}: {value!r}") from exc
    return AttackConfig(**kwargs)  # type: ignore[arg-type]


UNSAFE_ATTACK_ENV = "HIVENODE_UNSAFE_ATTACK"


def attack_from_env(environ: Mapping[str, str] | None = None) -> Attack | None:
    """The attack a stage applies to its outputs, only when `HIVENODE_UNSAFE_ATTACK` names one."""
    spec = (os.environ if environ is None else environ).get(UNSAFE_ATTACK_ENV, "").strip()
    if not spec:
        return None
    config = parse_attack(spec)
    banner = "!" * 78
    logger.warning(
        "%s\nUNSAFE: this replica ATTACKS the run (%s=%s): it corrupts its %s outputs. Tests and benchmarks "
        "only.\n%s",
        banner,
        UNSAFE_ATTACK_ENV,
        spec,
        config.direction,
        banner,
    )
    return Attack(config)


UNSAFE_ANNOUNCE_ENV = "HIVENODE_UNSAFE_ANNOUNCE_FACTOR"


def announce_factor_from_env(environ: Mapping[str, str] | None = None) -> float:
    """How much a stage replica inflates (> 1) or deflates (< 1) the throughput its heartbeat announces: 1 unless
    `HIVENODE_UNSAFE_ANNOUNCE_FACTOR` says otherwise (the placement attack of tests/integration/test_placement.py).
    """
    spec = (os.environ if environ is None else environ).get(UNSAFE_ANNOUNCE_ENV, "").strip()
    if not spec:
        return 1.0
    factor = float(spec)
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"{UNSAFE_ANNOUNCE_ENV} must be a positive number, got {spec!r}")
    banner = "!" * 78
    logger.warning(
        "%s\nUNSAFE: this replica LIES in its heartbeat (%s=%s): it announces %gx its throughput. Tests and "
        "benchmarks only.\n%s",
        banner,
        UNSAFE_ANNOUNCE_ENV,
        spec,
        factor,
        banner,
    )
    return factor
