"""benchmarks/protocol.py's pieces that decide what its figures mean: the receiver process's crypto switch (off must
switch off exactly what `crypto_off` does, on must be the real crypto, timed) and the bootstrap interval of the
signing share."""

from __future__ import annotations

import statistics
from pathlib import Path

import blake3

from benchmarks.protocol import ReceiverCrypto, _share_interval
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


def test_share_interval_is_exact_for_a_constant_difference_and_brackets_a_noisy_one() -> None:
    constant = {"transfer": [0.1] * 20, "streamed": [0.12] * 20, "streamed_nocrypto": [0.11] * 20}
    low, high = _share_interval(constant, resamples=200)
    assert abs(low - 0.1) < 1e-9 and abs(high - 0.1) < 1e-9
    noisy = {
        "transfer": [0.1] * 40,
        "streamed": [0.11 + 0.002 * (i % 7) for i in range(40)],
        "streamed_nocrypto": [0.1 + 0.002 * (i % 5) for i in range(40)],
    }
    point = (
        statistics.median(s - n for s, n in zip(noisy["streamed"], noisy["streamed_nocrypto"], strict=True))
        / 0.1
    )
    low, high = _share_interval(noisy, resamples=500)
    assert low < point < high and high - low < 0.2
