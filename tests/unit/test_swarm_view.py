"""The swarm view: health of peers, the swarm map, time series, merges from version bumps, bans and events."""

from __future__ import annotations

from typing import Any

import pytest

from node.status.swarm_view import (
    AWAITING_DESCRIPTION,
    MAX_ENTRIES_PER_LOOK,
    NOT_DESCRIBED,
    SwarmHistory,
    ViewConfig,
    peer_health,
    summary_line,
)

PERIOD_S = 1.0


def peer(peer_id: str, role: str = "learner", **fields: Any) -> dict[str, Any]:
    base = {
        "peer_id": peer_id,
        "role": role,
        "stage": None,
        "state": "training" if role in ("learner", "stage") else "serving",
        "throughput": 1000.0 if role in ("learner", "stage") else 0.0,
        "tokens": 0,
        "loss": None,
        "inner_step": 0,
        "leaving": False,
        "http": "127.0.0.1:1",
        "sent_at": 0.0,
    }
    base.update(fields)
    return base


def doc(now: float, peers: list[dict[str, Any]], *, bans=(), syncer=(), num_stages: int = 2, **extra) -> dict:
    for p in peers:
        p.setdefault("sent_at", now)
        if p["sent_at"] == 0.0:
            p["sent_at"] = now
    return {
        "time": now,
        "settings": {"heartbeat_period_s": PERIOD_S, "num_stages": num_stages},
        "peers": peers,
        "bans": list(bans),
        "syncer": list(syncer),
        **extra,
    }


def ban(offender: str, *, in_effect: bool = True, reason: str = "gradient flagged 3 times") -> dict[str, Any]:
    return {
        "offender": offender,
        "verifiers": ["V1"],
        "in_effect": in_effect,
        "notices": [
            {"verifier": "V1", "offender": offender, "reason": reason, "evidence": "ab" * 10, "stage": 1}
        ],
    }


def syncer(versions: list[int]) -> dict[str, Any]:
    return {"peer_id": "SYNC", "versions": versions, "term": 0, "state": "active", "lease_until": 1e12}


def config(**overrides: Any) -> ViewConfig:
    return ViewConfig(sample_period_s=PERIOD_S, rate_window_s=PERIOD_S, **overrides)


# ---- health ----


@pytest.mark.parametrize(
    ("fields", "banned", "median", "expected"),
    [
        ({}, set(), None, "alive"),
        ({}, {"A"}, None, "banned"),
        ({"leaving": True}, set(), None, "leaving"),
        ({"sent_at": 7.0}, set(), None, "straggling"),  # 3 s old at now=10 with a 1 s period
        ({"throughput": 100.0}, set(), 1000.0, "straggling"),
        ({"throughput": 900.0}, set(), 1000.0, "alive"),
        ({"state": "idle", "throughput": 0.0}, set(), None, "idle"),
    ],
)
def test_peer_health(fields, banned, median, expected) -> None:
    record = peer("A", sent_at=10.0, **{k: v for k, v in fields.items() if k != "sent_at"})
    record.update({k: v for k, v in fields.items() if k == "sent_at"})
    health, why = peer_health(
        record, now=10.0, banned=banned, group_median=median, period_s=PERIOD_S, config=config()
    )
    assert health == expected
    assert (why == "") == (expected == "alive")


def test_view_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="sample_period_s"):
        ViewConfig(sample_period_s=0)
    with pytest.raises(ValueError, match="slow_fraction"):
        ViewConfig(slow_fraction=1.5)


# ---- the time series ----


