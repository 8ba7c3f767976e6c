"""Admission (issue 18, Sybil resistance): the proof-of-work bound to the run and the peer id, the allow-list and
open modes, the manifest's `[admission]` table, the node's cached proof, and the syncer core's `admit_push`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from node.diloco.syncer_core import Refusal, SyncerCore
from node.swarm.admission import ADMISSION_FILE, cached_nonce, obtain_proof
from protocol.admission import (
    AdmissionRefused,
    AdmissionSpec,
    leading_zero_bits,
    proof_digest,
    solve,
    verify_admission,
)
from protocol.errors import ConfigError
from protocol.identity import NodeIdentity
from protocol.manifest import RunManifest, parse_run_toml
from tests.unit.test_syncer_core import core as make_core

pytestmark = pytest.mark.timeout(60)

RUN = "a" * 40
OTHER_RUN = "b" * 40
BITS = 10  # ~1,000 hashes: milliseconds
PEER = NodeIdentity.generate().peer_id
OTHER_PEER = NodeIdentity.generate().peer_id


def _pow(bits: int = BITS) -> AdmissionSpec:
    return AdmissionSpec(mode="pow", pow_bits=bits)


def test_a_solved_proof_verifies_and_has_the_bits() -> None:
    nonce = solve(RUN, PEER, BITS)
    assert leading_zero_bits(proof_digest(RUN, PEER, nonce)) >= BITS
    verify_admission(_pow(), RUN, PEER, nonce)  # no raise


def test_a_proof_is_bound_to_its_run_and_to_its_peer() -> None:
    nonce = solve(RUN, PEER, 16)  # 16 bits: a random nonce passes with probability 2^-16
    with pytest.raises(AdmissionRefused, match="leading zero bits") as wrong_run:
        verify_admission(_pow(16), OTHER_RUN, PEER, nonce)
    assert wrong_run.value.reason == "admission" and wrong_run.value.cause == "weak_proof"
    with pytest.raises(AdmissionRefused, match="leading zero bits"):
        verify_admission(_pow(16), RUN, OTHER_PEER, nonce)  # a Sybil cannot reuse it


def test_a_proof_of_too_few_bits_is_refused() -> None:
    nonce = solve(RUN, PEER, 4)
    while leading_zero_bits(proof_digest(RUN, PEER, nonce)) >= 12:  # one with exactly too few bits
        nonce = solve(RUN, PEER, 4, start=nonce + 1)
    with pytest.raises(AdmissionRefused, match="< 12"):
        verify_admission(_pow(12), RUN, PEER, nonce)


@pytest.mark.parametrize("proof", [None, {}, {"nonce": 7}, "12", -1, 2**64, [1], 1.0, True])
def test_a_missing_or_malformed_proof_is_refused(proof: object) -> None:
    with pytest.raises(AdmissionRefused) as refused:
        verify_admission(_pow(), RUN, PEER, proof)
    assert refused.value.cause == ("no_proof" if proof is None else "malformed_proof")  # /metrics' label


def test_allowlist_admits_only_listed_peers_and_open_admits_anyone() -> None:
    allow = AdmissionSpec(mode="allowlist", allowlist=(PEER,))
    verify_admission(allow, RUN, PEER, None)
    with pytest.raises(AdmissionRefused, match="allow-list") as refused:
        verify_admission(allow, RUN, OTHER_PEER, solve(RUN, OTHER_PEER, 0))
    assert refused.value.cause == "not_allowlisted"
    verify_admission(AdmissionSpec(mode="open"), RUN, OTHER_PEER, None)  # the defence off: no cost at all


def test_the_manifest_defaults_to_pow_and_reads_the_admission_table() -> None:
    default = RunManifest()
    assert default.admission.mode == "pow" and default.admission.pow_bits == 22
    run = parse_run_toml(f'[admission]\nmode = "allowlist"\nallowlist = ["{PEER}"]\n')
    assert run.admission.allowlist == (PEER,)
    assert RunManifest.from_canonical_bytes(run.to_canonical_bytes()) == run
    for bad in ('mode = "free"', "pow_bits = 49", "pow_bits = 2.5", 'allowlist = ["not-a-peer"]', "x = 1"):
        with pytest.raises(ConfigError, match="admission"):
            parse_run_toml(f"[admission]\n{bad}\n")


def test_the_node_solves_once_and_caches_its_proof(tmp_path: Path) -> None:
    spec = _pow()
    meta = obtain_proof(tmp_path, spec, RUN, PEER)
    assert meta is not None
    verify_admission(spec, RUN, PEER, meta)
    cached = json.loads((tmp_path / ADMISSION_FILE).read_text())
    assert cached[f"{RUN}/{PEER}"]["nonce"] == meta
    assert obtain_proof(tmp_path, spec, RUN, PEER) == meta  # from the cache
    # another run, or a harder difficulty, is not served by that entry
    assert cached_nonce(tmp_path, spec, OTHER_RUN, PEER) is None
    harder = _pow(BITS + 6)
    if leading_zero_bits(proof_digest(RUN, PEER, meta)) < harder.pow_bits:
        assert cached_nonce(tmp_path, harder, RUN, PEER) is None
    assert obtain_proof(tmp_path, AdmissionSpec(mode="open"), RUN, PEER) is None


def _core(admission: AdmissionSpec) -> SyncerCore:
    return make_core(admission=admission, run_id=RUN)


def test_the_syncer_core_refuses_a_push_without_admission_and_counts_it() -> None:
    core = _core(_pow())
    core.admit_push(PEER, solve(RUN, PEER, BITS), now=1.0)  # paid: admitted
    for _ in range(3):
        with pytest.raises(Refusal) as refused:
            core.admit_push(OTHER_PEER, None, now=1.0)
        assert refused.value.reason == "admission" and refused.value.blame_sender
    assert core.gate.refused == {OTHER_PEER: 3}
    # a stolen proof (another peer's) does not admit
    with pytest.raises(Refusal):
        core.admit_push(OTHER_PEER, solve(RUN, PEER, 16), now=1.0)
    # negative control: an open run (the defence off) admits the same push
    _core(AdmissionSpec(mode="open")).admit_push(OTHER_PEER, None, now=1.0)


def test_a_push_meta_with_the_proof_seals_into_an_envelope() -> None:
    """The proof travels as the nonce itself: envelope meta holds scalars only (a dict there failed every push)."""
    import torch

    from node.diloco.sync_client import contribution_meta
    from node.diloco.sync_types import OutgoingContribution
    from protocol.envelope import Context, Kind, seal

    identity = NodeIdentity.generate()
    nonce = solve(RUN, identity.peer_id, BITS)
    outgoing = OutgoingContribution(
        fragment=0, params={"w": torch.zeros(2)}, base_version=0, steps=1, tokens=8, sent_step=1,
        sched_step=1, step_time_s=0.1,
    )  # fmt: skip
    meta = contribution_meta(outgoing, admission=nonce)
    assert meta["admission"] == nonce and "admission" not in contribution_meta(outgoing)
    context = Context(run_id=RUN, kind=Kind.FRAGMENT, receiver=OTHER_PEER)
    seal(identity, context, microbatch=0, step=0, now=1.0, tensors=outgoing.params, meta=meta)
