"""Fragment planning (balanced LPT, embedding apart), the staggered schedule and the real-time floor."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.diloco.fragments import (
    FragmentSchedule,
    SyncFloor,
    SyncFloorConfig,
    min_sync_interval_s,
    plan_fragments,
)

EMBEDDINGS = {"tok_emb.weight", "pos_emb.weight"}


def gpt_sizes(num_layers: int, width: int, vocab: int = 256, context: int = 128) -> dict[str, int]:
    """Parameter element counts of a pre-LN GPT (fused qkv, 4x MLP, untied head)."""
    d = width
    sizes = {"tok_emb.weight": vocab * d, "pos_emb.weight": context * d}
    for i in range(num_layers):
        b = f"blocks.{i}."
        sizes |= {
            b + "ln1.weight": d,
            b + "ln1.bias": d,
            b + "attn.qkv.weight": 3 * d * d,
            b + "attn.qkv.bias": 3 * d,
            b + "attn.proj.weight": d * d,
            b + "attn.proj.bias": d,
            b + "ln2.weight": d,
            b + "ln2.bias": d,
            b + "mlp.fc.weight": 4 * d * d,
            b + "mlp.fc.bias": 4 * d,
            b + "mlp.proj.weight": 4 * d * d,
            b + "mlp.proj.bias": d,
        }
    sizes |= {"ln_f.weight": d, "ln_f.bias": d, "head.weight": vocab * d}
    return sizes


@pytest.mark.parametrize(
    ("num_layers", "width", "num_fragments"),
    [(4, 128, 4), (4, 256, 8), (6, 256, 8), (8, 512, 8), (8, 512, 16), (8, 384, 12)],
)
def test_largest_fragment_within_four_thirds_of_ideal(
    num_layers: int, width: int, num_fragments: int
) -> None:
    sizes = gpt_sizes(num_layers, width)
    plan = plan_fragments(sizes, num_fragments, EMBEDDINGS)
    packed = [f for f in plan.fragments if not f.is_embedding]
    assert len(packed) == num_fragments
    ideal = sum(f.num_params for f in packed) / num_fragments
    assert max(f.num_params for f in packed) <= 4 / 3 * ideal
    assert plan.imbalance() <= 4 / 3


def test_every_parameter_in_exactly_one_fragment_and_embedding_apart() -> None:
    sizes = gpt_sizes(6, 256)
    plan = plan_fragments(sizes, 8, EMBEDDINGS)
    names = list(plan.names())
    assert sorted(names) == sorted(sizes)
    assert len(names) == len(set(names))
    assert plan.num_fragments == 9
    assert plan.total_params == sum(sizes.values())
    embedding = plan.fragments[-1]
    assert embedding.is_embedding and embedding.index == 8
    assert set(embedding.names) == EMBEDDINGS
    assert all(not f.is_embedding for f in plan.fragments[:-1])
    for fragment in plan.fragments:
        assert fragment.num_params == sum(sizes[n] for n in fragment.names)
        for name in fragment.names:
            assert plan.fragment_of(name) == fragment.index


def test_plan_is_independent_of_dict_order() -> None:
    sizes = gpt_sizes(4, 128)
    reference = plan_fragments(sizes, 6, EMBEDDINGS)
    items = list(sizes.items())
    for seed in range(5):
        random.Random(seed).shuffle(items)
        assert plan_fragments(dict(items), 6, list(EMBEDDINGS)) == reference


def test_stage_without_embedding_gets_exactly_p_fragments() -> None:
    sizes = {k: v for k, v in gpt_sizes(4, 128).items() if k.startswith("blocks.1")}
    plan = plan_fragments(sizes, 3, EMBEDDINGS)  # the model-wide names are not in this span: ignored
    assert plan.num_fragments == 3
    assert not any(f.is_embedding for f in plan.fragments)


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="cannot fill"):
        plan_fragments({"a": 3, "b": 4, "tok_emb.weight": 9}, 3, EMBEDDINGS)
    with pytest.raises(ValueError, match="positive"):
        plan_fragments({"a": 0, "b": 4}, 1, ())
    with pytest.raises(ValueError, match="num_fragments"):
        plan_fragments({"a": 1}, 0, ())


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=10_000), min_size=1, max_size=60),
    num_fragments=st.integers(min_value=1, max_value=12),
)
def test_lpt_bound_holds_for_any_sizes(sizes: list[int], num_fragments: int) -> None:
    if len(sizes) < num_fragments:
        return
    named = {f"t{i}": s for i, s in enumerate(sizes)}
    plan = plan_fragments(named, num_fragments, ())
    # LPT: makespan <= 4/3 OPT. OPT >= the ideal share and the largest tensor, and with more tensors than
    # fragments two of the P+1 largest must share a fragment (pigeonhole), so OPT >= s_P + s_{P+1}.
    ordered = sorted(sizes, reverse=True)
    pair = ordered[num_fragments - 1] + ordered[num_fragments] if len(sizes) > num_fragments else 0
    lower_bound = max(sum(sizes) / num_fragments, ordered[0], pair)
    assert max(f.num_params for f in plan.fragments) <= 4 / 3 * lower_bound + 1e-9


def test_schedule_one_fragment_per_step_when_p_equals_h() -> None:
    schedule = FragmentSchedule(num_fragments=24, sync_every_steps=24, overlap_steps=2)
    assert schedule.due_to_send(0) == []
    seen: dict[int, list[int]] = {}
    for step in range(1, 24 * 4 + 1):
        due = schedule.due_to_send(step)
        assert len(due) == 1
        seen.setdefault(due[0], []).append(step)
    assert sorted(seen) == list(range(24))
    for steps in seen.values():
        assert 1 <= steps[0] <= 24
        assert all(b - a == 24 for a, b in zip(steps, steps[1:], strict=False))
    assert schedule.apply_at(30) == 32


@pytest.mark.parametrize(("p", "h"), [(25, 24), (3, 3), (4, 12), (1, 24), (7, 5)])
def test_schedule_sends_each_fragment_once_per_window(p: int, h: int) -> None:
    schedule = FragmentSchedule(num_fragments=p, sync_every_steps=h, overlap_steps=1)
    for window in range(3):
        sent = [f for step in range(1 + window * h, 1 + (window + 1) * h) for f in schedule.due_to_send(step)]
        assert sorted(sent) == list(range(p))
    for fragment in range(p):
        for after in (0, 5, 17):
            nxt = schedule.next_send(fragment, after)
            assert nxt > after and fragment in schedule.due_to_send(nxt)
            assert all(fragment not in schedule.due_to_send(s) for s in range(after + 1, nxt))


def test_schedule_validation() -> None:
    with pytest.raises(ValueError):
        FragmentSchedule(num_fragments=4, sync_every_steps=4, overlap_steps=4)
    with pytest.raises(ValueError):
        FragmentSchedule(num_fragments=0, sync_every_steps=4, overlap_steps=1)
    with pytest.raises(ValueError):
        FragmentSchedule(num_fragments=4, sync_every_steps=4, overlap_steps=1).offset(4)


def test_sync_floor_keeps_fast_links_from_shrinking_h() -> None:
    interval = min_sync_interval_s(24, 0.5)
    assert interval == 12.0
    floor = SyncFloor(SyncFloorConfig(min_interval_s=interval))
    assert floor.may_send(3, now=100.0)
    floor.mark_sent(3, now=100.0)
    assert not floor.may_send(3, now=105.0)
    assert floor.wait_s(3, now=105.0) == pytest.approx(7.0)
    assert floor.may_send(4, now=105.0)  # other fragments have their own clocks
    assert floor.may_send(3, now=112.0)
    assert floor.last_sent_at(3) == 100.0
    with pytest.raises(ValueError):
        SyncFloorConfig(min_interval_s=-1.0)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_transformers_parameter_names_plan_with_the_embedding_apart(family: str) -> None:
    """The real models' names (model.embed_tokens / transformer.wte+wpe, model.layers.N..., lm_head): the
    embedding fragment holds exactly the family's embedding tensors, every other tensor is packed."""
    import torch

    from node.ml.model import CausalLM, ModelConfig, embedding_param_names

    cfg = ModelConfig(family=family, context_len=16, num_layers=4, width=32, num_heads=4)
    with torch.device("meta"):
        sizes = {name: p.numel() for name, p in CausalLM(cfg).named_parameters()}
    embeddings = embedding_param_names(cfg)
    assert embeddings <= set(sizes) and len(embeddings) == (2 if family == "gpt2" else 1)
    plan = plan_fragments(sizes, 3, embeddings)
    assert plan.num_fragments == 4 and set(plan.names()) == set(sizes)
    apart = [f for f in plan.fragments if f.is_embedding]
    assert len(apart) == 1 and set(apart[0].names) == embeddings
    assert "lm_head.weight" not in apart[0].names  # untied: the head is trained and merged like any layer
    assert plan.imbalance() < 4 / 3
