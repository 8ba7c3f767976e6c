"""The free-rider and the copycat of the poisoning benchmark (node.diloco.attack_transport, kinds `freeride` and
`copycat`; tests and benchmarks only) and the copycat's file channel (node.diloco.copy_channel): what they push is
what the syncer's copy check (node.diloco.claims.copy_of) is for, the channel round-trips through safetensors and
reads a bad or missing file as absent, and a copycat never pushes before its source."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from node.diloco.attack_transport import (
    UNSAFE_COPY_DIR_ENV,
    UNSAFE_COPY_SOURCE_ENV,
    UNSAFE_LEARNER_ATTACK_ENV,
    AttackingTransport,
    CopySourceTransport,
    delta_norm,
    learner_attack_from_env,
    parse_learner_attack,
)
from node.diloco.claims import COPYCAT, FREE_RIDER, copy_of
from node.diloco.copy_channel import CopyChannel, file_name
from node.diloco.screening import ScreeningConfig
from node.diloco.sync_types import FragmentVersion, OutgoingContribution, PushReceipt, SyncDeferred

TOLERANCE = ScreeningConfig().copy_tolerance  # the syncer's default
GEN = torch.Generator().manual_seed(7)
OLD = {"w": torch.randn(64, generator=GEN), "b": torch.randn(8, generator=GEN)}  # version 2
CURRENT = {n: t - 0.05 * torch.randn(t.shape, generator=GEN) for n, t in OLD.items()}  # version 3


def work(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A learner's parameters after some steps on `base`."""
    gen = torch.Generator().manual_seed(seed)
    return {n: t - 0.05 * torch.randn(t.shape, generator=gen) for n, t in base.items()}


class Inner:
    """The syncer end: records pushes, serves version 3 (or `refuse`s every push)."""

    def __init__(self, refuse: bool = False) -> None:
        self.pushed: list[OutgoingContribution] = []
        self.refuse = refuse

    async def push(self, contribution: OutgoingContribution) -> PushReceipt:
        if self.refuse:
            raise RuntimeError("refused")
        self.pushed.append(contribution)
        return PushReceipt(target_version=4, term=1)

    async def fetch(self, fragment: int) -> FragmentVersion:
        return FragmentVersion(fragment=fragment, version=3, params=dict(CURRENT))

    async def versions(self, known: Any, wait_s: float) -> Any:
        raise NotImplementedError

    async def offer(self, held: Any) -> int:
        return 0


def contribution(params: dict[str, torch.Tensor], base_version: int = 3) -> OutgoingContribution:
    return OutgoingContribution(
        fragment=0,
        params=params,
        base_version=base_version,
        steps=8,
        tokens=256,
        sent_step=8,
        sched_step=8,
        step_time_s=0.2,
    )


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((a[n] - b[n]).pow(2).sum()) for n in a))


# ---- the free-rider ----


def test_a_free_rider_pushes_the_published_version_within_the_tolerance_with_honest_claims() -> None:
    inner = Inner()
    honest = work(CURRENT, seed=1)
    rider = AttackingTransport(inner, *parse_learner_attack("freeride"))
    assert rider.strength == 0.01
    asyncio.run(rider.push(contribution(honest)))
    sent = inner.pushed[-1]
    assert (sent.steps, sent.tokens, sent.base_version) == (8, 256, 3)  # the honest claims
    gap = distance(sent.params, CURRENT)
    assert gap == pytest.approx(0.01 * delta_norm(honest, CURRENT), rel=1e-4)
    assert gap <= TOLERANCE * delta_norm(honest, CURRENT)  # within the syncer's tolerance of its honest work


def test_a_free_rider_on_an_older_base_is_refused_by_the_copy_check() -> None:
    inner = Inner()
    rider = AttackingTransport(inner, "freeride", 0.01)
    asyncio.run(rider.fetch(0))  # the learner fetched version 3; its push is on version 2 (it learnt late)
    rider._fetched[0][2] = OLD  # and it had fetched version 2 before
    asyncio.run(rider.push(contribution(work(OLD, seed=2), base_version=2)))
    sent = inner.pushed[-1].params
    found = copy_of(sent, OLD, [(2, OLD), (3, CURRENT)], [], TOLERANCE)
    assert found is not None and found[0] == FREE_RIDER and "published version 3" in found[1]
    # false-positive control: the honest work on that base is no copy
    assert copy_of(work(OLD, seed=2), OLD, [(2, OLD), (3, CURRENT)], [], TOLERANCE) is None


