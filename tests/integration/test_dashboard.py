"""The dashboard in a real browser: headless Chromium loads the bootstrap's `/` of a running demo swarm and shows its
peers, loss points and a ban with its evidence. A screenshot is saved under tests/artifacts/.

The ban is a real signed DHT ban record. In the CI test the test signs the notice with the demo's authorized
verifier key and publishes it with `SwarmRecords.publish_ban` (DHT record -> validator -> bootstrap -> /api/swarm
-> page), which is deterministic. The slow test runs the demo with `--attack` and waits for the verifier's own
SENTINEL ban of the attacker (it depends on detection, which `tests/` for verification/ cover on their own).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from protocol.identity import NodeIdentity
from tests.integration.procs import PYTHON, REPO_ROOT, Proc, Procs, get_json, procs, wait_until
from tests.unit.test_learner_scores import SYNCER_ID, syncer_status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = REPO_ROOT / "tests" / "artifacts"
ATTACK_KIND = "random"
BAN_WAIT_S = 300.0  # the attacker is honest for its first 80 steps, then the verifier needs a few flags


def _skip_reason() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing (Debian's chromium; `make browser` installs it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright's Python package is not installed (pip install -e '.[test]')"
    return None


def _has_attack_option() -> bool:
    try:
        from verification.attacks import UNSAFE_ATTACK_ENV  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def running_demo(root: Path, *args: str) -> Iterator[tuple[Proc, str, Path]]:
    """A demo swarm (SIGINT and a clean exit at the end); yields (process, dashboard URL, out dir)."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    out = root / "run"
    argv = [PYTHON, "-m", "node", "demo", "--no-live", "--out", str(out), *args]
    with procs(root) as group:
        demo = _spawn(group, argv)
        url = demo.wait_line(r"^dashboard: (http://\S+)$", timeout_s=120).group(1)
        demo.wait_line(r"^swarm up", timeout_s=240)
        yield demo, url, out
        demo.signal(signal.SIGINT)  # the demo stops its swarm and writes its report
        assert demo.wait_exit(120) == 0, demo.stderr()


@pytest.fixture(scope="module")
def demo_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, str, Path]]:
    with running_demo(tmp_path_factory.mktemp("dashboard"), "--learners", "1", "--stages", "1") as swarm:
        yield swarm


def _spawn(group: Procs, argv: list[str]) -> Proc:
    return group._spawn(Proc, "demo", argv)


def _publish_ban(maddr: str, verifier_key: Path, offender: str, stage: int) -> bool:
    """Sign a ban notice with an authorized verifier key and store it in the swarm's DHT (as a verifier would)."""
    from hivemind.utils import get_dht_time

    from node.config import LOOPBACK_LISTEN, NetworkConfig
    from node.swarm import start_dht
    from protocol.dht_io import SwarmRecords, fetch_discovery
    from protocol.records import BanNotice, HivenodeRecordValidator, RunRules

    async def publish() -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            # the DHT peer is a throwaway; the record is signed by the verifier key
            throwaway = NodeIdentity.load_or_create(Path(tmp) / "dht.key")
            dht = start_dht(
                throwaway, [maddr], NetworkConfig(listen=(LOOPBACK_LISTEN,)), HivenodeRecordValidator()
            )
            try:
                signed = (await fetch_discovery(dht, timeout_s=10.0, now=get_dht_time()))[0]
                rules = RunRules.from_manifest(signed, signed.verify())
                dht.add_validators([HivenodeRecordValidator([rules])])
                records = SwarmRecords(dht, rules, NodeIdentity.load(verifier_key), timeout_s=10.0)
                notice = BanNotice(
                    offender=offender,
                    reason="test: gradient flagged 3 times in 20 microbatches",
                    evidence=bytes(range(64)),
                    stage=stage,
                    issued_at=get_dht_time(),
                )
                return await records.publish_ban(notice, expiration=get_dht_time() + 600.0)
            finally:
                dht.shutdown()

    return asyncio.run(publish())


def _swarm_with(url: str, predicate) -> dict | None:
    doc = get_json(url + "api/swarm", 10.0)
    return doc if predicate(doc) else None


