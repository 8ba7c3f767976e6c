"""Run manifest: run.toml parsing, canonical bytes, the run id, owner signatures, authorization, and TOFU pins."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import msgpack
import pytest

from protocol.errors import ConfigError, ManifestRejected, OwnerPinMismatch
from protocol.identity import NodeIdentity
from protocol.manifest import (
    OwnerPins,
    RunManifest,
    SignedManifest,
    authorize,
    default_manifest,
    load_run_toml,
    parse_run_toml,
)

OWNER = NodeIdentity.generate()
SYNCER = NodeIdentity.generate().peer_id
VERIFIER = NodeIdentity.generate().peer_id

FULL_TOML = f"""
name = "tiny-wiki"
seed = 7
num_stages = 4
bans_required = 2
heartbeat_period_s = 5
authorized_syncers = ["{SYNCER}"]
authorized_verifiers = ["{VERIFIER}"]

[model]
preset = "llama-20m"
family = "qwen2"
vocab_size = 256
context_len = 64
num_layers = 8
width = 96
num_heads = 4
mlp_width = 192

[inner]
lr = 3e-4
batch_size = 8
weight_decay = 0

[diloco]
min_quorum = 2
sync_every_steps = 50
num_fragments = 3
overlap_steps = 1
grace_gamma = 0.5
grace_tau = 2
outer_lr = 0.5
outer_momentum = 0.8
min_sync_interval_s = 1.5

[sentinel]
fence_k = 3.0
window_checks = 64

[sentinel.ledger]
ban_flags = 4

[data]
source = "corpus/"
validation_fraction = 0.05