def test_a_free_rider_on_the_current_base_is_refused_once_a_rounds_work_is_known() -> None:
    inner = Inner()
    honest = work(CURRENT, seed=3)
    asyncio.run(AttackingTransport(inner, "freeride", 0.01).push(contribution(honest)))
    sent = inner.pushed[-1].params
    work_norm = float(sum((CURRENT[n] - honest[n]).pow(2).sum() for n in CURRENT).sqrt())
    found = copy_of(sent, CURRENT, [(3, CURRENT)], [], TOLERANCE, work_norm=work_norm)
    assert found is not None and found[0] == FREE_RIDER
    # negative control: measured against its own delta (the noise) alone, as in warm-up, it passes
    assert copy_of(sent, CURRENT, [(3, CURRENT)], [], TOLERANCE, work_norm=None) is None
    # false-positive control: the honest work itself, on the same base, against the same norm
    assert copy_of(honest, CURRENT, [(3, CURRENT)], [], TOLERANCE, work_norm=work_norm) is None


# ---- the copycat and its channel ----


def test_the_channel_round_trips_and_reads_a_bad_or_missing_file_as_absent(tmp_path: Path) -> None:
    channel = CopyChannel(tmp_path / "copy")
    assert channel.read(0, 3, CURRENT) is None  # nothing written yet (no directory either)
    channel.write(0, 3, CURRENT)
    back = channel.read(0, 3, CURRENT)
    assert back is not None and all(torch.equal(back[n], CURRENT[n]) for n in CURRENT)
    assert [p.name for p in (tmp_path / "copy").iterdir()] == [file_name(0, 3)]  # no temporary file left
    assert channel.read(0, 4, CURRENT) is None and channel.read(1, 3, CURRENT) is None  # other keys
    assert channel.read(0, 3, {"w": torch.zeros(65)}) is None  # another shape
    assert channel.read(0, 3, {**CURRENT, "extra": torch.zeros(1)}) is None  # a tensor missing
    (tmp_path / "copy" / file_name(0, 3)).write_bytes(b"\x80\x04not safetensors, maybe a pickle")
    assert channel.read(0, 3, CURRENT) is None  # does not parse (and is never unpickled)
    channel.write(0, 3, CURRENT)
    renamed = tmp_path / "copy" / file_name(0, 4)  # a valid file under another key's name
    renamed.write_bytes((tmp_path / "copy" / file_name(0, 3)).read_bytes())
    assert channel.read(0, 4, CURRENT) is None  # its metadata names base 3


def test_the_channel_keeps_only_recent_bases(tmp_path: Path) -> None:
    channel = CopyChannel(tmp_path)
    for version in range(6):
        channel.write(1, version, CURRENT)
    channel.write(0, 0, CURRENT)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([file_name(0, 0), *(file_name(1, v) for v in (3, 4, 5))])


def test_a_copycat_pushes_the_sources_contribution_within_the_tolerance_after_the_source(
    tmp_path: Path,
) -> None:
    channel = CopyChannel(tmp_path)
    syncer = Inner()
    source, copycat = (
        CopySourceTransport(syncer, channel),
        AttackingTransport(syncer, "copycat", 0.01, channel=channel),
    )
    original = work(CURRENT, seed=4)
    asyncio.run(source.push(contribution(original)))
    assert source.written == 1 and len(syncer.pushed) == 1
    asyncio.run(copycat.push(contribution(work(CURRENT, seed=5))))  # its own work is never what it sends
    copied = syncer.pushed[-1]
    assert (copied.steps, copied.tokens, copied.base_version) == (8, 256, 3)  # its own claims
    theirs = {n: CURRENT[n] - original[n] for n in original}
    mine = {n: CURRENT[n] - copied.params[n] for n in original}
    assert distance(mine, theirs) == pytest.approx(0.01 * delta_norm(original, CURRENT), rel=1e-4)
    found = copy_of(copied.params, CURRENT, [(3, CURRENT)], [("source", theirs)], TOLERANCE)
    assert found is not None and found[0] == COPYCAT
    # negative control: with the copy check off (tolerance 0) the copy is taken for work
    assert copy_of(copied.params, CURRENT, [(3, CURRENT)], [("source", theirs)], 0.0) is None


