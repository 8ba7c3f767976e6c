"""The signed run manifest: what a run trains and who is trusted in it.

`run.toml` (or the built-in default run) parses to a `RunManifest`. Its canonical bytes (msgpack, sorted keys,
no timestamps) are signed by the owner key into a `SignedManifest`. The manifest has two parts: the run's
identity (`IDENTITY_KEYS`: name, seed, model, the stage cut, the fragment count, the data spec: what names its
checkpoints and fixes their layout) and operational settings (optimiser, quorum, timeouts, limits, trusted
peers, codecs, SENTINEL). The `run_id` is a hash of the owner key and the identity alone, so an owner may change
operational settings (raising `revision`) without orphaning a checkpoint, a pin or a peer's state. Nodes verify
the signature and pin the owner key per run id on first use (`OwnerPins`, in `<state-dir>/trusted_owners.json`).

Authorized syncers and verifiers are listed by peer id; an owner adds them in `run.toml` or with
`python -m bootstrap --authorize-syncer PEER_ID --authorize-verifier PEER_ID` (see `authorize`).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgpack
from cryptography.hazmat.primitives import serialization

from protocol.admission import AdmissionSpec
from protocol.boundary_codec import BoundaryCodecSpec
from protocol.compress import CodecSpec
from protocol.errors import ConfigError, IdentityError, ManifestRejected, OwnerPinMismatch
from protocol.identity import NodeIdentity, public_key_from_peer_id, verify_signature
from protocol.keys import RUN_ID_HEX_CHARS, is_run_id
from protocol.model_spec import BYTE_VOCAB, largest_param_elements, resolve_model

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - pyproject pulls tomli on 3.10
    import tomli as tomllib

logger = logging.getLogger(__name__)
FORMAT_VERSION = 1
DEFAULT_RUN_NAME = "default"
MAX_MANIFEST_BYTES = 16 * 1024
_SIGN_DOMAIN = b"hivenode-manifest-v1\x00"
_RUN_ID_DOMAIN = b"hivenode-run-id-v2\x00"  # v2: the hash covers the identity part only
# The top-level settings that make the run's identity (plus diloco.num_fragments, which fixes the checkpoint's
# version vector); every other setting is operational and may change under the same run id.
SHARDS_SOURCE = "shards"  # data.source of a run trained on prepared token shards (node.ml.shards)
IDENTITY_KEYS = ("name", "seed", "model", "num_stages", "data", "tokenizer")
_FLOAT32_BYTES = 4
_INT64_BYTES = 8
Scalar = str | int | float | bool


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class InnerOptimizerSpec:
    """AdamW on each learner/stage; every peer of a run uses the same values."""

    lr: float = 1e-3  # peak learning rate
    batch_size: int = 16  # sequences per inner step (per accumulated batch on a learner)
    weight_decay: float = 0.1
    warmup_steps: int = 0  # inner steps of linear warmup from 0 to lr (0: none)
    decay_steps: int = 0  # inner steps of cosine decay after warmup, down to min_lr_ratio x lr (0: constant)
    min_lr_ratio: float = 0.1  # the floor of the cosine decay, as a fraction of lr
    clip_norm: float = 0.0  # gradient norm clipping (a stage clips its own span's norm); 0: off
    accumulation: int = 1  # batches whose gradients a learner sums into one inner step

    def __post_init__(self) -> None:
        _require(_is_real(self.lr) and self.lr > 0, f"inner.lr must be a positive float, got {self.lr!r}")
        _require(_is_int(self.batch_size) and self.batch_size >= 1, "inner.batch_size must be an int >= 1")
        _require(_is_real(self.weight_decay) and self.weight_decay >= 0, "inner.weight_decay must be >= 0")
        for name in ("warmup_steps", "decay_steps"):
            _require(
                _is_int(getattr(self, name)) and getattr(self, name) >= 0, f"inner.{name} must be an int >= 0"
            )
        _require(
            _is_int(self.accumulation) and self.accumulation >= 1, "inner.accumulation must be an int >= 1"
        )
        _require(_is_real(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1, "inner.min_lr_ratio in [0, 1]")
        _require(_is_real(self.clip_norm) and self.clip_norm >= 0, "inner.clip_norm must be a float >= 0")

    def lr_at(self, step: int) -> float:
        """The learning rate of inner step `step` (1-based): linear warmup, then cosine decay to the floor."""
        if self.warmup_steps and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if not self.decay_steps:
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        floor = self.min_lr_ratio * self.lr
        return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


DILOCO_MODES = ("decoupled", "sync", "elastic_sync")


@dataclass(frozen=True, kw_only=True, slots=True)
class DilocoSpec:
    """Decoupled DiLoCo settings (DESIGN.md, "Decoupled DiLoCo: our reading")."""

    min_quorum: int = 1  # K: contributions before a fragment may merge
    sync_every_steps: int = 24  # H: inner steps between two syncs of one fragment
    num_fragments: int = 4  # P: parameter fragments, each due at its own offset
    overlap_steps: int = 2  # tau: steps a learner keeps training before applying a new version
    grace_gamma: float = 0.8  # grace window factor
    grace_tau: float = 2.0  # grace window, in step times
    outer_lr: float = 0.7  # outer Nesterov learning rate
    outer_momentum: float = 0.9  # outer Nesterov momentum
    min_sync_interval_s: float = 5.0  # floor on the real time between two syncs of one fragment
    # decoupled: K = min_quorum plus the grace window; sync: every one of sync_learners, learners wait for
    # their round (the synchronous DiLoCo baseline); elastic_sync: every learner alive per the DHT, learners wait
    mode: str = "decoupled"
    sync_learners: int = 4  # M, the learners mode "sync" waits for (dead ones included)

    def __post_init__(self) -> None:
        _require(self.mode in DILOCO_MODES, f"diloco.mode must be one of {DILOCO_MODES}, got {self.mode!r}")
        _require(
            _is_int(self.sync_learners) and self.sync_learners >= 1,
            "diloco.sync_learners must be an int >= 1",
        )
        for name in ("min_quorum", "sync_every_steps", "num_fragments"):
            _require(
                _is_int(getattr(self, name)) and getattr(self, name) >= 1,
                f"diloco.{name} must be an int >= 1",
            )
        _require(
            _is_int(self.overlap_steps) and self.overlap_steps >= 0,
            "diloco.overlap_steps must be an int >= 0",
        )
        for name in ("grace_gamma", "grace_tau", "outer_lr", "min_sync_interval_s"):
            _require(
                _is_real(getattr(self, name)) and getattr(self, name) >= 0,
                f"diloco.{name} must be a float >= 0",
            )
        _require(
            _is_real(self.outer_momentum) and 0 <= self.outer_momentum < 1, "diloco.outer_momentum in [0, 1)"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class WireSpec:
    """Inputs of the wire caps; the caps themselves are derived (`RunManifest.max_tensor_bytes`)."""

    max_batch: int = 64  # sequences in one pipeline microbatch, the most any boundary tensor may carry

    def __post_init__(self) -> None:
        _require(_is_int(self.max_batch) and self.max_batch >= 1, "wire.max_batch must be an int >= 1")


def _check_tokenizer(table: object) -> int:
    """The vocabulary size the `[tokenizer]` table implies (256 when empty: raw bytes)."""
    _require(isinstance(table, dict), "[tokenizer] must be a table")
    assert isinstance(table, dict)
    if not table:
        return BYTE_VOCAB
    _require(set(table) == {"sha256", "vocab_size"}, "[tokenizer] needs exactly sha256 and vocab_size")
    digest, vocab = table["sha256"], table["vocab_size"]
    _require(
        isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest),
        "tokenizer.sha256 must be 64 lowercase hex digits",
    )
    _require(
        _is_int(vocab) and BYTE_VOCAB < vocab <= 2**20, "tokenizer.vocab_size must be an int in (256, 2^20]"
    )
    return int(vocab)


def _check_scalar_table(name: str, table: Mapping[str, Any]) -> None:
    for key, value in table.items():
        _require(isinstance(key, str) and 0 < len(key) <= 64, f"{name} keys must be short strings")
        ok = isinstance(value, str | bool) or _is_int(value) or _is_real(value)
        _require(ok, f"{name}.{key} must be a string, int, float or bool, got {type(value).__name__}")


def _check_sentinel_table(table: Mapping[str, Any]) -> None:
    """Scalars, and sub-tables of scalars one level deep (which keys mean what is the verifier's business)."""
    scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
    _check_scalar_table("sentinel", scalars)
    for key, sub in table.items():
        if isinstance(sub, dict):
            _require(isinstance(key, str) and 0 < len(key) <= 64, "sentinel keys must be short strings")
            _check_scalar_table(f"sentinel.{key}", sub)


def _check_peer_ids(name: str, peer_ids: tuple[str, ...]) -> None:
    for peer_id in peer_ids:
        try:
            public_key_from_peer_id(peer_id)
        except IdentityError as e:
            raise ValueError(f"{name}: {e}") from None
    _require(len(set(peer_ids)) == len(peer_ids), f"{name} lists a peer twice")


def _default_model() -> dict[str, Any]:
    return {}  # the default preset, resolved in __post_init__ against the tokenizer's vocabulary


@dataclass(frozen=True, kw_only=True, slots=True)
class RunManifest:
    """Everything every peer of a run must agree on. Build with `parse_run_toml` or `default_manifest`."""

    name: str = DEFAULT_RUN_NAME  # human name, not an identity: owner keys are pinned per run id
    seed: int = 0  # model init and data sharding seed
    # protocol.model_spec: a preset and overrides, resolved here to the complete table the owner signs
    model: dict[str, Any] = field(default_factory=_default_model)
    num_stages: int = 2  # pipeline stages the layers are cut into
    inner: InnerOptimizerSpec = field(default_factory=InnerOptimizerSpec)
    diloco: DilocoSpec = field(default_factory=DilocoSpec)
    # how learners encode outer gradients (fragment deltas); the syncer decodes only this one. fp32: the
    # learner sends its parameters themselves, as before there were codecs (docs/diloco.md, "Compression")
    outer_codec: CodecSpec = field(default_factory=CodecSpec)
    # how stages and verifiers send boundary activations and gradients (protocol.boundary_codec): fp32 until a
    # run measures its loss with another (docs/pipeline.md, "Compressed boundaries")
    activation_codec: BoundaryCodecSpec = field(default_factory=BoundaryCodecSpec)
    # SENTINEL policy every verifier of the run applies (node.config.run_sentinel_config reads it): the monitor's
    # settings as scalars, the ledger's and the spot checks' as the sub-tables `ledger` and `spot`; empty = defaults
    sentinel: dict[str, Scalar | dict[str, Scalar]] = field(default_factory=dict)
    # distinct authorized verifier signatures before a ban takes effect; 0 = auto (`ban_quorum`): two once the run
    # authorizes two or more verifiers, so one verifier (compromised or wrong) can never ban alone
    bans_required: int = 0
    # corpus spec: {source = "builtin"}, a path, or {source = "shards", index_sha256 = ...}: token shards the
    # bootstrap serves (`--data-dir`), named by the sha256 of their index, so the run's identity names its tokens
    data: dict[str, Scalar] = field(default_factory=lambda: {"source": "builtin"})
    authorized_syncers: tuple[str, ...] = ()  # peer ids
    authorized_verifiers: tuple[str, ...] = ()  # peer ids
    # peer ids of the run's entry points besides the owner key (a bootstrap whose DHT key is not the owner's):
    # only these are listed as bootstraps (/api/swarm) and vouch for the run to a node that dials them
    bootstraps: tuple[str, ...] = ()
    wire: WireSpec = field(default_factory=WireSpec)
    heartbeat_period_s: float = 2.0  # how often each peer refreshes its heartbeat record
    revision: int = 0  # the owner raises it with each change of operational settings (same run id)
    # empty: raw bytes (vocabulary 256); else {sha256, vocab_size} of a BPE tokenizer.json that every peer
    # fetches (from the bootstrap) and checks against this before training (node.ml.tokenizer)
    tokenizer: dict[str, Scalar] = field(default_factory=dict)
    # what an identity pays before the syncer takes its contributions (protocol.admission): open, an allow-list,
    # or a proof-of-work bound to the run and the peer id (the default)
    admission: AdmissionSpec = field(default_factory=AdmissionSpec)

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and 0 < len(self.name) <= 64, "name must be 1-64 characters")
        _require(self.name.isprintable(), "name must be printable")
        _require(_is_int(self.seed) and 0 <= self.seed < 2**63, "seed must be a non-negative int")
        _require(isinstance(self.model, dict), "[model] must be a table")
        vocab = _check_tokenizer(self.tokenizer)
        object.__setattr__(self, "model", resolve_model(self.model, vocab_size=vocab))
        _require(
            self.model["vocab_size"] == vocab,
            f"model.vocab_size must be the tokenizer's {vocab}"
            + ("" if self.tokenizer else " (byte-level tokens)"),
        )
        _require(_is_int(self.num_stages) and self.num_stages >= 1, "num_stages must be an int >= 1")
        _require(self.num_stages <= self.model["num_layers"], "num_stages cannot exceed model.num_layers")
        _require(
            _is_int(self.bans_required) and self.bans_required >= 0,
            "bans_required must be an int >= 0 (0: auto)",
        )
        _check_sentinel_table(self.sentinel)
        _check_scalar_table("data", self.data)
        _require(isinstance(self.data.get("source"), str), "data.source must be a string")
        if self.data.get("source") == SHARDS_SOURCE:  # prepared token shards, named by their index's hash
            index = self.data.get("index_sha256")
            _require(
                isinstance(index, str) and len(index) == 64 and set(index) <= set("0123456789abcdef"),
                'data.source = "shards" needs index_sha256, 64 lowercase hex digits',
            )
        _check_peer_ids("authorized_syncers", self.authorized_syncers)
        _check_peer_ids("authorized_verifiers", self.authorized_verifiers)
        _check_peer_ids("bootstraps", self.bootstraps)
        _check_peer_ids("admission.allowlist", self.admission.allowlist)
        hb = self.heartbeat_period_s
        _require(_is_real(hb) and 0.2 <= hb <= 600, f"heartbeat_period_s must be in [0.2, 600], got {hb!r}")
        _require(_is_int(self.revision) and 0 <= self.revision < 2**31, "revision must be an int >= 0")

    @property
    def ban_quorum(self) -> int:
        """Distinct authorized verifier signatures a ban needs: `bans_required`, or with 0 (auto) min(2, the
        authorized verifiers) and at least 1."""
        if self.bans_required:
            return self.bans_required
        return max(1, min(2, len(self.authorized_verifiers)))

    @property
    def max_tensor_bytes(self) -> int:
        """The largest tensor any peer of this run may send: a boundary activation/gradient of a full microbatch,
        a token batch, or the largest single parameter tensor (fragments travel tensor by tensor)."""
        m, batch = self.model, self.wire.max_batch
        width: int = m["width"]
        context_len: int = m["context_len"]
        boundary = batch * context_len * width * _FLOAT32_BYTES
        tokens = batch * context_len * _INT64_BYTES
        return max(boundary, tokens, largest_param_elements(m) * _FLOAT32_BYTES)

    def to_dict(self) -> dict[str, Any]:
        """A plain, canonically ordered dict (lists, not tuples) for msgpack and JSON."""
        plain: dict[str, Any] = _sorted(dataclasses.asdict(self))
        return plain

    def to_canonical_bytes(self) -> bytes:
        return msgpack.packb({"format": FORMAT_VERSION, "run": self.to_dict()}, use_bin_type=True)

    def identity(self) -> dict[str, Any]:
        """The settings that name the run (and its checkpoints); see `IDENTITY_KEYS`."""
        plain = self.to_dict()
        ident = {key: plain[key] for key in IDENTITY_KEYS}
        ident["num_fragments"] = plain["diloco"]["num_fragments"]
        return ident

    def identity_bytes(self) -> bytes:
        packed: bytes = msgpack.packb({"format": FORMAT_VERSION, "identity": _sorted(self.identity())})
        return packed

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunManifest:
        """Build from a dict shaped like `to_dict()` (or like run.toml); raise ValueError on any deviation."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        _require(not unknown, f"unknown settings {unknown}")
        kwargs: dict[str, Any] = dict(data)
        nested = {
            "inner": InnerOptimizerSpec,
            "diloco": DilocoSpec,
            "wire": WireSpec,
            "outer_codec": CodecSpec,
            "activation_codec": BoundaryCodecSpec,
            "admission": AdmissionSpec,
        }
        for name, spec in nested.items():
            if name in kwargs:
                kwargs[name] = _build_nested(spec, name, kwargs[name])
        for name in ("authorized_syncers", "authorized_verifiers", "bootstraps"):
            if name in kwargs:
                _require(isinstance(kwargs[name], list | tuple), f"{name} must be a list of peer ids")
                _require(all(isinstance(p, str) for p in kwargs[name]), f"{name} must be a list of peer ids")
                kwargs[name] = tuple(kwargs[name])
        for name in ("model", "sentinel", "data", "tokenizer"):
            if name in kwargs:
                _require(isinstance(kwargs[name], dict), f"[{name}] must be a table")
        if "heartbeat_period_s" in kwargs:
            kwargs["heartbeat_period_s"] = _as_float("heartbeat_period_s", kwargs["heartbeat_period_s"])
        return cls(**kwargs)

    @classmethod
    def from_canonical_bytes(cls, blob: bytes) -> RunManifest:
        _require(len(blob) <= MAX_MANIFEST_BYTES, f"manifest larger than {MAX_MANIFEST_BYTES} bytes")
        try:
            outer = msgpack.unpackb(blob, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise ValueError(f"manifest bytes do not decode: {e}") from None
        _require(
            isinstance(outer, dict) and set(outer) == {"format", "run"}, "manifest is not a run document"
        )
        _require(
            outer["format"] == FORMAT_VERSION, f"manifest format {outer['format']!r} is not {FORMAT_VERSION}"
        )
        _require(isinstance(outer["run"], dict), "manifest run is not a table")
        manifest = cls.from_dict(outer["run"])
        _require(manifest.to_canonical_bytes() == blob, "manifest bytes are not canonical")
        return manifest


def _as_float(name: str, value: object) -> float:
    # TOML writes `lr = 1` as an int; accept it, but never a bool or a string
    _require(_is_int(value) or isinstance(value, float), f"{name} must be a number, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _build_nested(spec: type, name: str, table: object) -> Any:
    _require(isinstance(table, dict), f"[{name}] must be a table")
    assert isinstance(table, dict)
    fields_by_name = {f.name: f for f in dataclasses.fields(spec)}
    unknown = sorted(set(table) - set(fields_by_name))
    _require(not unknown, f"unknown [{name}] settings {unknown}")
    values = {}
    for key, value in table.items():
        is_float = fields_by_name[key].type in ("float", float)
        values[key] = _as_float(f"{name}.{key}", value) if is_float else value
    try:
        return spec(**values)
    except ValueError as e:
        message = str(e)
        raise ValueError(message if message.startswith(f"{name}.") else f"[{name}] {message}") from None


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list | tuple):
        return [_sorted(v) for v in value]
    return value


def default_manifest() -> RunManifest:
    """The built-in run: a tiny byte-level model on the built-in corpus; no file needed."""
    return RunManifest()


def parse_run_toml(text: str) -> RunManifest:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"run.toml is not valid TOML: {e}") from None
    try:
        return RunManifest.from_dict(data)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"run.toml: {e}") from None


def load_run_toml(path: Path) -> RunManifest:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read run file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"run file {path} is not UTF-8 text") from None
    try:
        return parse_run_toml(text)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def authorize(
    manifest: RunManifest,
    *,
    syncers: Iterable[str] = (),
    verifiers: Iterable[str] = (),
    bootstraps: Iterable[str] = (),
) -> RunManifest:
    """A copy of `manifest` with more authorized peers (kept sorted, so the run id does not depend on order)."""
    try:
        return dataclasses.replace(
            manifest,
            authorized_syncers=tuple(sorted(set(manifest.authorized_syncers) | set(syncers))),
            authorized_verifiers=tuple(sorted(set(manifest.authorized_verifiers) | set(verifiers))),
            bootstraps=tuple(sorted(set(manifest.bootstraps) | set(bootstraps))),
        )
    except ValueError as e:
        raise ConfigError(f"cannot authorize: {e}") from None


def run_bootstraps(signed: SignedManifest, manifest: RunManifest) -> frozenset[str]:
    """The peer ids that are this run's entry points, as its owner signed them: the owner key and `bootstraps`."""
    return frozenset({signed.owner, *manifest.bootstraps})


