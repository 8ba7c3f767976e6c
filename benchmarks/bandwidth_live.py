"""Outer-gradient codecs in a live swarm: held-out loss at equal merged tokens, and the bytes each push carried.

One arm per codec, one after another, each a fresh swarm of real processes on loopback (the goodput benchmark's
`Swarm`: a bootstrap, a primary and a standby syncer, 4 learners stepping at a fixed speed on the built-in
standard-library corpus, the same seeds), failure-free. The run manifest of an arm differs only in its
`[outer_codec]` table. From the syncers' events, the held-out loss curve against merged tokens (`measure`);
from the learners' status, the bytes their pushes carried and what fp32 would have carried.

    loss gap of a codec = (its final held-out loss - the fp32 arm's loss interpolated at the same merged tokens)
                          / the latter

Over a WAN (`run_live` with `WAN_LINK`, issue 20's "swarm over the WAN proxy"): the same arms with every syncer and learner
behind a `tools.wan_proxy` link of 50 Mbit/s each way and 50 ms one-way delay (100 ms round trip); each node
announces its proxy's address, so every connection to it crosses one shaped link (the shaping is per connection:
each learner-syncer pair gets its own 50 Mbit/s). Tokens/s trained and the merge efficiency (tokens merged / tokens
trained x fragments) of each codec.

An arm may run another outer step (`run_live(diloco=...)`, `[diloco]` keys over the swarm's, parsed from
outer_sweep's spelling by `parse_outer`): the fp32 control and the codec then share it.

Called by `benchmarks.bandwidth` (which writes the results); alone: `python -m benchmarks.bandwidth_live [--wan]`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import shutil
import socket
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.goodput import DILOCO, NUM_LEARNERS, Arm, Swarm, interpolate, measure
from protocol.compress import CodecSpec
from protocol.manifest import DilocoSpec
from tools.wan_proxy import LinkProfile, ProxyThread

logger = logging.getLogger("benchmarks.bandwidth_live")


def run_toml_table(spec: CodecSpec) -> str:
    fields = spec.header_fields()
    lines = [f'codec = "{fields.pop("codec")}"'] + [f"{k} = {v}" for k, v in fields.items()]
    if spec.feedback_decay != 1.0:  # learner side, not a header field
        lines.append(f"feedback_decay = {spec.feedback_decay}")
    if spec.codec == "randk" and not spec.mask_rotate:  # both sides, not a header field either
        lines.append("mask_rotate = false")
    return "\n[outer_codec]\n" + "\n".join(lines) + "\n"


WAN_LINK = LinkProfile(delay_s=0.05, bandwidth_bytes_per_s=50e6 / 8)  # 50 Mbit/s each way, 100 ms round trip
NODE_NAMES = ("syncer-a", "syncer-b", *(f"learner{i}" for i in range(NUM_LEARNERS)))  # goodput.Swarm's names


OUTER_KEYS = {"H": "sync_every_steps", "outer_lr": "outer_lr", "momentum": "outer_momentum"}


def parse_outer(text: str) -> dict[str, int | float]:
    """'H=12,outer_lr=1.0,momentum=0.0' (outer_sweep's spelling; any subset) -> `[diloco]` keys; ValueError
    naming the valid keys."""
    values = dict(part.strip().split("=", 1) for part in text.split(",") if part.strip())
    unknown = set(values) - set(OUTER_KEYS)
    if unknown:
        raise ValueError(f"unknown outer keys {sorted(unknown)}; valid: {', '.join(OUTER_KEYS)}")
    return {OUTER_KEYS[k]: int(v) if k == "H" else float(v) for k, v in values.items()}


def outer_label(diloco: Mapping[str, int | float]) -> str:
    """The `[diloco]` outer keys back in `parse_outer`'s spelling, the swarm's defaults filled in."""
    spec = DilocoSpec()
    full = {**DILOCO, "outer_lr": spec.outer_lr, "outer_momentum": spec.outer_momentum, **diloco}
    return ",".join(f"{short}={full[key]}" for short, key in OUTER_KEYS.items())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def wan_links(names: Sequence[str], profile: LinkProfile | None) -> Iterator[dict[str, list[str]]]:
    """A started proxy shaped by `profile` in front of each named node, and the node's `--listen` (its own port)
    and `--announce` (the proxy's) flags; no proxies and no flags when `profile` is None."""
    if profile is None:
        yield {}
        return
    ports = {name: _free_port() for name in names}
    proxies = {
        name: ProxyThread(
            target_host="127.0.0.1", target_port=port, profile=dataclasses.replace(profile, seed=i)
        )
        for i, (name, port) in enumerate(ports.items())
    }
    try:
        for proxy in proxies.values():
            proxy.start()
        yield {
            name: [
                "--listen",
                f"/ip4/127.0.0.1/tcp/{ports[name]}",
                "--announce",
                f"/ip4/127.0.0.1/tcp/{proxy.port}",
            ]
            for name, proxy in proxies.items()
        }
    finally:
        for proxy in proxies.values():
            proxy.stop()


def run_arm(
    root: Path,
    name: str,
    spec: CodecSpec,
    duration_s: float,
    min_step_s: float,
    link: LinkProfile | None = None,
    diloco: Mapping[str, int | float] | None = None,
) -> dict[str, Any]:
    """One failure-free swarm with `spec` as the run's outer codec (every node behind a `link` when given, the
    `[diloco]` keys of `diloco` over the swarm's: an outer step); `measure`'s result plus push bytes and tokens/s."""
    with wan_links(NODE_NAMES, link) as node_args:
        swarm = Swarm(
            root,
            Arm(name=name, mode="decoupled", chaos=False),
            min_step_s,
            run_extra=run_toml_table(spec),
            node_args=node_args,
            diloco=diloco,
        )
        try:
            swarm.start()
            warmup_s = swarm.warm_up()
            logger.info("arm %s: formed after %.1f s; measuring %.0f s", name, warmup_s, duration_s)
            result = measure(swarm, [], duration_s)
        finally:
            swarm.stop()
    sent = [s.get("push_bytes", 0) for s in result["learner_sync"].values()]
    plain = [s.get("push_bytes_fp32", 0) for s in result["learner_sync"].values()]
    pushes = [s.get("acked", 0) for s in result["learner_sync"].values()]
    result.pop("learner_samples", None)
    result.update(
        codec=spec.header_fields(),
        diloco={**DILOCO, **(diloco or {})},
        warmup_s=round(warmup_s, 2),
        push_bytes=sum(sent),
        push_bytes_fp32=sum(plain),
        pushes_acked=sum(pushes),
        live_compression=round(sum(plain) / sum(sent), 2) if sum(sent) else None,
        tokens_per_s=round(result["tokens_processed"] / result["window_s"], 1)
        if result["window_s"]
        else None,
    )
    logger.info(
        "arm %s: %d tokens merged, %d merges, push bytes %d (fp32 %d)",
        name,
        result["tokens_merged"],
        result["merges"],
        result["push_bytes"],
        result["push_bytes_fp32"],
    )
    return result


def loss_gap(arm: dict[str, Any], reference: dict[str, Any]) -> float | None:
    if not arm["loss_curve"] or not reference["loss_curve"]:
        return None
    tokens, loss = arm["loss_curve"][-1]
    ref = interpolate(reference["loss_curve"], tokens)
    return round((loss - ref) / ref, 4) if ref else None


def loss_gap_tail(arm: dict[str, Any], reference: dict[str, Any], last: int = 3) -> float | None:
    """The mean relative gap of the arm's last `last` evaluations, each against the reference interpolated at the
    same merged tokens: one evaluation of a lossy codec's swarm swings by more than the gap asked for."""
    gaps = []
    for tokens, loss in arm["loss_curve"][-last:]:
        ref = interpolate(reference["loss_curve"], tokens)
        if ref:
            gaps.append((loss - ref) / ref)
    return round(sum(gaps) / len(gaps), 4) if gaps else None


def run_live(
    codecs: dict[str, CodecSpec],
    duration_s: float,
    min_step_s: float,
    link: LinkProfile | None = None,
    diloco: Mapping[str, Mapping[str, int | float]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every arm of `codecs` (the first is the reference, fp32), each with its `loss_gap` against it; over
    `link` (every node behind one) when given; an arm named in `diloco` runs with those `[diloco]` keys over
    the swarm's (`parse_outer`)."""
    results: dict[str, dict[str, Any]] = {}
    base = Path(tempfile.mkdtemp(prefix="bandwidth-live-"))
    try:
        for index, (name, spec) in enumerate(codecs.items()):
            root = base / f"arm{index}"
            root.mkdir()
            overrides = (diloco or {}).get(name)
            results[name] = run_arm(root, f"codec{index}", spec, duration_s, min_step_s, link, overrides)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    reference = next(iter(results.values()))
    for result in results.values():
        result["loss_gap"] = loss_gap(result, reference)
        result["loss_gap_last3"] = loss_gap_tail(result, reference)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds measured per arm")
    parser.add_argument("--min-step-s", type=float, default=0.25)
    parser.add_argument("--wan", action="store_true", help="every node behind a 50 Mbit/s, 100 ms RTT link")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    codecs = {
        "fp32": CodecSpec(),
        "topk 1/128 2-bit EF 0.9": CodecSpec(
            codec="topk", chunk=4096, k=32, bits=2, scale_bits=16, feedback_decay=0.9
        ),  # benchmarks.bandwidth's RECOMMENDED
    }
    results = run_live(codecs, args.duration, args.min_step_s, WAN_LINK if args.wan else None)
    print(
        json.dumps(
            {
                n: {k: r[k] for k in ("loss_gap", "live_compression", "tokens_merged", "tokens_per_s")}
                for n, r in results.items()
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