[wire]
max_batch = 32
"""


def test_built_in_default_run_needs_no_file_and_has_the_documented_defaults() -> None:
    m = default_manifest()
    model = {
        key: m.model[key]
        for key in ("family", "vocab_size", "context_len", "num_layers", "width", "num_heads")
    }
    assert model == {
        "family": "llama",
        "vocab_size": 256,
        "context_len": 128,
        "num_layers": 4,
        "width": 128,
        "num_heads": 4,
    }
    assert (m.model["preset"], m.model["num_kv_heads"], m.model["mlp_width"]) == ("llama-tiny", 4, 352)
    assert (m.diloco.min_quorum, m.diloco.grace_gamma, m.diloco.grace_tau) == (1, 0.8, 2.0)
    assert (m.diloco.outer_lr, m.diloco.outer_momentum) == (0.7, 0.9)
    assert m.bans_required == 0 and m.data["source"] == "builtin" and m.heartbeat_period_s == 2.0
    assert m.ban_quorum == 1  # auto, and no verifier: one signature (of a syncer's learner ban) is enough


def test_full_run_toml_parses_with_ints_accepted_where_floats_are_meant() -> None:
    m = parse_run_toml(FULL_TOML)
    assert (m.name, m.seed, m.num_stages, m.bans_required) == ("tiny-wiki", 7, 4, 2)
    assert m.heartbeat_period_s == 5.0 and isinstance(m.heartbeat_period_s, float)
    assert m.inner.weight_decay == 0.0 and isinstance(m.inner.weight_decay, float)
    assert m.diloco.grace_tau == 2.0 and m.diloco.num_fragments == 3
    assert m.sentinel == {"fence_k": 3.0, "window_checks": 64, "ledger": {"ban_flags": 4}}
    assert m.authorized_syncers == (SYNCER,) and m.authorized_verifiers == (VERIFIER,)
    # the preset's fields under the explicit ones, resolved into what the owner signs
    assert (m.model["family"], m.model["num_layers"], m.model["mlp_width"]) == ("qwen2", 8, 192)
    assert (m.model["rope_theta"], m.model["num_kv_heads"]) == (10000.0, 4)
    assert RunManifest.from_canonical_bytes(m.to_canonical_bytes()) == m


def test_wire_cap_is_the_largest_tensor_a_peer_may_send() -> None:
    m = parse_run_toml(FULL_TOML)
    boundary = 32 * 64 * 96 * 4  # max_batch x context x width x float32
    largest_param = max(256 * 96, 64 * 96, 3 * 96 * 96, 192 * 96) * 4
    assert m.max_tensor_bytes == max(boundary, largest_param) == boundary


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('name = "x"\ncolour = 1', "unknown settings ['colour']"),
        ("[inner]\nlr = 1e-3\nmomentum = 0.9", "unknown [inner] settings ['momentum']"),
        (
            "[model]\nvocab_size = 256\ncontext_len = 8\nnum_layers = 2\nwidth = 30\nnum_heads = 4",
            "divisible",
        ),
        ("[model]\nvocab_size = 512\ncontext_len = 8\nnum_layers = 2\nwidth = 32\nnum_heads = 4", "256"),
        ('[model]\npreset = "llama-7b"', "model.preset must be one of"),
        ('[model]\nfamily = "mamba"', "model.family must be one of"),
        ("[model]\nmlp_ratio = 4", "unknown model keys ['mlp_ratio']"),
        ("num_stages = 9", "num_stages cannot exceed"),
        ('seed = "7"', "seed"),
        ("bans_required = -1", "bans_required"),
        ("[inner]\nlr = true", "inner.lr"),
        ('authorized_syncers = ["QmNotAnEd25519Key"]', "authorized_syncers"),
        ("heartbeat_period_s = 0.01", "heartbeat_period_s"),
        ("[diloco]\nouter_momentum = 1.0", "outer_momentum"),
        ("name = ", "not valid TOML"),
        ("[sentinel.ledger]\nban = [1]", "sentinel.ledger.ban must be a string"),
        ("[sentinel.ledger.deeper]\nban = 1", "sentinel.ledger.deeper must be a string"),
    ],
)
def test_bad_run_toml_is_a_one_line_config_error(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_run_toml(text)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_unreadable_run_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read run file"):
        load_run_toml(tmp_path / "missing.toml")
    (tmp_path / "run.toml").write_text(FULL_TOML)
    assert load_run_toml(tmp_path / "run.toml").name == "tiny-wiki"


def test_run_id_commits_to_owner_and_the_identity_but_not_to_operational_settings() -> None:
    m = default_manifest()
    signed = SignedManifest.sign(m, OWNER)
    assert signed.run_id == SignedManifest.sign(m, OWNER).run_id  # deterministic, no timestamps
    assert len(signed.run_id) == 40
    assert SignedManifest.sign(m, NodeIdentity.generate()).run_id != signed.run_id
    identity_changes = [
        dataclasses.replace(m, seed=1),
        dataclasses.replace(m, name="other"),
        dataclasses.replace(m, model={**m.model, "width": 64}),
        dataclasses.replace(m, num_stages=1),
        dataclasses.replace(m, data={"source": "files", "path": "/corpus"}),
        dataclasses.replace(m, diloco=dataclasses.replace(m.diloco, num_fragments=2)),
    ]
    for changed in identity_changes:
        assert SignedManifest.sign(changed, OWNER).run_id != signed.run_id, changed.identity()
    operational_changes = [
        dataclasses.replace(m, revision=3),
        dataclasses.replace(m, inner=dataclasses.replace(m.inner, lr=3e-4)),
        dataclasses.replace(m, diloco=dataclasses.replace(m.diloco, min_quorum=2, min_sync_interval_s=1.0)),
        dataclasses.replace(m, heartbeat_period_s=5.0, bans_required=2),
        authorize(m, syncers=[SYNCER], verifiers=[VERIFIER]),
        dataclasses.replace(m, sentinel={"warmup": 10}),
    ]
    for changed in operational_changes:
        resigned = SignedManifest.sign(changed, OWNER)
        assert resigned.manifest_bytes != signed.manifest_bytes  # a different signed document...
        assert resigned.run_id == signed.run_id  # ...of the same run: checkpoints and pins carry over


def test_revision_is_checked_and_a_garbled_manifest_has_no_run_id() -> None:
    with pytest.raises(ConfigError, match="revision"):
        parse_run_toml("revision = -1")
    assert parse_run_toml("revision = 4").revision == 4
    garbled = SignedManifest(b"\x93garbage", OWNER.peer_id, b"\x00" * 64)
    with pytest.raises(ManifestRejected, match="invalid"):
        _ = garbled.run_id


def test_authorize_adds_peers_sorted_so_the_run_id_ignores_flag_order() -> None:
    a, b = sorted([SYNCER, VERIFIER])
    m1 = authorize(default_manifest(), syncers=[b, a])
    m2 = authorize(authorize(default_manifest(), syncers=[a]), syncers=[b, a])
    assert m1.authorized_syncers == (a, b) == m2.authorized_syncers
    assert m1.to_canonical_bytes() == m2.to_canonical_bytes()
    with pytest.raises(ConfigError, match="cannot authorize"):
        authorize(default_manifest(), verifiers=["not-a-peer"])


def test_signature_verifies_and_survives_the_wire_and_base64() -> None:
    signed = SignedManifest.sign(parse_run_toml(FULL_TOML), OWNER)
    assert signed.verify().name == "tiny-wiki"
    assert SignedManifest.from_wire(signed.to_wire()) == signed
    assert SignedManifest.from_b64(signed.to_b64()) == signed


def test_tampered_or_resigned_manifests_are_rejected() -> None:
    signed = SignedManifest.sign(default_manifest(), OWNER)
    tampered = dataclasses.replace(
        signed, manifest_bytes=signed.manifest_bytes.replace(b"default", b"evilrun")
    )
    with pytest.raises(ManifestRejected, match="tampered"):
        tampered.verify()
    impostor = dataclasses.replace(signed, owner=NodeIdentity.generate().peer_id)
    with pytest.raises(ManifestRejected, match="not signed by its claimed owner"):
        impostor.verify()
    with pytest.raises(ManifestRejected, match="not usable"):
        dataclasses.replace(signed, owner="QmRsaPeer").verify()


def test_non_canonical_bytes_are_rejected_even_when_signed() -> None:
    data = msgpack.unpackb(default_manifest().to_canonical_bytes())
    reordered = msgpack.packb({"run": data["run"], "format": 1})  # same content, other key order
    signed = SignedManifest(reordered, OWNER.peer_id, OWNER.sign(b"hivenode-manifest-v1\x00" + reordered))
    with pytest.raises(ManifestRejected, match="not canonical"):
        signed.verify()


@pytest.mark.parametrize("garbage", ["", "!!!", "aGVsbG8=", None, "A" * 100_000])
def test_garbage_base64_manifests_are_rejected(garbage: object) -> None:
    with pytest.raises(ManifestRejected):
        SignedManifest.from_b64(garbage)


def test_owner_is_pinned_on_first_use_and_a_new_owner_is_refused(tmp_path: Path) -> None:
    pins = OwnerPins(tmp_path / "state" / OwnerPins.FILENAME)
    run_a, run_b = "a" * 40, "b" * 40
    assert pins.check_and_pin(run_a, OWNER.peer_id, run_name="default") is True
    assert pins.check_and_pin(run_a, OWNER.peer_id, run_name="default") is False
    assert pins.check_and_pin(run_b, SYNCER, run_name="default") is True  # pins are per run id, not name
    with pytest.raises(OwnerPinMismatch) as info:
        pins.check_and_pin(run_a, VERIFIER, run_name="default")
    assert OWNER.peer_id in str(info.value) and VERIFIER in str(info.value) and "\n" not in str(info.value)
    assert f"trust forget {run_a}" in str(info.value)
    assert (tmp_path / "state" / OwnerPins.FILENAME).stat().st_mode & 0o777 == 0o600
    assert json.loads(pins.path.read_text())["pins"][run_a]["owner"] == OWNER.peer_id


def test_a_corrupt_pin_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / OwnerPins.FILENAME
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="pinned owners"):
        OwnerPins(path).pinned("a" * 40)


def test_inner_schedule_warms_up_then_decays_by_cosine_to_the_floor() -> None:
    inner = parse_run_toml(
        "[inner]\nlr = 1e-3\nwarmup_steps = 10\ndecay_steps = 100\nmin_lr_ratio = 0.1\nclip_norm = 1\n"
        "accumulation = 4\n"
    ).inner
    assert (inner.clip_norm, inner.accumulation) == (1.0, 4)
    assert inner.lr_at(1) == pytest.approx(1e-4) and inner.lr_at(10) == pytest.approx(1e-3)
    assert inner.lr_at(60) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # halfway through the decay
    assert inner.lr_at(110) == pytest.approx(1e-4) and inner.lr_at(10_000) == pytest.approx(1e-4)
    lrs = [inner.lr_at(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    plain = default_manifest().inner  # the defaults keep the constant rate every calibrated test used
    assert {plain.lr_at(s) for s in (1, 50, 10_000)} == {plain.lr}
    assert (plain.clip_norm, plain.accumulation) == (0.0, 1)
    with pytest.raises(ConfigError, match="accumulation"):
        parse_run_toml("[inner]\naccumulation = 0")


def test_bans_required_auto_needs_two_verifiers_once_two_are_authorized() -> None:
    """Issue 18 item 4: with bans_required = 0 (the default) one verifier bans alone only while it is the
    run's only one; from two authorized verifiers on, a ban takes two signatures. An explicit value wins."""
    keys = [NodeIdentity.generate().peer_id for _ in range(3)]
    assert RunManifest(authorized_verifiers=tuple(keys[:1])).ban_quorum == 1
    assert RunManifest(authorized_verifiers=tuple(keys[:2])).ban_quorum == 2
    assert RunManifest(authorized_verifiers=tuple(keys)).ban_quorum == 2
    assert RunManifest(authorized_verifiers=tuple(keys), bans_required=3).ban_quorum == 3
    assert RunManifest(authorized_verifiers=tuple(keys), bans_required=1).ban_quorum == 1
