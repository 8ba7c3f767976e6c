"""Offline evaluation of the SENTINEL cores on honest boundary streams of a tiny pipelined GPT.

A byte-level GPT (4 blocks, width 128, context 128) is pre-trained briefly, then cut into 3 stages
(embedding + block 0 | blocks 1-2 | block 3 + head), each with R replicas. Every microbatch is routed
through one random replica per stage; each replica steps AdamW on what it processed, so replicas drift
apart; every `sync_every` microbatches the replicas of a stage are averaged (a DiLoCo merge) and adopt the
merge after a random per-replica delay (staggered versions). Two honest stage-wide shocks are injected:
a sudden identical weight jump on every replica, and a learning-rate spike.

The four boundary tensors (stage 0 and 1 forward, stage 1 and 2 backward) of every microbatch are fed to
"lanes": each lane is one verifier (SentinelMonitor + ViolationLedger + SpotCheckPolicy) that sees the
same honest stream, except that one replica of stage 1 applies the lane's attack to what it sends. The
clean lane has no attacker. For stage 1 the stream also carries recomputations of the same input by two
other replicas, for the spot checks.

Offline means the attack does not feed back into training (after a ban it would stop anyway; what an
undetected attack does to the model is not modelled). Run: `python -m benchmarks.sentinel_offline`.
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from verification.attacks import Attack, AttackConfig
from verification.ledger import LedgerConfig, LedgerDecision, ViolationLedger
from verification.sentinel import SentinelConfig, SentinelMonitor
from verification.spotcheck import SpotCheckConfig, SpotCheckPolicy

ATTACKED_STAGE = 1
ATTACKER = "s1r0"
# In pipeline order: a flag at one boundary drops (forward) or replaces (backward) the microbatch, so the
# boundaries after it in this order are not checked for that microbatch.
BOUNDARIES: tuple[tuple[int, str], ...] = ((0, "forward"), (1, "forward"), (2, "backward"), (1, "backward"))
# The tensor the verifier itself sent the stage for the same microbatch (the monitor's `context`):
# stage 1 forward gets stage 0's output, stage 1 backward gets the gradient stage 2 returned. Stage 0
# eats tokens and stage 2's output gradient is w.r.t. logits, so those boundaries have no context.
CONTEXT: dict[tuple[int, str], tuple[int, str]] = {
    (1, "forward"): (0, "forward"),
    (1, "backward"): (2, "backward"),
}


# --------------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attn)
        return x + self.mlp(self.ln2(x))


class StageModule(nn.Module):
    """One pipeline stage: optional embedding in front, blocks, optional head behind."""

    def __init__(self, width: int, seq: int, blocks: int, *, first: bool, last: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, width) if first else None
        self.pos = nn.Parameter(torch.zeros(seq, width)) if first else None
        self.blocks = nn.ModuleList(Block(width, 4) for _ in range(blocks))
        self.ln = nn.LayerNorm(width) if last else None
        self.head = nn.Linear(width, 256) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None and self.pos is not None:
            x = self.tok(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        if self.ln is not None and self.head is not None:
            x = self.head(self.ln(x))
        return x


def build_stages(width: int, seq: int) -> list[StageModule]:
    return [
        StageModule(width, seq, 1, first=True, last=False),
        StageModule(width, seq, 2, first=False, last=False),
        StageModule(width, seq, 1, first=False, last=True),
    ]


def load_corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """The standard library's own source as bytes (the project's default corpus)."""
    root = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 100_000:  # no stdlib sources on this machine: fall back to something byte-like
        chunks = [bytes(range(256)) * 4000]
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def sample_batch(
    corpus: torch.Tensor, rng: torch.Generator, batch: int, seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, corpus.numel() - seq - 1, (batch,), generator=rng)
    idx = starts[:, None] + torch.arange(seq + 1)
    tokens = corpus[idx]
    return tokens[:, :-1], tokens[:, 1:]


# --------------------------------------------------------------------------- honest stream


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamConfig:
    seed: int = 0
    replicas: int = 3  # per stage
    microbatches: int = 900
    batch: int = 8
    seq: int = 128
    width: int = 128
    pretrain_steps: int = 150
    lr: float = 1e-3
    sync_every: int = 30  # stage microbatches between merges
    sync_stagger: int = 12  # each replica adopts a merge 0..stagger stage microbatches late
    shock_at: int = 450  # identical weight jump on every replica of every stage
    shock_scale: float = 0.03  # jump = scale * per-tensor std * shared Gaussian
    lr_spike_at: int = 700
    lr_spike_factor: float = 8.0
    lr_spike_len: int = 40
    recompute_stage: int | None = ATTACKED_STAGE  # stage whose microbatches two other replicas recompute


@dataclass(slots=True)
class Microbatch:
    index: int
    route: list[str]  # replica id per stage
    tensors: dict[tuple[int, str], torch.Tensor]
    # direction -> [(replica id, recomputed tensor)] for two other replicas of recompute_stage
    recomputed: dict[str, list[tuple[str, torch.Tensor]]]
    loss: float
    stage_seconds: dict[tuple[int, str], float]  # compute time that produced each boundary tensor


class Replica:
    def __init__(self, name: str, module: StageModule, lr: float) -> None:
        self.name = name
        self.module = module
        self.opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0)
        self.pending: tuple[int, dict[str, torch.Tensor]] | None = None  # (adopt at, merged weights)


def _pretrain(cfg: StreamConfig, corpus: torch.Tensor, gen: torch.Generator) -> list[StageModule]:
    stages = build_stages(cfg.width, cfg.seq)
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    for _ in range(cfg.pretrain_steps):
        x, y = sample_batch(corpus, gen, cfg.batch, cfg.seq)
        h = x
        for s in stages:
            h = s(h)
        loss = F.cross_entropy(h.reshape(-1, 256), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return stages


def route_plan(cfg: StreamConfig) -> list[list[int]]:
    """Replica index per stage for every microbatch, drawn up front so lanes know the attacker's steps."""
    rng = random.Random(cfg.seed * 7919 + 1)
    return [[rng.randrange(cfg.replicas) for _ in range(3)] for _ in range(cfg.microbatches)]