def test_throughput_counts_learners_and_stage_zero_once_and_survives_restarts() -> None:
    history = SwarmHistory(config())
    history.observe(
        doc(0.0, [peer("L1", tokens=0), peer("S0", "stage", stage=0), peer("S1", "stage", stage=1)]), 0.0
    )
    history.observe(
        doc(
            1.0,
            [
                peer("L1", tokens=1000),
                peer("S0", "stage", stage=0, tokens=500),
                peer("S1", "stage", stage=1, tokens=500),  # the same microbatches again: not counted
            ],
        ),
        1.0,
    )
    assert history.samples[-1]["throughput"] == 1500.0
    # L1 restarted: its counter starts again from zero and counts from there
    history.observe(doc(2.0, [peer("L1", tokens=200), peer("S0", "stage", stage=0, tokens=700)]), 2.0)
    assert history.samples[-1]["throughput"] == 400.0
    assert history.tokens_total == 1900
    assert history.samples[-1]["workers"] == 2


def test_samples_are_rate_limited_but_events_are_not() -> None:
    history = SwarmHistory(config())
    history.observe(doc(0.0, [peer("A")]), 0.0)
    history.observe(doc(0.3, [peer("A"), peer("B")]), 0.3)
    assert len(history.samples) == 1
    assert [e["kind"] for e in history.events_json()] == ["joined", "joined"]


def test_goodput_is_merged_work_only_and_zero_before_the_first_merge() -> None:
    history = SwarmHistory(config())
    history.observe(doc(0.0, [peer("A"), peer("B")], syncer=[syncer([0, 0])]), 0.0)
    history.observe(
        doc(1.0, [peer("A", tokens=100), peer("B", tokens=300)], bans=[ban("B")], syncer=[syncer([0, 0])]),
        1.0,
    )
    last = history.samples[-1]
    # the heartbeats report 400 tok/s, but nothing has merged: the model got no tokens yet
    assert (last["throughput"], last["goodput"]) == (400.0, 0.0)
    assert history.goodput_source == "no merges yet"
    status = {"merges": [{"fragment": 1, "version": 1, "quorum": 2, "grace_s": 0.4, "tokens": 250}]}
    history.observe(
        doc(
            2.0,
            [peer("A", tokens=200), peer("B", tokens=600)],
            bans=[ban("B")],
            syncer=[syncer([0, 1])],
            syncer_status=status,
        ),
        2.0,
    )
    assert history.goodput_source == "syncer"
    # a contribution's tokens count once per fragment: 250 tokens into one of two fragments commit half of them
    assert history.samples[-1]["goodput"] == 125.0
    assert history.history_json()["totals"]["committed_tokens"] == 125


def test_loss_is_the_mean_of_unbanned_training_peers_and_kept_per_peer() -> None:
    history = SwarmHistory(config())
    peers = [peer("A", loss=3.0), peer("B", loss=2.0), peer("C", loss=9.0), peer("V", "verifier", loss=1.0)]
    history.observe(doc(0.0, peers, bans=[ban("C")]), 0.0)
    assert history.samples[-1]["loss"] == 2.5
    series = history.history_json()["peer_loss"]
    assert series["A"] == {"t": [0.0], "loss": [3.0]} and "V" not in series


# ---- merges, bans, events ----


def test_version_bumps_become_merges_enriched_by_the_syncer_status() -> None:
    history = SwarmHistory(config())
    history.observe(doc(0.0, [], syncer=[syncer([3, 0, 0])]), 0.0)
    assert not history.merges  # the first look is the state, not a merge
    status = {
        "merges": [
            {"fragment": 0, "version": 4, "quorum": 2, "grace_s": 0.5, "weights": {"A": 0.6, "B": 0.4}}
        ]
    }
    history.observe(doc(1.0, [], syncer=[syncer([4, 0, 2])], syncer_status=status), 1.0)
    merges = history.history_json()["merges"]
    assert [(m["fragment"], m["version"], m["count"]) for m in merges] == [(0, 4, 1), (2, 1, 1), (2, 2, 1)]
    assert merges[0]["quorum"] == 2 and merges[0]["weights"] == {"A": 0.6, "B": 0.4}
    assert "undescribed" not in merges[0]
    assert "quorum" not in merges[1] and merges[1]["undescribed"] == AWAITING_DESCRIPTION
    assert history.history_json()["totals"]["merges"] == 3
    texts = [e["text"] for e in history.events_json() if e["kind"] == "merge"]
    assert "fragment 0 -> v4 (quorum 2)" in texts
    assert any("2 merges since the last look" in t for t in texts)


