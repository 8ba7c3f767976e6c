"""Verifier token receipts: the signed record, how it is opened, and how it travels in a contribution's meta.

A verifier signs cumulative token counts per stage replica and session; the replica relays the newest with its
fragment contributions, and the syncer weights the replica by their growth (`node.diloco.receipts.ReceiptLedger`).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from protocol.codec import TensorLimits
from protocol.envelope import (
    MAX_HEADER_BYTES,
    Context,
    Kind,
    Opened,
    open_envelope,
    seal,
)
from protocol.errors import MalformedFrame, ProtocolError
from protocol.identity import NodeIdentity
from protocol.pipeline import UnauthorizedCaller
from protocol.replay import ReplayConfig, ReplayGuard

logger = logging.getLogger(__name__)


RECEIPT_FORMAT = "hivenode.receipt.v1"


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenReceipt:
    """A verifier's signed statement: "replica R of stage s processed N tokens for me, verified".

    Counts are cumulative over one verifier session (`session`, chosen at the verifier's start), so the latest
    receipt supersedes the earlier ones and a lost receipt loses nothing: the syncer weights a replica by
    the growth of `tokens` between the receipts it saw at two syncs. The frame is an envelope of kind
    `receipt` (no tensor), signed by the verifier, `receiver` = the replica, `stage` = its stage,
    `microbatch` = the receipt's sequence number in the session, `step` = the verifier's step; the fields
    below are its metadata. See docs/pipeline.md.
    """

    verifier: str  # signer (an authorized verifier)
    replica: str  # whose work it counts (also the envelope's receiver)
    stage: int
    session: str  # hex id of the verifier session
    sequence: int  # receipts of this session, increasing
    tokens: int  # cumulative verified tokens this session
    microbatches: int  # cumulative microbatches this session
    last_microbatch: int  # id of the latest microbatch counted
    issued_at: float  # verifier wall clock (also the envelope timestamp)

    def meta(self) -> dict[str, Any]:
        return {
            "format": RECEIPT_FORMAT,
            "replica": self.replica,
            "session": self.session,
            "tokens": self.tokens,
            "microbatches": self.microbatches,
            "last_microbatch": self.last_microbatch,
        }

    def seal(self, identity: NodeIdentity, run_id: str, *, step: int = 0) -> bytearray:
        if identity.peer_id != self.verifier:
            raise ValueError("a receipt is sealed by its verifier")
        context = Context(run_id=run_id, kind=Kind.RECEIPT, receiver=self.replica, stage=self.stage)
        return seal(
            identity, context, microbatch=self.sequence, step=step, now=self.issued_at, meta=self.meta()
        )

    @classmethod
    def from_opened(cls, opened: Opened) -> TokenReceipt:
        h, meta = opened.header, opened.meta
        session = meta.get("session")
        tokens, microbatches, last = (
            _count(meta.get(k)) for k in ("tokens", "microbatches", "last_microbatch")
        )
        if not (
            meta.get("format") == RECEIPT_FORMAT
            and meta.get("replica") == h.receiver
            and isinstance(session, str)
            and 0 < len(session) <= 64
            and tokens is not None
            and microbatches is not None
            and last is not None
            and not opened.tensors
        ):
            raise MalformedFrame("receipt metadata does not match the receipt format", reason="bad receipt")
        return cls(
            verifier=h.sender,
            replica=h.receiver,
            stage=h.stage,
            session=session,
            sequence=h.microbatch,
            issued_at=h.timestamp,
            tokens=tokens,
            microbatches=microbatches,
            last_microbatch=last,
        )


def _count(value: object) -> int | None:
    """`value` if it is a non-negative int (a bool is not: its type is not int), else None."""
    return value if type(value) is int and value >= 0 else None


def receipt_signer(frame: bytes | bytearray | memoryview) -> str:
    """The claimed signer of a frame (header field 3), read without trusting anything; `open_receipt` checks it."""
    view = memoryview(frame)
    if len(view) < 4:
        raise MalformedFrame("frame too short")
    (length,) = struct.unpack_from(">I", view)
    if length > MAX_HEADER_BYTES or 4 + length > len(view):
        raise MalformedFrame("bad header length")
    try:
        fields = msgpack.unpackb(bytes(view[4 : 4 + length]), raw=False, max_array_len=64, max_map_len=64)
    except Exception as e:  # msgpack raises several types for garbage
        raise MalformedFrame(f"header is not msgpack: {type(e).__name__}") from None
    if not isinstance(fields, list) or len(fields) < 4 or not isinstance(fields[3], str):
        raise MalformedFrame("header has no sender")
    return fields[3]


def open_receipt(
    frame: bytes | bytearray | memoryview,
    *,
    run_id: str,
    replica: str,
    stage: int,
    authorized_verifiers: Sequence[str],
    now: float,
    max_age_s: float = 3600.0,
) -> TokenReceipt:
    """Verify a receipt however it reached us (from the verifier, or relayed by the replica to a syncer).

    A receipt is a relayed statement: its signature binds it, not the channel, so the signer is checked
    against the authorized verifiers instead of the remote peer. Every other envelope check applies (context:
    run, kind, receiver = `replica`, stage; digest; age up to `max_age_s`).

    Raises:
        ProtocolError: not signed by an authorized verifier, or any envelope check failed.
    """
    signer = receipt_signer(frame)
    if signer not in authorized_verifiers:
        raise UnauthorizedCaller(f"receipt signed by {signer[-8:]}, not an authorized verifier")
    expect = Context(run_id=run_id, kind=Kind.RECEIPT, receiver=replica, stage=stage)
    guard = ReplayGuard(ReplayConfig(max_skew_s=max_age_s))
    opened = open_envelope(
        frame, remote_peer=signer, expect=expect, limits=TensorLimits(max_bytes=1), replay=guard, now=now
    )
    return TokenReceipt.from_opened(opened)


RECEIPTS_META = "receipts"  # contribution meta key: a list of hex-encoded receipt frames


MAX_RECEIPTS = 16  # receipts one contribution may carry (the newest)


MAX_RECEIPT_BYTES = 2000  # a receipt is one small metadata-only envelope (hex: twice that, < meta's 4096)


RECEIPT_MAX_AGE_S = 3600.0


# reasons that mean someone forged or garbled a receipt: the relaying replica is struck for them; others (old,
# another stage or replica, a replay) can be honest and are only counted
FORGERY_REASONS = frozenset(
    {"bad signature", "digest mismatch", "malformed", "bad receipt", "not an authorized verifier"}
)  # the last is node.roles.stage.UNAUTHORIZED


SessionKey = tuple[str, str]  # (verifier, session)


class BadReceipt(ProtocolError):
    reason = "bad receipt"


def receipts_meta(frames: Sequence[bytes]) -> list[str]:
    """The wire form of the newest `MAX_RECEIPTS` frames (callers pass them oldest first)."""
    kept = [bytes(f) for f in frames if 0 < len(f) <= MAX_RECEIPT_BYTES][-MAX_RECEIPTS:]
    return [f.hex() for f in kept]


def parse_receipts_meta(meta: Mapping[str, Any]) -> list[bytes]:
    """Receipt frames from a contribution's meta; [] if absent. MalformedFrame if the field is not a short list
    of hex strings (that is the sender's fault)."""
    value = meta.get(RECEIPTS_META)
    if value is None:
        return []
    if type(value) is not list or len(value) > MAX_RECEIPTS:
        raise MalformedFrame("receipts must be a list of at most 16 hex strings", reason="bad receipt")
    frames = []
    for item in value:
        if type(item) is not str or not 0 < len(item) <= 2 * MAX_RECEIPT_BYTES:
            raise MalformedFrame("a receipt is a hex string", reason="bad receipt")
        try:
            frames.append(bytes.fromhex(item))
        except ValueError:
            raise MalformedFrame("a receipt is a hex string", reason="bad receipt") from None
    return frames


def verify_receipts(
    frames: Sequence[bytes],
    *,
    run_id: str,
    replica: str,
    stage: int,
    authorized_verifiers: Sequence[str],
    now: float,
    max_age_s: float = RECEIPT_MAX_AGE_S,
) -> tuple[list[TokenReceipt], list[ProtocolError]]:
    """Open every frame with `node.roles.stage.open_receipt`; returns (valid receipts, one error per rejected frame)."""
    from protocol.receipts import open_receipt

    valid, errors = [], []
    for frame in frames:
        try:
            valid.append(
                open_receipt(
                    frame,
                    run_id=run_id,
                    replica=replica,
                    stage=stage,
                    authorized_verifiers=authorized_verifiers,
                    now=now,
                    max_age_s=max_age_s,
                )
            )
        except ProtocolError as e:
            errors.append(e)
        except (
            Exception
        ) as e:  # remote bytes: whatever the parser raises is the sender's problem, not a crash
            errors.append(BadReceipt(f"receipt does not parse: {type(e).__name__}"))
    return valid, errors