def maddr_peer_id(maddr: str) -> str | None:
    """The peer id of a multiaddr's last `/p2p/` part, or None when it has none."""
    _, sep, tail = maddr.rpartition("/p2p/")
    return tail.split("/", 1)[0] or None if sep else None


def derive_run_id(identity_bytes: bytes, owner_peer_id: str) -> str:
    """The run id: a hash of the owner's public key and the manifest's identity bytes (hex, 40 chars)."""
    owner_key = public_key_from_peer_id(owner_peer_id)
    raw = owner_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    digest = hashlib.sha256(_RUN_ID_DOMAIN + raw + identity_bytes).hexdigest()
    return digest[:RUN_ID_HEX_CHARS]


@functools.lru_cache(maxsize=64)
def _run_id_of(manifest_bytes: bytes, owner_peer_id: str) -> str:
    try:
        manifest = RunManifest.from_canonical_bytes(manifest_bytes)
    except (ValueError, TypeError) as e:
        raise ManifestRejected(f"run manifest is invalid: {e}") from None
    return derive_run_id(manifest.identity_bytes(), owner_peer_id)


@dataclass(frozen=True, slots=True)
class SignedManifest:
    """Canonical manifest bytes, the owner's peer id, and the owner's signature over them.

    Construct from untrusted input only through `from_wire`/`from_b64`, then call `verify()`.
    """

    manifest_bytes: bytes
    owner: str
    signature: bytes

    @classmethod
    def sign(cls, manifest: RunManifest, owner: NodeIdentity) -> SignedManifest:
        blob = manifest.to_canonical_bytes()
        return cls(blob, owner.peer_id, owner.sign(_SIGN_DOMAIN + blob))

    @property
    def run_id(self) -> str:
        """Derived from the identity part (parsed once per manifest); ManifestRejected if the bytes are invalid."""
        return _run_id_of(self.manifest_bytes, self.owner)

    def verify(self) -> RunManifest:
        """The manifest, if the owner signed exactly these bytes and they are a valid canonical manifest."""
        try:
            public_key_from_peer_id(self.owner)
        except IdentityError as e:
            raise ManifestRejected(f"manifest owner is not usable: {e}") from None
        if not verify_signature(self.owner, _SIGN_DOMAIN + self.manifest_bytes, self.signature):
            raise ManifestRejected(
                f"run manifest is not signed by its claimed owner {self.owner} (tampered or corrupted)"
            )
        try:
            return RunManifest.from_canonical_bytes(self.manifest_bytes)
        except (ValueError, TypeError) as e:
            raise ManifestRejected(f"signed run manifest is invalid: {e}") from None

    def to_wire(self) -> dict[str, Any]:
        return {"manifest": self.manifest_bytes, "owner": self.owner, "signature": self.signature}

    @classmethod
    def from_wire(cls, data: object) -> SignedManifest:
        ok = isinstance(data, dict) and set(data) == {"manifest", "owner", "signature"}
        if ok:
            assert isinstance(data, dict)
            blob, owner, sig = data["manifest"], data["owner"], data["signature"]
            ok = isinstance(blob, bytes) and isinstance(owner, str) and isinstance(sig, bytes)
            ok = ok and len(blob) <= MAX_MANIFEST_BYTES and len(owner) <= 64 and len(sig) <= 64
        if not ok:
            raise ManifestRejected("signed manifest has the wrong shape")
        return cls(data["manifest"], data["owner"], data["signature"])  # type: ignore[index]

    def to_b64(self) -> str:
        return base64.b64encode(msgpack.packb(self.to_wire(), use_bin_type=True)).decode()

    @classmethod
    def from_b64(cls, text: object) -> SignedManifest:
        if not isinstance(text, str) or len(text) > 2 * MAX_MANIFEST_BYTES:
            raise ManifestRejected("signed manifest is missing or too large")
        try:
            blob = base64.b64decode(text, validate=True)
            data = msgpack.unpackb(blob, raw=False, max_bin_len=MAX_MANIFEST_BYTES, max_ext_len=0)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise ManifestRejected(f"signed manifest does not decode: {e}") from None
        return cls.from_wire(data)


