"""Swarm-wide bans: evidence round trip, 2-of-n aggregation, forged notices, equivocation proofs, expiry."""

from __future__ import annotations

import pytest
import torch

from protocol.envelope import Context, Direction, Kind, seal
from protocol.identity import NodeIdentity
from verification.bans import (
    BanEvidence,
    BanList,
    BanVote,
    SignedBoundaryHeader,
    decide_bans,
    proves_equivocation,
    signed_header_of,
    suspicious_verifiers,
    verified_slot,
)

RUN = "run-test"
OFFENDER = NodeIdentity.generate()
V1, V2, V3 = (NodeIdentity.generate().peer_id for _ in range(3))
OUTSIDER = NodeIdentity.generate().peer_id
AUTHORIZED = frozenset({V1, V2, V3})


def frame(identity: NodeIdentity, tensor: torch.Tensor, *, microbatch: int = 7, run_id: str = RUN) -> bytes:
    ctx = Context(run_id=run_id, kind=Kind.ACTIVATION, receiver=V1, stage=1, direction=Direction.FORWARD)
    return seal(identity, ctx, microbatch=microbatch, step=0, now=1000.0, tensor=tensor)


def vote(
    verifier: str, *, offender: str | None = None, expires_at: float = 500.0, evidence: bytes = b""
) -> BanVote:
    return BanVote(
        verifier=verifier,
        offender=offender or OFFENDER.peer_id,
        reason="flags",
        evidence=evidence,
        expires_at=expires_at,
    )


def test_evidence_round_trips_and_fits_the_record_cap() -> None:
    signed = signed_header_of(frame(OFFENDER, torch.ones(2, 3, 4)))
    assert signed is not None
    evidence = BanEvidence(
        offender=OFFENDER.peer_id,
        verifier=V1,
        kind="statistical",
        reason="3 flags in 20",
        stage=1,
        headers=(signed,),
        scores={"align": -80.0},
        fences={"align": (-4.0, 4.0)},
        microbatches=(1, 2, 3),
    )
    data = evidence.to_bytes()
    assert len(data) <= 8 * 1024
    assert BanEvidence.from_bytes(data) == evidence
    huge = BanEvidence(offender=OFFENDER.peer_id, verifier=V1, kind="statistical", reason="x" * 20_000)
    assert len(huge.to_bytes()) <= 8 * 1024
    with pytest.raises(ValueError):
        BanEvidence.from_bytes(b"\x93garbage")


def test_two_of_three_verifiers_are_needed() -> None:
    one = decide_bans([vote(V1)], authorized=AUTHORIZED, required=2, run_id=RUN, now=0.0)
    assert one == []
    # the same verifier twice is still one signature
    twice = decide_bans(
        [vote(V1), vote(V1, expires_at=900.0)], authorized=AUTHORIZED, required=2, run_id=RUN, now=0.0
    )
    assert twice == []
    two = decide_bans(
        [vote(V1, expires_at=300.0), vote(V2)], authorized=AUTHORIZED, required=2, run_id=RUN, now=0.0
    )
    assert [d.offender for d in two] == [OFFENDER.peer_id]
    assert two[0].verifiers == {V1, V2}
    assert two[0].until == 300.0  # it holds while two notices hold


def test_unauthorized_and_expired_notices_do_not_count() -> None:
    votes = [vote(V1), vote(OUTSIDER), vote(V2, expires_at=5.0)]
    assert decide_bans(votes, authorized=AUTHORIZED, required=2, run_id=RUN, now=10.0) == []
    self_ban = BanVote(verifier=V1, offender=V1, reason="x", evidence=b"", expires_at=500.0)
    assert decide_bans([self_ban], authorized=AUTHORIZED, required=1, run_id=RUN, now=0.0) == []


def _equivocation(offender: NodeIdentity, *, same_digest: bool = False, run_id: str = RUN) -> BanEvidence:
    a = signed_header_of(frame(offender, torch.ones(2, 3, 4), run_id=run_id))
    b = signed_header_of(frame(offender, torch.ones(2, 3, 4) * (1.0 if same_digest else 2.0), run_id=run_id))
    assert a is not None and b is not None
    return BanEvidence(
        offender=offender.peer_id,
        verifier=V1,
        kind="equivocation",
        reason="two digests",
        stage=1,
        headers=(a, b),
    )


