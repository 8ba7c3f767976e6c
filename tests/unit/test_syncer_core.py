"""The syncer's network-free parts: admission, quorum-driven merges, the three modes, counter caps, idempotency,
adoption of newer versions, checkpoints, and the lease decision."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from node.diloco.merge import NothingToMerge
from node.diloco.quorum import PeerStepTimes, QuorumConfig
from node.diloco.receipts import ReceiptLedger
from node.diloco.sync_client import run_fragment_plan
from node.diloco.syncer_core import probe_base
from node.ml.checkpoint import CheckpointError, checkpoint_path, load_checkpoint, save_checkpoint
from node.ml.model import ModelConfig, build_model, embedding_param_names
from node.roles.syncer import LeaseView, Refusal, SyncerConfig, SyncerCore, lease_action, quorum_config
from protocol.errors import ConfigError, MalformedFrame, ProtocolError
from protocol.identity import NodeIdentity
from protocol.manifest import DilocoSpec, RunManifest
from protocol.receipts import (
    FORGERY_REASONS,
    TokenReceipt,
    parse_receipts_meta,
    receipts_meta,
    verify_receipts,
)
from protocol.records import SyncerRecord, SyncerState
from tests.unit.params_modes import IN_MEMORY_ONLY

MODEL = {"vocab_size": 256, "context_len": 16, "num_layers": 2, "width": 16, "num_heads": 2}
RUN = RunManifest(model=dict(MODEL), num_stages=1, diloco=DilocoSpec(num_fragments=2, sync_every_steps=4))
PLAN = run_fragment_plan(RUN)
CFG = ModelConfig.from_dict(MODEL)

pytestmark = pytest.mark.usefixtures("params_mode")


def core(quorum: QuorumConfig | None = None, *, now: float = 0.0, **kwargs: object) -> SyncerCore:
    model = build_model(CFG, seed=0)
    options = {
        "quorum": quorum or QuorumConfig.decoupled(1, grace_gamma=0.0),
        "embedding_names": embedding_param_names(CFG),
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "clip_factor": 3.0,
        "max_staleness": 2,
        "max_steps_per_s": 10.0,
        "tokens_per_step": 64,
        "now": now,
    }
    options.update(kwargs)
    return SyncerCore(PLAN, dict(model.named_parameters()), **options)  # type: ignore[arg-type]


def learner_params(c: SyncerCore, fragment: int, shift: float) -> dict[str, torch.Tensor]:
    return {n: t + shift * torch.randn_like(t) for n, t in c.fragment_tensors(fragment).items()}


def push(
    c: SyncerCore,
    peer: str,
    fragment: int = 0,
    *,
    now: float = 10.0,
    steps: int = 4,
    base: int = 0,
    nonce: bytes = b"n" * 16,
    shift: float = 0.01,
    params: dict[str, torch.Tensor] | None = None,
):  # noqa: ANN201
    return c.accept(
        peer,
        fragment,
        learner_params(c, fragment, shift) if params is None else params,
        base_version=base,
        steps=steps,
        tokens=steps * 64,
        sched_step=7,
        step_time_s=0.1,
        nonce=nonce,
        now=now,
    )


def test_a_contribution_opens_a_round_and_k1_merges_it_into_version_1() -> None:
    c = core()
    admission = push(c, "a")
    assert admission.target_version == 1 and not admission.capped
    ready, _ = c.due(10.0, lambda _f: 3)
    assert ready == [0]
    before = c.fragment_tensors(0)
    record = c.merge_now(0, 3, 10.0)
    assert record is not None and record.version == 1 and record.participants == ("a",)
    assert record.tokens == 4 * 64 and c.tokens_merged == 256 and c.versions[0] == 1
    assert any(not torch.equal(before[n], t) for n, t in c.fragment_tensors(0).items())
    assert c.clock == 7


def test_tokens_in_model_counts_a_learners_tokens_once_over_its_fragments() -> None:
    c = core()
    # one learner's sync: the same 4 steps' tokens on every fragment
    for fragment in range(PLAN.num_fragments):
        push(c, "a", fragment, nonce=bytes([fragment]) * 16)
        assert c.merge_now(fragment, 1, 10.0) is not None
    assert PLAN.num_fragments > 1
    assert c.tokens_merged == PLAN.num_fragments * 4 * 64
    assert c.tokens_in_model == 4 * 64


def test_grace_window_waits_for_latecomers_then_merges_all_of_them() -> None:
    c = core(QuorumConfig.decoupled(1, grace_gamma=0.8, max_grace_steps=1.0))
    push(c, "a", now=10.0)
    ready, deadline = c.due(10.0, lambda _f: 3)
    assert (
        ready == [] and deadline is not None and math.isclose(deadline, 10.0 + 0.1 * 1.0)
    )  # capped at one step
    push(c, "b", now=10.05, nonce=b"m" * 16)
    ready, _ = c.due(10.2, lambda _f: 3)
    assert ready == [0]
    record = c.merge_now(0, 3, 10.2)
    assert record is not None and set(record.participants) == {"a", "b"} and record.grace_waited_s >= 0


def test_synchronous_mode_waits_for_all_m_even_when_the_membership_says_fewer() -> None:
    c = core(quorum_config(DilocoSpec(mode="sync", sync_learners=3), max_grace_s=5.0))
    push(c, "a")
    push(c, "b")
    assert c.due(100.0, lambda _f: 2)[0] == []  # a dead third learner still holds the round
    push(c, "c")
    assert c.due(100.0, lambda _f: 2)[0] == [0]


def test_elastic_synchronous_mode_waits_for_every_live_learner() -> None:
    c = core(quorum_config(DilocoSpec(mode="elastic_sync"), max_grace_s=5.0))
    push(c, "a")
    assert c.due(100.0, lambda _f: 2)[0] == []
    assert c.due(100.0, lambda _f: 1)[0] == [0]  # the other one's heartbeat expired


def test_a_contribution_from_a_peer_outside_the_live_set_never_stands_in_for_a_live_one() -> None:
    """An elastic round with live learners a, b, c: b stopped long enough for its heartbeat to expire, then
    sent; its contribution must not complete the round while the live c has not sent yet."""
    c = core(quorum_config(DilocoSpec(mode="elastic_sync"), max_grace_s=5.0))
    live = {"a", "c", "d"}  # b's heartbeat expired
    push(c, "a")
    push(c, "b")
    push(c, "d")
    assert c.due(100.0, lambda _f: live)[0] == []  # c is live and missing
    assert c.due(100.0, lambda _f: len(live))[0] == [0]  # negative control: by count, b stands in for c
    push(c, "c")
    assert c.due(100.0, lambda _f: live)[0] == [0]
    taken = c.take_round(0, live, 100.0)
    assert taken is not None and taken[1:] == (4, 4)  # every one in counts, the round waited for all live


def test_counters_are_capped_by_elapsed_time_and_batch_size() -> None:
    c = core(now=0.0)
    admission = c.accept(
        "a",
        0,
        learner_params(c, 0, 0.01),
        base_version=0,
        steps=1000,
        tokens=10**9,
        sched_step=1,
        step_time_s=0.1,
        nonce=b"x" * 16,
        now=2.0,
    )
    assert admission.capped
    entry = c.rounds[0].entries["a"]
    assert entry.contribution.steps == 20 and entry.contribution.tokens == 20 * 64  # 2 s x 10 steps/s


def test_stale_ahead_malformed_and_duplicate_contributions_are_refused() -> None:
    c = core()
    for version in range(4):
        now = 10.0 * (version + 1)
        push(c, "a", base=version, nonce=bytes([version]) * 16, now=now)
        c.merge_now(0, 1, now)
    assert c.versions[0] == 4
    with pytest.raises(Refusal) as stale:
        push(c, "b", base=1, now=50.0)
    assert stale.value.reason == "stale base" and not stale.value.blame_sender
    with pytest.raises(Refusal) as ahead:
        push(c, "b", base=5)
    assert ahead.value.reason == "ahead of syncer"
    with pytest.raises(MalformedFrame):
        c.accept(
            "b",
            0,
            {"nope": torch.zeros(2)},
            base_version=4,
            steps=1,
            tokens=1,
            sched_step=0,
            step_time_s=0.1,
            nonce=b"z" * 16,
            now=10.0,
        )
    wrong_shape = {n: torch.zeros(3) for n in PLAN.fragments[0].names}
    with pytest.raises(MalformedFrame):
        c.accept(
            "b",
            0,
            wrong_shape,
            base_version=4,
            steps=1,
            tokens=1,
            sched_step=0,
            step_time_s=0.1,
            nonce=b"z" * 16,
            now=10.0,
        )
    with pytest.raises(Refusal) as duplicate:
        push(c, "a", base=3, nonce=bytes([3]) * 16)
    assert duplicate.value.reason == "duplicate" and duplicate.value.blame_sender


def test_a_peer_has_one_contribution_per_round_the_newest() -> None:
    c = core()
    push(c, "a", steps=2, nonce=b"1" * 16)
    push(c, "a", steps=5, nonce=b"2" * 16)
    assert len(c.rounds[0].entries) == 1 and c.rounds[0].entries["a"].contribution.steps == 5
    record = c.merge_now(0, 1, 10.0)
    assert record is not None and record.tokens == 5 * 64  # counted once


def test_a_merged_claim_cannot_be_claimed_again_on_the_same_base() -> None:
    c = core(
        quorum_config(DilocoSpec(mode="elastic_sync"), max_grace_s=5.0), now=0.0
    )  # a mode that takes contributions on an older base
    push(c, "a", base=0, steps=20, now=2.0, nonce=b"1" * 16)
    c.merge_now(0, 1, 2.0)
    # the same learner, not having applied version 1, claims its old steps again 0.5 s later
    c.accept(
        "a",
        0,
        learner_params(c, 0, 0.01),
        base_version=0,
        steps=25,
        tokens=25 * 64,
        sched_step=1,
        step_time_s=0.1,
        nonce=b"2" * 16,
        now=2.5,
    )
    assert c.rounds[0].entries["a"].contribution.steps == 5  # only what 0.5 s since the merge allows


def test_adopt_moves_versions_forward_only_and_snapshots_round_trip(tmp_path: Path) -> None:
    c = core()
    newer = {n: torch.full_like(t, 0.5) for n, t in c.fragment_tensors(1).items()}
    assert c.adopt(1, 7, newer, 1.0) and c.versions[1] == 7
    assert not c.adopt(1, 6, newer, 1.0)
    push(c, "a")
    c.merge_now(0, 1, 10.0)
    path = checkpoint_path(tmp_path, "ab" * 20)
    save_checkpoint(path, c.snapshot("ab" * 20, term=3))
    loaded = load_checkpoint(path, run_id="ab" * 20, expected=c.shapes, num_fragments=PLAN.num_fragments)
    assert loaded.versions == tuple(c.versions) and loaded.term == 3 and loaded.merges == 1
    assert loaded.momentum.keys() == c.snapshot("ab" * 20, term=3).momentum.keys()
    fresh = core()
    fresh.restore(loaded, 20.0)
    assert fresh.versions == c.versions
    assert all(torch.equal(fresh.params[n], c.params[n]) for n in c.params)
    with pytest.raises(CheckpointError):
        load_checkpoint(path, run_id="cd" * 20, expected=c.shapes, num_fragments=PLAN.num_fragments)


def test_work_on_a_restored_or_adopted_version_is_capped_from_its_publication_not_from_the_takeover(
    tmp_path: Path,
) -> None:
    """Max 10 steps/s. Version 1 of fragment 0 was published at t = 10 (wall 1010); the primary died and a
    successor restored at t = 60 (wall 1060). A learner that stepped 40 times on it through the outage claims
    40 steps at t = 61: 51 s since the publication allow it, the 1 s since the restore would allow 10."""
    primary = core(now=0.0)
    push(primary, "a", now=10.0)
    primary.merge_now(0, 1, 10.0)
    path = checkpoint_path(tmp_path, "ab" * 20)
    save_checkpoint(path, primary.snapshot("ab" * 20, term=1, wall_offset=1000.0))
    loaded = load_checkpoint(
        path, run_id="ab" * 20, expected=primary.shapes, num_fragments=PLAN.num_fragments
    )
    assert loaded.published_wall[0] == pytest.approx(1010.0)
    dated, undated = core(now=0.0), core(now=0.0)
    dated.restore(loaded, 60.0, wall_offset=1000.0)
    undated.restore(loaded, 60.0)  # negative control: no dates, capped from the restore
    assert not push(dated, "b", base=1, steps=40, now=61.0).capped
    assert push(undated, "b", base=1, steps=40, now=61.0).capped
    assert undated.rounds[0].entries["b"].contribution.steps == 10
    # adopted: dated by the envelope the learner fetched it in
    newer = {n: torch.full_like(t, 0.5) for n, t in dated.fragment_tensors(1).items()}
    assert dated.adopt(1, 3, newer, 62.0, published_at=30.0)
    assert not push(dated, "b", 1, base=3, steps=300, now=62.5).capped


def _record(peer: str, term: int, *, active: bool = True, lease_until: float = 100.0) -> SyncerRecord:
    state = SyncerState(lease_until=lease_until, term=term, state="active" if active else "standby")
    return SyncerRecord(peer_id=peer, state=state, expires_at=lease_until)


def test_lease_actions() -> None:
    empty = LeaseView(live_active=(), highest_term=2)
    assert lease_action(me="b", active=False, term=2, view=empty, vacant_looks=1) == "wait"
    assert lease_action(me="b", active=False, term=2, view=empty, vacant_looks=2) == "take_over"
    other = LeaseView(live_active=(_record("a", 3),), highest_term=3)
    assert lease_action(me="b", active=False, term=2, view=other, vacant_looks=0) == "stand_by"
    assert lease_action(me="b", active=True, term=2, view=other, vacant_looks=0) == "step_down"
    assert lease_action(me="b", active=True, term=4, view=other, vacant_looks=0) == "renew"
    tie = LeaseView(live_active=(_record("a", 4),), highest_term=4)
    assert lease_action(me="b", active=True, term=4, view=tie, vacant_looks=0) == "step_down"  # lower id wins
    assert lease_action(me="0", active=True, term=4, view=tie, vacant_looks=0) == "renew"


def test_syncer_config_defaults_follow_the_heartbeat_and_reject_unknown_keys() -> None:
    config = SyncerConfig.from_options({}, heartbeat_period_s=1.0)
    assert (config.renew_every_s, config.lease_s) == (1.0, 3.0)
    with pytest.raises(ConfigError):
        SyncerConfig.from_options({"lease": 3}, heartbeat_period_s=1.0)
    with pytest.raises(ConfigError):
        SyncerConfig.from_options({"lease_s": 1.0, "renew_every_s": 1.0}, heartbeat_period_s=1.0)


def test_a_second_contribution_on_the_same_base_counts_only_what_it_adds() -> None:
    c = core(quorum_config(DilocoSpec(mode="elastic_sync"), max_grace_s=5.0), now=0.0)
    push(c, "a", base=0, steps=4, now=5.0, nonce=b"1" * 16)
    first = c.merge_now(0, 1, 5.0)
    assert first is not None and first.tokens == 4 * 64
    # the learner missed version 1 (say, the syncer died) and sends again on base 0 with its grown counters
    push(c, "a", base=0, steps=10, now=8.0, nonce=b"2" * 16)
    assert c.rounds[0].entries["a"].contribution.steps == 6
    snapshot = c.snapshot("ab" * 20, term=1)
    assert ("a", 0, 0, 4, 4 * 64) in snapshot.merged
    fresh = core(quorum_config(DilocoSpec(mode="elastic_sync"), max_grace_s=5.0), now=0.0)
    fresh.restore(snapshot, 9.0)
    push(fresh, "a", base=0, steps=10, now=12.0, nonce=b"3" * 16)
    assert fresh.rounds[0].entries["a"].contribution.steps == 6  # the ledger survives a failover


def test_the_run_clock_is_the_median_of_extrapolated_reports() -> None:
    c = core()
    assert c.clock_estimate(0.0) == 0
    for peer, sched, nonce in (("a", 100, b"a"), ("b", 101, b"b"), ("liar", 10**6, b"l")):
        c.accept(
            peer,
            0,
            learner_params(c, 0, 0.01),
            base_version=0,
            steps=4,
            tokens=256,
            sched_step=sched,
            step_time_s=0.5,
            nonce=nonce * 16,
            now=10.0,
        )
    assert c.clock_estimate(10.0) == 101  # one outlier cannot move everyone's schedule
    assert c.clock_estimate(12.0) == 105  # extrapolated at the step-time EMA (0.5 s)
    assert c.clock_estimate(100.0) == 0  # reports older than a minute are forgotten


# ---- Q5: a contribution that missed its round gets weight 0 and never starts a round of its own


def params_with_delta(c: SyncerCore, fragment: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        n: t - 0.01 * torch.randn(t.shape, generator=gen) for n, t in c.fragment_tensors(fragment).items()
    }


def accept(c: SyncerCore, peer: str, params: dict[str, torch.Tensor], *, base: int, steps: int, now: float):  # noqa: ANN201
    return c.accept(
        peer,
        0,
        params,
        base_version=base,
        steps=steps,
        tokens=steps * 64,
        sched_step=7,
        step_time_s=0.1,
        nonce=bytes([steps, base, len(peer)]) * 4,
        now=now,
    )


def test_a_contribution_that_missed_its_round_is_refused_and_never_starts_one() -> None:
    c = core(now=0.0)
    accept(c, "a", params_with_delta(c, 0, 1), base=0, steps=4, now=10.0)
    assert c.due(10.0, lambda _f: 2)[0] == [0]
    c.merge_now(0, 2, 10.0)
    # b was a step behind a: its contribution on version 0 arrives just after version 1 was published
    with pytest.raises(Refusal) as missed:
        accept(c, "b", params_with_delta(c, 0, 2), base=0, steps=4, now=10.2)
    assert missed.value.reason == "missed round" and not missed.value.blame_sender
    assert c.due(10.3, lambda _f: 2) == ([], None) and c.versions[0] == 1  # no version 2 overwrites everyone
    accept(c, "b", params_with_delta(c, 0, 3), base=1, steps=4, now=11.0)  # on the current version: counts
    record = c.merge_now(0, 2, 11.0)
    assert record is not None and record.participants == ("b",) and record.late == 0


def test_a_stale_contribution_that_a_synchronous_mode_takes_is_a_delta_against_its_own_base() -> None:
    c = core(quorum_config(DilocoSpec(mode="elastic_sync"), max_grace_s=5.0), now=0.0)
    v0 = {n: t.clone() for n, t in c.fragment_tensors(0).items()}
    accept(c, "a", params_with_delta(c, 0, 1), base=0, steps=4, now=10.0)
    c.merge_now(0, 1, 10.0)
    v1 = {n: t.clone() for n, t in c.fragment_tensors(0).items()}
    theta_b = {n: t - 0.01 * torch.randn_like(t) for n, t in v0.items()}  # b trained on version 0
    accept(c, "b", theta_b, base=0, steps=4, now=10.2)
    round_, expected, required = c.take_round(0, 1, 11.0)
    prepared = c.compute_merge(0, round_, expected=expected, required=required, started_at=11.0)
    for n in v0:
        own = v0[n] - theta_b[n]  # what b did since it overwrote
        assert torch.allclose(v1[n] - prepared.merged["b"].params[n], own, atol=1e-6)
        # negative control: against the newest global value b's delta would also carry a's merge, reverted
        assert not torch.allclose(v1[n] - theta_b[n], own, atol=1e-6)
    record = c.commit_merge(prepared, 11.0)
    assert record.late == 1 and record.contributed["b"][0][3] == 0


def test_contributions_on_the_replaced_version_that_arrive_during_a_merge_are_dropped() -> None:
    c = core(now=0.0)
    accept(c, "a", params_with_delta(c, 0, 1), base=0, steps=4, now=10.0)
    round_, expected, required = c.take_round(0, 2, 10.0)
    prepared = c.compute_merge(0, round_, expected=expected, required=required, started_at=10.0)
    accept(c, "b", params_with_delta(c, 0, 2), base=0, steps=4, now=10.05)  # current is still 0
    assert c.rounds[0].entries
    c.commit_merge(prepared, 10.1)
    assert 0 not in c.rounds and c.due(10.2, lambda _f: 2) == ([], None)


def test_the_synchronous_modes_count_a_stale_contribution() -> None:
    c = core(quorum_config(DilocoSpec(mode="elastic_sync"), max_grace_s=5.0))
    accept(c, "a", params_with_delta(c, 0, 1), base=0, steps=4, now=10.0)
    c.merge_now(0, 1, 10.0)
    accept(c, "b", params_with_delta(c, 0, 2), base=0, steps=4, now=10.2)
    assert c.due(10.3, lambda _f: 1)[0] == [0]  # a lock-step round never waits on its own waiters


def test_a_late_lock_step_contribution_is_told_to_apply_the_version_that_exists() -> None:
    """b's round of fragment 0 merged without it. Its late contribution goes into the next round, but b must
    apply version 1 now: the next round of fragment 0 needs a, which first waits on rounds that need b."""
    c = core(quorum_config(DilocoSpec(mode="elastic_sync"), max_grace_s=5.0))
    accept(c, "a", params_with_delta(c, 0, 1), base=0, steps=4, now=10.0)
    c.merge_now(0, 1, 10.0)
    assert c.versions[0] == 1
    on_time = accept(c, "a", params_with_delta(c, 0, 1), base=1, steps=4, now=10.1)
    late = accept(c, "b", params_with_delta(c, 0, 2), base=0, steps=4, now=10.2)
    assert on_time.target_version == 2 and late.target_version == 1
    assert set(c.rounds[0].entries) == {"a", "b"}  # its work is still merged, with the next round


def test_the_grace_formulas_tau_is_at_most_the_learners_overlap() -> None:
    spec = DilocoSpec(overlap_steps=1, grace_tau=2.0, sync_every_steps=12)
    assert quorum_config(spec, max_grace_s=5.0).grace_tau == 1.0
    assert quorum_config(DilocoSpec(overlap_steps=3, grace_tau=2.0), max_grace_s=5.0).grace_tau == 2.0
    assert quorum_config(spec, max_grace_s=5.0).drop_stale
    assert not quorum_config(DilocoSpec(mode="sync", sync_learners=2), max_grace_s=5.0).drop_stale


# ---- verifier token receipts cap a stage replica's tokens


RUN_ID = "ab" * 20
VERIFIER = NodeIdentity.generate()
REPLICA = NodeIdentity.generate().peer_id


def receipt(tokens: int, *, sequence: int, signer: NodeIdentity = VERIFIER, replica: str = REPLICA) -> bytes:
    return TokenReceipt(
        verifier=signer.peer_id,
        replica=replica,
        stage=0,
        session="5e55",
        sequence=sequence,
        tokens=tokens,
        microbatches=tokens // 64,
        last_microbatch=sequence,
        issued_at=1000.0,
    ).seal(signer, RUN_ID)


def verified(frames: list[bytes]) -> tuple[list, list]:  # noqa: ANN201
    wire = parse_receipts_meta({"receipts": receipts_meta(frames)})
    return verify_receipts(
        wire, run_id=RUN_ID, replica=REPLICA, stage=0, authorized_verifiers=[VERIFIER.peer_id], now=1001.0
    )


def test_a_stage_contribution_is_capped_by_the_growth_of_its_verified_tokens() -> None:
    c = core(now=0.0)
    good, errors = verified([receipt(3 * 64, sequence=1)])
    assert len(good) == 1 and not errors
    # claims 8 steps x 64 tokens; the verifier vouched for 3 x 64 so far
    admission = c.accept(
        REPLICA, 0, learner_params(c, 0, 0.01), base_version=0, steps=8, tokens=8 * 64, sched_step=1,
        step_time_s=0.1, nonce=b"r1" * 8, now=10.0, receipts=good,
    )  # fmt: skip
    assert admission.receipt_capped and not admission.capped
    record = c.merge_now(0, 1, 10.0)
    assert record is not None and record.tokens == 3 * 64
    # next sync: the receipts grew to 10 x 64, so 7 x 64 are new; the claim of 5 x 64 is below that: kept
    good, _ = verified([receipt(3 * 64, sequence=1), receipt(10 * 64, sequence=2)])
    admission = c.accept(
        REPLICA, 0, learner_params(c, 0, 0.01), base_version=1, steps=5, tokens=5 * 64, sched_step=2,
        step_time_s=0.1, nonce=b"r2" * 8, now=20.0, receipts=good,
    )  # fmt: skip
    assert not admission.receipt_capped and c.rounds[0].entries[REPLICA].contribution.tokens == 5 * 64
    c.merge_now(0, 1, 20.0)
    # replaying the same receipts at the sync after: no growth, no verified tokens, no weight
    c.accept(
        REPLICA, 0, learner_params(c, 0, 0.01), base_version=2, steps=5, tokens=5 * 64, sched_step=3,
        step_time_s=0.1, nonce=b"r3" * 8, now=30.0, receipts=good,
    )  # fmt: skip
    assert c.rounds[0].entries[REPLICA].contribution.tokens == 0
    # negative control: a learner (receipts=None) keeps its self-reported tokens
    c.accept(
        "learner", 0, learner_params(c, 0, 0.01), base_version=2, steps=5, tokens=5 * 64, sched_step=3,
        step_time_s=0.1, nonce=b"r4" * 8, now=30.0,
    )  # fmt: skip
    assert c.rounds[0].entries["learner"].contribution.tokens == 5 * 64


def test_bad_receipts_are_rejected_one_by_one_with_a_typed_error() -> None:
    forger = NodeIdentity.generate()
    genuine = receipt(640, sequence=1)
    tampered = bytearray(genuine)
    tampered[-1] ^= 0xFF  # the signature
    other_replica = receipt(640, sequence=2, replica=NodeIdentity.generate().peer_id)
    good, errors = verified(
        [genuine, bytes(tampered), receipt(6400, sequence=3, signer=forger), other_replica]
    )
    assert [r.tokens for r in good] == [640]
    assert len(errors) == 3 and all(isinstance(e, ProtocolError) for e in errors)
    reasons = [e.reason for e in errors]
    assert sum(r in FORGERY_REASONS for r in reasons) == 2  # tampered and unauthorized: the relayer is struck
    with pytest.raises(MalformedFrame):
        parse_receipts_meta({"receipts": ["not hex"]})
    with pytest.raises(MalformedFrame):
        parse_receipts_meta({"receipts": "ab"})
    garbage, garbage_errors = verified([b"\x00\x00\x00\x05junk!"])
    assert not garbage and isinstance(garbage_errors[0], ProtocolError)


def test_two_contributions_merged_together_cannot_both_claim_the_same_receipt_growth() -> None:
    ledger = ReceiptLedger()
    good, _ = verified([receipt(640, sequence=1)])
    first, counts = ledger.growth(REPLICA, 0, good)
    second, _ = ledger.growth(REPLICA, 0, good, also=[counts])
    assert (first, second) == (640, 0)
    ledger.commit(REPLICA, 0, counts)
    assert ledger.growth(REPLICA, 0, good)[0] == 0 and ledger.growth(REPLICA, 1, good)[0] == 640


def test_quorum_time_is_when_the_kth_contribution_arrived_not_when_the_syncer_looked() -> None:
    c = core(QuorumConfig.decoupled(1, grace_gamma=0.8, max_grace_steps=1.0))
    push(c, "a", now=10.0)  # step time 0.1 s: a grace window of one step
    ready, _ = c.due(10.5, lambda _f: 3)  # the loop was busy merging another fragment until 10.5
    assert ready == [0] and c.policy.xi_quorum == 0.0  # the window ran from 10.0: over, and not inflated


def test_a_replaced_contribution_does_not_count_as_quorum_wait() -> None:
    """After a takeover a learner's retry replaced its first contribution 3 s later; taking the round's opening as
    the start of the quorum wait made xi_quorum 3 s and closed the grace window for the next ten merges."""
    c = core(QuorumConfig.decoupled(1, grace_gamma=0.8, max_grace_steps=1.0))
    push(c, "a", now=10.0, nonce=b"1" * 16)
    push(c, "a", now=13.0, nonce=b"2" * 16, steps=6)  # the same peer, a newer contribution on the same base
    c.due(13.0, lambda _f: 3)
    assert c.policy.xi_quorum == 0.0 and c.policy.grace_s() == pytest.approx(
        0.1
    )  # K = 1: no wait for learners
    k2 = core(QuorumConfig.decoupled(2, grace_gamma=0.8, max_grace_steps=1.0))
    push(k2, "a", now=10.0, nonce=b"1" * 16)
    push(k2, "a", now=12.0, nonce=b"2" * 16, steps=6)
    push(k2, "b", now=12.5)
    k2.due(12.5, lambda _f: 3)
    assert k2.policy.xi_quorum == pytest.approx(0.5)  # from a's newer contribution to b's, the K-th


def test_after_a_takeover_work_on_an_earlier_syncers_version_is_taken_until_we_merge_ourselves() -> None:
    old = core(now=0.0)
    accept(old, "a", params_with_delta(old, 0, 1), base=0, steps=4, now=10.0)
    old.merge_now(0, 2, 10.0)
    new = core(now=20.0)
    new.restore(old.snapshot("ab" * 20, term=1), 20.0)  # at version 1; b trained through the outage on 0
    accept(new, "b", params_with_delta(new, 0, 2), base=0, steps=4, now=21.0)  # missed no round of ours
    record = new.merge_now(0, 2, 21.0)
    assert record is not None and record.participants == ("b",) and new.versions[0] == 2
    with pytest.raises(Refusal) as missed:  # version 2 is our own merge: on 1 now, it missed that round
        accept(new, "c", params_with_delta(new, 0, 3), base=1, steps=4, now=22.0)
    assert missed.value.reason == "missed round"


def test_the_loss_probe_scores_only_work_on_a_base_we_hold() -> None:
    """After a takeover the base of a learner's outage work is an earlier syncer's version we lack: the probe
    does not score it (with the current version standing in it would score the version gap, not the work)."""
    old = core(now=0.0)
    accept(old, "a", params_with_delta(old, 0, 1), base=0, steps=4, now=10.0)
    old.merge_now(0, 2, 10.0)
    held = old.fragment_tensors(0)
    base = probe_base(old, 0, 1)
    assert base is not None and all(torch.equal(base[n], held[n]) for n in held)  # the control: held, scored
    new = core(now=20.0)
    new.restore(old.snapshot("ab" * 20, term=1), 20.0)  # at version 1
    assert probe_base(new, 0, 0) is None  # b's work on version 0, from before our term: not scored
    assert probe_base(new, 0, 1) is not None


def test_version_ages_date_only_our_regular_rounds() -> None:
    """Learners time their next send of a fragment from its round's publication: the syncer says how long ago it
    published each fragment's current version, and -1 for one that is not a regular round (the seed, restored,
    adopted, and our first merge after those)."""
    c = core()
    assert c.version_ages(5.0) == [-1.0] * PLAN.num_fragments
    push(c, "a", 0, now=8.0)
    assert c.merge_now(0, expected=1, now=8.5) is not None
    # our first merge of a fragment (from the seed, or after a takeover: everyone's retried outage work of
    # every fragment at once) is not a round to time sends from: the learners keep their staggered anchors
    assert c.version_ages(9.0) == [-1.0] * PLAN.num_fragments
    push(c, "a", 0, now=10.0, base=1)
    assert c.merge_now(0, expected=1, now=10.5) is not None
    ages = c.version_ages(12.0)
    assert ages[0] == pytest.approx(1.5) and ages[1:] == [-1.0] * (PLAN.num_fragments - 1)
    other = core()
    assert other.adopt(0, 3, c.fragment_tensors(0), now=13.0)
    # adopted from an earlier syncer: when it was merged is unknown
    assert other.version_ages(14.0)[0] == -1.0
    other.restore(c.snapshot("run", 1), now=15.0)
    assert other.version_ages(16.0) == [-1.0] * PLAN.num_fragments


def test_a_void_round_publishes_the_parameters_unchanged_so_a_synchronous_round_ends() -> None:
    # A synchronous round whose every contribution is weightless (here: it reports no steps)
    # raises NothingToMerge; its learners wait for the round's version, so the syncer publishes a void one.
    c = core(quorum_config(DilocoSpec(mode="sync", sync_learners=1), max_grace_s=5.0))
    push(c, "a")
    assert c.merge_now(0, 1, 10.0) is not None and c.versions[0] == 1
    push(c, "a", base=1, steps=0, now=11.0)
    taken = c.take_round(0, 1, 11.0)
    assert taken is not None
    round_, expected, required = taken
    with pytest.raises(NothingToMerge):
        c.compute_merge(0, round_, expected=expected, required=required, started_at=11.0)
    before = c.fragment_tensors(0)
    prepared = c.void_merge(0, round_, expected=expected, required=required, started_at=11.0, rejected={})
    record = c.commit_merge(prepared, 11.5)
    assert record.version == 2 and c.versions[0] == 2 and record.participants == () and record.tokens == 0
    assert all(torch.equal(before[n], t) for n, t in c.fragment_tensors(0).items())
    assert c.tokens_merged == 4 * 64  # only the first round's


@IN_MEMORY_ONLY
def test_a_snapshot_shares_the_cores_tensors_and_keeps_its_state_through_later_merges(tmp_path: Path) -> None:
    """The checkpoint snapshot holds no copy of the model (the syncer's memory at scale, docs/scale.md): it shares
    the published tensors and momentum buffers, and still says what it said when taken after merges, an adoption
    and a restore replaced them; a checkpoint written from it afterwards is the state at the time it was taken."""
    c = core(now=0.0)
    push(c, "a", fragment=0, now=5.0, nonce=b"1" * 16)
    assert c.merge_now(0, 1, 5.0) is not None  # momentum buffers exist for fragment 0
    snapshot = c.snapshot("ab" * 20, term=1)
    assert all(snapshot.params[n].data_ptr() == t.data_ptr() for n, t in c.params.items())
    momentum = c.outer.state_dict(share=True)
    assert momentum and all(snapshot.momentum[k].data_ptr() == t.data_ptr() for k, t in momentum.items())
    taken = {n: t.clone() for n, t in snapshot.params.items()}
    taken_momentum = {k: t.clone() for k, t in snapshot.momentum.items()}
    for step, fragment in enumerate((0, 1, 0)):  # later merges (the momentum of fragment 0 moves on)
        push(c, "a", fragment=fragment, base=c.versions[fragment], now=10.0 + step, nonce=bytes([step]) * 16)
        assert c.merge_now(fragment, 1, 10.0 + step) is not None
    c.adopt(1, c.versions[1] + 5, learner_params(c, 1, 0.5), 20.0)
    assert any(not torch.equal(c.params[n], taken[n]) for n in c.params)  # the core did move on
    assert all(torch.equal(snapshot.params[n], t) for n, t in taken.items())
    assert all(torch.equal(snapshot.momentum[k], t) for k, t in taken_momentum.items())
    path = checkpoint_path(tmp_path, "ab" * 20)
    save_checkpoint(path, snapshot)
    loaded = load_checkpoint(path, run_id="ab" * 20, expected=c.shapes, num_fragments=PLAN.num_fragments)
    assert all(torch.equal(loaded.params[n], t) for n, t in taken.items())
    # a restore puts new tensors in as well: the snapshot it came from is left as it was
    c.restore(loaded, 30.0)
    push(c, "a", fragment=0, base=c.versions[0], now=31.0, nonce=b"9" * 16)
    assert c.merge_now(0, 1, 31.0) is not None
    assert all(torch.equal(loaded.params[n], t) for n, t in taken.items())


def test_a_lock_step_round_does_not_wait_for_a_holder_whose_contribution_it_refused() -> None:
    """A refusal is final: the learner drops its contribution and sends nothing more to that round. Counted as
    expected, it held an elastic round forever (while that learner waited at the barrier on another round)."""
    c = core(quorum_config(DilocoSpec(mode="elastic_sync"), max_grace_s=5.0))
    holders = {"a", "b"}
    poisoned = {n: torch.full_like(t, math.nan) for n, t in learner_params(c, 0, 0.0).items()}
    with pytest.raises(Refusal):
        push(c, "b", nonce=b"b" * 16, params=poisoned)
    assert c.due(100.0, lambda _f: holders)[0] == []  # nothing in yet
    push(c, "a")
    assert c.due(100.0, lambda _f: holders)[0] == [0]  # "b" is not waited for
    record = c.merge_now(0, 1, 100.0)
    assert record is not None and record.participants == ("a",)
    # the next round waits for both again: the refusal was of the round that merged
    push(c, "a", base=1, nonce=b"x" * 16)
    assert c.due(200.0, lambda _f: holders)[0] == []


def test_the_control_a_silent_holder_still_holds_the_lock_step_round() -> None:
    c = core(quorum_config(DilocoSpec(mode="elastic_sync"), max_grace_s=5.0))
    push(c, "a")
    assert c.due(100.0, lambda _f: {"a", "b"})[0] == []


def _step_time_push(c: SyncerCore, peer: str, fragment: int, step_time_s: float, now: float, n: int) -> None:
    c.accept(
        peer,
        fragment,
        learner_params(c, fragment, 0.01),
        base_version=0,
        steps=4,
        tokens=4 * 64,
        sched_step=7,
        step_time_s=step_time_s,
        nonce=bytes([n % 256]) * 16,
        now=now,
    )


def _grace_after_a_fast_liar(c: SyncerCore) -> float:
    """Three honest learners report 0.5 s steps once; a liar reports 1 us at every one of 20 pushes after them."""
    for i, peer in enumerate(("h1", "h2", "h3")):
        _step_time_push(c, peer, 0, 0.5, now=10.0 + i, n=i)
    for i in range(20):
        _step_time_push(c, "liar", i % PLAN.num_fragments, 1e-6, now=20.0 + i, n=100 + i)
    return c.policy.grace_s()


def test_a_learner_reporting_1us_steps_cannot_shrink_the_grace_window() -> None:
    quorum = QuorumConfig.decoupled(1, grace_gamma=0.8, max_grace_steps=1.0)
    honest = core(quorum)
    for i, peer in enumerate(("h1", "h2", "h3")):
        _step_time_push(honest, peer, 0, 0.5, now=10.0 + i, n=i)
    assert math.isclose(honest.policy.grace_s(), 0.5)  # capped at one step time
    defended = _grace_after_a_fast_liar(core(quorum))
    assert math.isclose(defended, 0.5)  # the upper median of the peers' latest reports is an honest one
    undefended = core(quorum)
    undefended.policy.step_times = None  # negative control: every report fed to the EMA as it is
    assert _grace_after_a_fast_liar(undefended) < 0.01  # the liar dragged the window to nothing


def test_the_step_time_median_forgets_peers_silent_past_its_age() -> None:
    times = PeerStepTimes(max_age_s=60.0)
    assert times.report("a", 0.5, now=0.0) == 0.5
    assert times.report("b", 0.1, now=1.0) == 0.5  # with two, the slower one
    assert times.report("c", 0.2, now=2.0) == 0.2
    assert times.report("b", 0.1, now=100.0) == 0.1  # a and c are older than 60 s: b alone