def honest_stream(cfg: StreamConfig) -> Iterator[Microbatch]:
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    corpus = load_corpus()
    base = _pretrain(cfg, corpus, gen)
    replicas = [
        [Replica(f"s{s}r{r}", copy.deepcopy(base[s]), cfg.lr) for r in range(cfg.replicas)]
        for s in range(len(base))
    ]
    stage_counts = [0] * len(base)
    for index, plan in enumerate(route_plan(cfg)):
        _honest_events(cfg, index, replicas, gen)
        route = [stage_reps[r] for stage_reps, r in zip(replicas, plan, strict=True)]
        for s, rep in enumerate(route):
            stage_counts[s] += 1
            _maybe_adopt(rep, stage_counts[s])
            if stage_counts[s] % cfg.sync_every == 0:
                _schedule_merge(replicas[s], stage_counts[s], cfg.sync_stagger, rng)
        x, y = sample_batch(corpus, gen, cfg.batch, cfg.seq)
        yield _run_microbatch(cfg, index, route, replicas, x, y, rng)


def _honest_events(
    cfg: StreamConfig, index: int, replicas: list[list[Replica]], gen: torch.Generator
) -> None:
    if index == cfg.shock_at:
        for stage_reps in replicas:
            with torch.no_grad():
                for tensors in zip(*(r.module.parameters() for r in stage_reps), strict=True):
                    jump = (
                        torch.randn(tensors[0].shape, generator=gen)
                        * cfg.shock_scale
                        * float(tensors[0].std())
                    )
                    for t in tensors:
                        t.add_(jump)
    if index in (cfg.lr_spike_at, cfg.lr_spike_at + cfg.lr_spike_len):
        factor = cfg.lr_spike_factor if index == cfg.lr_spike_at else 1.0
        for stage_reps in replicas:
            for r in stage_reps:
                for group in r.opt.param_groups:
                    group["lr"] = cfg.lr * factor


def _schedule_merge(stage_reps: list[Replica], now: int, stagger: int, rng: random.Random) -> None:
    names = [n for n, _ in stage_reps[0].module.named_parameters()]
    merged = {
        n: torch.stack([dict(r.module.named_parameters())[n].detach() for r in stage_reps]).mean(0).clone()
        for n in names
    }
    for r in stage_reps:
        r.pending = (now + rng.randint(0, stagger), merged)


