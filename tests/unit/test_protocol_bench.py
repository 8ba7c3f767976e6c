"""benchmarks/protocol.py's pieces that decide what its figures mean: the receiver process's crypto switch (off must
switch off exactly what `crypto_off` does, on must be the real crypto, timed) and the bootstrap interval of the
signing share, the interleaved paired schedule and its statistics (benchmarks/paired.py)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import blake3
import pytest

from benchmarks.paired import Block, paired_share, schedule
from benchmarks.protocol import AA, OLD_SIGNING, SIGNING, CpuMeter, ReceiverCrypto, Runner
from protocol import envelope
from protocol.envelope import SIGNATURE_DOMAIN
from protocol.identity import NodeIdentity


def test_receiver_crypto_switches_the_digest_and_the_check_and_restores_them(tmp_path: Path) -> None:
    alice = NodeIdentity.load_or_create(tmp_path / "alice.key")
    message = SIGNATURE_DOMAIN + b"header"
    good, bad = alice.sign(message), bytes(64)
    originals = envelope._new_hasher, envelope.verify_signature
    switch = ReceiverCrypto()
    with switch.installed():
        # on: the real BLAKE3 and the real check (the bad signature is refused), their time on the clock
        hasher = envelope._new_hasher(4)
        hasher.update(b"abcd")
        assert hasher.digest(32) == blake3.blake3(b"abcd").digest()
        assert envelope.verify_signature(alice.peer_id, message, good)
        assert not envelope.verify_signature(alice.peer_id, message, bad)
        spent = switch.switch(off=True)
        assert spent > 0 and switch.clock[0] == 0.0
        # off: no digest, every signature passes, nothing on the clock
        hasher = envelope._new_hasher(4)
        hasher.update(b"abcd")
        assert hasher.digest(32) == bytes(32)
        assert envelope.verify_signature(alice.peer_id, message, bad)
        assert switch.switch(off=False) == 0.0
    assert (envelope._new_hasher, envelope.verify_signature) == originals


def test_schedule_is_balanced_per_comparison_and_interleaved() -> None:
    comparisons = (SIGNING, AA, OLD_SIGNING)
    blocks = schedule(comparisons, 40, random.Random(1))
    assert len(blocks) == 120
    for c in comparisons:
        firsts = [b.a_first for b in blocks if b.comparison == c]
        assert len(firsts) == 40 and sum(firsts) == 20  # arm a first in exactly half
    assert len({b.comparison for b in blocks[:20]}) == 3  # interleaved, not one comparison after another
    assert blocks == schedule(comparisons, 40, random.Random(1))  # seeded: the same schedule again
    assert len(schedule((SIGNING,), 5, random.Random(0))) == 6  # rounded up to even


def test_paired_share_is_exact_for_a_constant_ratio_under_drifting_load() -> None:
    b = [0.08 * (1 + 0.5 * (i % 17) / 17) for i in range(60)]  # the load drifts by up to 50 %
    a = [1.025 * t for t in b]
    s = paired_share(a, b, resamples=300)
    assert (
        abs(s.share - 0.025) < 1e-12 and abs(s.ci95_low - 0.025) < 1e-12 and abs(s.ci95_high - 0.025) < 1e-12
    )
    assert s.blocks == 60 and s.median_diff_s > 0
    with pytest.raises(ValueError):
        paired_share(a, b[:-1])


def _simulated(
    blocks: list[Block], cost: dict[str, float], rng: random.Random
) -> dict[str, tuple[list[float], list[float]]]:
    """Run a schedule on a model of this box: a path's cost, load drifting per block, noise, and a carry-over
    effect (the second call of a block 2 % slower than the first)."""
    samples: dict[str, tuple[list[float], list[float]]] = {}
    for k, block in enumerate(blocks):
        load = 1 + 0.3 * ((k // 25) % 3)
        first, second = (
            cost[name] * load * (1.02 if position else 1.0) * rng.lognormvariate(0, 0.02)
            for position, name in enumerate(block.order)
        )
        a_s, b_s = (first, second) if block.a_first else (second, first)
        arms = samples.setdefault(block.comparison.name, ([], []))
        arms[0].append(a_s)
        arms[1].append(b_s)
    return samples


def test_balanced_order_removes_a_carry_over_bias_that_a_fixed_order_reports() -> None:
    cost = {"streamed": 0.0824, "streamed_nocrypto": 0.08, "sealed": 0.09, "sealed_nocrypto": 0.08}  # +3 %
    blocks = schedule((SIGNING, AA), 400, random.Random(2))
    samples = _simulated(blocks, cost, random.Random(3))
    signing, aa = (
        paired_share(*samples["signing"], resamples=300),
        paired_share(*samples["aa"], resamples=300),
    )
    assert signing.ci95_low < 0.03 < signing.ci95_high and abs(signing.share - 0.03) < 0.005
    assert aa.ci95_low < 0 < aa.ci95_high and abs(aa.share) < 0.005  # the A/A control finds nothing
    # negative control: arm a always first, as a fixed order within a turn does; the carry-over becomes a bias
    fixed = [Block(b.comparison, a_first=True) for b in blocks]
    samples = _simulated(fixed, cost, random.Random(3))
    signing, aa = (
        paired_share(*samples["signing"], resamples=300),
        paired_share(*samples["aa"], resamples=300),
    )
    assert aa.ci95_high < -0.01 and signing.ci95_high < 0.02  # both off by the carry-over, ~2 %


def test_runner_block_returns_arm_a_then_arm_b_in_either_order() -> None:
    runner = Runner(paths={}, receiver_crypto=_no_switch, meter=CpuMeter(python=[], p2pd=[]))
    times = {"streamed": 2.0, "streamed_nocrypto": 1.0}
    ran: list[str] = []

    async def once(name: str) -> float:
        ran.append(name)
        return times[name]

    runner.once = once  # type: ignore[method-assign]
    assert asyncio.run(runner.block(Block(SIGNING, a_first=True))) == (2.0, 1.0)
    assert asyncio.run(runner.block(Block(SIGNING, a_first=False))) == (2.0, 1.0)
    assert ran == ["streamed", "streamed_nocrypto", "streamed_nocrypto", "streamed"]


async def _no_switch(off: bool) -> float:
    return 0.0