def _publish_a_ban(url: str, out: Path) -> str:
    """Ban the stage replica, signed with the demo's verifier key; return the offender."""
    swarm = wait_until(
        lambda: _swarm_with(url, lambda d: any(p["role"] == "stage" for p in d["peers"])), 120, what="a stage"
    )
    stage_peer = next(p for p in swarm["peers"] if p["role"] == "stage")
    verifier_key = out / "state" / "verifier1" / "identity.key"
    assert _publish_ban(
        swarm["bootstrap_maddrs"][0], verifier_key, stage_peer["peer_id"], stage_peer["stage"]
    )
    return stage_peer["peer_id"]


def _check_page(
    url: str, offender: str, screenshot: Path, *, merges: bool = False, learner: str | None = None
) -> dict:
    """Load the dashboard; wait for peers, loss points and the offender's ban (with `merges`, a merge the
    syncer described; with `learner`, that learner's merge weight among the syncer's scores); return what the
    page shows."""
    from playwright.sync_api import sync_playwright

    row = f'#bans tr[data-offender="{offender}"]'
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1600})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            page.wait_for_function("document.querySelectorAll('.peer').length >= 4", timeout=60_000)
            page.wait_for_function(
                "Number(document.getElementById('chart-loss').dataset.points || 0) >= 3", timeout=120_000
            )
            page.wait_for_selector(row, timeout=60_000)
            page.wait_for_selector(f".peer[data-peer-id='{offender}'][data-health='banned']", timeout=30_000)
            if merges:
                page.wait_for_selector('#merges tr[data-described="true"]', timeout=120_000)
                page.wait_for_function(  # the syncer's held-out evaluation of the global model
                    "document.getElementById('summary-eval').textContent.includes('perplexity')",
                    timeout=120_000,
                )
            scores: list[str] = []
            if learner is not None:
                weighed = f'#scores tr[data-peer-id="{learner}"] td:nth-child(4)'
                page.wait_for_function(  # its share of a merge, from the syncer's /api/status
                    f"(document.querySelector('{weighed}') || {{}}).textContent > '-'", timeout=120_000
                )
                scores = page.locator(f'#scores tr[data-peer-id="{learner}"] td').all_inner_texts()
            page.locator(f"{row} details").first.click()  # open the evidence
            page.screenshot(path=str(screenshot), full_page=True)
            shown = {
                "roles": set(page.locator(".peer").evaluate_all("els => els.map(e => e.dataset.role)")),
                "modes": set(page.locator(".peer").evaluate_all("els => els.map(e => e.dataset.mode)")),
                "ban": page.locator(row).inner_text(),
                "evidence": page.locator(f"{row} pre").first.inner_text().strip(),
                "bans": int(page.locator("#summary-bans").inner_text()),
                "scores": scores,
                "eval": page.locator("#summary-eval").inner_text(),
                "merges": page.locator("#merges tbody tr[data-fragment]").evaluate_all(
                    """rows => rows.map(r => ({described: r.dataset.described,
                        quorum: r.querySelector('.quorum').textContent,
                        weights: r.querySelector('.weights').textContent}))"""
                ),
            }
            assert not errors, errors
        finally:
            browser.close()
    assert {"bootstrap", "syncer", "stage", "verifier"} <= shown["roles"]
    assert shown["modes"] == {"direct"}  # every demo peer is on loopback: nobody needs a relay
    assert shown["bans"] >= 1
    assert offender[-8:] in shown["ban"] and "B evidence" in shown["ban"]
    assert len(shown["evidence"]) > 16 and all(c in "0123456789abcdef" for c in shown["evidence"])
    return shown