def test_equivocation_proof_bans_alone_and_is_checked() -> None:
    proof = _equivocation(OFFENDER)
    assert proves_equivocation(proof, RUN)
    banned = decide_bans(
        [vote(V1, evidence=proof.to_bytes())], authorized=AUTHORIZED, required=2, run_id=RUN, now=0.0
    )
    assert banned and banned[0].proof
    # the same digest twice is a retry, not an equivocation
    assert not proves_equivocation(_equivocation(OFFENDER, same_digest=True), RUN)
    # another run's headers prove nothing here
    assert not proves_equivocation(_equivocation(OFFENDER, run_id="other-run"), RUN)
    # headers signed by someone else cannot frame the offender
    framed = _equivocation(NodeIdentity.generate())
    forged = BanEvidence(
        offender=OFFENDER.peer_id, verifier=V1, kind="equivocation", reason="forged", headers=framed.headers
    )
    assert not proves_equivocation(forged, RUN)
    assert (
        decide_bans(
            [vote(V1, evidence=forged.to_bytes())], authorized=AUTHORIZED, required=2, run_id=RUN, now=0.0
        )
        == []
    )


def test_tampered_header_fails_the_signature() -> None:
    signed = signed_header_of(frame(OFFENDER, torch.ones(2, 3, 4)))
    assert signed is not None and verified_slot(OFFENDER.peer_id, signed) is not None
    tampered = type(signed)(signed.header[:-1] + bytes([signed.header[-1] ^ 1]), signed.signature)
    assert verified_slot(OFFENDER.peer_id, tampered) is None
    assert signed_header_of(b"\x00\x00\x00\x09abc") is None


def test_ban_list_expires_with_the_passed_clock() -> None:
    bans = BanList()
    decisions = decide_bans(
        [vote(V1, expires_at=100.0)], authorized=AUTHORIZED, required=1, run_id=RUN, now=0.0
    )
    fresh = bans.update(decisions, now=0.0)
    assert [d.offender for d in fresh] == [OFFENDER.peer_id]
    assert bans.update(decisions, now=1.0) == []  # not new the second time
    assert bans.is_banned(OFFENDER.peer_id, 50.0)
    assert OFFENDER.peer_id in bans.active(50.0)
    assert not bans.is_banned(OFFENDER.peer_id, 100.0)
    assert bans.active(100.0) == frozenset()


def test_a_verifier_that_accuses_alone_is_suspicious() -> None:
    offenders = [NodeIdentity.generate().peer_id for _ in range(6)]
    votes = [vote(V3, offender=o) for o in offenders]  # V3 accuses six peers nobody else accuses
    votes += [vote(V1, offender=offenders[0]), vote(V2, offender=offenders[0])]
    assert suspicious_verifiers(votes, required=2) == {V3: 5}
    agreeing = [vote(v, offender=o) for o in offenders[:3] for v in (V1, V2, V3)]
    assert suspicious_verifiers(agreeing, required=2) == {}


def _answer(step: int, value: float, *, input_digest: str = "ab" * 32) -> SignedBoundaryHeader | None:
    ctx = Context(run_id=RUN, kind=Kind.ACTIVATION, receiver=V1, stage=1, direction=Direction.FORWARD)
    sealed = seal(
        OFFENDER,
        ctx,
        microbatch=7,
        step=step,
        now=1000.0,
        tensor=torch.full((2, 3, 4), value),
        meta={"input_digest": input_digest},
    )
    return signed_header_of(sealed)


def test_a_context_rebuilt_after_a_step_never_frames_an_honest_replica() -> None:
    # The replica answered microbatch 7 at inner step 3, lost the context, stepped, and answered the same input
    # again at step 4 with its new weights: two honest statements, each signed with the step it computed at.
    first, rebuilt = _answer(3, 1.0), _answer(4, 2.0)
    evidence = BanEvidence(
        offender=OFFENDER.peer_id, verifier=V1, kind="equivocation", reason="x", headers=(first, rebuilt)
    )
    assert not proves_equivocation(evidence, RUN)
    assert (
        decide_bans(
            [vote(V1, evidence=evidence.to_bytes())], authorized=AUTHORIZED, required=2, run_id=RUN, now=0.0
        )
        == []
    )
    # two payloads at one step for one input are still a proof
    lie = BanEvidence(
        offender=OFFENDER.peer_id,
        verifier=V1,
        kind="equivocation",
        reason="x",
        headers=(rebuilt, _answer(4, 3.0)),
    )
    assert proves_equivocation(lie, RUN)
    # negative control: compared without the step (the slot before it was bound), the rebuilt context was "proof"
    a, b = verified_slot(OFFENDER.peer_id, first), verified_slot(OFFENDER.peer_id, rebuilt)
    assert a is not None and b is not None and (a.step, b.step) == (3, 4)
    without_step = [(s.run_id, s.stage, s.direction, s.microbatch, s.input_digest) for s in (a, b)]
    assert without_step[0] == without_step[1] and a.digest != b.digest
