"""`python -m node status URL_OR_MULTIADDR`: one swarm's summary, read from a bootstrap's API or from the DHT."""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any

from hivemind.utils import get_dht_time

from node.config import NetworkConfig
from node.context import EVENTS_FILENAME, short_id
from node.status.http import summarize_bans
from node.status.swarm_view import goodput_text, peer_mode, throughput_text
from protocol.dht_io import SwarmRecords, fetch_discovery
from protocol.errors import HivenodeError
from protocol.identity import NodeIdentity
from protocol.records import HivenodeRecordValidator, RunRules


def render_swarm(data: dict[str, Any]) -> str:
    """A text summary of an /api/swarm document (with the bootstrap's history when it has one)."""
    lines = [f"run {data.get('run_name', '?')} ({data.get('run_id', '?')})"]
    peers = data.get("peers") or []
    lines.append(f"{len(peers)} live peer(s)")
    for peer in peers:
        stage = peer.get("stage")
        where = f" stage {stage}" if stage is not None else ""
        step = peer.get("inner_step")
        loss = peer.get("loss")
        lines.append(
            f"  {short_id(str(peer.get('peer_id', '')))}  {peer.get('role', '?'):9}{where:9} {peer.get('state', '?'):10}"
            f" {peer_mode(peer):7} step {step if step is not None else '-'}  {peer.get('throughput', 0.0):.0f} tok/s"
            f"  loss {f'{loss:.3f}' if isinstance(loss, int | float) else '-'}  {peer.get('http', '')}"
        )
    syncers = data.get("syncer") or []
    lines.append(f"{len(syncers)} syncer record(s)")
    for record in syncers:
        versions = " ".join(str(v) for v in record.get("versions") or [])
        lines.append(
            f"  {short_id(str(record.get('peer_id', '')))}  {record.get('state', '?')} term {record.get('term', '?')}"
            f"  versions [{versions}]"
        )
    bans = data.get("bans") or []
    lines.append(f"{len(bans)} banned peer(s)")
    for ban in bans:
        reasons = sorted({n.get("reason", "") for n in ban.get("notices") or []} - {""})
        signed = ", ".join(short_id(v) for v in ban.get("verifiers") or [])
        effect = "in effect" if ban.get("in_effect") else "not yet in effect"
        lines.append(
            f"  {short_id(str(ban.get('offender', '')))}  {effect}, signed by {signed}: {'; '.join(reasons)}"
        )
    lines += _history_lines(data.get("history"))
    for maddr in data.get("bootstrap_maddrs") or []:
        lines.append(f"bootstrap {maddr}")
    return "\n".join(lines)


def _last_number(values: object) -> float | None:
    if not isinstance(values, list):
        return None
    numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return numbers[-1] if numbers else None


def _history_lines(history: object) -> list[str]:
    """What the bootstrap's history adds: goodput (merged work only), merges, the throughput the heartbeats
    report (apart, and labelled so), the latest held-out loss."""
    if not isinstance(history, dict) or not history.get("t"):
        return []
    throughput, goodput = _last_number(history.get("throughput")), _last_number(history.get("goodput"))
    totals = history.get("totals")
    merges = (totals.get("merges") if isinstance(totals, dict) else None) or 0
    source = str(history.get("goodput_source", "?")) if merges else "no merges yet"
    if source == "heartbeats":  # an older bootstrap: its goodput was the heartbeats' figure, not merged work
        source = "the bootstrap reports heartbeat figures only"
    evals = [p for p in history.get("eval") or [] if isinstance(p, dict)]
    line = f"swarm: {goodput_text(goodput, source)}, {merges} merges seen; {throughput_text(throughput)}"
    if evals:
        line += f"; held-out loss {evals[-1].get('loss')}"
    return [line]


