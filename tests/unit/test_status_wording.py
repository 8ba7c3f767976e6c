"""What `python -m node status` says about a swarm: goodput is merged work only, and the throughput the
heartbeats report is labelled so and shown apart (a swarm with no merges never reads as if it trained)."""

from __future__ import annotations

from typing import Any

from node.status.command import render_swarm
from tools.demo import join_command


def swarm(history: dict[str, Any]) -> dict[str, Any]:
    return {"run_name": "demo", "run_id": "r1", "peers": [], "syncer": [], "bans": [], "history": history}


def history(*, goodput: float | None, source: str, merges: int) -> dict[str, Any]:
    return {
        "t": [0.0, 2.0],
        "throughput": [None, 15974.0],
        "goodput": [None, goodput],
        "goodput_source": source,
        "totals": {"merges": merges},
    }


def swarm_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("swarm: "))


def test_no_merges_reads_goodput_zero_whatever_the_heartbeats_say() -> None:
    line = swarm_line(render_swarm(swarm(history(goodput=0.0, source="no merges yet", merges=0))))
    assert line.startswith("swarm: goodput 0 tok/s (no merges yet), 0 merges seen;")
    assert "15,974 tok/s processed (reported by heartbeats)" in line
    assert "goodput 15,974" not in line


def test_an_older_bootstraps_heartbeat_goodput_is_not_shown_as_goodput() -> None:
    before = swarm_line(render_swarm(swarm(history(goodput=15974.0, source="heartbeats", merges=0))))
    assert "goodput 0 tok/s (no merges yet)" in before
    after = swarm_line(render_swarm(swarm(history(goodput=15974.0, source="heartbeats", merges=3))))
    assert "goodput unknown (the bootstrap reports heartbeat figures only), 3 merges seen" in after


def test_merged_goodput_is_shown_with_its_merges() -> None:
    line = swarm_line(render_swarm(swarm(history(goodput=1234.0, source="syncer", merges=12))))
    assert line.startswith("swarm: goodput 1,234 tok/s merged, 12 merges seen;")


def test_the_swarm_summary_says_how_each_peer_is_reached() -> None:
    peers = [
        {"peer_id": "12D3KooWRelayed1", "role": "learner", "state": "training", "mode": "relay"},
        {"peer_id": "12D3KooWClientO2", "role": "learner", "state": "training", "mode": "client"},
        {
            "peer_id": "12D3KooWOlderNo3",
            "role": "stage",
            "stage": 0,
            "state": "serving",
        },  # no mode: older node
    ]
    text = render_swarm({**swarm(history(goodput=0.0, source="no merges yet", merges=0)), "peers": peers})
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ")}
    assert "training   relay   step" in lines["Relayed1"]
    assert "training   client  step" in lines["ClientO2"]
    assert "serving    unknown step" in lines["OlderNo3"]


def test_the_demo_join_line_names_an_absolute_command() -> None:
    maddr = "/ip4/127.0.0.1/tcp/4242/p2p/12D3KooWTest"
    venv = join_command(maddr)
    assert venv.startswith("/") and venv.endswith(f" --join {maddr}")
    assert join_command(maddr, "/opt/py/bin/python3") == f"/opt/py/bin/python3 -m node --join {maddr}"
