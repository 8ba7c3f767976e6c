"""The leaderboard page in a real browser (headless Chromium via playwright, as tests/integration/test_dashboard.py):
a bootstrap whose ledger holds three peers shows them ranked by verified tokens, re-sorts on a header click,
links the CSV export, and shows the pushes the syncer refused at admission by reason. The ledger is filled through `ContributionLedger` between two starts of the same bootstrap
(same keys, same run id), the way a restarted bootstrap finds its own file."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from bootstrap.ledger import LEDGER_FILENAME, ContributionLedger
from tests.integration.procs import get_text, procs
from tests.integration.test_dashboard import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, _skip_reason

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PEERS = {"12D3KooWAlice111": 4096, "12D3KooWBob22222": 512, "12D3KooWCarol333": 0}


def fill(ledger: ContributionLedger) -> None:
    start = time.time() - 60
    for version, (peer, tokens) in enumerate(PEERS.items(), start=1):
        ledger.observe_peers([(peer, "learner")], start, 2.0)
        ledger.observe_peers([(peer, "learner")], start + version, 2.0)
        merge = {"fragment": 0, "version": version, "t": start + version, "participants": [], "rejected": {}}
        if tokens:
            merge |= {"participants": [peer], "contributed": {peer: [[8, tokens, 0.1, 0]]}}
        else:
            merge |= {"rejected": {peer: "stale by 4 versions"}}
        ledger.record_merges([merge], start + 10)
    # two syncer processes refused pushes at admission; the first one's status is read twice (counted once)
    for since, counts in (
        (start, {"no_proof": 3}),
        (start, {"no_proof": 5}),
        (start + 30, {"weak_proof": 2}),
    ):
        status = {
            "peer_id": "12D3KooWSyncer",
            "admission": {"counted_since": since, "refused_by_reason": counts},
        }
        ledger.record_admission(status, start + 40)


def test_the_leaderboard_page_ranks_sorts_and_exports(tmp_path: Path) -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with procs(tmp_path) as group:
        first = group.start_bootstrap(state="bootstrap")
        run_id = first.swarm()["run_id"]
        first.signal(signal.SIGTERM)
        assert first.wait_exit(30) == 0
        ledger = ContributionLedger(tmp_path / "bootstrap" / LEDGER_FILENAME, run_id)
        fill(ledger)
        ledger.close()
        bootstrap = group.start_bootstrap(state="bootstrap")
        assert bootstrap.swarm()["run_id"] == run_id
        csv_text = get_text(bootstrap.http_url + "/api/leaderboard.csv")
        assert [line.split(",")[0] for line in csv_text.splitlines()[1:]] == list(PEERS)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1200, "height": 600})
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(bootstrap.http_url + "/leaderboard")
                page.wait_for_function("document.querySelectorAll('#leaderboard tbody tr').length === 3")
                order = "els => els.map(e => e.dataset.peerId)"
                assert page.locator("#leaderboard tbody tr").evaluate_all(order) == list(PEERS)
                carol = page.locator('#leaderboard tr[data-peer-id="12D3KooWCarol333"]').inner_text()
                assert "stale by 4 versions" in carol
                page.click('#leaderboard th[data-key="rejected"]')  # the most rejected first
                assert page.locator("#leaderboard tbody tr").evaluate_all(order)[0] == "12D3KooWCarol333"
                page.click('#leaderboard th[data-key="verified_tokens"]')
                page.click('#leaderboard th[data-key="verified_tokens"]')  # again: ascending
                assert page.locator("#leaderboard tbody tr").evaluate_all(order) == list(PEERS)[::-1]
                assert page.get_attribute("#csv", "href") == "/api/leaderboard.csv"
                page.wait_for_function("document.getElementById('admission').dataset.total === '7'")
                admission = page.locator("#admission").inner_text()
                assert "no proof-of-work 5" in admission and "proof too weak 2" in admission, admission
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "leaderboard.png"), full_page=True)
                assert not errors, errors
            finally:
                browser.close()
