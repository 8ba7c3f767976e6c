"""The public entry points trust only what the run's owner signed (#19 item 6): which bootstraps a bootstrap URL may
send us to, and which discovery record stands for the run of the bootstrap we dialled. Each defence has its
negative control: the same input with the defence's condition lifted, where the attack visibly wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.swarm import pick_run
from node.swarm.targets import JoinPlan, read_swarm_document
from protocol.errors import JoinError, ManifestRejected, OwnerPinMismatch
from protocol.identity import NodeIdentity
from protocol.manifest import OwnerPins, RunManifest, SignedManifest, authorize, maddr_peer_id

OWNER, MALLORY, SECOND = NodeIdentity.generate(), NodeIdentity.generate(), NodeIdentity.generate()
GENUINE = SignedManifest.sign(RunManifest(), OWNER)
URL = "http://bootstrap.example:8000/api/swarm"


def maddr(identity: NodeIdentity, port: int = 4001) -> str:
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{identity.peer_id}"


def document(signed: SignedManifest | None, *maddrs: str) -> dict[str, object]:
    doc: dict[str, object] = {"bootstrap_maddrs": list(maddrs)}
    if signed is not None:
        doc["manifest"] = signed.to_b64()
    return doc


def test_maddr_peer_id() -> None:
    assert maddr_peer_id(maddr(OWNER)) == OWNER.peer_id
    assert maddr_peer_id("/ip4/1.2.3.4/tcp/1/p2p/A/p2p-circuit/p2p/B") == "B"
    assert maddr_peer_id("/ip4/1.2.3.4/tcp/1") is None


def test_a_bootstrap_url_sends_us_only_to_the_bootstraps_its_owner_signed(tmp_path: Path) -> None:
    # the attack: an unsigned listing that adds (or only has) a peer the owner never named
    signed, kept = read_swarm_document(URL, document(GENUINE, maddr(MALLORY), maddr(OWNER)), None)
    assert signed == GENUINE and kept == [maddr(OWNER)]
    with pytest.raises(JoinError, match="lists no bootstrap of the run it serves"):
        read_swarm_document(URL, document(GENUINE, maddr(MALLORY)), None)
    # negative control: the same listing is followed once the owner signs that peer in as a bootstrap
    vouched = SignedManifest.sign(authorize(RunManifest(), bootstraps=[MALLORY.peer_id]), OWNER)
    assert read_swarm_document(URL, document(vouched, maddr(MALLORY)), None)[1] == [maddr(MALLORY)]


def test_a_bootstrap_url_without_a_verified_manifest_or_against_the_pin_is_not_followed(
    tmp_path: Path,
) -> None:
    with pytest.raises(JoinError, match="serves no signed run manifest"):
        read_swarm_document(URL, document(None, maddr(OWNER)), None)
    tampered = SignedManifest(
        GENUINE.manifest_bytes.replace(b"default", b"evilrun"), OWNER.peer_id, GENUINE.signature
    )
    with pytest.raises(ManifestRejected):
        read_swarm_document(URL, document(tampered, maddr(OWNER)), None)
    # a pin file that names another owner for this run id (edited, or a forged run id): refused before any dial
    pins = OwnerPins(tmp_path / OwnerPins.FILENAME)
    pins.check_and_pin(GENUINE.run_id, MALLORY.peer_id, run_name="default")
    with pytest.raises(OwnerPinMismatch, match="trust forget"):
        read_swarm_document(URL, document(GENUINE, maddr(OWNER)), pins)
    # negative control: the same document with a pin that holds (or none) is followed
    fresh = OwnerPins(tmp_path / "fresh.json")
    assert read_swarm_document(URL, document(GENUINE, maddr(OWNER)), fresh)[0] == GENUINE


def test_another_runs_discovery_record_does_not_stand_in_for_the_bootstrap_we_dialled(tmp_path: Path) -> None:
    """Mallory publishes a discovery record of her own run in the same DHT; the volunteer once joined it, so it
    is pinned. Joining through the genuine bootstrap's multiaddr must give the genuine run."""
    mallorys = SignedManifest.sign(RunManifest(), MALLORY)
    pins = OwnerPins(tmp_path / OwnerPins.FILENAME)
    pins.check_and_pin(mallorys.run_id, MALLORY.peer_id, run_name="default")
    through_bootstrap = JoinPlan((maddr(OWNER),))
    chosen = pick_run([mallorys, GENUINE], run_id=None, pins=pins, entry_ids=through_bootstrap.entry_ids)
    assert chosen == GENUINE
    # a bootstrap whose DHT key is not the owner's vouches through the manifest's `bootstraps`
    second = SignedManifest.sign(authorize(RunManifest(), bootstraps=[SECOND.peer_id]), OWNER)
    assert (
        pick_run([mallorys, second], run_id=None, pins=pins, entry_ids=JoinPlan((maddr(SECOND),)).entry_ids)
        == second
    )
    # negative control: through a peer that vouches for no run (a plain DHT peer), the pinned record wins
    through_plain_peer = JoinPlan((maddr(NodeIdentity.generate()),))
    assert (
        pick_run([mallorys, GENUINE], run_id=None, pins=pins, entry_ids=through_plain_peer.entry_ids)
        == mallorys
    )
