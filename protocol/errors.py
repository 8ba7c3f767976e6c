"""Typed errors for everything that crosses the network. Each rejection carries a reason and says whom it blames."""

from __future__ import annotations


class HivenodeError(Exception):
    """Base of every error this project raises on purpose."""


class IdentityError(HivenodeError):
    """An identity file or peer id is unreadable, malformed, or not Ed25519."""


class IdentityInUseError(IdentityError):
    """Another live process already uses this identity."""


class ConfigError(HivenodeError):
    """A user-supplied setting (flag, TOML file, manifest) is invalid."""


class ProtocolError(HivenodeError):
    """A frame, record or stream from a peer was rejected.

    `reason` is a short machine-readable tag (used in logs and metrics); `blame_sender` says whether the
    rejection may be counted against the claimed sender. It is False whenever the claimed sender cannot be the
    one at fault: a forged signer (someone else impersonates it) or our own clock disagreeing with its clock.
    """

    reason: str = "protocol"
    blame_sender: bool = True

    def __init__(self, message: str, *, reason: str | None = None, blame_sender: bool | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason
        if blame_sender is not None:
            self.blame_sender = blame_sender


class FrameTooLarge(ProtocolError):
    reason = "too large"


class MalformedFrame(ProtocolError):
    reason = "malformed"


class SignerMismatch(ProtocolError):
    reason = "signer is not the remote peer"
    blame_sender = False  # the named signer did not send it: never count it against them


class BadSignature(ProtocolError):
    reason = "bad signature"


class WrongContext(ProtocolError):
    reason = "wrong context"  # other run, stage, direction, kind or receiver


class ReplayedFrame(ProtocolError):
    reason = "replay"


class StaleFrame(ProtocolError):
    reason = "outside replay window"


class ClockSkew(ProtocolError):
    reason = "clock skew"
    blame_sender = False  # either clock may be wrong; refuse, but never strike the peer


class SizeMismatch(ProtocolError):
    reason = "size mismatch"


class DigestMismatch(ProtocolError):
    reason = "digest mismatch"


class TensorPolicyError(ProtocolError):
    reason = "tensor policy"  # dtype not allowed, bad shape, non-finite values


class CompressionError(ProtocolError):
    # a header out of schema or over the caps, a wrong length, a bad index or scale (`protocol.compress`)
    reason = "bad compressed tensor"


class RecordRejected(ProtocolError):
    reason = "record rejected"


class StreamClosed(ProtocolError):
    reason = "stream closed early"
    blame_sender = False  # a peer that crashed or lost its link looks exactly like this


class StreamTimeout(ProtocolError):
    reason = "read timeout"  # a chunk did not arrive in time (slow or stalling peer)


class RemoteRefused(HivenodeError):
    """The remote peer answered a framed call with an error; `reason` is its short reason tag."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class ManifestRejected(ProtocolError):
    reason = "manifest rejected"  # bad owner signature, non-canonical bytes, or out-of-schema contents


class OwnerPinMismatch(HivenodeError):
    """A run id pinned to one owner key (trust on first use) is presented signed by another key.

    Run ids hash their owner key, so this means the pin file or the manifest was altered; the message names both
    keys and the fix (`python -m node trust forget RUN_ID`). A new run id under a known name is not this error."""


class JoinError(HivenodeError):
    """This node could not join the swarm: no entry point answered, or no valid run manifest was found."""


class TokenizerMismatch(HivenodeError):
    """A tokenizer's bytes do not hash to the sha256 the signed run manifest names (or its vocabulary size
    differs): a wrong file, a tampered download, or a bootstrap serving another run's tokenizer. Refused."""


class DataError(HivenodeError):
    """Prepared training data cannot be used: a malformed shard index, an input format this install cannot read,
    or shards that are not the ones the signed run manifest names."""


class ShardMismatch(DataError):
    """A shard's bytes do not hash to the name the run's shard index gives it (a corrupt file on disk, a truncated
    or tampered download, a bootstrap serving another run's data). Refused: deleted and fetched again."""
