"""Attack behaviours: each kind transforms what it should, when it should, in the directions it should."""

from __future__ import annotations

import pytest
import torch

from verification.attacks import ATTACKS, DEFAULT_STRENGTH, Attack, AttackConfig, parse_attack


def honest(step: int, batch: int = 4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(batch, 8, 16, generator=gen) + 0.5


def rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


def apply(cfg: AttackConfig, x: torch.Tensor, step: int = 0, direction: str = "forward") -> torch.Tensor:
    return Attack(cfg).apply(x, direction=direction, microbatch_id=step, step=step)


def test_every_kind_has_a_default_strength_and_keeps_shape_and_dtype() -> None:
    assert set(ATTACKS) == set(DEFAULT_STRENGTH)
    x = honest(0)
    for kind in ATTACKS:
        out = apply(AttackConfig(kind=kind), x)
        assert out.shape == x.shape and out.dtype == x.dtype, kind
        assert torch.isfinite(out).all(), kind


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_tensors_keep_their_dtype(dtype: torch.dtype) -> None:
    for kind in ATTACKS:
        attack = Attack(AttackConfig(kind=kind, start_after=2, delay_steps=1))
        for step in range(4):
            out = attack.apply(honest(step).to(dtype), direction="forward", microbatch_id=step, step=step)
            assert out.dtype == dtype and out.shape == honest(step).shape, kind


def test_input_is_never_modified_in_place() -> None:
    x = honest(0)
    before = x.clone()
    for kind in ATTACKS:
        apply(AttackConfig(kind=kind), x)
    assert torch.equal(x, before)


def test_constant_and_zeros() -> None:
    x = honest(0)
    out = apply(AttackConfig(kind="constant", strength=2.0), x)
    assert torch.allclose(out, torch.full_like(x, 2.0 * rms(x)))
    assert torch.count_nonzero(apply(AttackConfig(kind="zeros"), x)) == 0


def test_random_replaces_with_noise_at_the_requested_scale() -> None:
    x = honest(0, batch=16)
    out = apply(AttackConfig(kind="random", strength=1.0, seed=3), x)
    assert abs(rms(out) / rms(x) - 1.0) < 0.05
    assert abs(float(torch.corrcoef(torch.stack([out.flatten(), x.flatten()]))[0, 1])) < 0.05


def test_scaling_including_minus_one() -> None:
    x = honest(0)
    assert torch.allclose(apply(AttackConfig(kind="scaling", strength=-1.0), x), -x)
    assert torch.allclose(apply(AttackConfig(kind="scaling", strength=10.0), x), 10 * x)


def test_sign_flip_flips_a_fixed_share_of_features() -> None:
    x = honest(0)
    attack = Attack(AttackConfig(kind="sign_flip", strength=0.25, seed=5))
    out1 = attack.apply(x, direction="forward", microbatch_id=0, step=0)
    out2 = attack.apply(x, direction="forward", microbatch_id=1, step=1)
    flipped = (out1 == -x).all(dim=(0, 1))
    assert int(flipped.sum()) == 4  # 25 % of 16 features
    assert torch.equal(out1, out2)  # the same features every step
    assert torch.equal(out1[..., ~flipped], x[..., ~flipped])


def test_bias_adds_a_constant_relative_to_scale() -> None:
    x = honest(0)
    out = apply(AttackConfig(kind="bias", strength=0.5), x)
    assert torch.allclose(out - x, torch.full_like(x, 0.5 * rms(x)))


def test_noise_is_scaled_to_within_batch_spread() -> None:
    x = honest(0, batch=32)
    out = apply(AttackConfig(kind="noise", strength=0.5, seed=1), x)
    spread = float((x - x.mean(0, keepdim=True)).pow(2).mean().sqrt())
    assert abs(rms(out - x) / spread - 0.5) < 0.03


def test_delay_replays_its_own_tensor_from_n_steps_ago() -> None:
    attack = Attack(AttackConfig(kind="delay", delay_steps=3, start_after=5))
    sent = [attack.apply(honest(s), direction="forward", microbatch_id=s, step=s) for s in range(10)]
    for s in range(5):
        assert torch.equal(sent[s], honest(s))  # before start_after: honest
    for s in range(5, 10):
        assert torch.equal(sent[s], honest(s - 3))
    # the history is bounded by the delay
    assert len(attack.state("forward").history) == 4


def test_delay_without_history_sends_the_honest_tensor() -> None:
    attack = Attack(AttackConfig(kind="delay", delay_steps=50))
    assert torch.equal(attack.apply(honest(0), direction="forward", microbatch_id=0, step=0), honest(0))


def test_onoff_attacks_only_in_its_duty_share_of_each_period() -> None:
    attack = Attack(AttackConfig(kind="onoff", inner="scaling", strength=-1.0, period_steps=10, duty=0.3))
    on = [
        not torch.equal(attack.apply(honest(s), direction="forward", microbatch_id=s, step=s), honest(s))
        for s in range(30)
    ]
    assert on == [s % 10 < 3 for s in range(30)]


def test_drift_grows_linearly_from_the_start() -> None:
    attack = Attack(AttackConfig(kind="drift", strength=0.01, start_after=10))
    x = honest(0)
    assert torch.equal(attack.apply(x, direction="forward", microbatch_id=0, step=9), x)
    assert torch.allclose(attack.apply(x, direction="forward", microbatch_id=0, step=10), x)
    assert torch.allclose(attack.apply(x, direction="forward", microbatch_id=0, step=60), 1.5 * x)


def test_mimic_sends_the_expected_value_it_learned_before_starting() -> None:
    attack = Attack(AttackConfig(kind="mimic", strength=0.0, start_after=50, mimic_beta=0.9))
    for s in range(50):
        attack.apply(honest(s), direction="forward", microbatch_id=s, step=s)
    out = attack.apply(honest(99), direction="forward", microbatch_id=99, step=50)
    # every sample is the same expected tensor, close to the true mean 0.5, whatever the input
    assert torch.equal(out[0], out[1])
    assert abs(float(out.mean()) - 0.5) < 0.1
    other = attack.apply(honest(123), direction="forward", microbatch_id=100, step=51)
    assert torch.equal(out, other)  # it never computes: the input does not matter


def test_mimic_with_noise_matches_honest_spread() -> None:
    attack = Attack(AttackConfig(kind="mimic", strength=1.0, start_after=50, seed=2))
    for s in range(50):
        attack.apply(honest(s, batch=16), direction="forward", microbatch_id=s, step=s)
    out = attack.apply(honest(99, batch=16), direction="forward", microbatch_id=99, step=50)
    spread = float((out - out.mean(0, keepdim=True)).pow(2).mean().sqrt())
    assert 0.8 < spread < 1.2  # honest spread is 1


@pytest.mark.parametrize("direction", ["forward", "backward", "both"])
def test_direction_selects_which_stream_is_attacked(direction: str) -> None:
    attack = Attack(AttackConfig(kind="zeros", direction=direction))  # type: ignore[arg-type]
    x = honest(0)
    fwd = attack.apply(x, direction="forward", microbatch_id=0, step=0)
    bwd = attack.apply(x, direction="backward", microbatch_id=0, step=0)
    assert (torch.count_nonzero(fwd) == 0) == (direction in ("forward", "both"))
    assert (torch.count_nonzero(bwd) == 0) == (direction in ("backward", "both"))


def test_start_after_keeps_the_attacker_honest_before() -> None:
    attack = Attack(AttackConfig(kind="zeros", start_after=3))
    outs = [attack.apply(honest(s), direction="forward", microbatch_id=s, step=s) for s in range(5)]
    assert [bool(torch.count_nonzero(o) == 0) for o in outs] == [False, False, False, True, True]


def test_parse_attack() -> None:
    cfg = parse_attack("scaling:strength=-1,direction=backward,start_after=100")
    assert cfg == AttackConfig(kind="scaling", strength=-1.0, direction="backward", start_after=100)
    assert parse_attack("zeros") == AttackConfig(kind="zeros")
    onoff = parse_attack("onoff: inner=sign_flip, period_steps=20, duty=0.5, seed=7")
    assert (onoff.inner, onoff.period_steps, onoff.duty, onoff.seed) == ("sign_flip", 20, 0.5, 7)


@pytest.mark.parametrize(
    "spec",
    [
        "nonsense",
        "scaling:strength",
        "scaling:power=2",
        "scaling:strength=x",
        "zeros:direction=up",
        "onoff:inner=delay",
    ],
)
def test_parse_attack_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_attack(spec)
