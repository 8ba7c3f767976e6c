"""Per-peer limits and DHT store quotas, on a fake clock: rates, streams, bytes, bounded tables, flood reports."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import limits
from protocol.limits import (
    Admission,
    LimitsConfig,
    PeerLimiter,
    QuotaConfig,
    RateLimit,
    StoreQuota,
    Throttled,
    TokenBucket,
)

# ---- TokenBucket ------------------------------------------------------------------------------------------


def test_bucket_starts_full_then_refills_at_rate() -> None:
    bucket = TokenBucket(rate_per_s=2.0, burst=3.0)
    assert [bucket.try_take(100.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.time_until(100.0) == pytest.approx(0.5)
    assert not bucket.try_take(100.49)
    assert bucket.try_take(100.5)
    assert bucket.tokens(1000.0) == 3.0  # never above burst, however long the quiet period


def test_bucket_cost_above_burst_never_passes() -> None:
    bucket = TokenBucket(rate_per_s=10.0, burst=5.0)
    assert bucket.time_until(0.0, cost=6.0) == math.inf
    assert not bucket.try_take(1e9, cost=6.0)
    assert bucket.try_take(1e9, cost=5.0)


def test_bucket_clock_stepping_back_mints_nothing() -> None:
    bucket = TokenBucket(rate_per_s=1.0, burst=1.0)
    assert bucket.try_take(50.0)
    assert not bucket.try_take(10.0)  # the clock went back 40 s
    assert not bucket.try_take(50.5)  # refill counts from 50, not from 10
    assert bucket.try_take(51.0)


@pytest.mark.parametrize(
    ("rate", "burst"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (math.inf, 1.0), (1.0, math.nan)]
)
def test_bucket_rejects_bad_parameters(rate: float, burst: float) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, burst)


@settings(max_examples=300, deadline=None)
@given(
    rate=st.floats(min_value=0.1, max_value=1000.0),
    burst=st.floats(min_value=1.0, max_value=100.0),
    steps=st.lists(
        st.tuples(st.floats(min_value=-1.0, max_value=2.0), st.floats(min_value=0.0, max_value=5.0)),
        min_size=1,
        max_size=200,
    ),
)
def test_admitted_never_exceeds_rate_times_elapsed_plus_burst(
    rate: float, burst: float, steps: list[tuple[float, float]]
) -> None:
    bucket = TokenBucket(rate, burst)
    now = 1000.0
    t0 = now + steps[0][0]  # the bucket's clock starts at the first time it is given
    latest = t0  # the clock may step back; the bound is over the latest time seen
    admitted = 0.0
    for dt, cost in steps:
        now += dt
        latest = max(latest, now)
        if bucket.try_take(now, cost):
            admitted += cost
        assert admitted <= rate * (latest - t0) + burst + 1e-9 * (1 + admitted)


@settings(max_examples=100, deadline=None)
@given(rate=st.floats(min_value=0.1, max_value=1000.0), num_requests=st.integers(min_value=1, max_value=200))
def test_requests_paced_at_the_rate_are_never_refused(rate: float, num_requests: int) -> None:
    bucket = TokenBucket(rate, burst=1.0)
    assert all(bucket.try_take(i * 1.000001 / rate) for i in range(num_requests))


@settings(max_examples=100, deadline=None)
@given(
    gaps=st.lists(st.floats(min_value=0.0, max_value=0.2), min_size=1, max_size=300),
    rpcs=st.lists(st.sampled_from(["forward", "backward", "ping", "rpc_store"]), min_size=1, max_size=300),
)
def test_limiter_per_rpc_admissions_respect_each_bucket(gaps: list[float], rpcs: list[str]) -> None:
    config = LimitsConfig(
        default_rate=RateLimit(rate_per_s=5.0, burst=3.0),
        rpc_rates={"forward": RateLimit(rate_per_s=20.0, burst=4.0)},
        global_rate=None,
    )
    limiter = PeerLimiter(config)
    now = t0 = 0.0
    admitted: dict[str, int] = {}
    for gap, rpc in zip(gaps, rpcs, strict=False):
        now += gap
        if limiter.admit("peer", rpc, now):
            key, _ = config.rate_for(rpc)
            admitted[key] = admitted.get(key, 0) + 1
    for key, count in admitted.items():
        limit = config.rpc_rates.get(key, config.default_rate)
        assert count <= limit.rate_per_s * (now - t0) + limit.burst + 1e-9


# ---- PeerLimiter: rates ---------------------------------------------------------------------------------


def _limiter(**overrides: object) -> PeerLimiter:
    base: dict[str, object] = {
        "default_rate": RateLimit(rate_per_s=1.0, burst=2.0),
        "global_rate": None,
        "flood_threshold": 1000,
    }
    base.update(overrides)
    return PeerLimiter(LimitsConfig(**base))  # type: ignore[arg-type]


def test_rate_refusal_carries_retry_after_which_works() -> None:
    limiter = _limiter()
    assert limiter.admit("a", "ping", 0.0) and limiter.admit("a", "ping", 0.0)
    refused = limiter.admit("a", "ping", 0.0)
    assert refused == Admission(ok=False, reason=limits.RATE, retry_after_s=1.0)
    assert not refused
    assert limiter.admit("a", "ping", refused.retry_after_s)


def test_buckets_are_per_peer_and_per_listed_rpc() -> None:
    limiter = _limiter(rpc_rates={"forward": RateLimit(rate_per_s=1.0, burst=1.0)})
    assert limiter.admit("a", "forward", 0.0)
    assert not limiter.admit("a", "forward", 0.0)
    assert limiter.admit("b", "forward", 0.0), "another peer has its own bucket"
    assert limiter.admit("a", "ping", 0.0), "another RPC has its own bucket"
    assert limiter.admit("a", "status", 0.0)
    assert not limiter.admit("a", "made-up-name", 0.0), "unlisted RPCs share one bucket"


def test_global_rate_caps_all_peers_without_counting_as_flooding() -> None:
    limiter = _limiter(global_rate=RateLimit(rate_per_s=1.0, burst=3.0), flood_threshold=1)
    results = [limiter.admit(f"peer{i}", "ping", 0.0) for i in range(10)]
    assert sum(map(bool, results)) == 3
    assert {r.reason for r in results if not r} == {limits.GLOBAL_RATE}
    assert all(r.flood is None for r in results)
    stats = limiter.stats()
    assert stats.throttled_by_reason == {limits.GLOBAL_RATE: 7}
    assert stats.num_tracked_peers == 3, "refused newcomers are not tracked"


def test_peer_rate_is_checked_before_global_and_refusals_spend_nothing() -> None:
    limiter = _limiter(global_rate=RateLimit(rate_per_s=1.0, burst=2.0))
    assert limiter.admit("a", "ping", 0.0) and limiter.admit("a", "ping", 0.0)
    assert limiter.admit("a", "ping", 0.0).reason == limits.RATE
    assert limiter.admit("b", "ping", 0.0).reason == limits.GLOBAL_RATE
    assert limiter.admit("b", "ping", 1.0), "a refused request took no global token"


# ---- PeerLimiter: streams and bytes ----------------------------------------------------------------------


def test_stream_cap_per_peer_and_release() -> None:
    limiter = _limiter(default_rate=RateLimit(rate_per_s=100.0, burst=100.0), max_streams_per_peer=2)
    assert limiter.open_stream("a", "forward", 0.0)
    assert limiter.open_stream("a", "backward", 0.0)
    assert limiter.open_stream("a", "forward", 0.0).reason == limits.STREAMS
    assert limiter.open_stream("b", "forward", 0.0), "the cap is per peer"
    limiter.close_stream("a", "forward")
    assert limiter.open_stream("a", "forward", 0.0)
    assert limiter.stats().peers["a"].num_open_streams == 2


def test_stream_refused_for_slots_spends_no_rate_token() -> None:
    limiter = _limiter(default_rate=RateLimit(rate_per_s=1.0, burst=1.0), max_streams_per_peer=1)
    with limiter.stream("a", "forward", 0.0):
        assert limiter.open_stream("a", "forward", 10.0).reason == limits.STREAMS
    assert limiter.open_stream("a", "forward", 10.0), "the refused open took no token"


def test_global_stream_cap() -> None:
    limiter = _limiter(
        default_rate=RateLimit(rate_per_s=100.0, burst=100.0), max_streams_per_peer=2, max_streams_total=3
    )
    results = [limiter.open_stream(peer, "forward", 0.0) for peer in ("a", "a", "b", "b")]
    assert [r.reason for r in results] == ["", "", "", limits.GLOBAL_STREAMS]


def test_stream_context_manager_releases_on_error_and_raises_when_refused() -> None:
    limiter = _limiter(default_rate=RateLimit(rate_per_s=100.0, burst=100.0), max_streams_per_peer=1)
    with pytest.raises(RuntimeError), limiter.stream("a", "forward", 0.0):
        raise RuntimeError("handler failed")
    assert limiter.stats().num_open_streams == 0
    with limiter.stream("a", "forward", 0.0):
        with pytest.raises(Throttled) as caught, limiter.stream("a", "forward", 0.0):
            pass
        assert limiter.stats().num_open_streams == 1, "the refused inner stream released nothing"
    assert limiter.stats().num_open_streams == 0
    assert caught.value.admission.reason == limits.STREAMS
    assert caught.value.blame_sender is False


def test_close_stream_without_open_is_a_bug() -> None:
    limiter = _limiter()
    with pytest.raises(ValueError):
        limiter.close_stream("a", "forward")
    limiter.open_stream("a", "forward", 0.0)
    with pytest.raises(ValueError):
        limiter.close_stream("a", "backward")


def test_bytes_in_flight_per_peer_and_global() -> None:
    limiter = _limiter(max_bytes_in_flight_per_peer=100, max_bytes_in_flight_total=150)
    assert limiter.reserve_bytes("a", 60, 0.0)
    assert limiter.reserve_bytes("a", 41, 0.0).reason == limits.BYTES_IN_FLIGHT
    assert limiter.reserve_bytes("a", 40, 0.0)
    assert limiter.reserve_bytes("b", 60, 0.0).reason == limits.GLOBAL_BYTES_IN_FLIGHT
    limiter.release_bytes("a", 60)
    assert limiter.reserve_bytes("b", 60, 0.0)
    assert limiter.stats().bytes_in_flight == 100
    with pytest.raises(ValueError):
        limiter.release_bytes("b", 61)
    with limiter.reserved_bytes("c", 10, 0.0):
        assert limiter.stats().peers["c"].bytes_in_flight == 10
    assert limiter.stats().peers["c"].bytes_in_flight == 0
    with pytest.raises(Throttled), limiter.reserved_bytes("c", 101, 0.0):
        pass


# ---- PeerLimiter: bounded memory ------------------------------------------------------------------------


def test_sybil_flood_cannot_grow_the_peer_table() -> None:
    limiter = _limiter(max_tracked_peers=8)
    for i in range(10_000):
        limiter.admit(f"sybil{i}", "ping", float(i))
    stats = limiter.stats()
    assert stats.num_tracked_peers == 8
    assert stats.num_evicted_peers == 10_000 - 8
    assert set(stats.peers) == {f"sybil{i}" for i in range(10_000 - 8, 10_000)}, (
        "least recently used go first"
    )


def test_busy_peers_are_never_evicted_and_a_full_busy_table_refuses_newcomers() -> None:
    limiter = _limiter(default_rate=RateLimit(rate_per_s=100.0, burst=100.0), max_tracked_peers=3)
    assert limiter.open_stream("honest", "forward", 0.0)
    assert limiter.reserve_bytes("uploader", 10, 0.0)
    for i in range(50):
        assert limiter.admit(f"sybil{i}", "ping", 1.0)
    assert {"honest", "uploader"} <= set(limiter.stats().peers)
    assert limiter.open_stream("sybil49", "forward", 2.0)  # now all three entries are busy
    refused = limiter.admit("newcomer", "ping", 3.0)
    assert refused.reason == limits.PEER_TABLE_FULL
    assert "newcomer" not in limiter.stats().peers
    limiter.close_stream("honest", "forward")
    assert limiter.admit("newcomer", "ping", 4.0), "an idle entry can be evicted again"
    assert "honest" not in limiter.stats().peers


# ---- PeerLimiter: flood reports and stats ----------------------------------------------------------------


def test_flood_report_once_per_crossing_within_the_window() -> None:
    limiter = _limiter(
        default_rate=RateLimit(rate_per_s=0.01, burst=1.0), flood_threshold=5, flood_window_s=10.0
    )
    assert limiter.admit("a", "ping", 0.0)
    refusals = [limiter.admit("a", "ping", 0.1 * i) for i in range(1, 13)]
    floods = [r.flood for r in refusals if r.flood is not None]
    assert [r.reason for r in refusals] == [limits.RATE] * 12
    assert len(floods) == 2, "6th and 12th own-fault refusals each cross the threshold once"
    report = floods[0]
    assert report.peer == "a" and report.num_throttled == 6 and report.window_s == 10.0
    assert "throttled 6 times within 10 s" in report.reason and "rate: 6" in report.reason
    assert limiter.stats().peers["a"].num_flood_reports == 2
    assert limiter.stats().num_flood_reports == 2


def test_throttles_spread_beyond_the_window_are_not_flooding() -> None:
    limiter = _limiter(
        default_rate=RateLimit(rate_per_s=0.001, burst=1.0), flood_threshold=3, flood_window_s=10.0
    )
    limiter.admit("a", "ping", 0.0)
    refusals = [limiter.admit("a", "ping", 4.0 * i) for i in range(1, 30)]
    assert all(not r and r.flood is None for r in refusals)
    assert limiter.stats().peers["a"].num_throttled == 29


def test_stats_count_refusals_by_peer_and_reason() -> None:
    limiter = _limiter(max_streams_per_peer=1, max_bytes_in_flight_per_peer=10)
    limiter.admit("a", "ping", 0.0)
    limiter.open_stream("a", "forward", 0.0)
    limiter.open_stream("a", "forward", 0.0)
    limiter.admit("a", "ping", 0.0)
    limiter.reserve_bytes("a", 11, 0.0)
    stats = limiter.stats()
    assert stats.peers["a"].throttled_by_reason == {
        limits.STREAMS: 1,
        limits.RATE: 1,
        limits.BYTES_IN_FLIGHT: 1,
    }
    assert stats.peers["a"].num_throttled == 3
    assert stats.num_admitted == 2
    assert stats.throttled_by_reason == stats.peers["a"].throttled_by_reason


def test_limits_config_validation_and_immutability() -> None:
    rates = {"forward": RateLimit(rate_per_s=1.0, burst=1.0)}
    config = LimitsConfig(rpc_rates=rates)
    rates["backward"] = RateLimit(rate_per_s=1.0, burst=1.0)
    assert "backward" not in config.rpc_rates
    with pytest.raises(TypeError):
        config.rpc_rates["x"] = RateLimit(rate_per_s=1.0, burst=1.0)  # type: ignore[index]
    for bad in (
        {"max_streams_per_peer": 0},
        {"max_streams_per_peer": 10, "max_streams_total": 5},
        {"max_bytes_in_flight_total": 1, "max_bytes_in_flight_per_peer": 2},
        {"flood_window_s": 0.0},
        {"rpc_rates": {limits.OTHER_RPCS: RateLimit(rate_per_s=1.0, burst=1.0)}},
    ):
        with pytest.raises(ValueError):
            LimitsConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RateLimit(rate_per_s=1.0, burst=0.5)


# ---- StoreQuota --------------------------------------------------------------------------------------------

NOW = 1_700_000_000.0  # DHT time is wall-clock seconds


def _quota(**overrides: object) -> StoreQuota:
    base: dict[str, object] = {
        "window_s": 60.0,
        "max_records_per_peer": 3,
        "max_bytes_per_peer": 1000,
        "max_value_bytes": 500,
        "max_records_total": 10,
        "max_tracked_peers": 10,
        "max_expiration_horizon_s": 600.0,
        "clock_skew_s": 10.0,
    }
    base.update(overrides)
    return StoreQuota(QuotaConfig(**base))  # type: ignore[arg-type]


def _store(quota: StoreQuota, peer: str, now: float, size: int = 10, **kwargs: object) -> Admission:
    expiration = kwargs.pop("expiration_time", now + 60.0)
    return quota.admit_store(peer, kwargs.pop("key", b"key"), size, expiration, now, **kwargs)  # type: ignore[arg-type]


def test_per_peer_record_quota_slides_with_the_window() -> None:
    quota = _quota()
    assert all(_store(quota, "a", NOW + i) for i in range(3))
    assert _store(quota, "a", NOW + 3).reason == limits.STORE_RECORDS
    assert _store(quota, "b", NOW + 3), "quota is per peer"
    assert _store(quota, "a", NOW + 59.9).reason == limits.STORE_RECORDS
    assert _store(quota, "a", NOW + 60.0), "the first store left the window"


def test_per_peer_byte_quota_and_value_cap() -> None:
    quota = _quota()
    assert _store(quota, "a", NOW, size=500)
    assert _store(quota, "a", NOW, size=500)
    assert _store(quota, "a", NOW, size=1).reason == limits.STORE_BYTES
    assert _store(quota, "b", NOW, size=501).reason == limits.VALUE_TOO_LARGE


@pytest.mark.parametrize(
    ("offset_s", "reason"),
    [
        (600.0 + 10.0 + 0.01, limits.EXPIRATION_TOO_FAR),
        (1e12, limits.EXPIRATION_TOO_FAR),
        (math.inf, limits.EXPIRATION_TOO_FAR),
        (math.nan, limits.EXPIRATION_TOO_FAR),
        (-10.0, limits.ALREADY_EXPIRED),
        (600.0 + 10.0, ""),  # at the horizon plus the allowed clock skew
        (-9.9, ""),  # slightly in the past by our clock: the writer's clock may be behind
    ],
)
def test_expiration_horizon(offset_s: float, reason: str) -> None:
    assert _store(_quota(), "a", NOW, expiration_time=NOW + offset_s).reason == reason


def test_global_quota_bounds_a_sybil_flood_and_its_memory() -> None:
    quota = _quota(max_records_total=10, max_tracked_peers=10)
    results = [_store(quota, f"sybil{i}", NOW + i * 0.001) for i in range(1000)]
    assert sum(map(bool, results)) == 10
    stats = quota.stats()
    assert stats.rejected_by_reason == {limits.GLOBAL_STORE_RECORDS: 990}
    assert stats.num_tracked_peers == 10 and stats.num_evicted_peers == 0


def test_eviction_cannot_reset_a_peer_quota_inside_its_window() -> None:
    quota = _quota(max_records_total=4, max_tracked_peers=4, max_records_per_peer=2)
    assert _store(quota, "greedy", NOW) and _store(quota, "greedy", NOW)
    for i in range(100):  # Sybils try to push "greedy" out of the table to reset its count
        _store(quota, f"sybil{i}", NOW + 1 + i * 0.01)
    assert _store(quota, "greedy", NOW + 30).reason == limits.STORE_RECORDS
    stats = quota.stats()
    assert stats.num_evicted_peers == 0 and stats.num_tracked_peers == 3
    assert stats.rejected_by_reason == {limits.GLOBAL_STORE_RECORDS: 98, limits.STORE_RECORDS: 1}


def test_subkey_cap_counts_distinct_live_subkeys() -> None:
    quota = _quota(
        max_subkeys_per_key=2, max_records_per_peer=100, max_records_total=100, max_tracked_peers=100
    )
    assert _store(quota, "a", NOW, key=b"peers", subkey=b"p1", expiration_time=NOW + 30)
    assert _store(quota, "b", NOW, key=b"peers", subkey=b"p2", expiration_time=NOW + 300)
    assert _store(quota, "c", NOW, key=b"peers", subkey=b"p3").reason == limits.SUBKEYS
    assert _store(quota, "a", NOW + 1, key=b"peers", subkey=b"p1", expiration_time=NOW + 40), (
        "refresh is fine"
    )
    assert _store(quota, "c", NOW, key=b"other", subkey=b"p3"), "the cap is per key"
    assert _store(quota, "c", NOW + 41, key=b"peers", subkey=b"p3"), "p1 expired and freed its slot"


def test_subkey_tables_stay_bounded() -> None:
    quota = _quota(
        max_subkeys_per_key=10**6,
        max_records_per_peer=10**6,
        max_bytes_per_peer=10**9,
        max_records_total=10**6,
        max_tracked_peers=10**6,
        max_tracked_keys=50,
        max_tracked_subkeys=200,
    )
    for i in range(5000):
        assert _store(quota, "a", NOW, key=f"k{i % 300}", subkey=f"s{i}")
    assert quota.stats().num_tracked_keys <= 50
    assert quota._num_subkeys <= 200


def test_quota_config_validation() -> None:
    for bad in (
        {"max_tracked_peers": 10, "max_records_total": 11},
        {"max_value_bytes": 2000, "max_bytes_per_peer": 1000},
        {"window_s": 0.0},
        {"clock_skew_s": -1.0},
        {"max_subkeys_per_key": 0},
        {"max_records_total": 10, "reserved_records_total": 10},
        {"reserved_records_total": -1},
    ):
        with pytest.raises(ValueError):
            QuotaConfig(**bad)  # type: ignore[arg-type]
    QuotaConfig()  # the defaults are consistent


def _sybil_flood(quota: StoreQuota, num_sybils: int, now: float) -> int:
    """`num_sybils` fresh identities, each storing its whole per-peer budget (3 records); how many were admitted."""
    return sum(bool(_store(quota, f"sybil{i}", now + i * 0.001)) for i in range(num_sybils) for _ in range(3))


def _reserved_quota(reserved: int, known: frozenset[str]) -> StoreQuota:
    config = QuotaConfig(
        window_s=60.0,
        max_records_per_peer=3,
        max_records_total=20,
        reserved_records_total=reserved,
        max_tracked_peers=20,
    )
    return StoreQuota(config, known=known.__contains__)


def test_a_sybil_flood_fills_the_guests_pool_and_a_known_peer_still_stores() -> None:
    """100 fresh identities at their per-peer budget against a global quota of 20 records, 8 reserved for the
    run's syncer: they get the guests' 12, and the syncer stores its whole budget under the flood."""
    quota = _reserved_quota(8, frozenset({"syncer"}))
    assert _sybil_flood(quota, 100, NOW) == 12
    assert _store(quota, "sybil99", NOW + 1).reason == limits.GUEST_STORE_RECORDS
    assert all(_store(quota, "syncer", NOW + 1 + i) for i in range(3))
    assert _store(quota, "syncer", NOW + 4).reason == limits.STORE_RECORDS  # its own cap still holds
    stats = quota.stats()
    assert stats.rejected_by_reason == {limits.GUEST_STORE_RECORDS: 289, limits.STORE_RECORDS: 1}
    assert (stats.num_admitted, stats.num_admitted_guests) == (15, 12)
    # The guests' pool slides with the window like the global count.
    assert _store(quota, "sybil99", NOW + 60.0005)


@pytest.mark.parametrize(
    ("reserved", "known"),
    [(0, frozenset({"syncer"})), (8, frozenset({"syncer", *(f"sybil{i}" for i in range(100))}))],
    ids=["no-reservation", "sybils-treated-as-known"],
)
def test_negative_control_without_the_reservation_the_flood_locks_the_known_peer_out(
    reserved: int, known: frozenset[str]
) -> None:
    quota = _reserved_quota(reserved, known)
    assert _sybil_flood(quota, 100, NOW) == 20  # the whole global quota
    assert _store(quota, "syncer", NOW + 1).reason == limits.GLOBAL_STORE_RECORDS
    assert quota.stats().num_admitted_guests == 0  # nobody counted as a guest: no pool to hold them to


def test_known_peers_may_use_the_guests_pool_when_guests_leave_it_free() -> None:
    quota = StoreQuota(
        QuotaConfig(
            max_records_per_peer=100, max_records_total=10, reserved_records_total=4, max_tracked_peers=10
        ),
        known={"verifier"}.__contains__,
    )
    assert all(_store(quota, "verifier", NOW + i) for i in range(10))
    assert _store(quota, "verifier", NOW + 10).reason == limits.GLOBAL_STORE_RECORDS
    assert _store(quota, "guest", NOW + 10).reason == limits.GLOBAL_STORE_RECORDS
    nobody_known = StoreQuota(
        QuotaConfig(
            max_records_per_peer=100, max_records_total=10, reserved_records_total=4, max_tracked_peers=10
        )
    )
    assert sum(bool(_store(nobody_known, "verifier", NOW + i)) for i in range(10)) == 6


def test_guests_cannot_take_the_stream_slots_reserved_for_preferred_peers() -> None:
    """Sixteen fresh identities with eight streams each against a stage's 64 slots; the verifier must get in."""
    rate = RateLimit(rate_per_s=1000.0, burst=1000.0)

    def flood(limiter: limits.PeerLimiter) -> int:
        return sum(
            bool(limiter.open_stream(f"sybil{i}", "forward", 0.0)) for i in range(16) for _ in range(8)
        )

    # negative control: nobody preferred (the old behaviour), the Sybils hold every slot
    open_door = _limiter(default_rate=rate, global_rate=None)
    assert flood(open_door) == 64
    assert open_door.open_stream("verifier", "forward", 0.0).reason == limits.GLOBAL_STREAMS

    guarded = _limiter(default_rate=rate, global_rate=None)
    guarded.prefer(lambda peer: peer == "verifier")
    assert flood(guarded) == 48  # 4 streams per guest, 64 - 16 reserved for all guests together
    assert guarded.open_stream("sybil0", "forward", 0.0).reason == limits.STREAMS
    assert guarded.open_stream("sybil99", "forward", 0.0).reason == limits.GLOBAL_STREAMS
    for _ in range(8):
        assert guarded.open_stream("verifier", "forward", 0.0)  # its own per-peer cap, in the reserve
    assert guarded.open_stream("verifier", "forward", 0.0).reason == limits.STREAMS
    guarded.close_stream("sybil0", "forward")
    assert guarded.open_stream("sybil99", "forward", 0.0), "a closed guest stream frees a guest slot"
