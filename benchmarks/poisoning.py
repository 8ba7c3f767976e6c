"""Poisoning the data-parallel axis: honest learners and attackers in a live swarm, the syncer's defences on.

One arm per attack, one after another, each a fresh swarm of real processes on loopback: a bootstrap, one syncer
(K = 1, decoupled), honest learners stepping at a fixed speed on the built-in standard-library corpus, and
attacker learners (`HIVENODE_UNSAFE_LEARNER_ATTACK`, node.diloco.attack_transport) that train like the others and
poison what they push. The `clean` arm (no attacker, same honest learners, same seeds) is the control of every
arm with 4 honest learners; `clean_k1` (one honest learner) that of `lone_k1` and `noise_k1`. An arm named with `--undefended`
also runs with the syncer's screening off (`[syncer.screening] enabled = false`, which also turns off the
seniority cap) and `[admission] mode = "open"`: the negative control, where the attack is seen to win. Defended
runs ask a 12-bit proof-of-work of every learner (the default mode at a difficulty the machine solves in ms).
`embed_flip`: 1 attacker that sends its honest contribution with only the output head's delta sign-flipped
(node.diloco.attack_transport, `embed_flip`: the tensor hides among the honest ones of its fragment, which set the
contribution's norm and cosine). `clean_nostep`: `clean` with the evidence's step scale off (`evidence_scales_step =
false`), the same-box A/B of how many honest contributions the evidence zeroes. `sybil_late`: 5 fresh identities join 30 s after 4 honest learners train, so the honest ones are senior
(node.diloco.seniority) and the Sybils' summed share of any merge is capped (`attacker_weight_share_max`).
`copycat`: 4 honest learners, the first of them also leaving each contribution the syncer took in a directory
(`HIVENODE_UNSAFE_COPY_SOURCE`, the colluders' or eavesdropper's channel), and 1 attacker that pushes those
contributions again (+1 % noise) with claims of its own; `freeride`: 1 attacker that pushes the current published
version (+1 % of its honest delta's norm as noise) with honest claims. Their `--undefended` run keeps the screening
on and turns only the copy check off (`copy_tolerance = 0.0`), the defence they test; `noise`'s turns only the
evidence weighting off (`evidence_weighting = false`, node.diloco.evidence). `noise_k1`: 1 attacker pushing noise at
an honest norm and 1 honest learner at K = 1, each contribution a round of its own; its `--undefended` run keeps
the evidence weighting on and turns off only the round's step scale (`evidence_scales_step = false`) and the
ledger violation of a run of factor-0 contributions (`evidence_zero_violation_after = 0`). `noise_k1_nocap`: the
same with the seniority cap off in both runs (`young_weight_cap = 1.0`), the step scale alone.
`noise_aligned_k1` (1 honest, K = 1) and `noise_aligned` (4 honest): cosine gaming, 1 attacker pushing noise at an
honest norm plus 0.2 x that norm along the public recent merged direction (its EMA of the updates between the
versions it fetched; node.diloco.attack_transport `aligned`); their `--undefended` run turns only the evidence's
public-direction rule off (`evidence_public_residual = false`, node.diloco.screening_residual).
`noise_aligned1_k1` and `noise_aligned1`: the same at 1.0 x the norm along the public direction.

Per arm, from the syncer's events and status after `--duration` seconds:

* loss_gap = (the arm's last held-out loss - its control's) / its control's (the syncer's own evaluation), and
  loss_gap_at_tokens: the same against the control's loss interpolated at the arm's merged tokens (the attackers'
  processes take CPU from the honest learners on a small machine, so equal windows merge fewer honest tokens);
* attacker_weight_share = mean over merges after the attackers' first refusal (all merges when none was
  refused) of the summed merge weight of attacker identities. The merge event's weights are each contribution's
  effective share of a full step: normalised weight x the round's `step_scale` (the evidence's largest factor x
  the seniority cap's young-only scale; the syncer scales both the step and the weights it records), so a lone
  attacker at K = 1 whose step was scaled to 0.1 counts 0.1, not 1.0;
* merges_after_detection: how many merges that mean is over (the test runs a fixed count of them);
  attacker_weight_share_since_joined: the mean from the first merge that took attacker weight on (the undefended
  control's share, not diluted by the merges before its first push);
* time_to_ban_s: from the window's start to the first `learner_banned` of an attacker (None: not banned);
* honest_banned: honest identities the syncer banned; no_evidence_violations: per side, the learner ledger's
  violations for runs of contributions at evidence factor 0 (`evidence: none`); scaled_steps: merges whose step
  the evidence or the seniority cap scaled below 1;
* evidence: per side, the evidence weighting's factors and the held-out slopes and cosines they came from, and
  `zeroed_after`: [zeroed, scored] in merges that followed a scaled step of their fragment and in the others;
* check cost: the held-out loss probe's mean seconds per contribution over the mean interval between merges of
  one fragment (the goal: <= 10 %).

    python -m benchmarks.poisoning                                   # every arm, 90 s each (~25 min)
    python -m benchmarks.poisoning --arms clean,signflip --duration 40 --undefended signflip
    python -m benchmarks.poisoning --arms clean,copycat,freeride --undefended copycat,freeride --merge

`--merge` keeps the results file's other arms (each with its loss gaps against its own run's control, named in
`control_final_loss`, and its `measured_at`) and recomputes the headline over all arms present.

Writes benchmarks/results/poisoning.json (headline: max_loss_gap, max_attacker_weight_share, honest_banned,
max_check_cost_share, arms) and poisoning.png (held-out loss over time per arm).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, plot_path, write_result
from benchmarks.goodput import interpolate, try_json, wait_for
from node.diloco.attack_transport import (
    UNSAFE_COPY_DIR_ENV,
    UNSAFE_COPY_SOURCE_ENV,
    UNSAFE_LEARNER_ATTACK_ENV,
)
from node.diloco.evidence import NO_EVIDENCE
from protocol.identity import NodeIdentity
from tools.chaos import ProcessGroup

logger = logging.getLogger("benchmarks.poisoning")

REPO_ROOT = Path(__file__).resolve().parents[1]
RUN_TOML = """
name = "poisoning-{arm}"
seed = 5
num_stages = 1
heartbeat_period_s = 1.0
authorized_syncers = ["{syncer}"]
[model]
vocab_size = 256
context_len = 32
num_layers = 2
width = 32
num_heads = 2
[inner]
lr = 0.003
batch_size = 4
weight_decay = 0.01
[diloco]
num_fragments = 2
sync_every_steps = 8
overlap_steps = 1
min_sync_interval_s = 0.0
mode = "decoupled"
[admission]
mode = "{admission}"
pow_bits = 12
"""
NODE_TOML = """
[learner]
min_step_s = {min_step_s}
eval_every_steps = 0
torch_threads = 1
join_timeout_s = 40.0
[syncer]
recovery_s = 1.0
eval_every_merges = 4
eval_batches = 4
eval_batch_size = 8
checkpoint_every_merges = 1000
[syncer.screening]
enabled = {defended}
{screening_extra}
"""


COPY_CHECK_OFF = "copy_tolerance = 0.0"  # node.diloco.screening: 0 turns the copycat / free-rider check off
# node.diloco.evidence: the merge weight kept whatever the held-out slope
EVIDENCE_OFF = "evidence_weighting = false"
# node.diloco.evidence, the weighting still on: a round's step not scaled by its best factor (a lone contribution
# keeps the whole step at any factor above 0) and runs of factor-0 contributions no ledger violation
SENIORITY_OFF = "young_weight_cap = 1.0"  # node.diloco.seniority: 1.0 caps nothing
STEP_SCALE_OFF = "evidence_scales_step = false"
EVIDENCE_STEP_OFF = "evidence_scales_step = false\nevidence_zero_violation_after = 0"
# node.diloco.screening_residual: the evidence judges the whole delta's slope and its cosine alone can raise it
PUBLIC_RESIDUAL_OFF = "evidence_public_residual = false"


@dataclass(frozen=True, kw_only=True, slots=True)
class Arm:
    name: str
    attack: str | None  # HIVENODE_UNSAFE_LEARNER_ATTACK of the attackers
    attackers: int
    honest: int = 4
    control: str = "clean"
    admission: str = "pow"  # the run's [admission] mode when defended (undefended: open)
    late_s: float = 0.0  # the attackers join this long after the honest learners train (seniority)
    # the first honest learner also leaves its contributions in the copycat's channel (HIVENODE_UNSAFE_COPY_SOURCE)
    copy_source: bool = False
    # the undefended run keeps the screening on with these `[syncer.screening]` lines instead of turning it off
    # (e.g. only the copy check off: "copy_tolerance = 0.0"); "": the whole screening off
    undefended_screening: str = ""
    screening: str = ""  # `[syncer.screening]` lines of both runs (before the undefended ones)


ARMS = {
    a.name: a
    for a in (
        Arm(name="clean", attack=None, attackers=0),
        Arm(name="clean_k1", attack=None, attackers=0, honest=1, control="clean_k1"),
        # the evidence's step scale off (A/B of `clean` on the same box: how many honest contributions get factor 0)
        Arm(name="clean_nostep", attack=None, attackers=0, screening=STEP_SCALE_OFF),
        Arm(name="scale_1e3", attack="scale:1e3", attackers=1),
        Arm(name="scale_1e30", attack="scale:1e30", attackers=1),
        Arm(name="huge_1e38", attack="value:1e38", attackers=1),
        Arm(name="nan", attack="value:nan", attackers=1),
        Arm(name="inf", attack="value:inf", attackers=1),
        Arm(name="signflip", attack="signflip", attackers=1),
        # only the output head's delta flipped (lm_head; the embedding's own fragment goes honest), hidden among the
        # honest tensors of its fragment that dominate the contribution's norm and cosine
        Arm(name="embed_flip", attack="embed_flip", attackers=1),
        # undefended: only the evidence weighting off (noise passes every other screen)
        Arm(name="noise", attack="noise", attackers=1, undefended_screening=EVIDENCE_OFF),
        Arm(name="stale_replay", attack="replay", attackers=1),
        # 4 honest learners, the first of them the copycat's source; undefended: only the copy check off
        Arm(
            name="copycat",
            attack="copycat",
            attackers=1,
            copy_source=True,
            undefended_screening=COPY_CHECK_OFF,
        ),
        Arm(name="freeride", attack="freeride", attackers=1, undefended_screening=COPY_CHECK_OFF),
        Arm(name="inflated_claims", attack="inflate:20", attackers=1),
        Arm(name="lone_k1", attack="signflip", attackers=1, honest=1, control="clean_k1"),
        # noise alone in its rounds (K = 1): normalised, its weight was the whole merge at any factor above 0;
        # undefended: the weighting on, only the step scale and the zero-evidence violations off
        Arm(
            name="noise_k1",
            attack="noise",
            attackers=1,
            honest=1,
            control="clean_k1",
            undefended_screening=EVIDENCE_STEP_OFF,
        ),
        # cosine gaming: noise plus 0.2 x the public merged direction (the attacker's EMA of the updates between the
        # versions it fetched), whose cosine looks honest and whose public part descends (node.diloco.evidence);
        # undefended: only the evidence's public-direction rule off (node.diloco.screening_residual)
        Arm(
            name="noise_aligned_k1",
            attack="aligned:0.2",
            attackers=1,
            honest=1,
            control="clean_k1",
            undefended_screening=PUBLIC_RESIDUAL_OFF,
        ),
        Arm(
            name="noise_aligned",
            attack="aligned:0.2",
            attackers=1,
            undefended_screening=PUBLIC_RESIDUAL_OFF,
        ),
        # the same at A = 1.0: as much public direction as noise, where the slope (the public part descends the
        # held-out loss faster than an honest delta), not only the cosine, is the lever
        Arm(
            name="noise_aligned1_k1",
            attack="aligned:1.0",
            attackers=1,
            honest=1,
            control="clean_k1",
            undefended_screening=PUBLIC_RESIDUAL_OFF,
        ),
        Arm(
            name="noise_aligned1",
            attack="aligned:1.0",
            attackers=1,
            undefended_screening=PUBLIC_RESIDUAL_OFF,
        ),
        # the same with the seniority cap off in both runs (it scales a lone young attacker's step to 0.25 once the
        # honest learner is senior, hiding what the evidence's step scale does)
        Arm(
            name="noise_k1_nocap",
            attack="noise",
            attackers=1,
            honest=1,
            control="clean_k1",
            screening=SENIORITY_OFF,
            undefended_screening=EVIDENCE_STEP_OFF,
        ),
        Arm(name="sybil_majority", attack="signflip", attackers=5),
        # fresh identities (each paid its proof-of-work) join once the honest learners are senior: the seniority
        # cap holds their summed share of any merge to young_weight_cap (0.25)
        Arm(name="sybil_late", attack="signflip", attackers=5, late_s=30.0),
    )
}


class Swarm:
    """One arm's processes; status URLs are read from each node's log ("status: http://...")."""

    def __init__(self, root: Path, arm: Arm, *, defended: bool, min_step_s: float) -> None:
        self.root, self.arm = root, arm
        env = dict(os.environ)
        env.update(
            PYTHONUNBUFFERED="1",
            HIVENODE_STATE_DIR=str(root / "state-default"),
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        )
        for name in (UNSAFE_LEARNER_ATTACK_ENV, UNSAFE_COPY_DIR_ENV, UNSAFE_COPY_SOURCE_ENV):
            env.pop(name, None)
        self.group = ProcessGroup(root / "logs", env=env, cwd=REPO_ROOT)
        self.syncer_key = root / "syncer.key"
        syncer_id = NodeIdentity.load_or_create(self.syncer_key).peer_id
        self.run_path = root / "run.toml"
        admission = arm.admission if defended else "open"
        self.run_path.write_text(RUN_TOML.format(arm=arm.name, syncer=syncer_id, admission=admission))
        self.node_toml = root / "node.toml"
        screening_on = defended or bool(arm.undefended_screening)
        self.node_toml.write_text(
            NODE_TOML.format(
                min_step_s=min_step_s,
                defended="true" if screening_on else "false",
                screening_extra="\n".join(
                    filter(None, [arm.screening, "" if defended else arm.undefended_screening])
                ),
            )
        )
        self.copy_dir = (
            root / "copy-channel"
        )  # the copycat's eavesdropping channel (node.diloco.copy_channel)
        self.honest = [f"honest{i}" for i in range(arm.honest)]
        self.attackers = [f"attacker{i}" for i in range(arm.attackers)]
        self._urls: dict[str, str] = {}
        self._started: set[str] = set()

    def start(self) -> float:
        """Start every process; returns when every learner trains (the window's start, wall clock)."""
        python = sys.executable
        maddrs = self.root / "bootstrap.maddrs"
        bootstrap = [
            "-m",
            "bootstrap",
            "--run",
            str(self.run_path),
            "--state-dir",
            str(self.root / "bootstrap"),
            # the benchmark runs its own syncer: the owner's (a bootstrap default since #19) raced it for the lease
            # and, when it won, ours stood by and the arm timed out waiting for it
            "--no-syncer",
            "--no-verifier",
        ]
        self.group.start("bootstrap", [python, *bootstrap, "--maddrs-file", str(maddrs)])
        maddr = wait_for(lambda: maddrs.exists() and maddrs.read_text().split(), 60, "bootstrap")[0]
        common = ["--join", maddr, "--config", str(self.node_toml), "--max-steps", "1000000"]
        node = [python, "-m", "node"]
        self.group.start(
            "syncer",
            [
                *node,
                "--state-dir",
                str(self.root / "syncer"),
                "--role",
                "syncer",
                "--identity",
                str(self.syncer_key),
            ]
            + common,
        )
        wait_for(lambda: (self.status("syncer") or {}).get("state") == "syncing", 60, "the syncer")
        if self.arm.late_s > 0:  # the honest learners first, long enough to be senior
            self._start_learners(self.honest, common)
            time.sleep(self.arm.late_s)
        self._start_learners(self.honest + self.attackers, common)
        return time.time()

    def _start_learners(self, names: list[str], common: list[str]) -> None:
        """Start those of `names` not started yet; returns when all of `names` train."""
        node = [sys.executable, "-m", "node"]
        for name in names:
            if name in self._started:
                continue
            argv = [
                *self._unsafe_env(name),
                *node,
                "--state-dir",
                str(self.root / name),
                "--role",
                "learner",
                *common,
            ]
            self.group.start(name, argv)
            self._started.add(name)
        wait_for(
            lambda: all((self.status(n) or {}).get("state") == "training" for n in names), 120, "learners"
        )

    def _unsafe_env(self, name: str) -> list[str]:
        """`env VAR=...` for an attacker (its attack) or the copycat's source; [] for the other learners."""
        channel = f"{UNSAFE_COPY_DIR_ENV}={self.copy_dir}"
        if name in self.attackers:
            return ["env", f"{UNSAFE_LEARNER_ATTACK_ENV}={self.arm.attack}", channel]
        if self.arm.copy_source and name == self.honest[0]:
            return ["env", f"{UNSAFE_COPY_SOURCE_ENV}=1", channel]
        return []

    def url(self, name: str) -> str | None:
        found = re.findall(r"^status: (http://\S+)$", self.group.log(name), re.MULTILINE)
        if found:
            self._urls[name] = found[-1]
        return self._urls.get(name)

    def status(self, name: str) -> dict[str, Any] | None:
        return try_json(self.url(name))

    def admission_metric(self, name: str) -> dict[str, float]:
        """`hivenode_admission_refused_total` by reason, scraped from the node's /metrics ({} if it does not
        answer)."""
        url = self.url(name)
        if not url:
            return {}
        try:
            with urllib.request.urlopen(url.replace("/api/status", "/metrics"), timeout=5.0) as response:
                text = response.read().decode()
        except (OSError, ValueError):
            return {}
        pattern = r'^hivenode_admission_refused_total\{reason="(\w+)"\} (\S+)$'
        return {reason: float(value) for reason, value in re.findall(pattern, text, re.MULTILINE)}

    def peer_ids(self, names: list[str]) -> set[str]:
        return {st["peer_id"] for n in names if (st := self.status(n)) and st.get("peer_id")}

    def events(self) -> list[dict[str, Any]]:
        path = self.root / "syncer" / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        self.group.terminate_all()


def run_arm(
    root: Path,
    arm: Arm,
    *,
    duration_s: float,
    defended: bool = True,
    min_step_s: float = 0.2,
    until: Callable[[dict[str, Any]], bool] | None = None,
) -> dict[str, Any]:
    """One arm: start the swarm, let it run `duration_s` (or, with `until`, until the summary so far satisfies it,
    `duration_s` being the deadline), read what the syncer did (see the module docstring)."""
    swarm = Swarm(root, arm, defended=defended, min_step_s=min_step_s)
    try:
        t0 = swarm.start()
        honest, attackers = swarm.peer_ids(swarm.honest), swarm.peer_ids(swarm.attackers)
        deadline = time.monotonic() + duration_s

        def summary() -> dict[str, Any]:
            status = swarm.status("syncer") or {}
            out = summarize(
                arm, swarm.events(), status, honest=honest, attackers=attackers, t0=t0, defended=defended
            )
            return {**out, "admission_refused_metric": swarm.admission_metric("syncer")}  # /metrics, by cause

        while until is not None and time.monotonic() < deadline and not until(summary()):
            time.sleep(1.0)
        time.sleep(max(0.0, deadline - time.monotonic()) if until is None else 0.0)
        result = summary()
    finally:
        swarm.stop()
    return result


def _mean_share_since_first(shares: list[float]) -> float:
    first = next((i for i, w in enumerate(shares) if w > 0), None)
    return 0.0 if first is None else round(sum(shares[first:]) / len(shares[first:]), 4)


def summarize(
    arm: Arm,
    events: list[dict[str, Any]],
    status: dict[str, Any],
    *,
    honest: set[str],
    attackers: set[str],
    t0: float,
    defended: bool,
) -> dict[str, Any]:
    merges = [e for e in events if e["event"] == "merge" and e["t"] >= t0]
    evals = [
        (round(e["t"] - t0, 2), e["loss"], e.get("tokens_total", 0))
        for e in events
        if e["event"] == "eval" and e["t"] >= t0
    ]
    bans = [e for e in events if e["event"] == "learner_banned"]
    learners = status.get("learners") or {}
    refused_at = [v["at"] for p in attackers for v in (learners.get(p) or {}).get("evidence", [])]
    detected = min(refused_at) if refused_at else None
    after = [m for m in merges if detected is None or m["t"] >= detected]
    shares = [sum(w for p, w in m["weights"].items() if p in attackers) for m in after]
    every = [sum(w for p, w in m["weights"].items() if p in attackers) for m in merges]
    attacker_bans = [e["t"] - t0 for e in bans if e["offender"] in attackers]
    probe = status.get("loss_probe") or {}
    interval = merge_interval(merges)
    cost = probe.get("mean_cost_s")
    return {
        "defended": defended,
        "attack": arm.attack,
        "attackers": len(attackers),
        "honest": len(honest),
        "merges": len(merges),
        "final_loss": evals[-1][1] if evals else None,
        "loss_curve": evals,
        "attacker_weight_share": round(sum(shares) / len(shares), 4) if shares else 0.0,
        "merges_after_detection": len(after) if detected is not None else 0,
        # from the merge that first took attacker weight on (merges before its first push are not its choice)
        "attacker_weight_share_since_joined": _mean_share_since_first(every),
        "attacker_weight_share_all": round(
            sum(sum(w for p, w in m["weights"].items() if p in attackers) for m in merges)
            / max(1, len(merges)),
            4,
        ),
        # merges holding any of the attackers' weight (the undefended control shows its ascent steps entered)
        "attacker_merges": sum(1 for w in every if w > 0),
        # the most attacker identities held of any one merge (the seniority cap bounds it for fresh identities)
        "attacker_weight_share_max": round(max(every), 4) if every else 0.0,
        "share_curve": [(round(m["t"] - t0, 2), round(w, 4)) for m, w in zip(merges, every, strict=True)],
        "detected_after_s": round(detected - t0, 2) if detected is not None else None,
        "time_to_ban_s": round(min(attacker_bans), 2) if attacker_bans else None,
        "attackers_banned": len({e["offender"] for e in bans if e["offender"] in attackers}),
        "honest_banned": len({e["offender"] for e in bans if e["offender"] in honest}),
        "honest_refused": sum((learners.get(p) or {}).get("refused", 0) for p in honest),
        **step_and_streaks(merges, learners, honest=honest, attackers=attackers),
        "refusals": status.get("refusals", {}),
        "screening": status.get("screening", {}),
        "seniority": status.get("seniority", {}),  # identities, young ones, demotions, capped merges
        "evidence": evidence_summary(merges, honest=honest, attackers=attackers),
        "probe_mean_cost_s": cost,
        "probe_max_cost_s": probe.get("max_cost_s"),
        "merge_interval_s": round(interval, 3) if interval else None,
        "check_cost_share": round(cost / interval, 4) if cost and interval else None,
    }


def step_and_streaks(
    merges: list[dict[str, Any]], learners: dict[str, Any], *, honest: set[str], attackers: set[str]
) -> dict[str, Any]:
    """Merges whose step was scaled below 1, and per side the ledger's violations for runs of contributions at
    evidence factor 0 (node.diloco.evidence)."""
    by_tag = {p: (learners.get(p) or {}).get("refused_by_tag") or {} for p in honest | attackers}
    return {
        "scaled_steps": sum(1 for m in merges if m.get("step_scale", 1.0) < 1.0),
        "no_evidence_violations": {
            side: sum(by_tag[p].get(NO_EVIDENCE, 0) for p in peers)
            for side, peers in (("honest", honest), ("attackers", attackers))
        },
    }


def evidence_summary(
    merges: list[dict[str, Any]], *, honest: set[str], attackers: set[str]
) -> dict[str, Any]:
    """The evidence weighting (node.diloco.evidence) per side, from the merge events' [slope, cosine, factor]:
    contributions scored, the mean factor their weight was scaled by, how many were scaled below 1 and to 0, the
    quartiles of their held-out slopes (nats per unit norm) and of their cosines with the recent merged direction."""
    out: dict[str, Any] = {}
    for side, peers in (("honest", honest), ("attackers", attackers)):
        rows = [row for m in merges for p, row in (m.get("evidence") or {}).items() if p in peers]
        factors = [row[-1] for row in rows]
        out[side] = {
            "scored": len(rows),
            "factor_mean": round(sum(factors) / len(factors), 4) if factors else None,
            "scaled": sum(1 for f in factors if f < 1.0),
            "zeroed": sum(1 for f in factors if f <= 0.0),
            "slope_quartiles": _quartiles([row[0] for row in rows]),
            "cosine_quartiles": _quartiles([row[1] for row in rows if row[1] is not None]),
            "zeroed_after": after_scaled_steps(merges, peers),
        }
    return out


def after_scaled_steps(merges: list[dict[str, Any]], peers: set[str]) -> dict[str, list[int]]:
    """[zeroed, scored] of `peers`' contributions in merges whose fragment's previous merge had its step scaled below
    1 (`scaled`) and in the others (`full`): a feedback of the step scale on the evidence shows as a higher share
    zeroed after scaled steps."""
    out = {"scaled": [0, 0], "full": [0, 0]}
    previous: dict[int, float] = {}
    for m in merges:
        key = "scaled" if previous.get(m.get("fragment", -1), 1.0) < 1.0 else "full"
        for p, row in (m.get("evidence") or {}).items():
            if p in peers:
                out[key][0] += row[-1] <= 0.0
                out[key][1] += 1
        previous[m.get("fragment", -1)] = m.get("step_scale", 1.0)
    return out


def _quartiles(values: list[float]) -> list[float]:
    """min, lower quartile, median, upper quartile, max (lower ones; [] for none)."""
    ordered = sorted(values)
    return [ordered[(len(ordered) - 1) * q // 4] for q in range(5)] if ordered else []


def merge_interval(merges: list[dict[str, Any]]) -> float | None:
    """Mean seconds between consecutive merges of one fragment (a sync interval)."""
    gaps = []
    for fragment in {m["fragment"] for m in merges}:
        times = sorted(m["t"] for m in merges if m["fragment"] == fragment)
        gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
    return sum(gaps) / len(gaps) if gaps else None


def with_gaps(results: dict[str, dict[str, Any]]) -> None:
    """Each arm's loss gap against its control in `results` (at the end of equal windows, and at equal merged
    tokens: the attackers' processes take CPU from the honest ones on a small machine); an arm whose control is
    not in `results` keeps the gaps it has (from its own run, `--merge`)."""
    for key, result in results.items():
        control = results.get(ARMS[key.split("@")[0]].control)
        if control is None:
            continue
        base, final = control.get("final_loss"), result.get("final_loss")
        result["control_final_loss"] = base
        result["loss_gap"] = round((final - base) / base, 4) if base and final is not None else None
        curve, reference = result["loss_curve"], control.get("loss_curve") or []
        at = interpolate([(c[2], c[1]) for c in reference], curve[-1][2]) if curve and reference else None
        result["loss_gap_at_tokens"] = round((curve[-1][1] - at) / at, 4) if at else None


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`with_gaps`, then the headline over every arm in `results`."""
    with_gaps(results)
    return headline(results)


def headline(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The worst arm of each figure (the issue's goals: loss gap within 2 %, attackers' share < 5 %, no honest
    learner banned)."""
    defended = {k: r for k, r in results.items() if r["defended"] and r["attackers"]}
    gaps = [r["loss_gap"] for r in defended.values() if r.get("loss_gap") is not None]
    token_gaps = [
        r["loss_gap_at_tokens"] for r in defended.values() if r.get("loss_gap_at_tokens") is not None
    ]
    costs = [
        r["check_cost_share"] for r in results.values() if r["defended"] and r["check_cost_share"] is not None
    ]
    return {
        "max_loss_gap": max(gaps) if gaps else None,
        "max_loss_gap_at_equal_tokens": max(token_gaps) if token_gaps else None,
        "max_attacker_weight_share": max(
            (r["attacker_weight_share"] for r in defended.values()), default=None
        ),
        "honest_banned": sum(r["honest_banned"] for r in results.values() if r["defended"]),
        "max_attacker_merge_share": max(
            (r["attacker_weight_share_max"] for r in defended.values()), default=None
        ),
        "max_attacker_merge_share_undefended": max(
            (
                r["attacker_weight_share_max"]
                for r in results.values()
                if not r["defended"] and r["attackers"]
            ),
            default=None,
        ),
        "max_check_cost_share": max(costs) if costs else None,
        "arms": sorted(results),
    }


def merged_with(
    path: Path, results: dict[str, dict[str, Any]]
) -> tuple[dict[str, dict[str, Any]], list[Any]]:
    """`--merge`: the arms of the results file at `path` (if any) that this run did not measure, with this run's
    (each keeps its loss gaps against the control of its own run: `with_gaps` has run on both), and the earlier
    runs' configs."""
    if not path.exists():
        return results, []
    earlier = json.loads(path.read_text())
    arms: dict[str, dict[str, Any]] = earlier.get("arms") or {}
    for key, record in arms.items():
        record.setdefault("measured_at", earlier.get("measured_at"))
        control = arms.get(ARMS[key.split("@")[0]].control) if key.split("@")[0] in ARMS else None
        record.setdefault("control_final_loss", (control or {}).get("final_loss"))
    runs = earlier.get("runs") or [
        {**(earlier.get("config") or {}), "measured_at": earlier.get("measured_at")}
    ]
    kept = {k: r for k, r in arms.items() if k not in results}
    return {**kept, **results}, runs


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, share_ax) = plt.subplots(1, 2, figsize=(14, 5))
    for name, result in results.items():
        curve = result["loss_curve"]
        style = "--" if not result["defended"] else ("-" if result["attackers"] else ":")
        if curve:
            ax.plot([c[0] for c in curve], [c[1] for c in curve], style, marker=".", label=name)
        shares = result.get("share_curve") or []
        if result["attackers"] and shares:
            share_ax.plot([c[0] for c in shares], [c[1] for c in shares], style, marker=".", label=name)
    ax.set_xlabel("seconds since every learner trained")
    ax.set_ylabel("held-out loss of the global model (nats/byte)")
    ax.set_title("poisoning arms (dotted: clean controls, dashed: screening off)")
    ax.legend(fontsize=8)
    share_ax.set_xlabel("seconds since every learner trained")
    share_ax.set_ylabel("attackers' summed weight in each merge")
    share_ax.set_title("attackers' share per merge")
    share_ax.axhline(0.25, color="grey", linewidth=0.8, linestyle=":")  # the default young_weight_cap
    if share_ax.lines[1:]:
        share_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_all(
    names: list[str], undefended: list[str], duration_s: float, min_step_s: float, keep: bool = False
) -> dict[str, dict[str, Any]]:
    """Each arm in a fresh swarm under one temporary directory, removed after unless `keep` (then each arm's
    `armN/logs` and `armN/syncer/events.jsonl` stay for reading, and the directory is logged)."""
    results: dict[str, dict[str, Any]] = {}
    base = Path(tempfile.mkdtemp(prefix="poisoning-"))
    try:
        runs = [(n, True) for n in names] + [(n, False) for n in undefended]
        for index, (name, defended) in enumerate(runs):
            root = base / f"arm{index}"
            root.mkdir()
            key = name if defended else f"{name}@undefended"
            logger.info("arm %s: %s", key, ARMS[name])
            results[key] = run_arm(
                root, ARMS[name], duration_s=duration_s, defended=defended, min_step_s=min_step_s
            )
            logger.info(
                "arm %s: %s", key, {k: results[key][k] for k in ("final_loss", "attacker_weight_share")}
            )
    finally:
        if keep:
            logger.info("kept the arms' logs and events under %s", base)
        else:
            shutil.rmtree(base, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arm names")
    parser.add_argument(
        "--undefended",
        default="",
        help="arms also run with screening off (negative controls; copycat, freeride: only the copy check off)",
    )
    parser.add_argument("--duration", type=float, default=90.0, help="seconds measured per arm")
    parser.add_argument("--min-step-s", type=float, default=0.2)
    parser.add_argument("--name", default="poisoning", help="results name (benchmarks/results/<name>.json)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the results file's other arms (each with the gaps against its own run's control) and"
        " recompute the headline over all of them",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep each arm's directory (logs/, syncer/events.jsonl) under the logged temporary directory",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    names = [n for n in args.arms.split(",") if n]
    undefended = [n for n in args.undefended.split(",") if n]
    for name in names + undefended:
        if name not in ARMS:
            parser.error(f"unknown arm {name!r}; known: {', '.join(ARMS)}")
    results = run_all(names, undefended, args.duration, args.min_step_s, keep=args.keep)
    with_gaps(results)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for record in results.values():
        record["measured_at"] = now
    config = {"duration_s": args.duration, "min_step_s": args.min_step_s, "command": " ".join(sys.argv)}
    runs: list[Any] = []
    if args.merge:
        results, runs = merged_with(RESULTS_DIR / f"{args.name}.json", results)
    summary = headline(results)
    plot(results, plot_path(args.name))
    detail = {"config": config, "runs": [*runs, {**config, "measured_at": now}], "arms": results}
    path = write_result(args.name, summary, detail)
    print(json.dumps(summary))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
