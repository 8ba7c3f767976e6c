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
    proof_meta,
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
    verify_admission(_pow(), RUN, PEER, proof_meta(nonce))  # no raise


def test_a_proof_is_bound_to_its_run_and_to_its_peer() -> None:
    nonce = solve(RUN, PEER, 16)  # 16 bits: a random nonce passes with probability 2^-16
    with pytest.raises(AdmissionRefused, match="leading zero bits") as wrong_run:
        verify_admission(_pow(16), OTHER_RUN, PEER, proof_meta(nonce))
    assert wrong_run.value.reason == "admission"
    with pytest.raises(AdmissionRefused, match="leading zero bits"):
        verify_admission(_pow(16), RUN, OTHER_PEER, proof_meta(nonce))  # a Sybil cannot reuse it


def test_a_proof_of_too_few_bits_is_refused() -> None:
    nonce = solve(RUN, PEER, 4)
    while leading_zero_bits(proof_digest(RUN, PEER, nonce)) >= 12:  # one with exactly too few bits
        nonce = solve(RUN, PEER, 4, start=nonce + 1)
    with pytest.raises(AdmissionRefused, match="< 12"):
        verify_admission(_pow(12), RUN, PEER, proof_meta(nonce))


@pytest.mark.parametrize("proof", [None, {}, {"nonce": "12"}, {"nonce": -1}, {"nonce": 2**64}, [1], 7])
def test_a_missing_or_malformed_proof_is_refused(proof: object) -> None:
    with pytest.raises(AdmissionRefused):
        verify_admission(_pow(), RUN, PEER, proof)


def test_allowlist_admits_only_listed_peers_and_open_admits_anyone() -> None:
    allow = AdmissionSpec(mode="allowlist", allowlist=(PEER,))
    verify_admission(allow, RUN, PEER, None)
    with pytest.raises(AdmissionRefused, match="allow-list"):
        verify_admission(allow, RUN, OTHER_PEER, proof_meta(solve(RUN, OTHER_PEER, 0)))
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
    assert cached[f"{RUN}/{PEER}"]["nonce"] == meta["nonce"]
    assert obtain_proof(tmp_path, spec, RUN, PEER) == meta  # from the cache
    # another run, or a harder difficulty, is not served by that entry
    assert cached_nonce(tmp_path, spec, OTHER_RUN, PEER) is None
    harder = _pow(BITS + 6)
    if leading_zero_bits(proof_digest(RUN, PEER, meta["nonce"])) < harder.pow_bits:
        assert cached_nonce(tmp_path, harder, RUN, PEER) is None
    assert obtain_proof(tmp_path, AdmissionSpec(mode="open"), RUN, PEER) is None


def _core(admission: AdmissionSpec) -> SyncerCore:
    return make_core(admission=admission, run_id=RUN)


def test_the_syncer_core_refuses_a_push_without_admission_and_counts_it() -> None:
    core = _core(_pow())
    core.admit_push(PEER, proof_meta(solve(RUN, PEER, BITS)), now=1.0)  # paid: admitted
    for _ in range(3):
        with pytest.raises(Refusal) as refused:
            core.admit_push(OTHER_PEER, None, now=1.0)
        assert refused.value.reason == "admission" and refused.value.blame_sender
    assert core.gate.refused == {OTHER_PEER: 3}
    # a stolen proof (another peer's) does not admit
    with pytest.raises(Refusal):
        core.admit_push(OTHER_PEER, proof_meta(solve(RUN, PEER, 16)), now=1.0)
    # negative control: an open run (the defence off) admits the same push
    _core(AdmissionSpec(mode="open")).admit_push(OTHER_PEER, None, now=1.0)