def test_a_ban_is_one_event_with_its_evidence_and_marks_the_peer() -> None:
    history = SwarmHistory(config())
    history.observe(doc(0.0, [peer("ATTACKER", "stage", stage=1), peer("OK", "stage", stage=1)]), 0.0)
    for now in (1.0, 2.0):
        history.observe(
            doc(
                now,
                [peer("ATTACKER", "stage", stage=1), peer("OK", "stage", stage=1)],
                bans=[ban("ATTACKER")],
            ),
            now,
        )
    bans = history.history_json()["bans"]
    assert len(bans) == 1
    assert bans[0]["reasons"] == ["gradient flagged 3 times"] and bans[0]["stage"] == 1
    assert bans[0]["notices"][0]["evidence_bytes"] == 10
    kinds = [e["kind"] for e in history.events_json()]
    assert kinds.count("banned") == 1
    grid = history.swarm_map(doc(2.0, []))["stages"]
    assert [(c["short"], c["health"]) for c in grid[1]] == [("ATTACKER", "banned"), ("OK", "alive")]


def test_a_vanished_peer_stays_on_the_map_as_missing_then_is_forgotten() -> None:
    history = SwarmHistory(config(remember_missing_s=10.0))
    history.observe(doc(0.0, [peer("A"), peer("B")]), 0.0)
    history.observe(doc(1.0, [peer("A")]), 1.0)
    view = history.swarm_map(doc(1.0, []))
    assert {c["short"]: c["health"] for c in view["learners"]} == {"A": "alive", "B": "missing"}
    assert view["counts"]["missing"] == 1
    history.observe(doc(5.0, [peer("A"), peer("B")]), 5.0)
    assert [e["kind"] for e in history.events_json()][:2] == ["joined", "lost"]
    assert "rejoined" in history.events_json()[0]["text"]
    history.observe(doc(6.0, [peer("A")]), 6.0)
    history.observe(doc(20.0, [peer("A")]), 20.0)
    assert [c["short"] for c in history.swarm_map(doc(20.0, []))["learners"]] == ["A"]


def test_straggler_and_recovery_events() -> None:
    history = SwarmHistory(config())
    fast = [peer("A"), peer("B"), peer("C")]
    history.observe(doc(0.0, fast), 0.0)
    history.observe(doc(1.0, [peer("A"), peer("B"), peer("C", throughput=10.0)]), 1.0)
    history.observe(doc(2.0, [peer("A"), peer("B"), peer("C")]), 2.0)
    kinds = [e["kind"] for e in history.events_json()]
    assert kinds[:2] == ["recovered", "straggling"]


def test_map_groups_roles_and_fills_stage_rows() -> None:
    history = SwarmHistory(config())
    peers = [
        peer("S0a", "stage", stage=0),
        peer("S0b", "stage", stage=0),
        peer("L", "learner"),
        peer("V", "verifier"),
        peer("Y", "syncer"),
        peer("BOOT", "bootstrap"),
    ]
    history.observe(doc(0.0, peers, num_stages=3), 0.0)
    view = history.swarm_map(doc(0.0, [], num_stages=3))
    assert [len(row) for row in view["stages"]] == [2, 0, 0]
    assert [len(view[k]) for k in ("learners", "verifiers", "syncers", "bootstraps")] == [1, 1, 1, 1]


