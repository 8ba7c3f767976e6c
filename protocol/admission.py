"""Admission: what an identity must show before the syncer takes its contributions (issue 18, Sybil resistance).

The run owner sets the cost in the manifest's `[admission]` table:

* `open`: anyone may contribute (the cost of an identity is nothing: a Sybil burst is bounded only by the
  seniority cap of node.diloco.seniority);
* `allowlist`: only the peer ids listed in `allowlist`;
* `pow` (the default): a proof-of-work, a nonce such that sha256(domain, run id, peer id, nonce) has at least
  `pow_bits` leading zero bits. It is bound to the run and to the peer id (the public key), so a proof can be
  reused neither in another run nor by another identity: each Sybil pays again. Verifying it is one hash.

Pure: no I/O and no clock. The node solves once and caches the proof (node.swarm.admission); learners and stages
send it in their push meta under `ADMISSION_META`; the syncer checks it (node.diloco.syncer_core.admit_push).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from protocol.errors import ProtocolError

ADMISSION_MODES = ("open", "allowlist", "pow")
ADMISSION_META = (
    "admission"  # the push meta key that carries the proof: its nonce, an int (meta holds scalars)
)
DEFAULT_POW_BITS = 22  # ~4 M hashes: a few seconds of one CPU core per identity (docs/security.md)
MAX_POW_BITS = 48  # beyond this no volunteer could ever join
MAX_NONCE = 2**63 - 1  # msgpack int range, and far beyond any search
_DOMAIN = b"hivenode-admission-v1\x00"


ADMISSION_CAUSES = ("not_allowlisted", "no_proof", "malformed_proof", "weak_proof")


class AdmissionRefused(ProtocolError):
    """An identity has not paid the run's admission cost; `reason` is always "admission" (what the pusher sees),
    `cause` one of ADMISSION_CAUSES (what metrics count it by), the message says why."""

    reason = "admission"

    def __init__(self, message: str, *, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True, kw_only=True, slots=True)
class AdmissionSpec:
    """The manifest's `[admission]` table."""

    mode: str = "pow"  # open | allowlist | pow
    pow_bits: int = DEFAULT_POW_BITS  # leading zero bits a proof needs (mode pow)
    allowlist: tuple[str, ...] = ()  # peer ids that may contribute (mode allowlist)

    def __post_init__(self) -> None:
        if self.mode not in ADMISSION_MODES:
            raise ValueError(f"admission.mode must be one of {ADMISSION_MODES}, got {self.mode!r}")
        bits = self.pow_bits
        if type(bits) is not int or not 0 <= bits <= MAX_POW_BITS:
            raise ValueError(f"admission.pow_bits must be an int in [0, {MAX_POW_BITS}], got {bits!r}")
        # TOML gives a list; the manifest keeps a tuple (hashable, canonical)
        object.__setattr__(self, "allowlist", tuple(self.allowlist))
        if not all(isinstance(p, str) and 0 < len(p) <= 128 for p in self.allowlist):
            raise ValueError("admission.allowlist must be a list of peer ids")
        if len(set(self.allowlist)) != len(self.allowlist):
            raise ValueError("admission.allowlist lists a peer twice")


def _prefix(run_id: str, peer_id: str) -> Any:
    """The sha256 state over the domain, the run id and the peer id (lengths first: no two inputs collide)."""
    run, peer = run_id.encode(), peer_id.encode()
    h = hashlib.sha256(_DOMAIN)
    h.update(len(run).to_bytes(2, "big") + run + len(peer).to_bytes(2, "big") + peer)
    return h


def proof_digest(run_id: str, peer_id: str, nonce: int) -> bytes:
    """sha256 over the domain, the run id, the peer id and the nonce."""
    h = _prefix(run_id, peer_id)
    h.update(nonce.to_bytes(8, "big"))
    return bytes(h.digest())


def leading_zero_bits(digest: bytes) -> int:
    value = int.from_bytes(digest, "big")
    return len(digest) * 8 - value.bit_length()


def solve(
    run_id: str,
    peer_id: str,
    bits: int,
    *,
    start: int = 0,
    progress: Callable[[int], None] | None = None,
    progress_every: int = 1 << 20,
) -> int:
    """The first nonce from `start` whose proof has `bits` leading zero bits (expected 2^bits hashes).
    `progress(hashes tried)` is called every `progress_every` hashes (the node logs it; a test may stop early by
    raising from it)."""
    if not 0 <= bits <= MAX_POW_BITS:
        raise ValueError(f"bits must be in [0, {MAX_POW_BITS}]")
    prefix = _prefix(run_id, peer_id)
    limit = 1 << (256 - bits)  # a digest below this has >= bits leading zero bits
    nonce = start
    while nonce <= MAX_NONCE:
        h = prefix.copy()  # the shared prefix hashed once: the loop is one sha256 block per nonce
        h.update(nonce.to_bytes(8, "big"))
        if int.from_bytes(h.digest(), "big") < limit:
            return nonce
        nonce += 1
        if progress is not None and (nonce - start) % progress_every == 0:
            progress(nonce - start)
    raise ValueError("no nonce found")  # pragma: no cover - 2^63 hashes


def verify_admission(spec: AdmissionSpec, run_id: str, peer_id: str, proof: object) -> None:
    """Raise AdmissionRefused unless `peer_id` may contribute to `run_id` with `proof` (the push meta's
    `ADMISSION_META` value: the nonce; None when absent). Cost: one hash at most."""
    if spec.mode == "open":
        return
    if spec.mode == "allowlist":
        if peer_id not in spec.allowlist:
            raise AdmissionRefused(f"{peer_id[-8:]} is not on the run's allow-list", cause="not_allowlisted")
        return
    if proof is None:
        raise AdmissionRefused(f"{peer_id[-8:]} sent no proof-of-work", cause="no_proof")
    if type(proof) is not int or not 0 <= proof <= MAX_NONCE:
        raise AdmissionRefused(f"{peer_id[-8:]} sent a malformed proof-of-work", cause="malformed_proof")
    got = leading_zero_bits(proof_digest(run_id, peer_id, proof))
    if got < spec.pow_bits:
        # a proof of another run or another peer lands here too: it is bound to both
        raise AdmissionRefused(
            f"{peer_id[-8:]}'s proof has {got} leading zero bits < {spec.pow_bits}", cause="weak_proof"
        )


def pays_admission(spec: AdmissionSpec, run_id: str, peer_id: str, proof: object) -> bool:
    """Whether `peer_id` has paid an admission cost that costs something: on the allow-list (mode allowlist), or
    with a valid `proof` (mode pow). Never in mode open: there anybody is admitted, so being admitted sets nobody
    apart from a free Sybil identity (what the DHT record budget and the syncer's stream slots reserve for admitted
    peers is then reserved for nobody more). One hash at most."""
    if spec.mode == "open":
        return False
    try:
        verify_admission(spec, run_id, peer_id, proof)
    except AdmissionRefused:
        return False
    return True


__all__ = [
    "ADMISSION_CAUSES",
    "ADMISSION_META",
    "ADMISSION_MODES",
    "AdmissionRefused",
    "AdmissionSpec",
    "pays_admission",
    "proof_digest",
    "solve",
    "verify_admission",
]
