"""Compressed outer gradients live: a syncer and two learners on loopback under the top-k codec (1/128 of every
fragment, 2-bit values, error feedback on the learners), and under topk_rice (the same with Rice-coded indices). The global model still learns, the pushes carry a small
fraction of the fp32 bytes, and the syncer refuses none of them (each is decoded, rebuilt on its base version and
screened like an uncompressed one)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from protocol.compress import (
    BAD_HEADER,
    BAD_INDEX,
    BAD_SCALE,
    NON_FINITE,
    TOO_LARGE,
    WRONG_CODEC,
    WRONG_LENGTH,
)
from protocol.identity import NodeIdentity
from tests.integration.procs import QUIET_LEARNER, RunSpec, procs, read_events, wait_until, write_node_toml

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

TOPK = (("codec", "topk"), ("chunk", 4096), ("k", 32), ("bits", 2), ("scale_bits", 16))
TOPK_RICE = (("codec", "topk_rice"), ("chunk", 4096), ("k", 43), ("bits", 2), ("scale_bits", 16))
RUN = RunSpec(name="compressed-sync-test", seed=5, outer_codec=TOPK)
LEARNER = {**QUIET_LEARNER, "min_step_s": 0.1, "join_timeout_s": 20.0}
# what a syncer answers to a payload it cannot decode, and the learner's own refusal of a delta it cannot encode
COMPRESSION_REFUSALS = {
    BAD_HEADER,
    TOO_LARGE,
    WRONG_CODEC,
    WRONG_LENGTH,
    BAD_SCALE,
    BAD_INDEX,
    NON_FINITE,
    "encode failed",
}
SYNCER = {"recovery_s": 1.0, "eval_every_merges": 6, "eval_batches": 2}


@pytest.mark.parametrize("codec", [TOPK, TOPK_RICE], ids=["topk", "topk_rice"])
def test_topk_swarm_learns_on_a_fraction_of_the_bytes(
    tmp_path: Path, codec: tuple[tuple[str, str | int], ...]
) -> None:
    key = tmp_path / "syncer.key"
    run = replace(RUN, outer_codec=codec, authorized_syncers=(NodeIdentity.load_or_create(key).peer_id,))
    run_path = run.write_run_toml(tmp_path / "run.toml")
    node_toml = write_node_toml(tmp_path / "node.toml", learner=LEARNER, syncer=SYNCER)
    with procs(tmp_path) as group:
        bootstrap = group.start_bootstrap("--run", str(run_path))
        common: dict[str, Any] = {"config": node_toml, "max_steps": 100_000}
        syncer = group.join_node(bootstrap, "syncer", identity=key, state="syncer", **common)
        learners = [group.join_node(bootstrap, "learner", state=f"learner{i}", **common) for i in range(2)]

        def evals() -> list[dict[str, Any]] | None:
            found = read_events(tmp_path / "syncer", "eval")
            return found if len(found) >= 4 else None

        found = wait_until(evals, 150, what="four evaluations of the global model", interval_s=0.5)
        initial, latest = found[0]["loss"], found[-1]["loss"]
        print(
            f"\ntop-k global held-out loss {initial:.3f} -> {latest:.3f} after {found[-1]['merges']} merges"
        )
        assert latest < initial - 0.3
        for learner in learners:
            # a learner that joined late (its corpus load is slow under load) still has pushes to make
            sync = wait_until(
                lambda n=learner: (st := n.try_status().get("sync")) and st["acked"] > 0 and st,
                60,
                what="a learner's acknowledged pushes",
            )
            print(f"learner sync: acked {sync['acked']}, refusals {sync['refusals']}")
            assert sync["acked"] > 0 and not set(sync["refusals"]) & COMPRESSION_REFUSALS
            ratio = sync["push_bytes_fp32"] / sync["push_bytes"]
            print(
                f"learner pushes: {sync['push_bytes']} bytes, fp32 {sync['push_bytes_fp32']} ({ratio:.0f}x)"
            )
            assert ratio > 50
        status = wait_until(
            lambda: "refusals" in (st := syncer.try_status()) and st, 20, what="the syncer's status"
        )
        refusals = status["refusals"]
        assert not set(refusals) & COMPRESSION_REFUSALS, refusals