def test_dashboard_shows_peers_loss_and_a_ban(demo_swarm) -> None:
    _demo, url, out = demo_swarm
    offender = _publish_a_ban(url, out)
    swarm = get_json(url + "api/swarm", 10.0)
    learner = next(p["peer_id"] for p in swarm["peers"] if p["role"] == "learner")
    shown = _check_page(url, offender, ARTIFACTS / "dashboard.png", merges=True, learner=learner)
    assert "gradient flagged" in shown["ban"]
    # the learner's row of the syncer's scores: short id, factor, slope, merge weight, trust, rejected, verdict
    short, _factor, _slope, weight, _trust, rejected, verdict = shown["scores"]
    assert short == learner[-8:] and 0.0 < float(weight) <= 1.0 and rejected.isdigit(), shown["scores"]
    assert verdict == "no" or verdict.startswith(("no; last refusal", "banned: ")), verdict
    syncers = [s["peer_id"] for s in get_json(url + "api/swarm", 10.0)["syncer"] if s["state"] == "active"]
    assert get_json(url + "api/swarm", 10.0)["scores"]["syncer"] in syncers
    held_out = re.search(r"held-out ([\d.,]+) · perplexity ([\d.,]+)", shown["eval"])
    assert held_out, shown["eval"]
    loss, perplexity = (float(g.replace(",", "")) for g in held_out.groups())
    assert perplexity == pytest.approx(math.exp(loss), rel=0.01)  # both rounded for display
    assert shown["evidence"].startswith(bytes(range(64)).hex()[:32])
    # every merge row says its quorum and weights, or why it cannot: never a bare "-"
    rows = shown["merges"]
    assert rows and all(r["quorum"] not in ("", "-") and r["weights"] not in ("", "-") for r in rows), rows
    described = [r for r in rows if r["described"] == "true"]
    assert described and all(r["quorum"].isdigit() for r in described), rows
    assert all(
        r["weights"] == "none (nothing merged)" or re.search(r"\w{8} \d", r["weights"]) for r in described
    )
    assert all("syncer" in r["weights"] or "merges" in r["weights"] for r in rows if r["described"] != "true")
    shutil.copy(ARTIFACTS / "dashboard.png", out / "dashboard.png")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dashboard_shows_the_attackers_ban(tmp_path: Path) -> None:
    """End to end: one stage replica attacks, the verifier bans it, the page shows the ban and its evidence."""
    if not _has_attack_option():
        pytest.skip("this version has no stage attack option (HIVENODE_UNSAFE_ATTACK)")
    # 3 replicas: the demo refuses --attack with fewer (the ban cap never leaves a stage below 2 replicas)
    args = ("--learners", "1", "--stages", "2", "--replicas", "3", "--attack", ATTACK_KIND)
    with running_demo(tmp_path, *args) as (_demo, url, out):
        attacker = NodeIdentity.load(out / "state" / "stage0r3" / "identity.key").peer_id
        doc = wait_until(
            lambda: _swarm_with(url, lambda d: d["bans"]), BAN_WAIT_S, what="a ban by the verifier"
        )
        banned = [b["offender"] for b in doc["bans"]]
        assert banned == [attacker], f"the verifier banned {banned}; the attacker is {attacker}"
        _check_page(url, attacker, ARTIFACTS / "dashboard-attack.png")


def test_operator_views_of_the_same_swarm(demo_swarm, tmp_path: Path) -> None:
    """/metrics of the bootstrap and of every role, and `python -m node status URL`, on the live swarm."""
    from tests.integration.procs import get_text, run_cli

    _demo, url, _out = demo_swarm
    bootstrap_metrics = get_text(url + "metrics")
    for name in (
        "hivenode_swarm_peers",
        "hivenode_swarm_tokens",
        "hivenode_swarm_merges",
        "hivenode_swarm_bans",
    ):
        assert f"\n{name}" in bootstrap_metrics, name
    peers = get_json(url + "api/swarm", 10.0)["peers"]
    expected = {"learner": "hivenode_tokens", "syncer": "hivenode_merges", "stage": "hivenode_inner_step"}
    for role, gauge in expected.items():
        peer = next(p for p in peers if p["role"] == role)

        def exported(peer: dict = peer, gauge: str = gauge) -> bool:
            return f"\n{gauge} " in get_text(f"http://{peer['http']}/metrics")

        wait_until(exported, 30, what=f"{gauge} on the {role}'s /metrics")
    result = run_cli("node", "status", url, root=tmp_path, timeout_s=60)
    assert result.returncode == 0, result.stderr
    assert "syncer record(s)" in result.stdout and "\nswarm: " in result.stdout
    syncer = next(p for p in peers if p["role"] == "syncer")
    assert f"{syncer['peer_id'][-8:]}  active" in result.stdout  # its lease record, with its versions