async def swarm_from_dht(maddrs: list[str], network: NetworkConfig) -> list[dict[str, Any]]:
    """Ask the DHT directly (no bootstrap HTTP needed): one /api/swarm-shaped summary per run found there."""
    from node.swarm import start_dht

    with tempfile.TemporaryDirectory(prefix="hivenode-status-") as tmp:
        identity = NodeIdentity.load_or_create(Path(tmp) / "identity.key")  # throwaway: we only read
        dht = start_dht(identity, maddrs, network, HivenodeRecordValidator())
        try:
            timeout_s = network.request_timeout_s
            summaries = []
            for signed in await fetch_discovery(dht, timeout_s=timeout_s, now=get_dht_time()):
                manifest = signed.verify()
                rules = RunRules.from_manifest(signed, manifest)
                dht.add_validators([HivenodeRecordValidator([rules])])  # the DHT process drops unknown runs
                records = SwarmRecords(dht, rules, identity, timeout_s=timeout_s)
                peers = await records.list_peers()
                syncers = await records.list_syncers()
                bans = await records.list_bans(p.peer_id for p in peers)
                summaries.append(
                    {
                        "run_id": signed.run_id,
                        "run_name": manifest.name,
                        "peers": [p.to_json() for p in peers],
                        "syncer": [s.to_json() for s in syncers],
                        "bans": summarize_bans(bans, manifest.ban_quorum),
                        "bootstrap_maddrs": maddrs,
                    }
                )
            return summaries
        finally:
            dht.shutdown()


def last_connectivity(state_dir: Path) -> dict[str, Any] | None:
    """The latest `connectivity` event in a node's event log (how it was reachable, and why), if any."""
    found = None
    with contextlib.suppress(OSError):
        for line in (state_dir / EVENTS_FILENAME).read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("event") == "connectivity":
                    found = record
    return found


def render_connectivity(record: dict[str, Any] | None) -> str:
    """One line: direct / relay / client and why (from `last_connectivity`)."""
    if record is None:
        return "connectivity: unknown (this node has not joined yet)"
    line = f"connectivity: {record.get('mode', '?')} ({record.get('reason', '')})"
    relays = record.get("relays") or []
    return line + (f"; relays: {', '.join(map(str, relays))}" if relays else "")


async def status_command(
    target: str, timeout_s: float = 10.0, *, peer: str | None = None, state_dir: Path | None = None
) -> int:
    """Print a summary of the swarm behind `target` (a bootstrap URL or a multiaddr), and with `peer` that peer's
    credit from the bootstrap's ledger (with `state_dir`, our node's connectivity first); return an exit code."""
    from node.swarm import check_multiaddr, fetch_json, is_url, swarm_url

    if state_dir is not None:
        print(render_connectivity(last_connectivity(state_dir)))
    if is_url(target):
        print(render_swarm(await fetch_json(swarm_url(target), timeout_s)))
        if peer is not None:
            url = swarm_url(target).removesuffix("/api/swarm") + f"/api/leaderboard?peer={peer}"
            print(render_credit(await fetch_json(url, timeout_s)))
        return 0
    network = NetworkConfig(join_timeout_s=timeout_s, request_timeout_s=min(timeout_s, 5.0), client_mode=True)
    summaries = await swarm_from_dht([check_multiaddr(target)], network)
    if not summaries:
        raise HivenodeError(f"no hivenode run is published on the DHT behind {target}")
    print("\n\n".join(render_swarm(s) for s in summaries))
    if peer is not None:
        ledgers = [
            p["http"] for s in summaries for p in s["peers"] if p.get("role") == "bootstrap" and p.get("http")
        ]
        if not ledgers:
            raise HivenodeError("no bootstrap in this swarm serves HTTP: its ledger holds the credit")
        print(render_credit(await fetch_json(f"http://{ledgers[0]}/api/leaderboard?peer={peer}", timeout_s)))
    return 0


def render_credit(data: dict[str, Any]) -> str:
    """A peer's line of the bootstrap's ledger, why its credit is held back, and its latest contributions."""
    peer_id = str(data.get("peer_id", "?"))
    row = data.get("peer") or {}
    lines = [
        f"credit of {peer_id}: {row.get('verified_tokens', 0):.0f} verified tokens, {row.get('accepted', 0)} "
        f"accepted and {row.get('rejected', 0)} rejected contribution(s), uptime {row.get('uptime_s', 0):.0f} s"
    ]
    lines += [f"  why: {reason}" for reason in data.get("reasons") or []]
    for entry in (data.get("recent") or [])[:5]:
        verdict = (
            f"accepted, {entry.get('tokens', 0):.0f} tokens"
            if entry.get("accepted")
            else f"rejected: {entry.get('reason')}"
        )
        lines.append(f"  fragment {entry.get('fragment')} version {entry.get('version')}: {verdict}")
    return "\n".join(lines)
