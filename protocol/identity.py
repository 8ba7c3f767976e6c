"""Node identity: one Ed25519 key per node, which is also its libp2p (hivemind) identity.

The key is stored in libp2p's protobuf `PrivateKey` format so that `p2pd -id <path>` uses it; the peer id is then
the identity multihash of the public key (`12D3KooW...`), and any signature can be checked from the sender's peer id
alone. That is what lets a receiver demand "signer == Noise-authenticated remote peer".
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.errors import IdentityError, IdentityInUseError

logger = logging.getLogger(__name__)

IDENTITY_FILENAME = "identity.key"
# libp2p crypto.proto: message PrivateKey/PublicKey { KeyType Type = 1; bytes Data = 2; }, KeyType Ed25519 = 1.
_KEYTYPE_ED25519_FIELD = b"\x08\x01"
_DATA_FIELD_TAG = 0x12
_PUBKEY_PROTO_PREFIX = _KEYTYPE_ED25519_FIELD + bytes([_DATA_FIELD_TAG, 32])
# A peer id of a small key is the identity multihash: code 0x00, length 36, then the 36-byte PublicKey protobuf.
_PEER_ID_PREFIX = b"\x00\x24" + _PUBKEY_PROTO_PREFIX
PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer id (base58) of a raw 32-byte Ed25519 public key."""
    if len(public_key) != PUBLIC_KEY_SIZE:
        raise IdentityError(f"an Ed25519 public key has {PUBLIC_KEY_SIZE} bytes, got {len(public_key)}")
    return base58.b58encode(_PEER_ID_PREFIX + public_key).decode()


@functools.lru_cache(maxsize=4096)  # bounded: a peer churning ids only evicts; parsing costs ~8 us per frame
def public_key_from_peer_id(peer_id: str) -> Ed25519PublicKey:
    """Recover the Ed25519 public key embedded in a `12D3KooW...` peer id; RSA (`Qm...`) ids carry none."""
    try:
        raw = base58.b58decode(peer_id)
    except ValueError as e:
        raise IdentityError(f"peer id {peer_id!r} is not base58") from e
    if len(raw) != len(_PEER_ID_PREFIX) + PUBLIC_KEY_SIZE or not raw.startswith(_PEER_ID_PREFIX):
        raise IdentityError(
            f"peer id {peer_id[:16]!r}... does not embed an Ed25519 key (only Ed25519 identities are accepted)"
        )
    return Ed25519PublicKey.from_public_bytes(raw[len(_PEER_ID_PREFIX) :])


def verify_signature(peer_id: str, data: bytes, signature: bytes) -> bool:
    """True if `signature` over `data` was made by the key behind `peer_id`."""
    if len(signature) != SIGNATURE_SIZE:
        return False
    try:
        public_key_from_peer_id(peer_id).verify(signature, data)
    except (InvalidSignature, IdentityError):
        return False
    return True


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    """An Ed25519 key pair; `peer_id` is what hivemind will report for a daemon started with `path`."""

    private_key: Ed25519PrivateKey
    path: Path | None = None

    @property
    def public_key(self) -> bytes:
        return _raw_public(self.private_key.public_key())

    @property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.public_key)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    @classmethod
    def generate(cls) -> NodeIdentity:
        return cls(private_key=Ed25519PrivateKey.generate())

    def to_libp2p_bytes(self) -> bytes:
        seed = self.private_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        data = seed + self.public_key  # libp2p's Ed25519 private key is seed || public key (64 bytes)
        return _KEYTYPE_ED25519_FIELD + bytes([_DATA_FIELD_TAG, len(data)]) + data

    @classmethod
    def from_libp2p_bytes(cls, blob: bytes, path: Path | None = None) -> NodeIdentity:
        prefix = _KEYTYPE_ED25519_FIELD + bytes([_DATA_FIELD_TAG, 64])
        if len(blob) != len(prefix) + 64 or not blob.startswith(prefix):
            raise IdentityError(
                f"{path or 'identity'} is not an Ed25519 key in libp2p format "
                "(an RSA identity from hivemind cannot be used: delete it to create a new one)"
            )
        seed, public = blob[len(prefix) : len(prefix) + 32], blob[len(prefix) + 32 :]
        key = Ed25519PrivateKey.from_private_bytes(seed)
        if _raw_public(key.public_key()) != public:
            raise IdentityError(
                f"{path or 'identity'}: public half does not match the private key (corrupted file)"
            )
        return cls(private_key=key, path=path)

    @classmethod
    def load(cls, path: Path) -> NodeIdentity:
        try:
            blob = path.read_bytes()
        except OSError as e:
            raise IdentityError(f"cannot read identity {path}: {e.strerror or e}") from e
        return cls.from_libp2p_bytes(blob, path=path)

    @classmethod
    def load_or_create(cls, path: Path) -> NodeIdentity:
        """Load the identity at `path`, or create it there (mode 0600) on first start."""
        if path.exists():
            return cls.load(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        identity = cls.generate()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity.to_libp2p_bytes())
        logger.info("created a new identity %s in %s", identity.peer_id, path)
        return cls(private_key=identity.private_key, path=path)


class IdentityLock:
    """An exclusive OS lock beside the identity file: a second process with the same identity fails at once.

    hivemind's own "identity taken" check only understands RSA identities, and needs the bootstrap to be reachable;
    this lock covers the common case (two processes on one machine) without the network. The lock dies with the
    process, so a SIGKILLed node never leaves a stale lock behind.
    """

    def __init__(self, identity_path: Path) -> None:
        self.path = identity_path.with_name(identity_path.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise IdentityInUseError(
                f"identity {self.path.with_suffix('')} is already in use by another process (pid {holder}); "
                "give this node its own --identity or state dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> IdentityLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