# ---- the peers' connectivity modes, from heartbeat records to the page (no swarm: the page's requests are routed) --

FAKE_ORIGIN = "http://dashboard.test"


def _modes_document() -> dict:
    """An /api/swarm document built as the bootstrap builds it: heartbeat bodies -> PeerRecord.to_json -> the
    swarm view's map. One peer per mode, one older node without a mode, and a bootstrap."""
    from node.status.swarm_view import SwarmHistory, ViewConfig
    from protocol.records import Heartbeat, PeerRecord

    now = 1_800_000_000.0
    heartbeats = {
        "12D3KooWDirect01": {"role": "learner", "mode": "direct"},
        "12D3KooWRelay002": {"role": "learner", "mode": "relay"},
        "12D3KooWClient03": {"role": "learner", "mode": "client"},
        "12D3KooWOlder004": {"role": "learner"},  # an older node: its heartbeat has no mode
        "12D3KooWBoot0005": {"role": "bootstrap", "mode": "direct"},
    }
    peers = [
        PeerRecord(
            peer_id=peer_id,
            heartbeat=Heartbeat.from_body(
                Heartbeat(sent_at=now, maddrs=(), **fields).to_body()
            ),  # the wire body
            expires_at=now + 4,
        ).to_json()
        for peer_id, fields in heartbeats.items()
    ]
    document = {
        "run_id": "r" * 16,
        "run_name": "modes",
        "owner": "12D3KooWOwner000",
        "settings": {"num_stages": 1, "heartbeat_period_s": 2.0},
        "time": now,
        "peers": peers,
        "bans": [],
        "syncer": [],
    }
    history = SwarmHistory(ViewConfig())
    history.observe(document, now)
    return {**document, "map": history.swarm_map(document), "history": history.history_json(), "events": []}


def _serve_routed(route, document: dict) -> None:
    """The bootstrap's routes for the page: `/`, `/static/...` from bootstrap/static/, `/api/swarm` -> document."""
    import json

    path = route.request.url[len(FAKE_ORIGIN) :].split("?", 1)[0]
    static = REPO_ROOT / "bootstrap" / "static"
    if path == "/api/swarm":
        route.fulfill(status=200, content_type="application/json", body=json.dumps(document))
    elif path == "/":
        route.fulfill(status=200, content_type="text/html", body=(static / "index.html").read_text())
    elif path.startswith("/static/") and (static / path[len("/static/") :]).is_file():
        kind = "text/css" if path.endswith(".css") else "text/javascript"
        route.fulfill(status=200, content_type=kind, body=(static / path[len("/static/") :]).read_text())
    else:
        route.fulfill(status=404, body="not found")


@contextlib.contextmanager
def routed_page(document: dict) -> Iterator[tuple[Any, list[str]]]:
    """A Chromium page of the dashboard served from `document` (`_serve_routed`, no swarm), and its page errors."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.route(f"{FAKE_ORIGIN}/**", lambda route: _serve_routed(route, document))
            page.goto(FAKE_ORIGIN + "/")
            yield page, errors
        finally:
            browser.close()


def test_the_map_shows_how_each_peer_is_reached() -> None:
    """Relayed, client-only and older (mode unknown) peers are told apart on the map and counted in the summary."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    with routed_page(_modes_document()) as (page, errors):
        page.wait_for_function("document.querySelectorAll('.peer').length === 5", timeout=30_000)
        tiles = page.locator(".peer").evaluate_all(
            "els => els.map(e => [e.dataset.peerId, e.dataset.mode, e.textContent, e.title])"
        )
        summary = page.locator("#summary-health").inner_text()
        assert not errors, errors
    shown = {peer_id[-8:]: (mode, text, title) for peer_id, mode, text, title in tiles}
    assert {k: v[0] for k, v in shown.items()} == {
        "Direct01": "direct",
        "Relay002": "relay",
        "Client03": "client",
        "Older004": "unknown",
        "Boot0005": "direct",
    }
    assert "learner · relay" in shown["Relay002"][1] and "relay's circuit" in shown["Relay002"][2]
    assert "learner · client" in shown["Client03"][1] and "serves nothing" in shown["Client03"][2]
    assert "learner · unknown" in shown["Older004"][1]
    assert "1 relay" in summary and "1 client" in summary and "1 unknown" in summary, summary
    assert "direct" not in summary, summary  # the usual case is not counted out loud


