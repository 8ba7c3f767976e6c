"""Blame for the held-out loss screen's refusals, counted per piece of work (issue 18): the syncer's flow
(`LossBound.judge`, then `LearnerLedger.record` for a blamed refusal, as node.roles.syncer_rpc does), no sockets, the
clock passed in.

The scores are those of the failing run of tests/integration/test_poisoning.py (2026-12-07): an honest learner whose
schedule was re-aligned sent fragment 0 three times within 1.4 s on one base, each judged an ascent step in that
base's context (held-out loss 3.286 -> 3.36-3.40, over the bound), then one more contribution of another fragment,
and was banned on that fourth (ban after weight 3). Counted once per (fragment, base version), the burst weighs one
violation and the learner is not banned; the sign-flipper, one push per fragment and round on each round's new base,
is banned on its fourth push either way. The negative control is the old count (`work` not given): the same honest
burst is banned."""

from __future__ import annotations

import pytest

from node.diloco.learner_ledger import LearnerBan, LearnerLedger
from node.diloco.loss_probe import LOSS, LossBound, LossScore

pytestmark = pytest.mark.timeout(30)

HONEST, OTHER, ATTACKER = "honest", "other-honest", "sign-flipper"
BEFORE = 3.286  # the held-out loss before, in the failing run


def bound() -> LossBound:
    """The syncer's defaults (node.diloco.screening.ScreeningConfig), warmed up: every fragment has the merged
    scores the bound learns from and another peer's latest work passed there (a failure is corroborated)."""
    b = LossBound(tolerance=0.02, mad_factor=3.0, history=32, min_history=4, reverse_tolerance=0.005)
    for fragment in range(3):
        b.commit(fragment, [-0.03, -0.02, -0.04, -0.03])
        assert b.judge(fragment, descent(), OTHER) == (None, None)
    return b


def ledger() -> LearnerLedger:
    return LearnerLedger(ban_after=3.0, forgive_half_life_s=600.0, ban_s=3600.0)


def descent() -> LossScore:
    return LossScore(before=BEFORE, after=BEFORE - 0.03, cost_s=0.0, opposite=BEFORE + 0.03, norm=1.0)


def ascent(after: float) -> LossScore:
    """Higher applied than reversed, by as much as it rose: an ascent step, judged by the reverse rule."""
    return LossScore(before=BEFORE, after=after, cost_s=0.0, opposite=2 * BEFORE - after, norm=1.0)


def pushed(
    b: LossBound,
    book: LearnerLedger,
    peer: str,
    fragment: int,
    base_version: int,
    score: LossScore,
    now: float,
    *,
    once_per_work: bool,
) -> tuple[bool, LearnerBan | None]:
    """(whether the contribution was refused, the ban its refusal triggered): the screen's verdict and, when it is
    blamed, the ledger's record, with (fragment, base version) as its work, or none (the old count)."""
    reason, excuse = b.judge(fragment, score, peer)
    if reason is None:
        return False, None
    if excuse is not None:
        return True, None
    work = (fragment, base_version) if once_per_work else None
    scores = {"loss_before": score.before, "loss_after": score.after}
    return True, book.record(peer, LOSS, f"fragment {fragment}: {reason}", f"d{now}", now, scores, work)


# the failing run's honest learner: (seconds, fragment, base version, held-out loss applied alone)
HONEST_BURST = [(0.0, 0, 12, 3.36), (0.7, 0, 12, 3.38), (1.4, 0, 12, 3.40), (9.5, 1, 11, 3.37)]


@pytest.mark.parametrize("once_per_work", [True, False], ids=["per-work", "negative-control-per-push"])
def test_a_burst_of_one_honest_learners_work_on_one_base_weighs_once_and_is_not_banned(
    once_per_work: bool,
) -> None:
    b, book = bound(), ledger()
    bans = []
    for at, fragment, base_version, after in HONEST_BURST:
        refused, ban = pushed(
            b, book, HONEST, fragment, base_version, ascent(after), at, once_per_work=once_per_work
        )
        # each is refused either way: over the bound, higher than its reverse (never merged)
        assert refused and after - BEFORE > b.bound(fragment, BEFORE)[0]
        bans.append(ban)
        b.judge(fragment, descent(), OTHER)  # the other honest learner's work keeps passing meanwhile
    status = book.status(10.0)[HONEST]
    assert status["refused_by_tag"] == {LOSS: 4}
    if once_per_work:
        # the burst is one violation, the other fragment's refusal a second: under ban_after, no ban
        assert bans == [None] * 4 and book.banned(HONEST, 10.0) is None
        assert status["refused"] == 2 and status["repeats"] == 2 and 1.9 < status["weight"] < 2.0
    else:
        # the old count: four violations within 10 s, banned on the fourth (the integration test's failure)
        assert bans[:3] == [None] * 3 and bans[3] is not None and book.banned(HONEST, 10.0) is not None
        assert status["refused"] == 4 and status["repeats"] == 0


@pytest.mark.parametrize("once_per_work", [True, False], ids=["per-work", "per-push"])
def test_a_sign_flipper_pushing_on_each_rounds_new_base_is_blamed_every_time_and_banned(
    once_per_work: bool,
) -> None:
    """The defence still bites: one sign-flipped push per fragment and round, each on the version the round before
    published (as in the integration test and the poisoning benchmark), is a new piece of work each time."""
    b, book = bound(), ledger()
    ban, pushes = None, 0
    for round_ in range(10):
        fragment, base_version = round_ % 3, 1 + round_ // 3
        refused, ban = pushed(
            b, book, ATTACKER, fragment, base_version, ascent(3.40), 0.6 * round_, once_per_work=once_per_work
        )
        assert refused
        pushes += 1
        if ban is not None:
            break
        b.judge(fragment, descent(), OTHER)
    assert ban is not None and pushes == 4  # banned on its fourth, with or without the per-work count
    assert [v.digest for v in ban.evidence] == [f"d{0.6 * i}" for i in range(4)]
    assert book.status(3.0)[ATTACKER]["repeats"] == 0


def test_a_sign_flipper_repeating_one_base_is_refused_every_time_and_banned_as_the_versions_move() -> None:
    """What the per-work count gives up, and why it holds: flips sent again and again on one base weigh once, but
    each is still refused (never merged), and a base is current only until the honest learners' next merge of the
    fragment; older ones are refused as a missed round before they are scored. On the fourth base: banned, as with
    one flip per base (three violations, forgiven a little meanwhile, stay under ban_after 3)."""
    b, book = bound(), ledger()
    now, bans = 0.0, []
    for base_version in (5, 6, 7, 8):
        for _ in range(5):
            refused, ban = pushed(b, book, ATTACKER, 0, base_version, ascent(3.40), now, once_per_work=True)
            assert refused
            bans.append(ban)
            now += 0.1
        b.judge(0, descent(), OTHER)  # the honest learner's work merges: the next base
    assert all(ban is None for ban in bans[:15]) and bans[15] is not None  # the first flip of the fourth base
    status = book.status(now)[ATTACKER]
    assert status["refused_by_tag"] == {LOSS: 20} and status["refused"] == 4 and status["repeats"] == 16
