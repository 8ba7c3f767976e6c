"""Identity: Ed25519 keys in libp2p format, peer id <-> public key, signatures, and the one-process-per-identity lock."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.errors import IdentityError, IdentityInUseError
from protocol.identity import (
    IdentityLock,
    NodeIdentity,
    peer_id_from_public_key,
    public_key_from_peer_id,
    verify_signature,
)


def test_created_with_mode_0600_and_reloaded(tmp_path: Path) -> None:
    path = tmp_path / "state" / "identity.key"
    first = NodeIdentity.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert first.peer_id.startswith("12D3KooW")
    assert NodeIdentity.load_or_create(path).peer_id == first.peer_id


def test_peer_id_carries_the_public_key() -> None:
    identity = NodeIdentity.generate()
    assert peer_id_from_public_key(identity.public_key) == identity.peer_id
    from cryptography.hazmat.primitives import serialization

    raw = public_key_from_peer_id(identity.peer_id).public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    assert raw == identity.public_key


def test_signature_checks_from_peer_id_alone() -> None:
    alice, bob = NodeIdentity.generate(), NodeIdentity.generate()
    sig = alice.sign(b"payload")
    assert verify_signature(alice.peer_id, b"payload", sig)
    assert not verify_signature(bob.peer_id, b"payload", sig)
    assert not verify_signature(alice.peer_id, b"payload!", sig)
    assert not verify_signature(alice.peer_id, b"payload", sig[:-1])


def test_rsa_or_garbage_peer_ids_are_refused() -> None:
    with pytest.raises(IdentityError):
        public_key_from_peer_id("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")
    with pytest.raises(IdentityError):
        public_key_from_peer_id("not-base58-0OIl")
    assert not verify_signature("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", b"x", b"\0" * 64)


@pytest.mark.parametrize(
    "blob", [b"", b"\x08\x00\x12\x40" + b"\0" * 64, b"\x08\x01\x12\x40" + b"\1" * 64, b"junk"]
)
def test_malformed_identity_files_give_a_clear_error(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(blob)
    with pytest.raises(IdentityError, match="identity"):
        NodeIdentity.load(path)


def test_unreadable_identity(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="cannot read"):
        NodeIdentity.load(tmp_path / "missing.key")


def test_second_process_with_same_identity_fails_clearly(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    NodeIdentity.load_or_create(path)
    code = (
        "import sys; from pathlib import Path; from protocol.identity import IdentityLock\n"
        "from protocol.errors import IdentityInUseError\n"
        f"try:\n    IdentityLock(Path({str(path)!r})).acquire()\nexcept IdentityInUseError as e:\n"
        "    print(e); sys.exit(3)\n"
    )
    with IdentityLock(path):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 3
        assert "already in use" in proc.stdout and str(os.getpid()) in proc.stdout
    # released: a new holder succeeds
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0


def test_lock_in_same_process_also_conflicts(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    with IdentityLock(path), pytest.raises(IdentityInUseError):
        IdentityLock(path).acquire()
