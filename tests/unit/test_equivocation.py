"""Equivocation detector: two digests signed for one slot by one signer is proof; memory is bounded."""

from __future__ import annotations

import pytest

from verification.equivocation import EquivocationConfig, EquivocationDetector, SignedHeader, Slot


def signed(digest: bytes, tag: bytes = b"") -> SignedHeader:
    return SignedHeader(header=b"hdr:" + digest + tag, signature=b"sig:" + digest + tag, digest=digest)


SLOT = Slot(run_id="run", microbatch_id=7, stage=1, direction="forward")


def test_two_digests_for_one_slot_yield_a_proof_with_both_headers() -> None:
    det = EquivocationDetector()
    first, second = signed(b"\x01" * 32), signed(b"\x02" * 32)
    assert det.observe("peer", SLOT, first, now=1.0) is None
    proof = det.observe("peer", SLOT, second, now=2.0)
    assert proof is not None
    assert (proof.signer, proof.slot, proof.first, proof.second) == ("peer", SLOT, first, second)
    assert (proof.first_seen, proof.second_seen) == (1.0, 2.0)
    assert "equivocation by peer" in proof.reason and "0101" in proof.reason


def test_a_retry_of_the_same_payload_is_not_equivocation() -> None:
    det = EquivocationDetector()
    # a resend may carry a fresh header/signature (timestamp, nonce) over the same payload digest
    assert det.observe("peer", SLOT, signed(b"\x01" * 32), now=1.0) is None
    assert det.observe("peer", SLOT, signed(b"\x01" * 32, tag=b"retry"), now=2.0) is None


def test_a_new_input_for_the_same_microbatch_is_a_new_slot() -> None:
    # The verifier rerouted upstream: the replica answers a different request, so a different payload is honest.
    det = EquivocationDetector()
    first = Slot(run_id="run", microbatch_id=7, stage=1, direction="forward", input_digest="aa")
    rerouted = Slot(run_id="run", microbatch_id=7, stage=1, direction="forward", input_digest="bb")
    assert det.observe("peer", first, signed(b"\x01" * 32), now=1.0) is None
    assert det.observe("peer", rerouted, signed(b"\x02" * 32), now=2.0) is None
    assert det.observe("peer", first, signed(b"\x03" * 32), now=3.0) is not None  # same input, new payload


@pytest.mark.parametrize(
    "other_signer, other_slot",
    [
        ("other-peer", SLOT),
        ("peer", Slot(run_id="run", microbatch_id=8, stage=1, direction="forward")),
        ("peer", Slot(run_id="run", microbatch_id=7, stage=1, direction="backward")),
        ("peer", Slot(run_id="run", microbatch_id=7, stage=2, direction="forward")),
        ("peer", Slot(run_id="run2", microbatch_id=7, stage=1, direction="forward")),
    ],
)
def test_different_slots_or_signers_never_conflict(other_signer: str, other_slot: Slot) -> None:
    det = EquivocationDetector()
    det.observe("peer", SLOT, signed(b"\x01" * 32), now=0.0)
    assert det.observe(other_signer, other_slot, signed(b"\x02" * 32), now=0.0) is None


def test_entries_expire_with_the_passed_clock() -> None:
    det = EquivocationDetector(EquivocationConfig(ttl_s=10.0))
    det.observe("peer", SLOT, signed(b"\x01" * 32), now=0.0)
    assert det.observe("peer", SLOT, signed(b"\x02" * 32), now=5.0) is not None
    det2 = EquivocationDetector(EquivocationConfig(ttl_s=10.0))
    det2.observe("peer", SLOT, signed(b"\x01" * 32), now=0.0)
    assert det2.observe("peer", SLOT, signed(b"\x02" * 32), now=10.5) is None  # forgotten
    assert len(det2) == 1


def test_memory_is_bounded_and_the_oldest_go_first() -> None:
    det = EquivocationDetector(EquivocationConfig(max_entries=100))
    for mb in range(1000):
        slot = Slot(run_id="run", microbatch_id=mb, stage=0, direction="forward")
        det.observe("peer", slot, signed(b"\x01" * 32), now=float(mb))
    assert len(det) == 100
    recent = Slot(run_id="run", microbatch_id=999, stage=0, direction="forward")
    old = Slot(run_id="run", microbatch_id=0, stage=0, direction="forward")
    assert det.observe("peer", recent, signed(b"\x02" * 32), now=1000.0) is not None
    assert det.observe("peer", old, signed(b"\x02" * 32), now=1000.0) is None


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        EquivocationConfig(max_entries=0)
    with pytest.raises(ValueError):
        EquivocationConfig(ttl_s=0.0)


def test_a_context_rebuilt_after_the_replica_stepped_is_a_new_slot() -> None:
    det = EquivocationDetector()
    at_step = {
        s: Slot(run_id="run", microbatch_id=7, stage=1, direction="forward", input_digest="aa", step=s)
        for s in (3, 4)
    }
    assert det.observe("peer", at_step[3], signed(b"\x01" * 32), now=1.0) is None
    assert det.observe("peer", at_step[4], signed(b"\x02" * 32), now=2.0) is None  # new weights, honest
    assert det.observe("peer", at_step[4], signed(b"\x03" * 32), now=3.0) is not None  # same step: a lie
    # negative control: a slot that ignores the step turns the honest rebuild into a proof
    blind = Slot(run_id="run", microbatch_id=7, stage=1, direction="forward", input_digest="aa")
    det2 = EquivocationDetector()
    assert det2.observe("peer", blind, signed(b"\x01" * 32), now=1.0) is None
    assert det2.observe("peer", blind, signed(b"\x02" * 32), now=2.0) is not None