@dataclass(frozen=True, slots=True)
class OwnerPin:
    """One trusted run: its id, the owner key that signs it, its human name and when we first saw it."""

    run_id: str
    owner: str  # peer id of the owner key
    run_name: str
    first_seen: float  # unix seconds

    def to_json(self) -> dict[str, Any]:
        return {"owner": self.owner, "run_name": self.run_name, "first_seen": self.first_seen}


def short_key(peer_id: str) -> str:
    """An owner key for humans and logs: every Ed25519 peer id starts with `12D3KooW`, the tail tells them apart."""
    return f"...{peer_id[-8:]}" if peer_id else "--------"


class OwnerPins:
    """Trust on first use, keyed by run id: the owner key first seen for each run id, in `trusted_owners.json`.

    "The same run" means the same run id. The run id is a hash of the owner key and the manifest's identity
    bytes (`derive_run_id`), so it already commits to its owner: a verified manifest can never present another
    owner for a pinned run id, and finding one (an edited pin file, a manifest whose id does not match its
    owner) is refused with `OwnerPinMismatch`, resolved by `python -m node trust forget RUN_ID`. A run *name*
    is not an identity (every default run is called "default"): a new run id is pinned whatever its name, and
    when its name is already pinned to another owner that is logged as a warning, with both keys, and shown by
    `python -m node trust list`.

    Format 2 is `{"format": 2, "pins": {run_id: {"owner", "run_name", "first_seen"}}}`. The old name-keyed
    format (`{"runs": {name: owner}}`) names no run id, so its entries cannot become run-id pins: they are
    ignored with one warning, reported in `legacy`, and dropped when the file is next written. Writes are
    atomic (temp file, fsync, rename), so a crash leaves the old file or the new one, never half of one.
    """

    FILENAME = "trusted_owners.json"
    FORMAT = 2

    def __init__(self, path: Path) -> None:
        self.path = path
        self.legacy: dict[str, str] = {}  # name -> owner from an old-format file, ignored
        self._warned_legacy = False

    def pins(self) -> list[OwnerPin]:
        """Every pin, oldest first."""
        return sorted(self._load().values(), key=lambda pin: (pin.first_seen, pin.run_id))

    def get(self, run_id: str) -> OwnerPin | None:
        return self._load().get(run_id)

    def pinned(self, run_id: str) -> str | None:
        """The owner pinned for `run_id`, if any."""
        pin = self.get(run_id)
        return pin.owner if pin is not None else None

    def check_and_pin(self, run_id: str, owner: str, *, run_name: str, now: float | None = None) -> bool:
        """Pin `owner` for `run_id` if none is (True: newly pinned); raise OwnerPinMismatch if another owner is."""
        pins = self._load()
        known = pins.get(run_id)
        if known is not None and known.owner == owner:
            return False
        if known is not None:
            raise OwnerPinMismatch(
                f"run {run_id} ({known.run_name!r}) is pinned to owner {known.owner} since "
                f"{format_time(known.first_seen)}, but the manifest found is signed by {owner}; the run id commits "
                f"to its owner key, so the pin file or the manifest is not what it was. If you trust the new owner, "
                f"run `python -m node trust forget {run_id} --state-dir {self.path.parent}` and join again"
            )
        self._log_new_pin(pins.values(), run_id, owner, run_name)
        pins[run_id] = OwnerPin(run_id, owner, run_name, time.time() if now is None else now)
        self._save(pins)
        return True

    def forget(self, run_id: str) -> OwnerPin | None:
        """Remove the pin of `run_id`; the removed pin, or None when there was none."""
        pins = self._load()
        removed = pins.pop(run_id, None)
        if removed is not None:
            self._save(pins)
        return removed

    def _log_new_pin(self, pins: Iterable[OwnerPin], run_id: str, owner: str, run_name: str) -> None:
        # A name pinned to another owner is the case name-keyed pins refused: now a new run, but said out loud.
        others = sorted({p.owner for p in pins if p.run_name == run_name and p.owner != owner})
        if others:
            logger.warning(
                "run %r (%s) is signed by owner %s, not by %s who owns another pinned run of that name; trusting "
                "it as a different run (see `python -m node trust list`)",
                run_name,
                run_id[:12],
                short_key(owner),
                ", ".join(short_key(o) for o in others),
            )
        else:
            logger.info(
                "pinned owner %s for run %r (%s) (trust on first use)",
                short_key(owner),
                run_name,
                run_id[:12],
            )

    def _load(self) -> dict[str, OwnerPin]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read pinned owners {self.path}: {e}") from None
        if isinstance(data, dict) and "pins" not in data and _is_legacy(data.get("runs")):
            self._note_legacy(data["runs"])
            return {}
        try:
            return _parse_pins(data)
        except ValueError as e:
            raise ConfigError(
                f"pinned owners file {self.path} is malformed ({e}); fix it or delete it to re-pin"
            ) from None

    def _note_legacy(self, runs: dict[str, str]) -> None:
        self.legacy = dict(runs)
        if not self._warned_legacy and runs:
            self._warned_legacy = True
            logger.warning(
                "ignoring %d name-keyed owner pin(s) in old-format %s (%s): pins are per run id now; runs are "
                "re-pinned by run id as they are joined, and the old entries are dropped at the next write",
                len(runs),
                self.path,
                ", ".join(f"{name!r} -> {short_key(owner)}" for name, owner in sorted(runs.items())),
            )

    def _save(self, pins: Mapping[str, OwnerPin]) -> None:
        document = {"format": self.FORMAT, "pins": {rid: pins[rid].to_json() for rid in sorted(pins)}}
        write_atomically(self.path, json.dumps(document, indent=1, sort_keys=True) + "\n")
        self.legacy = {}