def _maybe_adopt(rep: Replica, now: int) -> None:
    if rep.pending is not None and now >= rep.pending[0]:
        with torch.no_grad():
            params = dict(rep.module.named_parameters())
            for n, value in rep.pending[1].items():
                params[n].copy_(value)
        rep.pending = None


def _run_microbatch(
    cfg: StreamConfig,
    index: int,
    route: list[Replica],
    replicas: list[list[Replica]],
    x: torch.Tensor,
    y: torch.Tensor,
    rng: random.Random,
) -> Microbatch:
    seconds: dict[tuple[int, str], float] = {}
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    h: torch.Tensor = x
    for s, rep in enumerate(route):
        inp = h.detach().requires_grad_(s > 0)
        t0 = time.perf_counter()
        h = rep.module(inp)
        seconds[(s, "forward")] = time.perf_counter() - t0
        inputs.append(inp)
        outputs.append(h)
    loss = F.cross_entropy(h.reshape(-1, 256), y.reshape(-1))
    grad: torch.Tensor | None = None
    grads_in: dict[int, torch.Tensor] = {}
    for s in reversed(range(len(route))):
        route[s].opt.zero_grad()
        t0 = time.perf_counter()
        if grad is None:
            loss.backward()
        else:
            outputs[s].backward(grad)
        seconds[(s, "backward")] = time.perf_counter() - t0
        if s > 0:
            grad = inputs[s].grad.detach()
            grads_in[s] = grad
        route[s].opt.step()
    tensors = {
        (0, "forward"): outputs[0].detach(),
        (1, "forward"): outputs[1].detach(),
        (1, "backward"): grads_in[1],
        (2, "backward"): grads_in[2],
    }
    recomputed: dict[str, list[tuple[str, torch.Tensor]]] = {"forward": [], "backward": []}
    if cfg.recompute_stage is None:
        return Microbatch(index, [r.name for r in route], tensors, recomputed, float(loss.detach()), seconds)
    rs = cfg.recompute_stage
    others = [r for r in replicas[rs] if r is not route[rs]]
    grad_out = grads_in.get(rs + 1)
    for other in rng.sample(others, min(2, len(others))):
        inp = inputs[rs].detach().requires_grad_(True)
        out = other.module(inp)
        recomputed["forward"].append((other.name, out.detach()))
        if grad_out is not None:
            (g,) = torch.autograd.grad(out, inp, grad_out)
            recomputed["backward"].append((other.name, g.detach()))
    return Microbatch(index, [r.name for r in route], tensors, recomputed, float(loss.detach()), seconds)


# --------------------------------------------------------------------------- lanes


@dataclass(slots=True)
class LaneStats:
    honest_checks: int = 0
    honest_flags: int = 0
    attacked_checks: int = 0
    attacked_flags: int = 0
    ban_after: int | None = None  # attacker's own attacked microbatches until its ban
    ban_via: str = ""
    false_bans: list[str] = field(default_factory=list)
    honest_quarantines: int = 0
    rewarms: int = 0
    spot_checks: int = 0
    spot_false_convictions: int = 0
    spot_inconclusive: int = 0
    spot_exonerated: int = 0  # flagged tensors whose recomputation cleared them
    honest_rel_diffs: list[float] = field(default_factory=list)
    check_seconds: list[float] = field(default_factory=list)
    honest_flags_by_boundary: dict[str, int] = field(default_factory=dict)
    honest_flags_by_metric: dict[str, int] = field(default_factory=dict)


