"""Owner pins per run id (issue #19 item 2): a new run under a known name is trusted and said out loud, a changed
owner for the same run id is refused with the fix, old name-keyed files are read, writes are atomic, and
`python -m node trust list|forget` (in process here; as subprocesses in tests/integration/test_trust_cli.py)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from node.__main__ import main
from protocol.errors import ConfigError, OwnerPinMismatch
from protocol.identity import NodeIdentity
from protocol.manifest import OwnerPins, RunManifest, SignedManifest

OWNER_A, OWNER_B = NodeIdentity.generate(), NodeIdentity.generate()
FIRST_SEEN = 1_780_000_000.0  # 2026-05-28 20:26:40 UTC


def default_runs() -> tuple[SignedManifest, SignedManifest]:
    """Two unrelated swarms with every default: both runs are named "default", their owners differ."""
    return SignedManifest.sign(RunManifest(), OWNER_A), SignedManifest.sign(RunManifest(), OWNER_B)


def pin(pins: OwnerPins, signed: SignedManifest) -> bool:
    return pins.check_and_pin(signed.run_id, signed.owner, run_name=signed.verify().name, now=FIRST_SEEN)


class NamePins:
    """The old behaviour, kept here as the negative control: one owner per run *name*."""

    def __init__(self) -> None:
        self.owners: dict[str, str] = {}

    def check_and_pin(self, name: str, owner: str) -> None:
        if self.owners.setdefault(name, owner) != owner:
            raise OwnerPinMismatch(f"run {name!r} is pinned to owner {self.owners[name]}")


def test_a_second_default_swarm_is_refused_by_name_pins_but_trusted_by_run_id_pins(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = default_runs()
    assert first.run_id != second.run_id  # the run id commits to the owner key
    old = NamePins()
    old.check_and_pin("default", first.owner)
    with pytest.raises(OwnerPinMismatch):  # control: what volunteers hit before
        old.check_and_pin("default", second.owner)
    pins = OwnerPins(tmp_path / OwnerPins.FILENAME)
    assert pin(pins, first) is True
    with caplog.at_level(logging.INFO, logger="protocol.manifest"):
        assert pin(pins, second) is True
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "'default'" in warning and OWNER_A.peer_id[-8:] in warning and OWNER_B.peer_id[-8:] in warning
    assert {(p.run_id, p.owner) for p in pins.pins()} == {
        (first.run_id, first.owner),
        (second.run_id, second.owner),
    }
    assert pin(pins, second) is False  # rejoining is quiet and changes nothing


def test_a_changed_owner_for_the_same_run_id_is_refused_with_the_fix(tmp_path: Path) -> None:
    first, second = default_runs()
    pins = OwnerPins(tmp_path / "state" / OwnerPins.FILENAME)
    pin(pins, first)
    before = pins.path.read_bytes()
    with pytest.raises(OwnerPinMismatch) as info:
        pins.check_and_pin(first.run_id, second.owner, run_name="default")
    message = str(info.value)
    for fragment in (first.run_id, first.owner, second.owner, f"python -m node trust forget {first.run_id}"):
        assert fragment in message, message
    assert str(tmp_path / "state") in message and "\n" not in message
    assert pins.path.read_bytes() == before  # a refusal writes nothing
    assert pins.forget(first.run_id) is not None
    assert pins.check_and_pin(first.run_id, second.owner, run_name="default") is True  # forgotten: re-pinned


def test_pins_survive_a_reload_with_name_owner_and_first_seen(tmp_path: Path) -> None:
    first, _ = default_runs()
    path = tmp_path / OwnerPins.FILENAME
    pin(OwnerPins(path), first)
    (loaded,) = OwnerPins(path).pins()
    assert (loaded.run_id, loaded.owner, loaded.run_name, loaded.first_seen) == (
        first.run_id,
        first.owner,
        "default",
        FIRST_SEEN,
    )
    assert json.loads(path.read_text())["format"] == OwnerPins.FORMAT


def test_an_old_name_keyed_file_is_read_ignored_with_a_warning_and_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, _ = default_runs()
    path = tmp_path / OwnerPins.FILENAME
    path.write_text(json.dumps({"runs": {"default": OWNER_B.peer_id}}))
    pins = OwnerPins(path)
    with caplog.at_level(logging.WARNING, logger="protocol.manifest"):
        assert pins.pinned(first.run_id) is None
        assert pins.pins() == []
    warnings = [r.getMessage() for r in caplog.records if "name-keyed" in r.getMessage()]
    assert len(warnings) == 1 and "'default'" in warnings[0]  # once per store, not once per lookup
    assert pins.legacy == {"default": OWNER_B.peer_id}
    assert pin(pins, first) is True  # the owner it named is not enforced: it names no run id
    assert set(json.loads(path.read_text())) == {"format", "pins"} and pins.legacy == {}


@pytest.mark.parametrize(
    "document",
    [
        [],
        {"format": 2, "pins": []},
        {"format": 3, "pins": {}},
        {"format": 2, "pins": {"not-a-run-id": {"owner": "x", "run_name": "d", "first_seen": 1.0}}},
        {"format": 2, "pins": {"a" * 40: {"owner": "x", "run_name": "d"}}},
        {"runs": {"default": 7}},
    ],
)
def test_a_malformed_pin_file_is_a_clear_error(tmp_path: Path, document: object) -> None:
    path = tmp_path / OwnerPins.FILENAME
    path.write_text(json.dumps(document))
    with pytest.raises(ConfigError, match="malformed.*delete it to re-pin"):
        OwnerPins(path).pins()


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = default_runs()
    pins = OwnerPins(tmp_path / OwnerPins.FILENAME)
    pin(pins, first)
    before = pins.path.read_bytes()

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        pin(pins, second)
    assert pins.path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [OwnerPins.FILENAME]


def test_trust_list_and_forget_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = default_runs()
    pins = OwnerPins(tmp_path / OwnerPins.FILENAME)
    pin(pins, first)
    pin(pins, second)
    assert main(["trust", "list", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for fragment in (first.run_id, second.run_id, OWNER_A.peer_id[-8:], "default", "2026-05-28 20:26:40 UTC"):
        assert fragment in out, out
    assert main(["trust", "forget", first.run_id, "--state-dir", str(tmp_path)]) == 0
    assert f"forgot run {first.run_id}" in capsys.readouterr().out
    assert [p.run_id for p in OwnerPins(pins.path).pins()] == [second.run_id]
    assert main(["trust", "forget", first.run_id, "--state-dir", str(tmp_path)]) == 2
    assert "no pin for run id" in capsys.readouterr().err


def test_trust_is_in_the_help_text() -> None:
    from node.config import build_run_parser

    assert "trust" in build_run_parser().format_help()