def _is_legacy(runs: object) -> bool:
    return isinstance(runs, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in runs.items())


def _parse_pins(data: object) -> dict[str, OwnerPin]:
    """Format-2 document -> pins; ValueError naming the first thing wrong."""
    _require(isinstance(data, dict), "not a JSON object")
    assert isinstance(data, dict)
    _require(
        data.get("format") == OwnerPins.FORMAT, f"format is {data.get('format')!r}, not {OwnerPins.FORMAT}"
    )
    raw = data.get("pins")
    _require(isinstance(raw, dict), "pins is not an object")
    assert isinstance(raw, dict)
    pins: dict[str, OwnerPin] = {}
    for run_id, entry in raw.items():
        _require(is_run_id(run_id), f"{run_id!r} is not a run id")
        _require(isinstance(entry, dict), f"pin {run_id} is not an object")
        owner, name, seen = entry.get("owner"), entry.get("run_name"), entry.get("first_seen")
        _require(isinstance(owner, str) and isinstance(name, str), f"pin {run_id} lacks owner or run_name")
        _require(_is_int(seen) or _is_real(seen), f"pin {run_id} has no first_seen time")
        pins[run_id] = OwnerPin(run_id, owner, name, float(seen))
    return pins


def format_time(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` (mode 0600) so that a crash at any point leaves the old file or the new one:
    write a temp file beside it, fsync it, rename it over, fsync the directory so the rename is durable too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # some filesystems cannot open or fsync a directory: the rename stands
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