class Lane:
    """One verifier watching the stream; with an attack, replica ATTACKER of stage 1 applies it."""

    def __init__(
        self,
        name: str,
        attack: AttackConfig | None,
        *,
        sentinel: SentinelConfig,
        ledger: LedgerConfig,
        spot: SpotCheckConfig | None,
        replicas: int,
        seed: int,
        boundaries: tuple[tuple[int, str], ...] = BOUNDARIES,
    ) -> None:
        self.name = name
        self.attack = Attack(attack) if attack is not None else None
        self.monitor = SentinelMonitor(sentinel)
        self.ledger = ViolationLedger(ledger)
        self.spot = SpotCheckPolicy(spot) if spot is not None else None
        self.replicas = replicas
        self.rng = random.Random(seed)
        self.boundaries = boundaries
        self.stats = LaneStats()
        self.attacker_steps = 0
        self.attacked_steps = 0
        self.banned: set[str] = set()

    def members(self, stage: int) -> list[str]:
        return [f"s{stage}r{r}" for r in range(self.replicas)]

    def process(self, mb: Microbatch) -> None:
        attacker_here = mb.route[ATTACKED_STAGE] == ATTACKER
        step = self.attacker_steps
        if attacker_here:
            self.attacker_steps += 1
            if self.attack is not None and any(
                stage == ATTACKED_STAGE and self.attack.is_active(direction, step)
                for stage, direction in self.boundaries
            ):
                self.attacked_steps += 1
        for stage, direction in self.boundaries:
            signer = mb.route[stage]
            if signer in self.banned:
                continue  # in a live run the microbatch would have gone to another replica
            honest = mb.tensors[(stage, direction)]
            attacked = False
            sent = honest
            if self.attack is not None and stage == ATTACKED_STAGE and attacker_here:
                sent = self.attack.apply(honest, direction=direction, microbatch_id=mb.index, step=step)
                attacked = self.attack.is_active(direction, step)
            t0 = time.perf_counter()
            ctx = mb.tensors[CONTEXT[(stage, direction)]] if (stage, direction) in CONTEXT else None
            verdict = self.monitor.check(
                stage, direction, signer, mb.index, sent, float(mb.index), context=ctx
            )
            self.stats.check_seconds.append(time.perf_counter() - t0)
            self._count(verdict.flagged, verdict.reason, attacked, f"{stage}/{direction}")
            self._apply(
                self.ledger.record(
                    signer,
                    stage,
                    verdict.flagged,
                    float(mb.index),
                    microbatch_id=mb.index,
                    replicas=self.members(stage),
                )
            )
            cleared = False
            if stage == ATTACKED_STAGE and signer not in self.banned:
                cleared = self._spot_check(mb, direction, signer, sent, attacked, verdict.flagged)
            if verdict.flagged and not cleared:
                break  # cascade handling: later boundaries of this microbatch are not checked

    def _count(self, flagged: bool, reason: str, attacked: bool, boundary: str) -> None:
        st = self.stats
        if attacked:
            st.attacked_checks += 1
            st.attacked_flags += int(flagged)
            return
        st.honest_checks += 1
        if flagged:
            st.honest_flags += 1
            st.honest_flags_by_boundary[boundary] = st.honest_flags_by_boundary.get(boundary, 0) + 1
            metric = reason.split(" ")[0]
            st.honest_flags_by_metric[metric] = st.honest_flags_by_metric.get(metric, 0) + 1

    def _apply(self, decision: LedgerDecision) -> None:
        for d in decision.all():
            if d.action == "ban":
                self._on_ban(d.signer, d.reason)
            elif d.action == "quarantine" and (d.signer != ATTACKER or self.attacked_steps == 0):
                self.stats.honest_quarantines += 1
            elif d.action == "rewarm":
                self.stats.rewarms += 1
                self.monitor.rewarm(d.stage)

    def _on_ban(self, signer: str, reason: str) -> None:
        self.banned.add(signer)
        self.monitor.forget_replica(signer)
        if signer == ATTACKER and self.attack is not None and self.attacked_steps > 0:
            self.stats.ban_after = self.attacked_steps
            self.stats.ban_via = "spot check" if "spot-check" in reason else "monitor"
        else:
            self.stats.false_bans.append(f"{signer}: {reason}")

    def _spot_check(
        self, mb: Microbatch, direction: str, signer: str, sent: torch.Tensor, attacked: bool, flagged: bool
    ) -> bool:
        """As verification.tap does live; True when the recomputation cleared a flagged tensor."""
        if self.spot is None or len(mb.recomputed[direction]) < 2:
            return False
        decision = self.spot.should_check(
            self.rng,
            microbatches_seen=self.ledger.microbatches_seen(signer),
            recent_flags=self.ledger.flags_in_window(signer),
            quarantined=self.ledger.is_quarantined(signer),
            flagged_now=flagged,
        )
        if not decision.check:
            return False
        self.stats.spot_checks += 1
        (checker_id, checker), (_, third) = mb.recomputed[direction][:2]
        verdict = self.spot.adjudicate(sent, checker)
        if verdict.outcome == "need_third":
            verdict = self.spot.adjudicate(sent, checker, third)
        if not attacked:
            self.stats.honest_rel_diffs.append(verdict.original_vs_checker.rel_diff)
        if verdict.outcome == "inconclusive":
            self.stats.spot_inconclusive += 1
        if flagged and self.spot.clears(verdict):
            self.stats.spot_exonerated += 1
            self._apply(self.ledger.exonerate(signer, mb.index, reason=verdict.reason))
            return True
        if verdict.culprit is None:
            return False
        # The stream's checkers are honest replicas: convicting one, or an unattacked original, is false.
        culprit = signer if verdict.culprit == "original" else checker_id
        self.stats.spot_false_convictions += int(culprit != signer or not attacked)
        decision = self.ledger.record_evidence(
            culprit,
            ATTACKED_STAGE,
            float(mb.index),
            reason=verdict.reason,
            corroborated=verdict.corroborated,
            replicas=self.members(ATTACKED_STAGE),
        )
        self._apply(decision)
        return False


