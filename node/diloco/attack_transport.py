"""A poisoning learner, for tests and benchmarks only (issue 18): a `SyncTransport` wrapper that rewrites each
contribution before it is pushed. A learner applies one solely through the loudly named environment variable
`HIVENODE_UNSAFE_LEARNER_ATTACK=KIND[:STRENGTH]` (`learner_attack_from_env`); the stage replicas' attacks are
verification.attacks.

Kinds (`delta` is the learner's honest progress, base - params, on the base version it names):

* `scale:F` sends base - F x delta (x1e3, x1e30);
* `value:V` sends every tensor filled with V (1e38, nan, inf);
* `signflip` sends base + delta (an ascent step at the honest norm);
* `embed_flip[:F]` sends the honest delta except on the token embedding and output head (`EMBED_TENSORS`), where
  it sends base + F x delta (F = 1: that tensor's delta sign-flipped; larger: flipped and scaled), but only in a
  fragment that holds other tensors too: the flip hides among honest tensors that dominate the contribution's
  norm and direction (a fragment of the embedding alone goes honest; flipped whole it is `signflip`);
* `noise` sends base - (gaussian noise at the honest delta's norm);
* `aligned[:A]` (cosine gaming) sends base - (gaussian noise at the honest delta's norm + A (default 0.2) x that
  norm x the recent public merged direction): the learner fetches every version the syncer publishes, so it keeps
  an EMA (decay `ALIGNED_DECAY`, the screen's default) of the unit updates between consecutive versions it fetched
  of each fragment (old - new, the merged descent as a delta), as any learner could. Its cosine with the syncer's
  recent merged direction looks honest and the public part adds held-out descent (node.diloco.evidence); until it
  fetched two versions of a fragment it sends plain noise;
* `replay` sends its first contribution of each fragment again and again, on whatever base is current (stale);
* `inflate:F` sends honest parameters but claims F x the steps and tokens;
* `no_admission` sends honest contributions without the admission proof (a Sybil that did not pay);
* `freeride[:F]` (a free-rider) sends the syncer's current version of the fragment (fetched at push time) plus
  gaussian noise at F (default 0.01) x the honest delta's norm, on its honest base version and with its honest
  step and token claims: work it did not do. When no round merged since its base (the usual case in decoupled
  mode) the delta it sends is that noise alone;
* `copycat[:F]` sends another learner's contribution (the "source": an honest learner started with
  `HIVENODE_UNSAFE_COPY_SOURCE=1`) plus gaussian noise at F (default 0.01) x that contribution's delta norm, with
  its own claims. The channel is a directory both name in `HIVENODE_UNSAFE_COPY_DIR` (node.diloco.copy_channel):
  the source writes each contribution there once the syncer took it, so the copycat never pushes before the
  source (the source is never the one refused as a copy). Once it pushed a fragment, a watcher copies the
  source's contribution on the newest version of it the learner fetched as soon as the source wrote it (with the
  learner's latest claims for it): waiting for the copycat's own schedule, its copies came after the round had
  merged and were refused as a missed round, not as copies. A learner's push whose copy the watcher sent returns
  that push's answer; otherwise it polls the channel for the source's contribution on the same fragment and base
  version for up to `COPY_WAIT_S`, then pushes nothing: it raises `SyncDeferred` (the learner keeps the snapshot
  and tries again; a newer snapshot replaces it). It never pushes its own honest work.

The base is the syncer's own copy of the version (one fetch per push when the learner's base is not the current
one: then the contribution goes honest; `freeride` and `copycat` also keep the versions the learner fetched, for
the norm of a delta on an older base). Only the syncer's checks stand between these and the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from node.diloco.copy_channel import CopyChannel
from node.diloco.sync_types import (
    FragmentVersion,
    OutgoingContribution,
    PushReceipt,
    SyncDeferred,
    SyncTransport,
    SyncUnavailable,
    VersionsView,
)

logger = logging.getLogger(__name__)

UNSAFE_LEARNER_ATTACK_ENV = "HIVENODE_UNSAFE_LEARNER_ATTACK"
UNSAFE_COPY_DIR_ENV = "HIVENODE_UNSAFE_COPY_DIR"  # the copycat's channel (see the module docstring)
UNSAFE_COPY_SOURCE_ENV = "HIVENODE_UNSAFE_COPY_SOURCE"  # "1": an honest learner that writes to the channel
KINDS = (
    "scale",
    "value",
    "signflip",
    "embed_flip",
    "noise",
    "aligned",
    "replay",
    "inflate",
    "no_admission",
    "freeride",
    "copycat",
)
# the perturbation, relative to a delta norm
DEFAULT_STRENGTH = {"freeride": 0.01, "copycat": 0.01, "aligned": 0.2}
COPY_WAIT_S = 5.0  # how long a copycat's push polls the channel for its source's contribution
COPY_POLL_S = 0.05
KEEP_FETCHED = 2  # versions per fragment a free-rider or copycat keeps (the bases of its pushes)
COPY_WAITING = "copycat: no source contribution yet"
# `aligned`: the EMA of public merged updates keeps this per version (as screening.direction_decay does)
ALIGNED_DECAY = 0.7
# the tensors `embed_flip` flips: the token embedding and the (untied) output head of node.ml.model's llama
EMBED_TENSORS = ("embed_tokens.weight", "lm_head.weight")


def parse_learner_attack(spec: str) -> tuple[str, float]:
    kind, _, strength = spec.partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown learner attack {kind!r}; known: {KINDS}")
    return kind, float(strength) if strength else DEFAULT_STRENGTH.get(kind, 1.0)


def delta_norm(params: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((base[n].double() - t.double()).pow(2).sum()) for n, t in params.items()))


def perturbed(
    params: Mapping[str, torch.Tensor], norm: float, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """`params` plus gaussian noise of norm `norm` (as float32; `params` unchanged at norm 0)."""
    noise = {n: torch.randn(t.shape, generator=gen) for n, t in params.items()}
    total = math.sqrt(sum(float(x.double().pow(2).sum()) for x in noise.values()))
    scale = norm / total if total > 0 else 0.0
    return {n: t.detach().float() + scale * noise[n] for n, t in params.items()}


def poisoned(
    kind: str,
    strength: float,
    params: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    gen: torch.Generator,
) -> dict[str, torch.Tensor]:
    """The tensors `kind` sends instead of `params` (built on `base`); `replay` and `inflate` leave them."""
    delta = {n: base[n].float() - t.float() for n, t in params.items()}
    if kind == "scale":
        return {n: base[n].float() - strength * d for n, d in delta.items()}
    if kind == "value":
        return {n: torch.full_like(t, strength, dtype=torch.float32) for n, t in params.items()}
    if kind == "signflip":
        return {n: base[n].float() + d for n, d in delta.items()}
    if kind == "embed_flip":
        flip = {n for n in delta if n.endswith(EMBED_TENSORS)}
        flip = flip if len(flip) < len(delta) else set()  # the embedding alone: sent honest (see KINDS' doc)
        return {n: base[n].float() + (strength * d if n in flip else -d) for n, d in delta.items()}
    if kind == "noise":
        norm = math.sqrt(sum(float(d.double().pow(2).sum()) for d in delta.values()))
        noise = {n: torch.randn(d.shape, generator=gen) for n, d in delta.items()}
        scale = norm / max(math.sqrt(sum(float(x.double().pow(2).sum()) for x in noise.values())), 1e-12)
        return {n: base[n].float() - scale * x for n, x in noise.items()}
    return {n: t.detach().clone() for n, t in params.items()}


def aligned_noise(
    params: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    direction: Mapping[str, torch.Tensor] | None,
    alpha: float,
    gen: torch.Generator,
) -> dict[str, torch.Tensor]:
    """`aligned`: base - (noise at the honest delta's norm N + alpha x N x the unit `direction`, a delta-convention
    public merged direction; plain noise without one)."""
    norm = delta_norm(params, base)
    noisy = poisoned("noise", 1.0, params, base, gen)
    if direction is None:
        return noisy
    length = math.sqrt(sum(float(direction[n].double().pow(2).sum()) for n in params if n in direction))
    if length <= 0:
        return noisy
    scale = alpha * norm / length
    return {n: t - scale * direction[n].float() if n in direction else t for n, t in noisy.items()}


class PublicDirection:
    """`aligned`: per fragment, an EMA of the unit updates between consecutive versions fetched (old - new, what the
    merges moved the public model by: an attacker's view of the syncer's recent merged direction)."""

    def __init__(self, decay: float = ALIGNED_DECAY) -> None:
        self.decay = decay
        self._last: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        self._ema: dict[int, dict[str, torch.Tensor]] = {}

    def observe(self, version: FragmentVersion) -> None:
        last = self._last.get(version.fragment)
        if last is not None and version.version <= last[0]:
            return
        params = {n: t.detach().float().clone() for n, t in version.params.items()}
        self._last[version.fragment] = (version.version, params)
        if last is None:
            return
        update = {n: last[1][n] - t for n, t in params.items() if n in last[1]}
        length = math.sqrt(sum(float(u.double().pow(2).sum()) for u in update.values()))
        if length <= 0 or not math.isfinite(length):
            return
        old = self._ema.get(version.fragment, {})
        self._ema[version.fragment] = {
            n: (1.0 - self.decay) * u / length + (self.decay * old[n] if n in old else 0.0)
            for n, u in update.items()
        }

    def get(self, fragment: int) -> dict[str, torch.Tensor] | None:
        return self._ema.get(fragment)


class _Wrapping:
    """Passes every `SyncTransport` call but `push` (the subclass's) through to `inner`."""

    inner: SyncTransport

    async def versions(self, known: Sequence[int], wait_s: float) -> VersionsView:
        return await self.inner.versions(known, wait_s)

    async def fetch(self, fragment: int) -> FragmentVersion:
        return await self.inner.fetch(fragment)

    async def offer(self, held: Sequence[FragmentVersion]) -> int:
        return await self.inner.offer(held)

    def __getattr__(self, name: str) -> Any:  # current_syncer, forget_syncer, ... of the framed transport
        return getattr(self.inner, name)


class AttackingTransport(_Wrapping):
    """`SyncTransport` that poisons every push (see the module docstring); the other calls pass through."""

    def __init__(
        self,
        inner: SyncTransport,
        kind: str,
        strength: float,
        seed: int = 0,
        *,
        channel: CopyChannel | None = None,
        copy_wait_s: float = COPY_WAIT_S,
    ) -> None:
        if kind == "copycat" and channel is None:
            raise ValueError(f"a copycat needs its channel ({UNSAFE_COPY_DIR_ENV})")
        self.inner, self.kind, self.strength = inner, kind, strength
        self.channel, self.copy_wait_s = channel, copy_wait_s
        self.gen = torch.Generator().manual_seed(seed)
        self.public = PublicDirection()  # `aligned`: the recent merged direction from the versions fetched
        self._first: dict[int, dict[str, torch.Tensor]] = {}  # replay: the first contribution per fragment
        self._fetched: dict[int, dict[int, dict[str, torch.Tensor]]] = {}  # fragment -> version -> tensors
        self.poisoned = 0
        self.copy_waits = 0  # copycat pushes deferred: nothing of the source's to copy yet
        self._template: dict[int, OutgoingContribution] = {}  # copycat: its latest snapshot per fragment
        self._copies: dict[tuple[int, int], asyncio.Future[PushReceipt]] = {}  # (fragment, base) -> its push
        self._watch: asyncio.Future[None] | None = None
        if kind == "no_admission" and hasattr(inner, "admission"):
            inner.admission = None  # the framed transport sends no proof

    async def push(self, contribution: OutgoingContribution) -> PushReceipt:
        c = contribution
        if self.kind == "no_admission":
            self.poisoned += 1
            return await self.inner.push(c)
        if self.kind == "inflate":
            factor = max(1, int(self.strength))
            c = dataclasses.replace(c, steps=c.steps * factor, tokens=c.tokens * factor)
        elif self.kind == "replay":
            first = self._first.setdefault(c.fragment, {n: t.clone() for n, t in c.params.items()})
            current = await self.inner.fetch(c.fragment)
            c = dataclasses.replace(c, params=first, base_version=current.version)
        elif self.kind == "copycat":
            return await self._copy_push(c)
        elif self.kind == "freeride":
            c = await self._free_ride(c)
        elif c.base is None:
            current = await self.fetch(c.fragment)  # (`aligned` sees it too)
            if current.version == c.base_version:
                c = dataclasses.replace(c, params=self._poisoned(c, current.params))
        else:
            c = dataclasses.replace(c, params=self._poisoned(c, c.base))
        self.poisoned += c is not contribution
        return await self.inner.push(c)

    def _poisoned(self, c: OutgoingContribution, base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.kind == "aligned":
            return aligned_noise(c.params, base, self.public.get(c.fragment), self.strength, self.gen)
        return poisoned(self.kind, self.strength, c.params, base, self.gen)

    async def _base_of(
        self, c: OutgoingContribution, current: FragmentVersion | None = None
    ) -> Mapping[str, torch.Tensor] | None:
        """The tensors of the version `c` built on: its own (a lossy codec's), one the learner fetched through us,
        or the syncer's current one (`current`, else fetched) if that is it; None if none of these."""
        if c.base is not None:
            return c.base
        if (kept := self._fetched.get(c.fragment, {}).get(c.base_version)) is not None:
            return kept
        current = current if current is not None else await self.fetch(c.fragment)
        return current.params if current.version == c.base_version else None

    async def _free_ride(self, c: OutgoingContribution) -> OutgoingContribution:
        """The current version plus noise at `strength` x the honest delta's norm (none if its base is unknown)."""
        if c.codec_meta:
            return c  # an encoded payload: sent as it is (the benchmark runs no lossy codec)
        current = await self.fetch(c.fragment)
        base = await self._base_of(c, current)
        norm = self.strength * delta_norm(c.params, base) if base is not None else 0.0
        return dataclasses.replace(c, params=perturbed(current.params, norm, self.gen))

    async def _copy_push(self, c: OutgoingContribution) -> PushReceipt:
        """The copycat's push: the copy of the source's contribution on (fragment, base), pushed once (by the
        watcher as soon as the source wrote it, or now); raises SyncDeferred while the source has none."""
        if c.codec_meta:
            return await self.inner.push(c)  # an encoded payload: sent as it is (the benchmark runs no codec)
        self._template[c.fragment] = c
        if self._watch is None:
            self._watch = asyncio.ensure_future(self._watch_source())
            self._watch.add_done_callback(_watcher_done)
        key = (c.fragment, c.base_version)
        if key not in self._copies:
            source = await self._wait_for_source(c)
            if key not in self._copies:  # the watcher may have pushed it meanwhile
                self._copies[key] = asyncio.ensure_future(self._push_copy(c, source))
        return await asyncio.shield(self._copies[key])

    async def _wait_for_source(self, c: OutgoingContribution) -> dict[str, torch.Tensor]:
        deadline = time.monotonic() + self.copy_wait_s
        while (source := await asyncio.to_thread(self._read, c.fragment, c.base_version, c.params)) is None:
            if time.monotonic() >= deadline:
                self.copy_waits += 1
                raise SyncDeferred(
                    f"{COPY_WAITING} on fragment {c.fragment} version {c.base_version}", reason=COPY_WAITING
                )
            await asyncio.sleep(COPY_POLL_S)
        return source

    def _read(
        self, fragment: int, version: int, expected: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        assert self.channel is not None
        return self.channel.read(fragment, version, expected)

    async def _watch_source(self) -> None:
        """Copy the source's contribution on the newest version the learner fetched of each fragment it pushed as
        soon as the source wrote it (with the learner's last claims for that fragment): a copy that waited for the
        copycat's own schedule came after the round had merged (refused as a missed round, not as a copy)."""
        while True:
            await asyncio.sleep(COPY_POLL_S)
            for fragment, template in list(self._template.items()):
                if not (kept := self._fetched.get(fragment)):
                    continue
                key = (fragment, max(kept))
                if key in self._copies:
                    continue
                source = await asyncio.to_thread(self._read, fragment, key[1], template.params)
                if source is not None and key not in self._copies:
                    c = dataclasses.replace(template, base_version=key[1])
                    task = self._copies[key] = asyncio.ensure_future(self._push_copy(c, source))
                    task.add_done_callback(_retrieved)
                for old in [k for k in self._copies if k[0] == fragment and k[1] < key[1] - KEEP_FETCHED]:
                    del self._copies[old]

    async def _push_copy(self, c: OutgoingContribution, source: dict[str, torch.Tensor]) -> PushReceipt:
        """`source` plus noise at `strength` x its delta norm (none if the base is unknown), with `c`'s claims."""
        base = await self._base_of(c)
        norm = self.strength * delta_norm(source, base) if base is not None else 0.0
        self.poisoned += 1
        logger.info("copycat: copied fragment %d on version %d", c.fragment, c.base_version)
        try:
            return await self.inner.push(dataclasses.replace(c, params=perturbed(source, norm, self.gen)))
        except SyncUnavailable:
            self._copies.pop((c.fragment, c.base_version), None)  # not taken: copy it again
            raise

    async def aclose(self) -> None:
        """Cancel the copycat's watcher and the copies it is pushing (the learner role calls this when it stops)."""
        pending = [t for t in (self._watch, *self._copies.values()) if t is not None and not t.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._watch = None
        self._copies.clear()

    async def fetch(self, fragment: int) -> FragmentVersion:
        version = await self.inner.fetch(fragment)
        if self.kind == "aligned":
            self.public.observe(version)
        if self.kind in ("freeride", "copycat"):  # the bases of later pushes (see `_base_of`)
            kept = self._fetched.setdefault(fragment, {})
            kept[version.version] = version.params
            for old in sorted(kept)[:-KEEP_FETCHED]:
                del kept[old]
        return version


class CopySourceTransport(_Wrapping):
    """An honest learner's transport that also leaves every contribution the syncer took in the copycat's channel
    (`HIVENODE_UNSAFE_COPY_SOURCE`); what it pushes is untouched."""

    def __init__(self, inner: SyncTransport, channel: CopyChannel) -> None:
        self.inner, self.channel = inner, channel
        self.written = 0

    async def push(self, contribution: OutgoingContribution) -> PushReceipt:
        receipt = await self.inner.push(contribution)  # first: the copycat must never push before the source
        if not contribution.codec_meta:
            try:
                c = contribution
                await asyncio.to_thread(self.channel.write, c.fragment, c.base_version, c.params)
                self.written += 1
            except OSError as e:  # the channel is the benchmark's, not the run's: the push stands
                logger.warning("copy channel: cannot write: %s", e)
        return receipt


def _retrieved(task: asyncio.Future[PushReceipt]) -> None:
    """A watcher's copy nobody awaits: its failure is logged, not left to the loop's unretrieved warning."""
    if not task.cancelled() and (error := task.exception()) is not None:
        logger.info("copycat: a copy was not taken: %s", error)


def _watcher_done(task: asyncio.Future[None]) -> None:
    """The copy watcher ends only when cancelled (`aclose`); anything else it died of is logged."""
    if not task.cancelled() and (error := task.exception()) is not None:
        logger.error("copycat: the source watcher died: %r", error)


def _banner(what: str) -> None:
    banner = "!" * 78
    logger.warning("%s\nUNSAFE: %s. Tests and benchmarks only.\n%s", banner, what, banner)


def learner_attack_from_env(inner: SyncTransport, environ: Mapping[str, str] | None = None) -> SyncTransport:
    """`inner`, wrapped in an AttackingTransport only when `HIVENODE_UNSAFE_LEARNER_ATTACK` names an attack, or
    in a CopySourceTransport when `HIVENODE_UNSAFE_COPY_SOURCE` is 1 (both need `HIVENODE_UNSAFE_COPY_DIR`)."""
    env = os.environ if environ is None else environ
    spec = env.get(UNSAFE_LEARNER_ATTACK_ENV, "").strip()
    copy_dir = env.get(UNSAFE_COPY_DIR_ENV, "").strip()
    channel = CopyChannel(Path(copy_dir)) if copy_dir else None
    if env.get(UNSAFE_COPY_SOURCE_ENV, "").strip() == "1":
        if spec or channel is None:
            raise ValueError(f"{UNSAFE_COPY_SOURCE_ENV} needs {UNSAFE_COPY_DIR_ENV} and no attack")
        _banner(f"this learner's contributions are written to {copy_dir} for a copycat to copy")
        return CopySourceTransport(inner, channel)
    if not spec:
        return inner
    kind, strength = parse_learner_attack(spec)
    _banner(f"this learner POISONS the run ({UNSAFE_LEARNER_ATTACK_ENV}={spec})")
    return AttackingTransport(inner, kind, strength, channel=channel)
