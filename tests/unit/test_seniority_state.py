"""Seniority survives the syncer (issue 18): saved with its checkpoint and its standby's mirror, restored on a
restart or a takeover, bounded, and malformed saved state is logged and read as an empty table. The clocks are
passed in: a restarted process has another monotonic clock, so `wall_offset` differs between save and load."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from node.diloco.screening import ScreeningConfig
from node.diloco.seniority import (
    SAVED_MAX,
    WIRE_CHUNK_CHARS,
    WIRE_MAX_CHARS,
    Seniority,
    SeniorityConfig,
    SeniorityStateError,
    seniority_chunks,
    seniority_from_chunks,
    seniority_from_json,
    seniority_to_json,
)
from node.diloco.sync_client import control_limits
from node.diloco.syncer_core import SyncerCore
from node.ml.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from protocol.envelope import Context, Kind, open_envelope, seal
from protocol.identity import NodeIdentity
from protocol.replay import ReplayGuard
from tests.unit.test_syncer_core import PLAN, core, push

pytestmark = pytest.mark.timeout(60)

RUN = "ab" * 20
HONEST = [f"honest{i}" for i in range(4)]
SYBILS = [f"sybil{i}" for i in range(5)]
SCREENING = ScreeningConfig(young_rounds=2, young_weight_cap=0.25, loss_probe=False, copy_tolerance=0.0)
OLD_WALL, NEW_WALL = 1_000_000.0, 1_000_500.0  # wall minus monotonic before and after the restart


def _sybil_share(weights: dict[str, float]) -> float:
    return math.fsum(weights[p] for p in SYBILS) / math.fsum(weights.values())


def _merge(c: SyncerCore, peers: list[str], now: float) -> dict[str, float]:
    for peer in peers:
        push(c, peer, 0, now=now, base=c.versions[0], nonce=f"{peer}{now}".encode())
    record = c.merge_now(0, len(peers), now)
    assert record is not None
    return dict(record.weights)


def _senior_core() -> SyncerCore:
    c = core(screening=SCREENING, clip_factor=None)
    for now in (10.0, 20.0):
        _merge(c, HONEST, now)
    assert not any(c.seniority.is_young(p, 20.0) for p in HONEST)
    return c


def _restarted(tmp_path: Path, c: SyncerCore) -> SyncerCore:
    """`c` checkpointed, then a new process (clock at 5 s, a larger wall offset) restores the checkpoint."""
    path = checkpoint_path(tmp_path, RUN)
    save_checkpoint(path, c.snapshot(RUN, term=1, wall_offset=OLD_WALL))
    loaded = load_checkpoint(path, run_id=RUN, expected=c.shapes, num_fragments=PLAN.num_fragments)
    fresh = core(screening=SCREENING, clip_factor=None, now=5.0)
    fresh.restore(loaded, 5.0, wall_offset=NEW_WALL)
    return fresh


def test_the_table_round_trips_through_json_onto_another_clock() -> None:
    policy = Seniority(SeniorityConfig(young_rounds=2))
    policy.observe_merge(["a", "b"], 10.0)
    policy.observe_merge(["a"], 20.0, credit={"a": 0.5})
    saved = seniority_from_json(seniority_to_json(policy.export(OLD_WALL)))
    assert [e[0] for e in saved] == ["a", "b"]  # the most recently merged first
    other = Seniority(SeniorityConfig(young_rounds=2))
    other.load(saved, now=0.0, wall_offset=OLD_WALL + 30.0)  # 30 s later on the wall, a new monotonic clock
    assert other.rounds("a", 0.0) == 1.5 and other.rounds("b", 0.0) == 1.0
    assert other.status(0.0)["identities"] == 2
    # dates move to the new clock: b was merged 20 s (wall) before the load, so it is forgotten at forget_s - 20
    assert other.rounds("b", other.config.forget_s - 21.0) == 1.0
    assert other.rounds("b", other.config.forget_s - 19.0) == 0


def test_a_restarted_syncer_keeps_its_seniors_and_caps_a_sybil_burst(tmp_path: Path) -> None:
    fresh = _restarted(tmp_path, _senior_core())
    assert not any(fresh.seniority.is_young(p, 5.0) for p in HONEST)  # senior before, senior after
    assert all(fresh.seniority.is_young(p, 5.0) for p in SYBILS)
    assert _sybil_share(_merge(fresh, HONEST + SYBILS, 6.0)) <= 0.25 + 1e-9


def test_control_without_the_saved_table_a_restart_lets_the_sybils_hold_the_merge(tmp_path: Path) -> None:
    """The attack the saved table defends against: everyone young after a restart, so nothing is capped."""
    c = _senior_core()
    path = checkpoint_path(tmp_path, RUN)
    save_checkpoint(path, c.snapshot(RUN, term=1))  # undated: no seniority saved (as before issue 18's fix)
    loaded = load_checkpoint(path, run_id=RUN, expected=c.shapes, num_fragments=PLAN.num_fragments)
    assert loaded.seniority == ()
    fresh = core(screening=SCREENING, clip_factor=None, now=5.0)
    fresh.restore(loaded, 5.0, wall_offset=NEW_WALL)
    assert all(fresh.seniority.is_young(p, 5.0) for p in HONEST)
    assert _sybil_share(_merge(fresh, HONEST + SYBILS, 6.0)) > 0.5


def test_a_demoted_identity_stays_young_across_the_restart(tmp_path: Path) -> None:
    c = _senior_core()
    c.seniority.demote("honest0", 21.0)
    fresh = _restarted(tmp_path, c)
    assert fresh.seniority.is_young("honest0", 5.0) and not fresh.seniority.is_young("honest1", 5.0)


def _rewrite_seniority(path: Path, text: str) -> None:
    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
    metadata["seniority"] = text
    save_file(load_file(str(path)), str(path), metadata=metadata)


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        '{"a": 1}',
        '[["p", 1.0]]',
        '[["p", -1.0, 5.0]]',
        '[["p", 1.0, 0]]',
        "[[7, 1.0, 5.0]]",
        '[["p", "1", 5.0]]',
        '[["p", 1e999, 5.0]]',
        "[" * 100_000 + "]" * 100_000,
        f'[["{"x" * 200}", 1.0, 5.0]]',
    ],
)
def test_a_malformed_saved_table_is_logged_and_the_parameters_still_resume(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    c = _senior_core()
    path = checkpoint_path(tmp_path, RUN)
    save_checkpoint(path, c.snapshot(RUN, term=1, wall_offset=OLD_WALL))
    _rewrite_seniority(path, text)
    with pytest.raises(SeniorityStateError):
        seniority_from_json(text)
    with caplog.at_level(logging.WARNING, logger="node.ml.checkpoint"):
        loaded = load_checkpoint(path, run_id=RUN, expected=c.shapes, num_fragments=PLAN.num_fragments)
    assert loaded.seniority == () and loaded.versions == tuple(c.versions)
    assert "ignoring its seniority state" in caplog.text
    fresh = core(screening=SCREENING, clip_factor=None, now=5.0)
    fresh.restore(loaded, 5.0, wall_offset=NEW_WALL)  # starts with an empty table: everyone young
    assert fresh.versions == c.versions and fresh.seniority.status(5.0)["identities"] == 0


def test_the_saved_and_loaded_tables_are_bounded_the_least_recently_merged_dropped() -> None:
    policy = Seniority(SeniorityConfig(young_rounds=1))
    for i in range(SAVED_MAX + 10):
        policy.observe_merge([f"p{i}"], float(i))
    saved = policy.export(OLD_WALL)
    assert len(saved) == SAVED_MAX and saved[0][0] == f"p{SAVED_MAX + 9}" and saved[-1][0] == "p10"
    text = seniority_to_json(saved)
    assert len(seniority_from_json(text)) == SAVED_MAX
    with pytest.raises(SeniorityStateError):  # a longer stored list is refused, not allocated
        seniority_from_json(seniority_to_json(policy.export(OLD_WALL, limit=SAVED_MAX + 1)))
    small = Seniority(SeniorityConfig(young_rounds=1, max_peers=3))
    small.load(saved, now=float(SAVED_MAX + 10), wall_offset=OLD_WALL)
    kept = [p for p in (f"p{i}" for i in range(SAVED_MAX + 10)) if small.rounds(p, float(SAVED_MAX + 10)) > 0]
    assert kept == [f"p{SAVED_MAX + 7}", f"p{SAVED_MAX + 8}", f"p{SAVED_MAX + 9}"]


def test_load_forgets_idle_identities_and_clamps_dates_from_a_clock_ahead() -> None:
    policy = Seniority(SeniorityConfig(young_rounds=1, forget_s=100.0))
    saved = (
        ("ahead", 3.0, OLD_WALL + 500.0),
        ("recent", 2.0, OLD_WALL + 90.0),
        ("idle", 5.0, OLD_WALL - 50.0),
    )
    policy.load(saved, now=100.0, wall_offset=OLD_WALL)
    assert policy.rounds("ahead", 100.0) == 3.0 and policy.rounds("recent", 100.0) == 2.0
    assert policy.rounds("idle", 100.0) == 0 and policy.status(100.0)["identities"] == 2
    assert policy.rounds("ahead", 200.0) == 3.0  # counted as merged at the load, not 400 s in the future


def test_the_standby_mirror_gets_the_most_recent_identities_in_a_bounded_signed_frame() -> None:
    policy = Seniority(SeniorityConfig(young_rounds=1))
    peers = [f"12D3KooW{i:044d}" for i in range(1000)]  # peer-id sized names
    for i, peer in enumerate(peers):
        policy.observe_merge([peer], float(i))
    chunks = seniority_chunks(policy.export(OLD_WALL))
    assert all(len(c) <= WIRE_CHUNK_CHARS for c in chunks) and sum(map(len, chunks)) <= WIRE_MAX_CHARS
    alice = NodeIdentity.generate()
    ctx = Context(run_id=RUN, kind=Kind.VERSION, receiver=alice.peer_id)
    frame = seal(alice, ctx, microbatch=0, step=1, now=100.0, meta={"seniority": chunks})
    opened = open_envelope(
        frame, remote_peer=alice.peer_id, expect=ctx, limits=control_limits(), replay=ReplayGuard(), now=100.0
    )
    got = seniority_from_chunks(opened.meta["seniority"])
    assert 100 < len(got) < len(peers) and got[0][0] == peers[-1]  # the most recently merged kept
    assert [e[0] for e in got] == peers[::-1][: len(got)]
    for bad in ("[]", ["[", 3], ["x" * (WIRE_MAX_CHARS + 1)], ["[[1]]"]):
        with pytest.raises(SeniorityStateError):
            seniority_from_chunks(bad)


def test_the_active_syncers_state_answer_carries_its_seniority_to_a_standby() -> None:
    """Through the real STATE route (`SyncerService._handle_state`): the answer a standby's mirror opens holds the
    table, which a core restored from it (as `restore_best` does with the mirror) knows."""
    from node.diloco.sync_client import fragment_limits
    from tests.unit.test_syncer_ban_push import RUN as BAN_RUN
    from tests.unit.test_syncer_ban_push import RUN_ID, Host

    host = Host(swarm_banned=set())
    standby = NodeIdentity.generate()
    host.ctx.manifest = dataclasses.replace(BAN_RUN, authorized_syncers=(standby.peer_id,))
    now = time.monotonic()
    for _ in range(host.core.seniority.config.young_rounds):
        host.core.seniority.observe_merge(HONEST, now)
    ask = seal(
        standby,
        Context(run_id=RUN_ID, kind=Kind.CONTROL, receiver=host.identity.peer_id),
        microbatch=0,
        step=0,
        now=time.time(),
        meta={"fragment": 0},
    )
    answer = asyncio.run(host.service._handle_state(ask, standby.peer_id))
    opened = open_envelope(
        answer,
        remote_peer=host.identity.peer_id,
        expect=Context(run_id=RUN_ID, kind=Kind.VERSION, receiver=standby.peer_id),
        limits=fragment_limits(host.plan, factor=2),
        replay=ReplayGuard(),
        now=time.time(),
    )
    saved = seniority_from_chunks(opened.meta["seniority"])
    assert sorted(peer for peer, _, _ in saved) == sorted(HONEST)
    policy = Seniority(host.core.seniority.config)
    policy.load(saved, now=5.0, wall_offset=time.time() - 5.0)  # another process's clock
    assert not any(policy.is_young(p, 5.0) for p in HONEST) and policy.is_young(SYBILS[0], 5.0)