# --------------------------------------------------------------------------- suite and report


def attack_suite() -> list[tuple[str, str, float | None, dict[str, object]]]:
    """(kind, label, strength, extra config) of every attack evaluated, each run forward and backward."""
    return [
        ("constant", "constant", None, {}),
        ("zeros", "zeros", None, {}),
        ("random", "random", None, {}),
        ("scaling", "scale x-1", -1.0, {}),
        ("scaling", "scale x10", 10.0, {}),
        ("scaling", "scale x1.5", 1.5, {}),
        ("sign_flip", "sign flip 50%", 0.5, {}),
        ("bias", "bias 0.5", 0.5, {}),
        ("delay", "delay 100", None, {"delay_steps": 100}),
        ("noise", "noise 0.5", 0.5, {}),
        ("noise", "noise 0.2", 0.2, {}),
        ("onoff", "on/off random", 1.0, {"inner": "random", "period_steps": 20, "duty": 0.1}),
        ("drift", "drift 0.002", 0.002, {}),
        ("mimic", "mimic", 0.0, {}),
        ("mimic", "mimic+noise", 1.0, {}),
    ]


def make_lanes(
    stream: StreamConfig,
    attack_start: int,
    sentinel: SentinelConfig,
    ledger: LedgerConfig,
    spot: SpotCheckConfig | None,
    kinds: list[str] | None,
) -> list[Lane]:
    plan = route_plan(stream)
    start_own = sum(1 for route in plan[:attack_start] if route[ATTACKED_STAGE] == 0)
    lanes = [
        Lane(
            "clean",
            None,
            sentinel=sentinel,
            ledger=ledger,
            spot=spot,
            replicas=stream.replicas,
            seed=stream.seed,
        )
    ]
    for i, (kind, label, strength, extra) in enumerate(attack_suite()):
        if kinds and kind not in kinds and label not in kinds:
            continue
        for direction in ("forward", "backward"):
            cfg = AttackConfig(
                kind=kind,
                direction=direction,  # type: ignore[arg-type]
                strength=strength,
                start_after=start_own,
                seed=stream.seed * 101 + i,
                **extra,  # type: ignore[arg-type]
            )
            lanes.append(
                Lane(
                    f"{label} {direction[:3]}",
                    cfg,
                    sentinel=sentinel,
                    ledger=ledger,
                    spot=spot,
                    replicas=stream.replicas,
                    seed=stream.seed * 31 + i,
                    boundaries=((ATTACKED_STAGE, direction),),
                )
            )
    return lanes


