"""Disguised spot checks over real daemons on loopback (issue 18 item 4: spot checks indistinguishable from
ordinary traffic). The colluding ring of tests/unit/test_disguised_checks.py (`collusion_arm`): stage 1 has
replicas A, B and C, every answer is spot-checked; A lies on all its traffic but what it recognises as checks, B
vouches for A on every check of A it recognises, C is honest. Here every replica is served by a `FramedServer` on a
daemon of its own key and the verifier's driver calls them over `FramedTransport` (`pipeline_over_daemons`); the
colluders still share what they see out of band, as a real ring would.

With checks disguised (the default) neither A nor B can tell a check from training traffic: A is convicted and
banned, C never. Negative control: checks marked (`disguised_spot_checks=False`): B clears A's lies and, as the
third opinion against C, gets the honest replica banned.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tests.integration.procs import pipeline_over_daemons
from tests.unit.test_disguised_checks import (  # noqa: F401 - one_torch_thread: autouse
    collusion_arm,
    drive_training,
    one_torch_thread,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]
logger = logging.getLogger(__name__)

MICROBATCHES = 24  # as in the unit tests: what their measured convictions were counted over
SCENARIO_S = 120.0


@pytest.mark.parametrize("disguised", [True, False], ids=["disguised", "marked-control"])
def test_disguised_checks_convict_the_liar_over_daemons_and_marked_ones_frame_the_honest(
    loop_thread: Any, tmp_path: Path, disguised: bool
) -> None:
    arm, tally = collusion_arm("clear", disguised)

    async def scenario() -> None:
        async with pipeline_over_daemons(arm.services, arm.driver, arm.driver.identity, tmp_path):
            await drive_training(arm, MICROBATCHES)

    loop_thread.run(scenario(), timeout_s=SCENARIO_S)
    got = tally()
    logger.info("disguised=%s: %s, %d spot checks", disguised, got, arm.driver.stats.spot_checks)
    assert arm.driver.stats.spot_checks >= MICROBATCHES, arm.driver.stats
    if disguised:
        assert got["A_convicted"] >= 1 and got["A_matched"] == 0 and got["banned"] == ["A"], got
        assert got["B_convicted"] == got["C_convicted"] == 0, got
    else:
        # the control: B vouches for A's lies and frames C
        assert got["A_matched"] >= 8 and got["A_convicted"] == 0, got
        assert got["C_convicted"] >= 1 and got["banned"] == ["C"], got