# ---- the syncer's scores per learner (issue 18, "visible"), from its status to the page (routed, no swarm) ----

# markup a peer could put where the page shows text: if the page ever parsed it, the image would set the flag
HOSTILE = '<img src=x onerror="window.__pwned=1">'
HONEST_LEARNER, HOSTILE_LEARNER = "12D3KooWDirect01", "12D3KooW" + HOSTILE


def _scores_document() -> dict:
    """The modes document with the `scores` section the bootstrap adds: a syncer status filled by the syncer's
    own learner ledger and `peer_scores` -> `learner_scores`. One learner, banned on its third refusal, has markup
    in its peer id and in the reason of its refusals."""
    from node.diloco.learner_ledger import LearnerLedger
    from node.status.learner_scores import learner_scores

    book = LearnerLedger(ban_after=2.5, forgive_half_life_s=600.0, ban_s=3600.0)
    for i in range(3):
        book.record(HOSTILE_LEARNER, "screen: loss", f"held-out loss up {HOSTILE}", f"d{i}", float(i))
    merges = [
        {
            "evidence": {HONEST_LEARNER: [0.0123, 0.3, 1.0], HOSTILE_LEARNER: [-0.5, None, 0.0]},
            "weights": {HONEST_LEARNER: 0.75, HOSTILE_LEARNER: 0.25},
        }
    ]
    return {**_modes_document(), "scores": learner_scores(syncer_status(book, merges, 10.0))}


def test_the_scores_table_shows_each_learners_scores_and_ban_with_markup_as_text() -> None:
    """Per learner: evidence factor, held-out slope, merge weight, trust, rejected count, ban and its reason. A
    peer id and a reason holding an <img onerror> are shown as text; control: the same string parsed as HTML
    (innerHTML) in the same page creates the image and runs its handler."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    with routed_page(_scores_document()) as (page, errors):
        page.wait_for_function(
            "document.querySelectorAll('#scores tr[data-peer-id]').length === 2", timeout=30_000
        )
        rows = page.locator("#scores tr[data-peer-id]").evaluate_all(
            """rows => rows.map(r => ({id: r.dataset.peerId, banned: r.dataset.banned, title: r.cells[0].title,
                cells: [...r.cells].map(c => c.textContent)}))"""
        )
        note = page.locator("#scores-note").inner_text()
        images = page.evaluate("document.querySelectorAll('img').length")
        pwned = page.evaluate("window.__pwned === undefined ? null : window.__pwned")
        # negative control: the same string set as HTML becomes an element and runs its handler
        page.evaluate(
            "s => { const d = document.createElement('div'); d.innerHTML = s; document.body.append(d); }",
            HOSTILE,
        )
        page.wait_for_function("window.__pwned === 1", timeout=10_000)
        control_images = page.evaluate("document.querySelectorAll('img').length")
        assert not errors, errors
    assert (images, pwned, control_images) == (0, None, 1)
    hostile, honest = rows  # the banned first
    assert hostile["id"] == hostile["title"] == HOSTILE_LEARNER and hostile["banned"] == "true"
    # factor, slope, weight, trust, rejected, ban and its reason: the markup shown as the characters it is
    assert hostile["cells"][1:6] == ["0.00", "-0.500", "0.250", "0.00", "3"], hostile["cells"]
    assert (
        hostile["cells"][6].startswith("banned: 3 refused contributions") and HOSTILE in hostile["cells"][6]
    )
    assert hostile["cells"][0] == HOSTILE_LEARNER[-8:]
    assert honest["id"] == HONEST_LEARNER and honest["banned"] == "false"
    assert honest["cells"] == ["Direct01", "1.00", "0.0123", "0.750", "1.00", "0", "no"], honest["cells"]
    assert SYNCER_ID[-8:] in note, note  # whose scores they are
