"""The end-of-run report of a swarm: held-out loss at start and end, throughput and goodput, faults survived, merges,
bans, processes and CPU; as a dict (`report.json`), as text, and as PNG plots.

`build_report(inputs)` is pure: it reads a `ReportInputs` (the swarm history from `node.status.swarm_view`, the held-out
loss points, the faults a chaos schedule injected, process and CPU figures) and computes every figure.
`render_text`, `write_report` and `write_plots` present it. Times in the report are seconds since the run started.

Definitions (also written into the report):

- *time to fall*: seconds from the first held-out evaluation until the held-out loss is `fall_nats` below it.
- *goodput*: tokens the global model got (committed by the merges the syncer describes; 0 before any merge,
  unknown when merges were seen but none described: never the tokens the heartbeats report), divided by the
  tokens a fault-free swarm of the planned size would have
  processed over the same working time at the healthy per-peer rate measured in this run. Committed tokens lag
  (tokens not yet synced at the end) and Decoupled DiLoCo drops some by design (a learner overwrites a fragment
  with a version it did not contribute to, losing its steps since its last send), so a fault-free run stays
  below 1. *working fraction*: the same ratio for tokens processed by unbanned live peers (the share of the
  fault-free chip time spent training, the paper's sense of goodput).
- *fault survived*: after it, the global model kept advancing (a merge happened), and a killed or stalled node
  came back (heartbeated again after going missing or straggling; or never visibly went away) before the end.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

REPORT_FILENAME = "report.json"
PLOT_NAMES = ("loss.png", "throughput.png", "merges.png")
GOODPUT_DEFINITION = (
    "tokens the global model got (committed by the merges the syncer describes; 0 before any merge) / tokens a "
    "fault-free swarm of the planned size would process in the same working time at the healthy per-peer rate "
    "measured in this run"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportInputs:
    """Everything the report is computed from; times are on one clock (the history's)."""

    run: Mapping[str, Any]  # what ran: roles and counts, model, chaos/attack settings, run id
    started_at: float  # the run's time zero
    ended_at: float
    history: Mapping[str, Any]  # SwarmHistory.history_json()
    events: Sequence[Mapping[str, Any]] = ()  # SwarmHistory.events_json() (any order)
    faults: Sequence[Mapping[str, Any]] = ()  # injected faults: {"t", "action", "target", "role", ...}
    planned_workers: int = 0  # learners + stage-0 replicas the swarm was planned with
    processes: Mapping[str, Any] = field(default_factory=dict)  # started, peak alive, left behind
    cpu: Mapping[str, Any] = field(default_factory=dict)  # cores, cpu_s, wall_s
    fall_nats: float = 0.5  # "loss has fallen" threshold

    def __post_init__(self) -> None:
        if self.ended_at < self.started_at:
            raise ValueError("ended_at is before started_at")
        if self.fall_nats <= 0:
            raise ValueError("fall_nats must be positive")


def _rel(t: float, t0: float) -> float:
    return round(t - t0, 2)


def _finite(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]


def held_out_summary(points: Sequence[Mapping[str, Any]], t0: float, fall_nats: float) -> dict[str, Any]:
    """Start and end of the held-out loss, its drop, and when it first fell by `fall_nats`."""
    points = sorted((p for p in points if math.isfinite(p.get("loss", math.nan))), key=lambda p: p["t"])
    if not points:
        return {"start": None, "end": None, "best": None, "drop": None, "time_to_fall_s": None, "points": []}
    start, end = points[0], points[-1]
    fell = next((p for p in points if p["loss"] <= start["loss"] - fall_nats), None)
    return {
        "start": round(start["loss"], 4),
        "end": round(end["loss"], 4),
        "best": round(min(p["loss"] for p in points), 4),
        "drop": round(start["loss"] - end["loss"], 4),
        "fell": end["loss"] < start["loss"],
        "fall_nats": fall_nats,
        "time_to_fall_s": _rel(fell["t"], start["t"]) if fell is not None else None,
        "points": [{"t": _rel(p["t"], t0), "loss": round(p["loss"], 4)} for p in points],
    }


def throughput_summary(history: Mapping[str, Any], planned_workers: int) -> dict[str, Any]:
    """Tokens processed and useful, mean rates over the working time, and goodput against a fault-free swarm."""
    times = list(history.get("t") or [])
    throughput = list(history.get("throughput") or [])
    goodput = list(history.get("goodput") or [])
    workers = list(history.get("workers") or [0] * len(times))
    totals = history.get("totals") or {}
    working = [i for i, v in enumerate(throughput) if isinstance(v, int | float) and v > 0]
    if not working:
        return {
            "tokens": totals.get("tokens", 0),
            "useful_tokens": totals.get("useful_tokens", 0),
            "mean_tokens_per_s": None,
            "goodput_fraction": None,
            "goodput_source": history.get("goodput_source"),
            "goodput_definition": GOODPUT_DEFINITION,
        }
    first, last = working[0], len(times) - 1
    # the working time starts at the sample before the first tokens (their increment spans that interval)
    span_s = max(times[last] - times[max(first - 1, 0)], 1e-9)
    # per-peer rate while the whole planned swarm was working: the fault-free reference
    rates = [
        (throughput[i] / workers[i], workers[i] >= max(planned_workers, 1))
        for i in range(first, last + 1)
        if isinstance(throughput[i], int | float) and workers[i]
    ]
    full = [rate for rate, complete in rates if complete] or [rate for rate, _ in rates]
    healthy_rate = statistics.median(full) if full else None
    committed = totals.get("committed_tokens")
    # merged work only: the heartbeats' tokens are the working fraction below, never goodput
    got = committed if history.get("goodput_source") == "syncer" else None
    got = 0 if got is None and not totals.get("merges") else got
    reference = healthy_rate * max(planned_workers, 1) * span_s if healthy_rate else None
    goodputs = _finite(goodput[first : last + 1])
    return {
        "tokens": totals.get("tokens", 0),
        "useful_tokens": totals.get("useful_tokens", 0),
        "committed_tokens": committed,
        "working_time_s": round(span_s, 1),
        "mean_tokens_per_s": round(statistics.fmean(_finite(throughput[first : last + 1])), 1),
        "mean_goodput_tokens_per_s": round(statistics.fmean(goodputs), 1)
        if goodputs and got is not None
        else None,
        "healthy_tokens_per_s_per_peer": round(healthy_rate, 1) if healthy_rate else None,
        "goodput_fraction": round(min(got / reference, 1.0), 3) if reference and got is not None else None,
        # the same against tokens processed by unbanned live peers: the share of chip time spent working
        "working_fraction": round(min(totals.get("useful_tokens", 0) / reference, 1.0), 3)
        if reference
        else None,
        "goodput_source": history.get("goodput_source"),
        "goodput_definition": GOODPUT_DEFINITION,
    }


def fault_summary(
    faults: Sequence[Mapping[str, Any]],
    merges: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """Which injected faults the swarm survived (see the module docstring)."""
    merge_times = sorted(m["t"] for m in merges if "t" in m)
    rejoins: dict[str, list[float]] = {}
    losses: dict[str, list[float]] = {}
    for event in events:
        peer = event.get("peer")
        if event.get("kind") in ("joined", "recovered") and peer:
            rejoins.setdefault(str(peer), []).append(float(event["t"]))
        if event.get("kind") in ("left", "lost", "straggling") and peer:
            losses.setdefault(str(peer), []).append(float(event["t"]))
    out: list[dict[str, Any]] = []
    kinds: dict[str, int] = {}
    for fault in sorted(faults, key=lambda f: f["t"]):
        t = float(fault["t"])
        kinds[fault["action"]] = kinds.get(fault["action"], 0) + 1
        advanced = any(m > t for m in merge_times)
        peer = fault.get("peer")
        needs_return = fault["action"] in ("kill", "stall")
        went_away = peer is not None and any(x >= t for x in losses.get(str(peer), []))
        returned = peer is not None and any(r > t for r in rejoins.get(str(peer), []))
        # a fault too short for the records to show (no heartbeat missed) never took the peer away
        came_back = not needs_return or returned or (peer is not None and not went_away)
        out.append(
            {
                **fault,
                "model_advanced_after": advanced,
                "came_back": came_back,
                "survived": advanced and came_back,
            }
        )
    return {
        "injected": len(out),
        "survived": sum(f["survived"] for f in out),
        "by_action": kinds,
        "faults": out,
    }


def merge_summary(merges: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    by_fragment: dict[str, int] = {}
    for m in merges:
        by_fragment[str(m["fragment"])] = by_fragment.get(str(m["fragment"]), 0) + int(m.get("count", 1))
    quorums = _finite([m.get("quorum") for m in merges])
    graces = _finite([m.get("grace_s") for m in merges])
    return {
        "count": sum(by_fragment.values()),
        "by_fragment": by_fragment,
        "mean_quorum": round(statistics.fmean(quorums), 2) if quorums else None,
        "mean_grace_s": round(statistics.fmean(graces), 3) if graces else None,
    }


def ban_summary(bans: Sequence[Mapping[str, Any]], t0: float) -> list[dict[str, Any]]:
    return [
        {
            "offender": b["offender"],
            "stage": b.get("stage"),
            "in_effect": b.get("in_effect", False),
            "verifiers": list(b.get("verifiers") or []),
            "reasons": list(b.get("reasons") or []),
            "first_seen_s": _rel(b["first_seen"], t0) if "first_seen" in b else None,
            "evidence_bytes": sum(int(n.get("evidence_bytes", 0)) for n in b.get("notices") or []),
        }
        for b in bans
    ]


def build_report(inputs: ReportInputs) -> dict[str, Any]:
    t0 = inputs.started_at
    history = inputs.history
    merges = list(history.get("merges") or [])
    cpu = dict(inputs.cpu)
    if cpu.get("cpu_s") is not None and cpu.get("wall_s") and cpu.get("cores"):
        cpu["mean_utilisation"] = round(cpu["cpu_s"] / (cpu["wall_s"] * cpu["cores"]), 3)
    return {
        "run": dict(inputs.run),
        "duration_s": _rel(inputs.ended_at, t0),
        "held_out_loss": held_out_summary(history.get("eval") or [], t0, inputs.fall_nats),
        "throughput": throughput_summary(history, inputs.planned_workers),
        "faults": fault_summary(
            [{**f, "t": _rel(f["t"], t0)} for f in inputs.faults],
            [{**m, "t": _rel(m["t"], t0)} for m in merges],
            [{**e, "t": _rel(e["t"], t0)} for e in inputs.events if "t" in e],
        ),
        "merges": merge_summary(merges),
        "bans": ban_summary(history.get("bans") or [], t0),
        "processes": dict(inputs.processes),
        "cpu": cpu,
    }


def _fmt(value: Any, spec: str = "", missing: str = "n/a") -> str:
    if value is None:
        return missing
    return format(value, spec)


def render_text(report: Mapping[str, Any]) -> str:
    """A short human summary of a report."""
    loss, thr, faults = report["held_out_loss"], report["throughput"], report["faults"]
    merges, bans, procs, cpu = report["merges"], report["bans"], report["processes"], report["cpu"]
    fall = loss.get("time_to_fall_s")
    lines = [
        f"hivenode demo report ({report['duration_s']:.0f} s)",
        f"  held-out loss      {_fmt(loss['start'], '.3f')} -> {_fmt(loss['end'], '.3f')}"
        f" (best {_fmt(loss['best'], '.3f')}; fell {loss.get('fall_nats', 0.5)} nats after "
        f"{_fmt(fall, '.0f', 'never')}{' s' if fall is not None else ''})",
        f"  tokens             {thr['tokens']:,} processed, {_fmt(thr.get('mean_tokens_per_s'), ',.0f')} tok/s",
        f"  goodput            {_fmt(thr.get('goodput_fraction'), '.0%')} ({_goodput_source(thr)});"
        f" peers worked {_fmt(thr.get('working_fraction'), '.0%')} of the fault-free time",
        f"  merges             {merges['count']} (mean quorum {_fmt(merges['mean_quorum'])})",
        f"  faults             {faults['survived']}/{faults['injected']} survived {faults['by_action'] or ''}",
        f"  bans               {len(bans)}"
        + "".join(
            f"\n    {b['offender'][-8:]} stage {b['stage']}: {'; '.join(r[:100] for r in b['reasons'])}"
            for b in bans
        ),
        f"  processes          {procs.get('started', '?')} started, peak {procs.get('peak_alive', '?')} alive,"
        f" {procs.get('left_behind', '?')} left behind"
        + (
            f", {len(procs['unplanned_exits'])} exited on their own (restarted)"
            if procs.get("unplanned_exits")
            else ""
        ),
        f"  cpu                {_fmt(cpu.get('mean_utilisation'), '.0%')} of {cpu.get('cores', '?')} cores",
    ]
    return "\n".join(lines)


def _goodput_source(throughput: Mapping[str, Any]) -> str:
    source = throughput.get("goodput_source")
    if source == "syncer":
        return "tokens merged into the global model"
    if source == "no merges yet":
        return "no merges yet"
    return f"unknown: {source or 'no syncer figures'}"


def write_report(out_dir: Path, report: Mapping[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / REPORT_FILENAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(path)
    return path


# ---- plots ----


def _series(history: Mapping[str, Any], name: str, t0: float) -> tuple[list[float], list[float]]:
    pairs = [
        (t - t0, v)
        for t, v in zip(history.get("t") or [], history.get(name) or [], strict=False)
        if isinstance(v, int | float) and math.isfinite(v)
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


_FAULT_STYLE = {"kill": ("0.35", ":"), "stall": ("tab:orange", "-.")}


def _mark_faults(ax: Any, report: Mapping[str, Any]) -> None:
    labelled = set()
    for fault in report["faults"]["faults"]:
        action = fault["action"]
        color, style = _FAULT_STYLE.get(action, ("0.6", ":"))
        label = None if action in labelled else f"chaos: {action}"
        ax.axvline(fault["t"], color=color, lw=0.9, ls=style, label=label)
        labelled.add(action)
    for ban in report["bans"]:
        if ban.get("first_seen_s") is not None:
            ax.axvline(ban["first_seen_s"], color="tab:red", lw=1.0, ls="--", label="ban")


def write_plots(
    report: Mapping[str, Any], history: Mapping[str, Any], out_dir: Path, t0: float
) -> list[Path]:
    """loss.png (held-out and training loss), throughput.png (tokens/s, goodput, peers), merges.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for series in (history.get("peer_loss") or {}).values():
        ax.plot([t - t0 for t in series["t"]], series["loss"], lw=0.6, alpha=0.35, label=None)
    t, v = _series(history, "loss", t0)
    ax.plot(t, v, color="tab:blue", lw=1.2, label="training loss (mean of peers)")
    points = report["held_out_loss"]["points"]
    if points:
        ax.plot(
            [p["t"] for p in points], [p["loss"] for p in points], "o-", color="black", label="held-out loss"
        )
    _mark_faults(ax, report)
    ax.set(xlabel="seconds", ylabel="loss (nats/token)", title="Loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out_dir / "loss.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, color in (("throughput", "tab:blue"), ("goodput", "tab:green")):
        t, v = _series(history, name, t0)
        ax.plot(t, v, color=color, label=f"{name} (tokens/s)")
    ax.set(xlabel="seconds", ylabel="tokens/s", title="Throughput and goodput")
    ax2 = ax.twinx()
    t, v = _series(history, "workers", t0)
    ax2.step(t, v, where="post", color="tab:orange", lw=0.8, label="working peers")
    ax2.set_ylabel("working peers")
    ax2.set_ylim(bottom=0, top=max(v + [1]) + 1)
    _mark_faults(ax, report)
    handles = ax.get_legend_handles_labels()
    handles2 = ax2.get_legend_handles_labels()
    ax.legend(handles[0] + handles2[0], handles[1] + handles2[1], fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out_dir / "throughput.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    merges = history.get("merges") or []
    if merges:
        sizes = [20 + 20 * float(m.get("quorum") or 1) for m in merges]
        ax.scatter([m["t"] - t0 for m in merges], [m["fragment"] for m in merges], s=sizes, alpha=0.6)
        ax2 = ax.twinx()
        times = sorted(m["t"] - t0 for m in merges)
        ax2.step(times, range(1, len(times) + 1), where="post", color="tab:gray", lw=0.8)
        ax2.set_ylabel("merges so far")
    ax.set(xlabel="seconds", ylabel="fragment", title="Merges (marker size: quorum)")
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out_dir / "merges.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
