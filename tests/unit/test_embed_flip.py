"""An embedding-only flip (issue 18; node.diloco.attack_transport `embed_flip`): an honest contribution whose output
head's delta is sign-flipped, the rest of its fragment honest, through SyncerCore with a real small model. The
question was whether whole-contribution checks miss it because the other tensors dominate the contribution. They do
not in this model: the head holds about half of its fragment's delta, so the whole delta's cosine with the recent
merged direction falls from ~0.87 (honest) to ~-0.5, and the held-out loss probe's ascent rule (the loss with the
delta applied above the loss with it reversed) refuses it in every round. Negative control: without a held-out score
(the probe off) it is merged at full weight and the held-out loss rises."""

from __future__ import annotations

import math

import pytest
import torch

from node.diloco.attack_transport import EMBED_TENSORS, poisoned
from node.diloco.loss_probe import LOSS, LossScore
from node.diloco.screening import ScreeningConfig
from node.roles.syncer import Refusal
from tests.unit.test_loss_probe import Harness, Tensors, trained

pytestmark = pytest.mark.timeout(60)


def embed_flip(h: Harness, honest: Tensors) -> Tensors:
    return poisoned("embed_flip", 1.0, honest, h.c.fragment_tensors(0), torch.Generator())


class Unscored(Harness):
    """The held-out loss probe off: no contribution has a score (the evidence factor is then 1 too)."""

    def score(self, params: Tensors) -> LossScore | None:
        return None


def warm(h: Harness) -> None:
    """Six honest rounds at K = 1: the norm, loss and evidence histories and the recent direction are learned."""
    for seed in range(6):
        h.push("honest", trained(h.c, seed=seed))
        assert h.c.merge_now(0, 1, h.now) is not None


def test_the_attack_flips_only_the_head_and_keeps_the_honest_norm() -> None:
    h = Harness(ScreeningConfig())
    honest = trained(h.c, seed=1)
    bad, base = embed_flip(h, honest), h.c.fragment_tensors(0)
    flipped = {n for n in honest if not torch.allclose(bad[n], honest[n], atol=1e-6)}  # (float rounding)
    assert flipped == {n for n in honest if n.endswith(EMBED_TENSORS)} == {"lm_head.weight"}
    assert all(torch.allclose(bad[n] - base[n], base[n] - honest[n]) for n in flipped)

    def norm(params: Tensors) -> float:
        return math.sqrt(sum(float((base[n] - t).double().pow(2).sum()) for n, t in params.items()))

    assert norm(bad) == pytest.approx(norm(honest), rel=1e-5)  # the norm screen sees an honest size
    # a fragment of the embedding alone goes honest (flipped whole it would be `signflip`)
    alone = {"model.embed_tokens.weight": torch.ones(3)}
    assert torch.equal(
        poisoned("embed_flip", 1.0, alone, {"model.embed_tokens.weight": torch.zeros(3)}, torch.Generator())[
            "model.embed_tokens.weight"
        ],
        alone["model.embed_tokens.weight"],
    )


def test_an_embedding_only_flip_is_refused_by_the_held_out_loss_every_round() -> None:
    h = Harness(ScreeningConfig())
    warm(h)
    for r in range(4):
        honest = trained(h.c, seed=50 + r)
        with pytest.raises(Refusal) as refused:
            h.push("attacker", embed_flip(h, honest))
        assert refused.value.reason == LOSS and "above its reverse" in str(refused.value)
        assert refused.value.blame_sender  # over the bound: a ledger violation toward a ban
        h.push("honest", honest)  # the same work unflipped passes (the false-positive control)
        record = h.c.merge_now(0, 1, h.now)
        assert record is not None and record.participants == ("honest",)
    assert h.c.screen.status()[LOSS] == 4


def test_negative_control_without_the_probe_the_flip_is_merged_at_full_weight() -> None:
    # the probation ramp off too: the lone fresh attacker's step would be scaled by it (test_probation.py)
    h = Unscored(ScreeningConfig(probation_merges=0))
    warm(h)
    before = h.held_out()
    for r in range(4):
        h.push("attacker", embed_flip(h, trained(h.c, seed=50 + r)))
        record = h.c.merge_now(0, 1, h.now)
        assert record is not None and record.weights == {"attacker": 1.0} and record.step_scale == 1.0
    assert h.held_out() > before  # what the probe's refusal kept out