def test_the_map_shows_each_peers_connectivity_mode_and_counts_them() -> None:
    history = SwarmHistory(config())
    peers = [
        peer("D", "learner", mode="direct"),
        peer("R", "learner", mode="relay"),
        peer("C", "learner", mode="client"),
        peer("OLD", "learner"),  # an older node's heartbeat has no mode
        peer("ODD", "learner", mode="<b>satellite</b>"),  # a document from elsewhere: not shown as given
        peer("BOOT", "bootstrap", mode="direct"),
    ]
    history.observe(doc(0.0, peers), 0.0)
    view = history.swarm_map(doc(0.0, []))
    modes = {c["short"]: c["mode"] for c in view["learners"] + view["bootstraps"]}
    assert modes == {
        "D": "direct",
        "R": "relay",
        "C": "client",
        "OLD": "unknown",
        "ODD": "unknown",
        "BOOT": "direct",
    }
    assert view["modes"] == {"direct": 2, "relay": 1, "client": 1, "unknown": 2}
    # a peer that rejoins relayed shows its new mode
    history.observe(doc(1.0, [peer("D", "learner", mode="relay")]), 1.0)
    assert {c["short"]: c["mode"] for c in history.swarm_map(doc(1.0, []))["learners"]}["D"] == "relay"


def test_ring_buffers_stay_bounded() -> None:
    history = SwarmHistory(config(max_samples=5, max_events=7, max_peers_tracked=3, remember_missing_s=1.0))
    for i in range(50):
        history.observe(doc(float(i), [peer(f"P{i}", loss=1.0)]), float(i))
    assert len(history.samples) == 5 and len(history.events) == 7
    assert len(history.peer_loss) <= 3 and len(history._peers) <= 3


def test_external_notes_and_eval_points_are_kept() -> None:
    history = SwarmHistory(config())
    history.note(3.0, "chaos", "killed learner2", peer="L2")
    history.add_eval(3.5, 4.2)
    history.add_eval(4.0, float("nan"))
    assert history.events_json()[0]["text"] == "killed learner2"
    history.note(5.0, "chaos", "restarted learner2")
    assert [e["seq"] for e in history.events_after(1)] == [2]
    assert history.history_json()["eval"] == [{"t": 3.5, "loss": 4.2, "label": "held-out"}]


def test_summary_line() -> None:
    history = SwarmHistory(config())
    assert summary_line(history) == "no samples yet"
    history.observe(doc(0.0, [peer("A", loss=2.0)]), 0.0)
    assert summary_line(history) == (
        "1 peers; goodput 0 tok/s (no merges yet), 0 merges; 0 tok/s processed (reported by heartbeats);"
        " loss 2.000; 0 bans"
    )


def test_a_syncer_heartbeat_loss_is_a_held_out_point_when_it_changes() -> None:
    history = SwarmHistory(config())
    for now, loss in [(0.0, None), (1.0, 5.0), (2.0, 5.0), (3.0, 4.5)]:
        history.observe(doc(now, [peer("SYNC", "syncer", loss=loss)]), now)
    assert [(p["t"], p["loss"]) for p in history.history_json()["eval"]] == [(1.0, 5.0), (3.0, 4.5)]
    assert history.samples[-1]["loss"] is None  # not a training loss


def test_described_versions_get_entries_of_their_own_and_grace_is_what_was_waited() -> None:
    history = SwarmHistory(config())
    history.observe(doc(0.0, [], syncer=[syncer([0])]), 0.0)
    tape = [
        {"fragment": 0, "version": 3, "participants": ["A", "B"], "grace_waited_s": 0.2, "grace_s": 0.5},
        {"fragment": 0, "version": 4, "participants": ["A"], "grace_waited_s": 0.0, "grace_s": 0.5},
    ]
    history.observe(
        doc(1.0, [], syncer=[syncer([4])], syncer_status={"merges": 17, "recent_merges": tape}), 1.0
    )
    merges = history.history_json()["merges"]
    assert [(m["version"], m["count"], m.get("quorum")) for m in merges] == [
        (1, 1, None),
        (2, 1, None),
        (3, 1, 2),
        (4, 1, 1),
    ]
    assert (merges[2]["grace_s"], merges[2]["grace_window_s"]) == (0.2, 0.5)
    assert history.history_json()["totals"]["merges"] == 4