def run_seed(
    stream: StreamConfig,
    attack_start: int,
    sentinel: SentinelConfig,
    ledger: LedgerConfig,
    spot: SpotCheckConfig | None,
    kinds: list[str] | None = None,
) -> tuple[dict[str, LaneStats], dict[str, float]]:
    lanes = make_lanes(stream, attack_start, sentinel, ledger, spot, kinds)
    compute: dict[str, list[float]] = {"forward": [], "backward": []}
    losses: list[float] = []
    for mb in honest_stream(stream):
        for lane in lanes:
            lane.process(mb)
        compute["forward"].append(mb.stage_seconds[(ATTACKED_STAGE, "forward")])
        compute["backward"].append(mb.stage_seconds[(ATTACKED_STAGE, "backward")])
        losses.append(mb.loss)
    facts = {
        "stage1_forward_ms": 1000 * statistics.median(compute["forward"]),
        "stage1_backward_ms": 1000 * statistics.median(compute["backward"]),
        "loss_first_50": statistics.mean(losses[:50]),
        "loss_last_50": statistics.mean(losses[-50:]),
    }
    return {lane.name: lane.stats for lane in lanes}, facts


def _fmt_ban(values: list[int | None]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "never"
    text = f"{statistics.median(got):g}"
    return text if len(got) == len(values) else f"{text} ({len(got)}/{len(values)})"


def summarize(per_seed: list[dict[str, LaneStats]]) -> dict[str, dict[str, object]]:
    names = list(per_seed[0])
    table: dict[str, dict[str, object]] = {}
    for name in names:
        stats = [seed[name] for seed in per_seed]
        honest_checks = sum(s.honest_checks for s in stats)
        attacked_checks = sum(s.attacked_checks for s in stats)
        table[name] = {
            "ban_after_own_microbatches": [s.ban_after for s in stats],
            "ban_via": [s.ban_via for s in stats],
            "ban_median": _fmt_ban([s.ban_after for s in stats]),
            "attacked_flag_rate": sum(s.attacked_flags for s in stats) / attacked_checks
            if attacked_checks
            else None,
            "honest_flag_rate": sum(s.honest_flags for s in stats) / honest_checks if honest_checks else 0.0,
            "false_bans": sum(len(s.false_bans) for s in stats),
            "false_ban_reasons": [r for s in stats for r in s.false_bans],
            "honest_quarantines": sum(s.honest_quarantines for s in stats),
            "rewarms": sum(s.rewarms for s in stats),
            "spot_checks": sum(s.spot_checks for s in stats),
            "spot_false_convictions": sum(s.spot_false_convictions for s in stats),
            "spot_inconclusive": sum(s.spot_inconclusive for s in stats),
            "spot_exonerated": sum(s.spot_exonerated for s in stats),
        }
    return table


def print_table(table: dict[str, dict[str, object]]) -> None:
    print(
        f"{'lane':<24}{'ban after':>12}{'via':>12}{'att flag':>10}{'hon flag':>10}{'false ban':>10}{'rewarm':>8}"
    )
    for name, row in table.items():
        att = row["attacked_flag_rate"]
        vias = sorted({v for v in row["ban_via"] if v})  # type: ignore[union-attr]
        print(
            f"{name:<24}{row['ban_median']!s:>12}{'/'.join(vias) or '-':>12}"
            f"{'-' if att is None else f'{att:.2f}':>10}{row['honest_flag_rate']:>10.4f}"
            f"{row['false_bans']!s:>10}{row['rewarms']!s:>8}"
        )


def measure_cost(batches: tuple[int, ...] = (8, 16), repeats: int = 200) -> dict[str, dict[str, float]]:
    """CPU time of the two checks of a microbatch against the stage compute that produced the tensors
    (a 2-block stage of the model above).

    "interleaved": check right after the stage's own forward/backward in one process, whose caches the
    stage compute has just flushed (conservative). "isolated": the same checks run back to back on
    stored tensors, as a verifier process that does nothing but check would run them."""
    from verification.sentinel import BoundaryMonitor

    torch.manual_seed(0)
    module = StageModule(128, 128, 2, first=False, last=False)
    out: dict[str, dict[str, float]] = {}
    for batch in batches:
        config = SentinelConfig(warmup_checks=10, min_window_checks=8)
        monitors = {d: BoundaryMonitor(config, stage=1, direction=d) for d in ("forward", "backward")}
        pattern = torch.randn(128, 128)
        times: dict[str, list[float]] = {
            k: [] for k in ("forward", "backward", "check_forward", "check_backward")
        }
        stored: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for i in range(repeats + 20):
            x = (pattern + torch.randn(batch, 128, 128)).requires_grad_(True)
            grad_out = torch.randn(batch, 128, 128) * 1e-3
            t0 = time.process_time()
            y = module(x)
            t1 = time.process_time()
            y.backward(grad_out)
            t2 = time.process_time()
            assert x.grad is not None
            monitors["forward"].check(y.detach(), f"r{i % 3}", i, float(i), context=x.detach())
            t3 = time.process_time()
            monitors["backward"].check(x.grad, f"r{i % 3}", i, float(i), context=grad_out)
            t4 = time.process_time()
            if i >= 20:  # after the monitors' warm-up, when every fence is live
                for key, value in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    times[key].append(1000 * value)
                if len(stored) < 50:
                    stored.append((y.detach(), x.detach(), x.grad, grad_out))
        isolated: dict[str, list[float]] = {"isolated_check_forward": [], "isolated_check_backward": []}
        for rep in range(4):
            for j, (y, x, gx, gy) in enumerate(stored):
                for direction, tensor, context, key in (
                    ("forward", y, x, "isolated_check_forward"),
                    ("backward", gx, gy, "isolated_check_backward"),
                ):
                    t0 = time.process_time()
                    monitors[direction].check(
                        tensor, f"r{j % 3}", 10_000 + rep * 100 + j, 0.0, context=context
                    )
                    isolated[key].append(1000 * (time.process_time() - t0))
        times.update(isolated)
        # Median: this (shared, often oversubscribed) machine; 10th percentile: closer to an idle one.
        for label, pick in (("median", statistics.median), ("p10", lambda v: sorted(v)[len(v) // 10])):
            row = {key: pick(values) for key, values in times.items()}
            stage = row["forward"] + row["backward"]
            row["interleaved_share_of_stage_compute"] = (row["check_forward"] + row["check_backward"]) / stage
            row["isolated_share_of_stage_compute"] = (
                row["isolated_check_forward"] + row["isolated_check_backward"]
            ) / stage
            out[f"batch_{batch}_{label}"] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--microbatches", type=int, default=900)
    parser.add_argument("--attack-start", type=int, default=300)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--kinds", nargs="*", default=None, help="restrict to these attack kinds or labels")
    parser.add_argument("--no-spot", action="store_true", help="disable spot checks (monitor-only detection)")
    parser.add_argument("--fence-k", type=float, default=None)
    parser.add_argument("--fence-kind", choices=["mad", "tukey"], default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--metrics", nargs="*", default=None)
    parser.add_argument(
        "--no-peers", action="store_true", help="ablation: history-only fences (paper as written)"
    )
    parser.add_argument("--name", default="sentinel_offline")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: stable timings on shared cores)"
    )
    parser.add_argument("--cost", action="store_true", help="only measure the CPU cost of checks")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.cost:
        from benchmarks.common import write_result

        cost = measure_cost()
        print(cost)
        write_result(f"{args.name}_cost", {"threads": args.threads, **cost})
        return 0

    overrides: dict[str, object] = {}
    if args.fence_k is not None:
        overrides["fence_k"] = args.fence_k
    if args.fence_kind is not None:
        overrides["fence_kind"] = args.fence_kind
    if args.warmup is not None:
        overrides["warmup_checks"] = args.warmup
    if args.window is not None:
        overrides["window_checks"] = args.window
    if args.metrics:
        overrides["metrics"] = tuple(args.metrics)
    if args.no_peers:
        overrides["min_peer_replicas"] = 10**6
    sentinel = SentinelConfig(**overrides)  # type: ignore[arg-type]
    ledger = LedgerConfig()
    spot = None if args.no_spot else SpotCheckConfig()

    per_seed: list[dict[str, LaneStats]] = []
    facts_all: list[dict[str, float]] = []
    t_start = time.perf_counter()
    for seed in args.seeds:
        stream = StreamConfig(seed=seed, replicas=args.replicas, microbatches=args.microbatches)
        stats, facts = run_seed(stream, args.attack_start, sentinel, ledger, spot, args.kinds)
        per_seed.append(stats)
        facts_all.append(facts)
        print(f"seed {seed}: {facts} ({time.perf_counter() - t_start:.0f} s)", flush=True)
    table = summarize(per_seed)
    print_table(table)
    _report(args, sentinel, ledger, spot, per_seed, facts_all, table)
    return 0


def _report(
    args: argparse.Namespace,
    sentinel: SentinelConfig,
    ledger: LedgerConfig,
    spot: SpotCheckConfig | None,
    per_seed: list[dict[str, LaneStats]],
    facts_all: list[dict[str, float]],
    table: dict[str, dict[str, object]],
) -> None:
    from dataclasses import asdict

    from benchmarks.common import plot_path, write_result

    check_ms = [1000 * t for seed in per_seed for t in seed["clean"].check_seconds]
    rel = sorted(r for seed in per_seed for stats in seed.values() for r in stats.honest_rel_diffs)
    fwd_ms = statistics.median(f["stage1_forward_ms"] for f in facts_all)
    bwd_ms = statistics.median(f["stage1_backward_ms"] for f in facts_all)
    check_med = statistics.median(check_ms)
    attack_rows = {k: v for k, v in table.items() if k != "clean"}
    headline = {
        "seeds": len(per_seed),
        "clean_false_bans": table["clean"]["false_bans"],
        "clean_honest_flag_rate": table["clean"]["honest_flag_rate"],
        "false_bans_all_lanes": sum(int(v["false_bans"]) for v in table.values()),  # type: ignore[call-overload]
        "attacks_banned_every_seed": sum(
            1
            for v in attack_rows.values()
            if all(b is not None for b in v["ban_after_own_microbatches"])  # type: ignore[union-attr]
        ),
        "attack_lanes": len(attack_rows),
        "check_ms_median": check_med,
        "check_ms_p95": sorted(check_ms)[int(0.95 * (len(check_ms) - 1))],
        "stage_fwd_bwd_ms_median": fwd_ms + bwd_ms,
        "check_share_of_stage_compute": 2 * check_med / (fwd_ms + bwd_ms),
        "honest_spot_rel_diff_median": statistics.median(rel) if rel else None,
        "honest_spot_rel_diff_p99": rel[int(0.99 * (len(rel) - 1))] if rel else None,
    }
    detail = {
        "args": vars(args),
        "sentinel_config": asdict(sentinel),
        "ledger_config": asdict(ledger),
        "spot_config": asdict(spot) if spot else None,
        "facts_per_seed": facts_all,
        "lanes": table,
        "clean_flags_by_boundary": [seed["clean"].honest_flags_by_boundary for seed in per_seed],
        "clean_flags_by_metric": [seed["clean"].honest_flags_by_metric for seed in per_seed],
    }
    path = write_result(args.name, headline, detail)
    print(f"headline: {headline}\nwrote {path}")
    _plot(args.name, table, plot_path(args.name))


def _plot(name: str, table: dict[str, dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(k, v) for k, v in table.items() if k != "clean"]
    bans = [[b for b in v["ban_after_own_microbatches"] if b is not None] for _, v in rows]  # type: ignore[union-attr]
    seeds = [len(v["ban_after_own_microbatches"]) for _, v in rows]  # type: ignore[arg-type]
    medians = [statistics.median(b) if b else math.nan for b in bans]
    longest = max([m for m in medians if not math.isnan(m)], default=10.0)
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(rows) + 1.5))
    y = list(range(len(rows)))
    widths = [longest * 1.05 if math.isnan(m) else m for m in medians]
    colors = ["#f4a6a6" if math.isnan(m) else ("tab:orange" if len(b) < n else "tab:blue")
              for m, b, n in zip(medians, bans, seeds, strict=True)]  # fmt: skip
    ax.barh(y, widths, color=colors)
    for yi, m, b, n in zip(y, medians, bans, seeds, strict=True):
        label = "never" if math.isnan(m) else (f"{m:g}" if len(b) == n else f"{m:g} ({len(b)}/{n} seeds)")
        ax.text(widths[yi] + longest * 0.01, yi, label, va="center", fontsize=7)
    ax.set_yticks(y, [k for k, _ in rows], fontsize=7)
    ax.set_xlim(0, longest * 1.3)
    ax.set_xlabel("attacker's own microbatches from attack start to ban (median over seeds)")
    false_bans = sum(int(v["false_bans"]) for v in table.values())  # type: ignore[call-overload]
    ax.set_title(
        f"{name}: false bans in all lanes = {false_bans} (clean lane: {table['clean']['false_bans']})"
    )
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
