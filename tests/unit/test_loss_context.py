"""The held-out loss screen scores a contribution in its base context (node.diloco.syncer_core.probe_context): the
model as it stood when the syncer published the contribution's base, not today's global model.

Why: in the poisoning benchmark's `clean` arm (4 honest learners, no attacker) honest pushes of the token-embedding
fragment were refused as ascent steps (their held-out loss rose, their reverse's fell): scored after the other
fragments had been merged on (outer Nesterov), an embedding delta trained against the old body met a body that
had already done part of its work. Here a held-out "loss" where two fragments can do the same job, (a + b - 1)^2
with a in the output head's fragment and b in the embedding's, shows it exactly: after a merge moves a past 1, an
honest step of b (descent where it was trained) is an ascent step in today's model (the old rule refuses it: the
negative control) and passes in its base context, while its sign flip is refused there (the attack the screen
exists for; in today's model the verdicts were swapped: the flip undoes the overshoot and passed)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from node.diloco.loss_probe import LOSS, LossProbe, LossScore
from node.diloco.quorum import QuorumConfig
from node.diloco.screening import ScreeningConfig
from node.diloco.sync_client import run_fragment_plan
from node.diloco.syncer_core import probe_context
from node.ml.model import ModelConfig, build_model, embedding_param_names
from node.roles.syncer import Refusal, SyncerCore
from protocol.manifest import DilocoSpec, RunManifest
from tests.unit.params_modes import IN_MEMORY_ONLY

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("params_mode")]

MODEL = {"vocab_size": 256, "context_len": 16, "num_layers": 2, "width": 32, "num_heads": 2}
RUN = RunManifest(model=dict(MODEL), num_stages=1, diloco=DilocoSpec(num_fragments=2, sync_every_steps=4))
PLAN = run_fragment_plan(RUN)
CFG = ModelConfig.from_dict(MODEL)
SEED = {n: p.detach().clone() for n, p in build_model(CFG, seed=0).named_parameters()}
HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"
HEAD_FRAGMENT = next(i for i, f in enumerate(PLAN.fragments) if HEAD in f.names)
EMBED_FRAGMENT = next(i for i, f in enumerate(PLAN.fragments) if EMBED in f.names)
Tensors = dict[str, torch.Tensor]


def redundant_loss(params: Mapping[str, torch.Tensor]) -> float:
    """(a + b - 1)^2: a, b how far one head weight and one embedding weight moved from the seed (either can do
    the job, as the head and the embedding both raise a common token's logit)."""
    a = float(params[HEAD][0, 0] - SEED[HEAD][0, 0])
    b = float(params[EMBED][0, 0] - SEED[EMBED][0, 0])
    return (a + b - 1.0) ** 2


class Swarm:
    def __init__(self, *, base_context: bool, spill_dir: Path | None = None, read_mib: float = 256.0) -> None:
        # the seniority cap and the probation ramp off: every identity here is young or fresh, and their step
        # scales are not what is tested
        screening = ScreeningConfig(
            loss_base_context=base_context,
            young_weight_cap=1.0,
            probation_merges=0,
            loss_context_read_mib=read_mib,
        )
        self.core = SyncerCore(
            PLAN,
            {n: t.detach().clone() for n, t in SEED.items()},
            quorum=QuorumConfig.decoupled(1, grace_gamma=0.0),
            embedding_names=embedding_param_names(CFG),
            outer_lr=0.7,
            outer_momentum=0.0,
            clip_factor=3.0,
            max_staleness=2,
            max_steps_per_s=10.0,
            tokens_per_step=128,
            now=0.0,
            screening=screening,
            spill_dir=spill_dir,  # the live syncer's: only current versions in memory, older ones in files
        )
        self.probe = LossProbe(redundant_loss)
        self.now, self.nonce, self.ticks = 0.0, itertools.count(1), itertools.count()

    def moved(self, fragment: int, name: str, by: float) -> Tensors:
        """The fragment's current tensors with one weight moved by `by` (a learner's work on it)."""
        out = {n: t.clone() for n, t in self.core.fragment_tensors(fragment).items()}
        out[name][0, 0] += by
        return out

    def score(self, fragment: int, params: Tensors) -> LossScore | None:
        base_version = self.core.versions[fragment]
        context = probe_context(self.core, fragment, base_version)
        base = self.core.history.at(fragment, base_version)
        assert base is not None
        clock = lambda: next(self.ticks) * 0.001  # noqa: E731
        return self.probe.measure(context.read(), context.versions, base, params, clock, True)

    def push(self, peer: str, fragment: int, params: Tensors) -> None:
        self.now += 1.0
        n = next(self.nonce)
        self.core.accept(
            peer,
            fragment,
            params,
            base_version=self.core.versions[fragment],
            steps=4,
            tokens=512,
            sched_step=n,
            step_time_s=0.1,
            nonce=n.to_bytes(16, "big"),
            now=self.now,
            loss=self.score(fragment, params),
        )

    def merged(self, peer: str, fragment: int, params: Tensors) -> None:
        self.push(peer, fragment, params)
        assert self.core.merge_now(fragment, 1, self.now) is not None


def head_moved_past_the_embeddings_work(
    base_context: bool, spill_dir: Path | None = None, read_mib: float = 256.0
) -> tuple[Swarm, Tensors, Tensors]:
    """The embedding's version 1 is published (b = 0.07); then a merge of the head's fragment moves a to 1.12
    (a learner's 1.6 at outer lr 0.7). Returns the swarm, an honest step of b on that version 1 (+0.3, trained
    where a was 0: descent there) and its sign flip."""
    s = Swarm(base_context=base_context, spill_dir=spill_dir, read_mib=read_mib)
    s.merged("warm", EMBED_FRAGMENT, s.moved(EMBED_FRAGMENT, EMBED, 0.1))
    honest = s.moved(EMBED_FRAGMENT, EMBED, 0.3)  # trained before the head's merge, pushed after it
    flipped = s.moved(EMBED_FRAGMENT, EMBED, -0.3)
    s.merged("head", HEAD_FRAGMENT, s.moved(HEAD_FRAGMENT, HEAD, 1.6))
    assert s.core.params[HEAD][0, 0] - SEED[HEAD][0, 0] == pytest.approx(1.12)
    return s, honest, flipped


@pytest.mark.parametrize("spilled", [False, True])
def test_an_honest_step_that_meets_moved_fragments_passes_in_its_base_context(
    spilled: bool, tmp_path: Path
) -> None:
    """In memory, and with older versions in spill files (as the live syncer keeps them: there the first fix,
    reading only versions held in memory, changed nothing, 6 honest refusals before and after)."""
    s, honest, _ = head_moved_past_the_embeddings_work(True, tmp_path / "spill" if spilled else None)
    score = s.score(EMBED_FRAGMENT, honest)
    assert score is not None and score.descent is not None and score.descent > 0  # a step down where trained
    s.merged("honest", EMBED_FRAGMENT, honest)
    assert s.core.screen.status().get(LOSS, 0) == 0


def test_negative_control_scored_in_todays_model_the_honest_step_is_refused_as_an_ascent_step() -> None:
    s, honest, _ = head_moved_past_the_embeddings_work(base_context=False)
    score = s.score(EMBED_FRAGMENT, honest)
    assert score is not None and score.descent is not None and score.descent < 0  # its reverse is lower
    with pytest.raises(Refusal) as caught:
        s.push("honest", EMBED_FRAGMENT, honest)
    assert caught.value.reason == LOSS and "ascent step" in str(caught.value)


@pytest.mark.parametrize("spilled", [False, True])
def test_the_sign_flipped_step_is_refused_in_its_base_context(spilled: bool, tmp_path: Path) -> None:
    s, _, flipped = head_moved_past_the_embeddings_work(True, tmp_path / "spill" if spilled else None)
    with pytest.raises(Refusal) as caught:
        s.push("evil", EMBED_FRAGMENT, flipped)
    assert caught.value.reason == LOSS and "ascent step" in str(caught.value)
    assert s.core.merge_now(EMBED_FRAGMENT, 1, s.now) is None  # nothing merged


def test_in_todays_model_the_verdicts_are_swapped() -> None:
    """Why today's model is the wrong place to judge a learner by: there the flip undoes the head's overshoot and
    scores as descent, the honest step as ascent (the old rule refused the honest one and passed the flip)."""
    s, honest, flipped = head_moved_past_the_embeddings_work(base_context=False)
    scores = s.score(EMBED_FRAGMENT, honest), s.score(EMBED_FRAGMENT, flipped)
    assert all(x is not None and x.descent is not None for x in scores)
    assert scores[0].descent < 0 < scores[1].descent  # type: ignore[union-attr,operator]
    s.push("evil", EMBED_FRAGMENT, flipped)  # passes


@IN_MEMORY_ONLY
def test_the_context_is_every_fragment_at_its_version_when_the_base_was_published() -> None:
    s, _, _ = head_moved_past_the_embeddings_work(base_context=True)
    versions = list(s.core.versions)
    found = probe_context(s.core, EMBED_FRAGMENT, versions[EMBED_FRAGMENT])
    context, vector = found.read(), found.versions
    assert vector[HEAD_FRAGMENT] == versions[HEAD_FRAGMENT] - 1  # the head as it was, not its merge since
    assert torch.equal(context[HEAD], SEED[HEAD]) and not torch.equal(s.core.params[HEAD], SEED[HEAD])
    assert all(context[n] is s.core.params[n] for n in PLAN.fragments[EMBED_FRAGMENT].names)
    # a base we did not publish (the seed), and the switch off: today's model
    seed = probe_context(s.core, HEAD_FRAGMENT, 0)
    assert seed.versions == tuple(versions) and seed.tensors[HEAD] is s.core.params[HEAD]
    s.core.screen.config = ScreeningConfig(loss_base_context=False)
    assert probe_context(s.core, EMBED_FRAGMENT, versions[EMBED_FRAGMENT]).versions == tuple(versions)


@IN_MEMORY_ONLY
def test_a_context_whose_version_was_dropped_takes_todays_tensors() -> None:
    s, _, _ = head_moved_past_the_embeddings_work(base_context=True)
    head_v0 = s.core.versions[HEAD_FRAGMENT] - 1
    s.core.history.tensors[HEAD_FRAGMENT].pop(head_v0)  # dropped (or spilled: a file, never read whole here)
    found = probe_context(s.core, EMBED_FRAGMENT, s.core.versions[EMBED_FRAGMENT])
    assert found.versions == tuple(s.core.versions) and found.tensors[HEAD] is s.core.params[HEAD]


@IN_MEMORY_ONLY
def test_spilled_versions_are_read_only_within_the_budget(tmp_path: Path) -> None:
    """A spilled version of the context is read (in the probe's thread) while the total fits
    `loss_context_read_mib`; over it, today's tensors (a big model's probe never reads a model's worth)."""
    s, honest, _ = head_moved_past_the_embeddings_work(True, tmp_path / "a")
    found = probe_context(s.core, EMBED_FRAGMENT, s.core.versions[EMBED_FRAGMENT])
    assert found.spilled and torch.equal(found.read()[HEAD], SEED[HEAD])
    tight, _, _ = head_moved_past_the_embeddings_work(True, tmp_path / "b", read_mib=0.001)
    over = probe_context(tight.core, EMBED_FRAGMENT, tight.core.versions[EMBED_FRAGMENT])
    assert not over.spilled and over.versions == tuple(tight.core.versions)
    with pytest.raises(Refusal):  # scored in today's model as before: the honest step refused (the control)
        tight.push("honest", EMBED_FRAGMENT, honest)


def test_the_loss_before_is_cached_per_version_vector_for_contexts_in_turn() -> None:
    calls: list[int] = []

    def loss(params: Mapping[str, torch.Tensor]) -> float:
        calls.append(1)
        return redundant_loss(params)

    probe, ticks = LossProbe(loss), itertools.count()
    base = {EMBED: SEED[EMBED]}
    params = {EMBED: SEED[EMBED] + 0.01}
    for vector in [(1, 0, 1), (0, 1, 1), (1, 0, 1), (0, 1, 1)]:  # two fragments' contexts, in turn
        probe.measure(dict(SEED), vector, base, params, lambda: next(ticks) * 0.001)
    assert len(calls) == 2 + 4  # one loss before per vector, one after per score