def test_rates_are_averaged_over_the_window() -> None:
    history = SwarmHistory(ViewConfig(sample_period_s=1.0, rate_window_s=4.0))
    tokens = 0
    for i in range(8):
        tokens += 400 if i % 2 else 0  # the counter moves every other look
        history.observe(doc(float(i), [peer("A", tokens=tokens)]), float(i))
    assert history.samples[-1]["throughput"] == 200.0


def test_a_peer_back_from_a_stall_does_not_count_its_old_tokens_again() -> None:
    history = SwarmHistory(config())
    history.observe(doc(0.0, [peer("A", tokens=5000)]), 0.0)
    history.observe(doc(1.0, []), 1.0)  # stalled: its heartbeat expired
    history.observe(doc(2.0, [peer("A", tokens=5100)]), 2.0)
    assert history.tokens_total == 5100
    history.observe(doc(3.0, []), 3.0)  # killed and restarted: a fresh counter
    history.observe(doc(4.0, [peer("A", tokens=300)]), 4.0)
    assert history.tokens_total == 5400


def test_the_served_history_is_thinned_and_bounded() -> None:
    history = SwarmHistory(config(max_merges=3))
    history.observe(doc(0.0, [], syncer=[syncer([0])]), 0.0)
    for i in range(1, 100):
        peers = [peer(f"P{j}", loss=1.0 + i) for j in range(5)]
        history.observe(doc(float(i), peers, syncer=[syncer([i])]), float(i))
    full = history.history_json()
    served = history.history_json(max_points=10, max_peer_series=2, max_merges=2)
    assert len(full["t"]) == 100 and len(served["t"]) == 10 and served["t"][-1] == full["t"][-1]
    assert len(served["peer_loss"]) == 2 and all(len(s["t"]) == 10 for s in served["peer_loss"].values())
    assert [m["version"] for m in served["merges"]] == [98, 99]
    assert served["totals"]["merges"] == full["totals"]["merges"] == 99  # counted beyond the ring of 3


def test_when_every_heartbeat_is_late_the_observer_is_the_one_lagging() -> None:
    history = SwarmHistory(config())
    # a slow DHT answer: every record is 3 periods old, one is 6
    peers = [peer("A", sent_at=7.0), peer("B", sent_at=7.0), peer("C", sent_at=4.0)]
    history.observe(doc(10.0, peers), 10.0)
    health = {c["short"]: c["health"] for c in history.swarm_map(doc(10.0, []))["learners"]}
    assert health == {"A": "alive", "B": "alive", "C": "straggling"}


# ---- what the events and the lines say ----


def test_a_clean_leave_is_left_and_silence_without_leaving_is_lost() -> None:
    history = SwarmHistory(config())
    history.observe(doc(0.0, [peer("CLEAN"), peer("VIA_LIST"), peer("CRASH")]), 0.0)
    # CLEAN's last record announces leaving; VIA_LIST's is in the document's `leaving` list (as a bootstrap
    # serves it: records that announce leaving are left out of `peers`); CRASH just stops
    history.observe(
        doc(1.0, [peer("CLEAN", leaving=True, state="leaving")], leaving=[peer("VIA_LIST", leaving=True)]),
        1.0,
    )
    history.observe(doc(2.0, []), 2.0)
    gone = {e["peer"]: (e["kind"], e["text"]) for e in history.events_json() if e["kind"] in ("left", "lost")}
    assert gone == {
        "CLEAN": ("left", "CLEAN (learner) left: announced leaving"),
        "VIA_LIST": ("left", "VIA_LIST (learner) left: announced leaving"),
        "CRASH": (
            "lost",
            "CRASH (learner) lost: stopped heartbeating without announcing leaving (killed, stalled or cut off)",
        ),
    }
    health = {c["short"]: c["health"] for c in history.swarm_map(doc(2.0, []))["learners"]}
    assert health == {"CLEAN": "leaving", "VIA_LIST": "leaving", "CRASH": "missing"}
    assert not any("stopped heartbeating" in t for k, t in gone.values() if k == "left")


