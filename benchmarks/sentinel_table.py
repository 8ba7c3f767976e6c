"""SENTINEL's Table 1 on the running pipeline: every attack, three arms, bans scored and the held-out loss.

The pipeline is the production one, in process (`tools.pipeline_harness`): one verifier's `PipelineDriver`
calls `StageService`s through `DirectTransport` with a `SentinelTap` at every boundary, bans go through
`BanWatcher` and are enforced by the driver and by every stage. An attack that is not stopped therefore
feeds back into training: stage 2 learns from corrupted activations, stage 0 from corrupted gradients, and
the replicas of a stage are averaged every `merge_every` microbatches (the syncer's merge, simplified).

Setting (defaults): a byte-level GPT (3 blocks, width 64, context 32) pre-trained centrally for 300 steps,
then cut into 3 stages with (3, 8, 3) replicas; 3 of the 8 middle-stage replicas (37.5 %) attack, first and
last stages are honest (the paper's assumption). Routing spreads microbatches evenly over a stage's
replicas. The attackers send honestly for their first `attack_start` own microbatches (the monitor's warm-up
runs meanwhile; with 8 replicas that is about 160 driven microbatches), then attack forward and backward
until the end of the 480. Per attack three arms:

* clean: no attacker, no verification (the loss reference; one run, seed 0),
* attacked without verification (the harm; the negative control),
* attacked with SENTINEL (the production tap with its default monitor and ledger settings).

Spot checks are disguised as training requests (`VerifierConfig.disguised_spot_checks`), or marked with
`--marked-checks` (recorded as `disguised_spot_checks` in the JSON's config). An attacker cannot tell a disguised
check from training and corrupts its answers to the checks it makes too; its schedule (`attack_start`) and its
"own attacked microbatches" count training microbatches only (`tools.pipeline_harness.CountingAttack`).

Plus clean runs with SENTINEL on three seeds (false bans). Reported per attack: precision, recall and F1 of
the bans over all replicas, the attackers' own attacked microbatches until their ban, false bans, and the
held-out loss gap relative to the clean run at equal trained tokens. And the verifier's cost
(`benchmarks.sentinel_offline.measure_cost`, CPU time of the checks against the stage compute that
produced the tensors, plus the same ratio measured live in this pipeline) and its memory per boundary.

Run: `python -m benchmarks.sentinel_table` (about 13 000 driven microbatches: 6-7 min wall on the shared
2-core machine under a load average of 6-8), `--quick` for a smoke run, `--attacks random,mimic` for a subset,
`--marked-checks --name sentinel_table_marked` for the marked-checks comparison.
docs/sentinel.md section 9 has the method, the table and what the adaptive attacks do.
Results: `benchmarks/results/sentinel_table.json` and `.png` (written after every arm, with `complete`
false until the end, so a run cut short still leaves its table so far).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from protocol.boundary_codec import BOUNDARY_CODECS, BoundaryCodecName
from tools.pipeline_harness import Arm, Checkpoint, HarnessConfig, build_arm, drive, pretrained_state

# name -> (attack spec without direction and start, adaptive?). The adaptive ones are the issue's: on/off,
# slow drift, the free-riding mimic; "{start}" is the attackers' honest prefix (delay replays that far back).
ATTACKS: dict[str, tuple[str, bool]] = {
    "constant": ("constant", False),
    "zeros": ("zeros", False),
    "random": ("random", False),
    "scale_x-1": ("scaling:strength=-1", False),
    "scale_x10": ("scaling:strength=10", False),
    "sign_flip": ("sign_flip:strength=0.5", False),
    "bias": ("bias:strength=0.5", False),
    "delay": ("delay:delay_steps={start}", False),
    "noise_0.5": ("noise:strength=0.5", False),
    "onoff": ("onoff:inner=random,period_steps=20,duty=0.1", True),
    "drift": ("drift:strength=0.002", True),
    "mimic": ("mimic", True),
    "mimic_noise": ("mimic:strength=1", True),
}
# scale_x10 and mimic_noise only on request (--attacks): the table has to fit ~20-30 min on 2 cores
DEFAULT_ATTACKS = tuple(n for n in ATTACKS if n not in ("scale_x10", "mimic_noise"))
QUICK_ATTACKS = ("random", "scale_x-1", "mimic")
# The integration test's model: the table's ~13 000 driven microbatches cost ~30 ms of CPU each with it,
# twice as much at width 128 / context 64 (measured: 34 vs 81 ms with SENTINEL).
MODEL = {"vocab_size": 256, "context_len": 32, "num_layers": 3, "width": 64, "num_heads": 2}
LOSS_GOAL = 0.02  # held-out loss within 2 % of clean (the goal)
F1_GOAL = 0.95


@dataclass(frozen=True, kw_only=True, slots=True)
class TableConfig:
    replicas: tuple[int, ...] = (3, 8, 3)
    attackers: int = 3
    microbatches: int = 480  # per attack arm (a multiple of merge_every: the last loss follows a merge)
    attack_start: int = 20  # attackers' own microbatches sent honestly first (~160 driven microbatches)
    clean_microbatches: int = 640  # per clean run with SENTINEL (false bans)
    seeds: tuple[int, ...] = (0, 1, 2)  # clean runs with SENTINEL; attack arms use the first
    pretrain_steps: int = 300
    merge_every: int = 80
    eval_every: int = 80
    held_out_batches: int = 8
    direction: str = "both"
    model: Mapping[str, int] = field(default_factory=lambda: dict(MODEL))
    activation_codec: BoundaryCodecName = "fp32"  # how boundary tensors travel; SENTINEL sees them decoded
    # spot-check recomputations as ordinary training requests (VerifierConfig.disguised_spot_checks); False:
    # marked as checks (`--marked-checks`)
    disguised_spot_checks: bool = True

    def harness(self) -> HarnessConfig:
        return HarnessConfig(
            model=self.model,
            replicas=self.replicas,
            attackers=self.attackers,
            merge_every=self.merge_every,
            held_out_batches=self.held_out_batches,
            even_routing=True,
            activation_codec=self.activation_codec,
            disguised_spot_checks=self.disguised_spot_checks,
        )


QUICK = TableConfig(microbatches=320, attack_start=15, clean_microbatches=320, seeds=(0,), pretrain_steps=200)


def attack_spec(name: str, config: TableConfig) -> str:
    template, _ = ATTACKS[name]
    spec = template.format(start=config.attack_start)
    joiner = "," if ":" in spec else ":"
    return f"{spec}{joiner}direction={config.direction},start_after={config.attack_start}"


# --------------------------------------------------------------------------- accounting (pure)


def ban_scores(banned: set[str], attackers: set[str], replicas: set[str]) -> dict[str, float | int]:
    """Precision, recall and F1 of bans as a detector of the attackers among `replicas`.

    Conventions for the empty cases: no ban at all has precision 1 (no false accusation); no attacker has
    recall 1 (nothing to find); F1 is 0 when attackers exist and none is banned, 1 when there is no attacker
    and nobody is banned, 0 when there is no attacker and someone is."""
    banned = banned & replicas
    tp = len(banned & attackers)
    fp = len(banned - attackers)
    fn = len(attackers - banned)
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    if not attackers:
        f1 = 1.0 if not banned else 0.0
    elif tp == 0:
        f1 = 0.0
    else:
        f1 = 2 * precision * recall / (precision + recall)
    return {"tp": tp, "fp": fp, "fn": fn, "precision": precision, "recall": recall, "f1": f1}


def loss_at_tokens(curve: Sequence[tuple[int, float]], tokens: int) -> float:
    """The reference run's held-out loss at `tokens` trained tokens, linear between checkpoints (and
    extrapolated from the nearest two outside them)."""
    points = sorted(curve)
    if not points:
        raise ValueError("empty loss curve")
    if len(points) == 1:
        return points[0][1]
    for (t0, l0), (t1, l1) in zip(points, points[1:], strict=False):
        if tokens <= t1 or (t1, l1) == points[-1]:
            if t1 == t0:
                return l1
            return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    return points[-1][1]  # unreachable: the loop returns at the last pair


def loss_gap(loss: float, reference: float) -> float:
    """Relative excess of `loss` over `reference` (positive: worse than clean)."""
    return (loss - reference) / reference


def microbatches_to_ban(attacked_at_ban: Mapping[str, int], attackers: Sequence[str]) -> list[int | None]:
    """Per attacker, its own attacked microbatches when its ban took effect (None: never banned)."""
    return [attacked_at_ban.get(a) for a in attackers]


def median_or_none(values: Sequence[int | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


# --------------------------------------------------------------------------- running arms


@dataclass(slots=True)
class ArmResult:
    label: str
    seed: int
    verify: bool
    attack: str | None
    loss: float
    tokens: int
    completed: int
    microbatches: int
    curve: list[tuple[int, float]]  # (tokens trained, held-out loss)
    attackers: list[str]
    banned: list[str]
    attacked_at_ban: dict[str, int]
    replicas: list[str]
    stats: dict[str, Any]
    seconds: float
    driver: dict[str, int] = field(default_factory=dict)  # `driver_counts`: what the verifier sent
    attacked_checks: int = 0
    attacked_flags: int = 0
    honest_checks: int = 0
    honest_flags: int = 0
    check_ms: float | None = None
    compute_ms_per_request: float | None = None
    boundary_bytes: list[int] = field(default_factory=list)


def _nbytes(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, Mapping):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 8  # a number or a short string: one word


def run_arm(
    config: TableConfig,
    weights: Mapping[str, torch.Tensor],
    *,
    label: str,
    seed: int,
    attack: str | None,
    verify: bool,
    microbatches: int,
) -> ArmResult:
    started = time.perf_counter()
    arm = build_arm(config.harness(), attack=attack, verify=verify, seed=seed, weights=weights)
    shown = {"next": 200}

    def progress(done: int, a: Arm) -> None:
        if done >= shown["next"]:
            shown["next"] += 200
            print(
                f"    {label}: {done}/{microbatches} microbatches, {a.driver.stats.completed} completed, "
                f"{len(a.tap.ban_log)} bans ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )

    out = drive(arm, microbatches, seed, eval_every=config.eval_every, progress=progress)
    checkpoints: list[Checkpoint] = out["checkpoints"]
    result = ArmResult(
        label=label,
        seed=seed,
        verify=verify,
        attack=attack,
        loss=float(out["loss"]),
        tokens=int(out["tokens"]),
        completed=int(out["completed"]),
        microbatches=microbatches,
        curve=[(c.tokens, c.loss) for c in checkpoints],
        attackers=list(arm.attackers),
        banned=sorted(arm.banned()),
        attacked_at_ban=dict(arm.attacked_at_ban),
        replicas=sorted(arm.stages),
        stats=asdict(arm.tap.stats),
        seconds=time.perf_counter() - started,
        driver=driver_counts(arm),
    )
    for replica, row in arm.tap.per_replica.items():
        if replica in arm.attackers:
            result.attacked_checks += row.attacked_checks
            result.attacked_flags += row.attacked_flags
        else:
            result.honest_checks += row.checks
            result.honest_flags += row.flags
    if verify and arm.tap.stats.checked:
        result.check_ms = 1000 * arm.tap.stats.check_s / arm.tap.stats.checked
        compute = sum(s.timings["compute_s"] for s in arm.services.values())
        requests = sum(int(s.timings["requests"]) for s in arm.services.values())
        result.compute_ms_per_request = 1000 * compute / max(requests, 1)
        result.boundary_bytes = [_nbytes(v) for v in arm.tap.monitor.state_dict().values()]
    return result


def driver_counts(arm: Arm) -> dict[str, int]:
    """The driver's own counts: spot checks, how many went disguised and of those how many made a checker apply
    a microbatch twice, the retries elsewhere (same input, same id), the hops stages applied."""
    stats = arm.driver.stats
    return {
        "spot_checks": stats.spot_checks,
        "disguised_checks": stats.disguised_checks,
        "duplicate_gradients": stats.duplicate_gradients,
        "retries": stats.retries,
        "abandoned": stats.abandoned,
        "applied": sum(stats.applied_per_stage.values()),
        "attackers_corrupted_check_answers": arm.attacked_checks(),
    }


def _describe(r: ArmResult) -> str:
    honest_banned = [b for b in r.banned if b not in r.attackers]
    caught = [b for b in r.banned if b in r.attackers]
    return (
        f"loss {r.loss:.4f}, {r.completed}/{r.microbatches} completed, banned {len(caught)}/{len(r.attackers)} "
        f"attackers + {len(honest_banned)} honest, flags attacked {r.attacked_flags}/{r.attacked_checks} "
        f"honest {r.honest_flags}/{r.honest_checks} ({r.seconds:.0f} s)"
    )


# --------------------------------------------------------------------------- the table


def attack_row(
    name: str, config: TableConfig, attacked: ArmResult, unverified: ArmResult, clean: ArmResult
) -> dict[str, Any]:
    scores = ban_scores(set(attacked.banned), set(attacked.attackers), set(attacked.replicas))
    to_ban = microbatches_to_ban(attacked.attacked_at_ban, attacked.attackers)
    reference = loss_at_tokens(clean.curve, attacked.tokens)
    reference_unverified = loss_at_tokens(clean.curve, unverified.tokens)
    adaptive = ATTACKS[name][1]
    gap = loss_gap(attacked.loss, reference)
    banned_all = scores["recall"] == 1.0
    return {
        "f1": scores["f1"],
        "precision": scores["precision"],
        "recall": scores["recall"],
        "microbatches_to_ban": median_or_none(to_ban),
        "false_bans": scores["fp"],
        "loss_gap": gap,
        "adaptive": adaptive,
        "spec": attacked.attack,
        "microbatches_to_ban_per_attacker": to_ban,
        "loss": attacked.loss,
        "loss_clean_at_equal_tokens": reference,
        "loss_gap_equal_microbatches": loss_gap(attacked.loss, clean.loss),
        "loss_unverified": unverified.loss,
        "loss_gap_unverified": loss_gap(unverified.loss, reference_unverified),
        "tokens": attacked.tokens,
        "completed": attacked.completed,
        "attacked_flag_rate": attacked.attacked_flags / attacked.attacked_checks
        if attacked.attacked_checks
        else None,
        "honest_flag_rate": attacked.honest_flags / attacked.honest_checks
        if attacked.honest_checks
        else None,
        "goal_met": (scores["f1"] >= F1_GOAL and scores["fp"] == 0 and gap < LOSS_GOAL)
        if not adaptive
        else ((banned_all or gap < LOSS_GOAL) and scores["fp"] == 0),
        "tap": attacked.stats,
        "driver": attacked.driver,
        "seconds": attacked.seconds + unverified.seconds,
    }


def clean_row(r: ArmResult, reference: ArmResult | None) -> dict[str, Any]:
    honest_banned = [b for b in r.banned if b not in r.attackers]
    row: dict[str, Any] = {
        "seed": r.seed,
        "microbatches": r.microbatches,
        "false_bans": len(honest_banned),
        "honest_flag_rate": r.honest_flags / r.honest_checks if r.honest_checks else None,
        "completed": r.completed,
        "loss": r.loss,
        "tap": r.stats,
        "driver": r.driver,
    }
    if reference is not None and reference.seed == r.seed:
        # Verification's own cost on clean traffic (false flags drop microbatches), at equal tokens.
        tokens = min(r.tokens, reference.tokens)
        row["loss_gap_vs_unverified"] = loss_gap(
            loss_at_tokens(r.curve, tokens), loss_at_tokens(reference.curve, tokens)
        )
    return row


def headline_of(
    attacks: Mapping[str, Mapping[str, Any]], clean: Sequence[Mapping[str, Any]], cost: Mapping[str, Any]
) -> dict[str, Any]:
    f1s = [float(v["f1"]) for v in attacks.values()]
    plain = [float(v["f1"]) for v in attacks.values() if not v["adaptive"]]
    gaps = [float(v["loss_gap"]) for v in attacks.values()]
    attack_false = sum(int(v["false_bans"]) for v in attacks.values())
    clean_false = sum(int(c["false_bans"]) for c in clean)
    return {
        "min_f1": min(f1s) if f1s else None,
        "min_f1_non_adaptive": min(plain) if plain else None,
        "false_bans": attack_false + clean_false,
        "clean_false_bans": clean_false,
        "clean_seeds": len(clean),
        "max_loss_gap": max(gaps) if gaps else None,
        "max_loss_gap_unverified": max(
            (float(v["loss_gap_unverified"]) for v in attacks.values()), default=None
        ),
        "attacks_meeting_goal": sum(bool(v["goal_met"]) for v in attacks.values()),
        "attacks": len(attacks),
        **cost,
    }


def cost_figures(batch: int) -> dict[str, Any]:
    """The headline's cost keys from sentinel_offline's measurement: CPU time of the two checks of a
    microbatch against the forward+backward of the 2-block stage that produced the tensors."""
    from benchmarks.sentinel_offline import measure_cost

    offline = measure_cost(batches=(batch,), repeats=100)
    median = offline[f"batch_{batch}_median"]
    return {
        "check_cost_share": median["interleaved_share_of_stage_compute"],
        "check_cost_share_isolated": median["isolated_share_of_stage_compute"],
        # 10th percentiles of each timing: closer to an idle machine than the medians on shared cores
        "check_cost_share_p10": offline[f"batch_{batch}_p10"]["interleaved_share_of_stage_compute"],
        "cost_detail": offline,
    }


def live_cost(verified: Sequence[ArmResult]) -> dict[str, Any]:
    """The same ratio in this pipeline (wall clock, so it includes the stages' thread hand-offs), and the
    monitor's memory per boundary (its state: EMA, score windows, per-replica summaries)."""
    runs = [r for r in verified if r.check_ms is not None and r.compute_ms_per_request]
    memory = [b for r in verified for b in r.boundary_bytes]
    out: dict[str, Any] = {
        "check_memory_bytes_per_boundary": int(statistics.median(memory)) if memory else None
    }
    if runs:
        check_ms = statistics.median(float(r.check_ms or 0.0) for r in runs)
        compute_ms = statistics.median(float(r.compute_ms_per_request or 0.0) for r in runs)
        out.update(
            {
                "live_check_ms": check_ms,
                "live_stage_compute_ms_per_request": compute_ms,
                "live_check_cost_share": check_ms / compute_ms,
            }
        )
    # Spot checks cost stage compute, not verifier CPU: recomputations (thirds included) per checked tensor,
    # in the clean runs (attacked runs recompute more: quarantined replicas are recomputed every time).
    clean = [r for r in verified if r.attack is None and r.stats.get("checked")]
    if clean:
        recomputed = sum(
            int(r.stats.get("spot_checks", 0)) + int(r.stats.get("spot_thirds", 0)) for r in clean
        )
        out["spot_recomputations_per_checked_tensor"] = recomputed / sum(
            int(r.stats["checked"]) for r in clean
        )
    return out


# --------------------------------------------------------------------------- plot


def plot(
    name: str, attacks: Mapping[str, Mapping[str, Any]], headline: Mapping[str, Any], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(attacks)
    y = list(range(len(names)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 0.35 * len(names) + 2), sharey=True)
    f1 = [float(attacks[n]["f1"]) for n in names]
    colors = ["tab:orange" if attacks[n]["adaptive"] else "tab:blue" for n in names]
    ax1.barh(y, f1, color=colors)
    ax1.axvline(F1_GOAL, color="grey", ls="--", lw=1)
    for yi, n in zip(y, names, strict=True):
        mb = attacks[n]["microbatches_to_ban"]
        text = f"F1 {float(attacks[n]['f1']):.2f}, " + ("no ban" if mb is None else f"ban after {mb:g}")
        ax1.text(0.02, yi, text, va="center", fontsize=7)
    ax1.set_xlim(0, 1.05)
    ax1.set_yticks(y, names, fontsize=8)
    ax1.set_xlabel("F1 of bans (orange: adaptive attacks); ban after: attackers' own attacked microbatches")
    ax1.invert_yaxis()
    width = 0.4
    unverified = [100 * float(attacks[n]["loss_gap_unverified"]) for n in names]
    verified = [100 * float(attacks[n]["loss_gap"]) for n in names]
    ax2.barh([v - width / 2 for v in y], unverified, height=width, color="tab:red", label="no verification")
    ax2.barh([v + width / 2 for v in y], verified, height=width, color="tab:green", label="SENTINEL")
    ax2.axvline(100 * LOSS_GOAL, color="grey", ls="--", lw=1)
    ax2.axvline(0, color="black", lw=0.5)
    ax2.set_xscale("symlog", linthresh=2)
    top = max([2.0, *unverified, *verified])
    ticks = [t for t in (-2, 0, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if t <= top * 1.5]
    ax2.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax2.set_xlabel("held-out loss gap vs clean at equal tokens (%)")
    ax2.legend(fontsize=7, loc="lower right")
    fig.suptitle(
        f"{name}: min F1 {headline['min_f1']}, false bans {headline['false_bans']} "
        f"(clean seeds {headline['clean_false_bans']}), max loss gap {100 * (headline['max_loss_gap'] or 0):.2f} %",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few attacks, short runs, one clean seed")
    parser.add_argument("--attacks", default=None, help=f"comma-separated subset of {','.join(ATTACKS)}")
    parser.add_argument(
        "--seeds", default=None, help="comma-separated seeds of the clean runs (first: attacks)"
    )
    parser.add_argument("--replicas", default=None, help="replicas per stage, e.g. 3,8,3")
    parser.add_argument("--attackers", type=int, default=None, help="malicious replicas of the middle stage")
    parser.add_argument("--microbatches", type=int, default=None)
    parser.add_argument("--clean-microbatches", type=int, default=None)
    parser.add_argument("--attack-start", type=int, default=None, help="attackers' honest own microbatches")
    parser.add_argument("--direction", choices=["forward", "backward", "both"], default=None)
    parser.add_argument("--no-cost", action="store_true", help="skip the offline cost measurement")
    parser.add_argument(
        "--activation-codec", choices=BOUNDARY_CODECS, default=None, help="boundary codec (default fp32)"
    )
    parser.add_argument(
        "--marked-checks",
        action="store_true",
        help="send spot checks marked as checks (default: disguised as training requests)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on shared cores)")
    parser.add_argument("--name", default=None, help="result name (default sentinel_table[_quick])")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = QUICK if args.quick else TableConfig()
    overrides: dict[str, Any] = {}
    if args.seeds:
        overrides["seeds"] = tuple(int(s) for s in args.seeds.split(","))
    if args.marked_checks:
        overrides["disguised_spot_checks"] = False
    if args.replicas:
        overrides["replicas"] = tuple(int(s) for s in args.replicas.split(","))
    for key in (
        "attackers",
        "microbatches",
        "clean_microbatches",
        "attack_start",
        "direction",
        "activation_codec",
    ):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    if overrides:
        config = TableConfig(**{**asdict(config), **overrides})
    names = (
        args.attacks.split(",") if args.attacks else list(QUICK_ATTACKS if args.quick else DEFAULT_ATTACKS)
    )
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        parser.error(f"unknown attacks {unknown}; known: {list(ATTACKS)}")
    name = args.name or ("sentinel_table_quick" if args.quick else "sentinel_table")
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    share = config.attackers / config.replicas[1]
    print(
        f"{name}: replicas {config.replicas}, {config.attackers} attackers ({100 * share:.1f} %), "
        f"{len(names)} attacks x 2 arms of {config.microbatches} microbatches + clean runs, seeds {config.seeds}, "
        f"load {load_start[0]:.1f}",
        flush=True,
    )

    weights: dict[int, dict[str, torch.Tensor]] = {}

    def weights_for(seed: int) -> dict[str, torch.Tensor]:
        if seed not in weights:
            weights[seed] = pretrained_state(config.harness(), steps=config.pretrain_steps, seed=seed)
        return weights[seed]

    seed0 = config.seeds[0]
    total = 1 + 2 * len(names) + len(config.seeds)
    done = 0

    def run(label: str, **kwargs: Any) -> ArmResult:
        nonlocal done
        done += 1
        print(f"[{done}/{total}] {label} (t = {time.perf_counter() - t0:.0f} s)", flush=True)
        seed = int(kwargs.pop("seed"))
        r = run_arm(config, weights_for(seed), label=label, seed=seed, **kwargs)
        print(f"    {_describe(r)}", flush=True)
        return r

    from benchmarks.common import plot_path, write_result

    # The cost first (a few seconds): a run cut short by the clock still reports it.
    cost = {} if args.no_cost else cost_figures(int(config.harness().batch_size))
    cost_detail = cost.pop("cost_detail", None)
    rows: dict[str, dict[str, Any]] = {}
    clean_runs: list[dict[str, Any]] = []
    verified_runs: list[ArmResult] = []
    clean_ref: ArmResult | None = None

    def report(final: bool) -> Path:
        """Write the JSON (and the plot) with what is done so far: a run stopped early leaves a partial table."""
        headline = headline_of(rows, clean_runs, {**cost, **live_cost(verified_runs)})
        headline.update(
            {
                "complete": final,
                "malicious_share": share,
                "replicas": list(config.replicas),
                "wall_s": time.perf_counter() - t0,
                "load_average_start": load_start[0],
                "load_average_now": os.getloadavg()[0],
            }
        )
        detail = {
            "config": {**asdict(config), "model": dict(config.model)},
            "attacks": rows,
            "clean": clean_runs,
            "clean_reference": None
            if clean_ref is None
            else {"loss": clean_ref.loss, "tokens": clean_ref.tokens, "curve": clean_ref.curve},
            "cost_detail": cost_detail,
        }
        path = write_result(name, headline, detail)
        if rows:
            plot(name, rows, headline, plot_path(name))
        return path

    clean_ref = run(
        "clean, no verification", seed=seed0, attack=None, verify=False, microbatches=config.microbatches
    )

    def clean_run(seed: int) -> None:
        r = run(
            f"clean seed {seed}, SENTINEL",
            seed=seed,
            attack=None,
            verify=True,
            microbatches=config.clean_microbatches,
        )
        verified_runs.append(r)
        clean_runs.append(clean_row(r, clean_ref))
        report(final=False)

    clean_run(seed0)
    for attack_name in names:
        spec = attack_spec(attack_name, config)
        unverified = run(
            f"{attack_name}, no verification",
            seed=seed0,
            attack=spec,
            verify=False,
            microbatches=config.microbatches,
        )
        attacked = run(
            f"{attack_name}, SENTINEL", seed=seed0, attack=spec, verify=True, microbatches=config.microbatches
        )
        verified_runs.append(attacked)
        rows[attack_name] = attack_row(attack_name, config, attacked, unverified, clean_ref)
        r = rows[attack_name]
        print(
            f"    => {attack_name}: F1 {r['f1']:.3f} (P {r['precision']:.2f} R {r['recall']:.2f}), ban after "
            f"{r['microbatches_to_ban']}, false bans {r['false_bans']}, loss gap {100 * r['loss_gap']:+.2f} % "
            f"(unverified {100 * r['loss_gap_unverified']:+.2f} %)",
            flush=True,
        )
        report(final=False)
    for seed in config.seeds[1:]:
        clean_run(seed)
    path = report(final=True)
    print(f"{'attack':<14}{'F1':>6}{'P':>6}{'R':>6}{'ban':>7}{'false':>7}{'gap %':>8}{'no-ver %':>10}")
    for attack_name, r in rows.items():
        mb = r["microbatches_to_ban"]
        print(
            f"{attack_name:<14}{r['f1']:>6.2f}{r['precision']:>6.2f}{r['recall']:>6.2f}"
            f"{'never' if mb is None else f'{mb:g}':>7}{r['false_bans']:>7}{100 * r['loss_gap']:>8.2f}"
            f"{100 * r['loss_gap_unverified']:>10.2f}"
        )
    for c in clean_runs:
        print(
            f"clean seed {c['seed']}: false bans {c['false_bans']}, honest flag rate {c['honest_flag_rate']}"
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