def test_a_copycat_without_a_source_contribution_pushes_nothing(tmp_path: Path) -> None:
    syncer = Inner()
    channel = CopyChannel(tmp_path)
    copycat = AttackingTransport(syncer, "copycat", 0.01, channel=channel, copy_wait_s=0.1)
    with pytest.raises(SyncDeferred):
        asyncio.run(copycat.push(contribution(work(CURRENT, seed=6))))
    channel.write(0, 2, work(OLD, seed=7))  # the source's work on another base is no use either
    with pytest.raises(SyncDeferred):
        asyncio.run(copycat.push(contribution(work(CURRENT, seed=6))))
    assert syncer.pushed == [] and copycat.copy_waits == 2


def test_a_source_whose_push_fails_writes_nothing(tmp_path: Path) -> None:
    source = CopySourceTransport(Inner(refuse=True), CopyChannel(tmp_path))
    with pytest.raises(RuntimeError):
        asyncio.run(source.push(contribution(work(CURRENT, seed=8))))
    assert list(tmp_path.iterdir()) == [] and source.written == 0


def test_the_copy_roles_come_only_from_the_unsafe_variables(tmp_path: Path) -> None:
    inner = Inner()
    assert learner_attack_from_env(inner, {UNSAFE_COPY_DIR_ENV: str(tmp_path)}) is inner
    source = learner_attack_from_env(
        inner,
        {UNSAFE_COPY_DIR_ENV: str(tmp_path), UNSAFE_COPY_SOURCE_ENV: "1"},
    )
    assert isinstance(source, CopySourceTransport)
    copycat = learner_attack_from_env(
        inner,
        {UNSAFE_COPY_DIR_ENV: str(tmp_path), UNSAFE_LEARNER_ATTACK_ENV: "copycat"},
    )
    assert isinstance(copycat, AttackingTransport) and copycat.channel is not None
    with pytest.raises(ValueError):
        learner_attack_from_env(inner, {UNSAFE_LEARNER_ATTACK_ENV: "copycat"})
    with pytest.raises(ValueError):
        learner_attack_from_env(inner, {UNSAFE_COPY_SOURCE_ENV: "1"})


def test_the_copycats_watcher_copies_as_soon_as_the_source_wrote_and_pushes_each_copy_once(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        channel, syncer = CopyChannel(tmp_path), Inner()
        copycat = AttackingTransport(syncer, "copycat", 0.01, channel=channel, copy_wait_s=0.05)
        await copycat.fetch(0)  # the learner holds version 3
        with pytest.raises(SyncDeferred):  # its snapshot on version 3: nothing to copy yet
            await copycat.push(contribution(work(CURRENT, seed=9)))
        await CopySourceTransport(syncer, channel).push(contribution(work(CURRENT, seed=10)))
        for _ in range(100):  # the watcher, without a push of the learner's
            if len(syncer.pushed) == 2:
                break
            await asyncio.sleep(0.02)
        assert len(syncer.pushed) == 2 and syncer.pushed[-1].base_version == 3
        receipt = await copycat.push(contribution(work(CURRENT, seed=11)))  # the learner's retry
        assert receipt.target_version == 4 and len(syncer.pushed) == 2  # answered by the watcher's push

    asyncio.run(scenario())


def test_a_closed_copycat_stops_its_watcher_and_copies_nothing_more(tmp_path: Path) -> None:
    async def scenario() -> None:
        channel, syncer = CopyChannel(tmp_path), Inner()
        copycat = AttackingTransport(syncer, "copycat", 0.01, channel=channel, copy_wait_s=0.05)
        await copycat.fetch(0)
        with pytest.raises(SyncDeferred):  # starts the watcher
            await copycat.push(contribution(work(CURRENT, seed=9)))
        before = {t for t in asyncio.all_tasks() if not t.done()}
        await copycat.aclose()
        assert not {t for t in asyncio.all_tasks() if not t.done()} & before - {asyncio.current_task()}
        await CopySourceTransport(syncer, channel).push(contribution(work(CURRENT, seed=10)))
        await asyncio.sleep(0.2)  # several of the watcher's polls, had it still run
        assert len(syncer.pushed) == 1  # the source's push only: no copy

    asyncio.run(scenario())