def test_a_merge_the_syncer_describes_a_look_late_gets_its_quorum_and_weights() -> None:
    history = SwarmHistory(config(describe_within_s=5.0))
    history.observe(doc(0.0, [], syncer=[syncer([0, 0])]), 0.0)
    # the bootstrap reads the syncer's status after the records: the first look at v1 has no description
    history.observe(doc(1.0, [], syncer=[syncer([1, 1])], syncer_status={"recent_merges": []}), 1.0)
    assert [m["undescribed"] for m in history.merges] == [AWAITING_DESCRIPTION] * 2
    assert history.goodput_source == "merges not described" and history.samples[-1]["goodput"] is None
    tape = [
        {
            "fragment": 0,
            "version": 1,
            "participants": ["A", "B"],
            "weights": {"A": 0.5, "B": 0.5},
            "tokens": 80,
        }
    ]
    history.observe(doc(2.0, [], syncer=[syncer([1, 1])], syncer_status={"recent_merges": tape}), 2.0)
    first, second = history.history_json()["merges"]
    assert (first["quorum"], first["weights"], "undescribed" in first) == (2, {"A": 0.5, "B": 0.5}, False)
    assert history.goodput_source == "syncer" and history.history_json()["totals"]["committed_tokens"] == 40
    assert second["undescribed"] == AWAITING_DESCRIPTION
    history.observe(doc(9.0, [], syncer=[syncer([1, 1])], syncer_status={"recent_merges": tape}), 9.0)
    assert second["undescribed"] == NOT_DESCRIBED and "quorum" not in second  # a labelled reason, not a blank


def test_many_versions_between_two_looks_lump_only_the_oldest() -> None:
    history = SwarmHistory(config())
    history.observe(doc(0.0, [], syncer=[syncer([0])]), 0.0)
    history.observe(doc(1.0, [], syncer=[syncer([MAX_ENTRIES_PER_LOOK + 4])]), 1.0)
    merges = list(history.merges)
    assert (merges[0]["version"], merges[0]["count"]) == (4, 4) and "not described one by one" in merges[0][
        "undescribed"
    ]
    assert [m["count"] for m in merges[1:]] == [1] * MAX_ENTRIES_PER_LOOK
    assert history.merges_total == MAX_ENTRIES_PER_LOOK + 4
    assert [e["kind"] for e in history.events_json()].count("merge") == 1


def test_notes_from_a_file_become_events_and_junk_is_ignored() -> None:
    history = SwarmHistory(config())
    lines = [
        b'{"t": 5.0, "kind": "fault", "text": "kill learner1", "target": "learner1", "phase": "start"}',
        b"not json",
        b'["a list"]',
        b'{"text": "no kind"}',
        '{"kind": "recovered", "text": "' + "x" * 1000 + '"}',
    ]
    assert history.add_notes(lines, now=7.0) == 2
    fault, recovered = history.events_after(0)
    assert (fault["t"], fault["kind"], fault["target"], fault["phase"]) == (5.0, "fault", "learner1", "start")
    assert recovered["t"] == 7.0 and len(recovered["text"]) == 300


def test_summary_line_says_goodput_is_merged_and_throughput_is_what_heartbeats_report() -> None:
    history = SwarmHistory(config())
    history.observe(doc(0.0, [peer("A")], syncer=[syncer([0])]), 0.0)
    status = {"recent_merges": [{"fragment": 0, "version": 1, "participants": ["A"], "tokens": 300}]}
    history.observe(doc(1.0, [peer("A", tokens=1000)], syncer=[syncer([1])], syncer_status=status), 1.0)
    line = summary_line(history)
    assert "goodput 300 tok/s merged, 1 merges" in line
    assert "1,000 tok/s processed (reported by heartbeats)" in line
