"""Token ids on the pipeline's wire (`protocol.token_wire`): the vocabulary's narrowest dtype each way, widened back
to int64 before the stage computes, a bad dtype or id refused (each refusal with a negative control), and the pipeline
trained through it sending fewer bytes for the same losses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from protocol import token_wire
from protocol.envelope import Context, Direction, Kind, Opened, open_envelope, seal
from protocol.errors import TensorPolicyError
from protocol.identity import NodeIdentity
from protocol.manifest import WireSpec
from protocol.pipeline import FORWARD_RPC, TARGETS, BoundaryShape
from protocol.replay import ReplayGuard
from tests.unit import test_pipeline_local as local
from tests.unit.test_boundary_codec import CountingTransport

NOW = 1_700_000_000.0
ALICE, BOB = NodeIdentity.generate(), NodeIdentity.generate()
TOKENS_CTX = Context(run_id="r", kind=Kind.TOKENS, receiver=BOB.peer_id, stage=0, direction=Direction.FORWARD)
SHAPE = BoundaryShape(max_batch=8, context_len=32, width=64, vocab_size=1000)


@pytest.mark.parametrize(
    ("vocab", "dtype"),
    [(2, torch.uint8), (256, torch.uint8), (257, torch.uint16), (65536, torch.uint16), (65537, torch.int32)],
)
def test_the_narrowest_dtype_holds_every_id_of_the_vocabulary(vocab: int, dtype: torch.dtype) -> None:
    assert token_wire.token_dtype(vocab) == dtype
    ids = torch.tensor([[0, vocab - 1]])
    assert torch.equal(token_wire.narrow(ids, vocab).to(torch.int64), ids)
    assert token_wire.narrow(ids, vocab).dtype == dtype


def test_an_id_outside_the_vocabulary_is_never_narrowed_into_one() -> None:
    ids = torch.tensor([[3, 300]])
    assert token_wire.narrow(ids, 256) is ids  # travels as int64; the stage's check_tokens refuses it
    # negative control: a plain cast wraps 300 to 44, a valid id the stage would train on
    assert ids.to(torch.uint8).tolist() == [[3, 44]]


def opened(tensors: dict[str, torch.Tensor], shape: BoundaryShape = SHAPE) -> Opened:
    frame = seal(ALICE, TOKENS_CTX, microbatch=1, step=1, now=NOW, tensors=tensors)
    return open_envelope(
        frame,
        remote_peer=ALICE.peer_id,
        expect=TOKENS_CTX,
        limits=shape.limits,
        replay=ReplayGuard(),
        now=NOW,
    )


def test_narrow_ids_are_widened_to_int64_before_the_stage_reads_them() -> None:
    ids = torch.randint(0, 1000, (8, 32), generator=torch.Generator().manual_seed(0))
    sent = {"": token_wire.narrow(ids, 1000), TARGETS: token_wire.narrow(ids, 1000)}
    assert sent[""].dtype == torch.uint16
    widened = SHAPE.widen_tokens(opened(sent))
    assert all(t.dtype == torch.int64 and torch.equal(t, ids) for t in widened.tensors.values())
    SHAPE.check_tokens(widened.tensors[""])
    # int64, the old form, passes as it is
    assert torch.equal(SHAPE.widen_tokens(opened({"": ids})).tensors[""], ids)


def test_a_bad_dtype_or_an_id_past_the_vocabulary_is_refused() -> None:
    past = torch.full((2, 4), 1000, dtype=torch.uint16)  # fits uint16, outside a 1000-id vocabulary
    with pytest.raises(TensorPolicyError) as e:
        SHAPE.widen_tokens(opened({"": past}))
    assert e.value.reason == token_wire.BAD_TOKENS
    # negative control: widened without the range check, the id reaches int64 outside the vocabulary
    assert int(past.to(torch.int64).max()) >= SHAPE.vocab_size
    loose = dataclasses.replace(SHAPE.limits, allowed_dtypes=frozenset({"int64", "uint16", "int32", "uint8"}))
    for wrong in (torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.uint8)):
        frame = seal(ALICE, TOKENS_CTX, microbatch=1, step=1, now=NOW, tensors={"": wrong})
        got = open_envelope(
            frame, remote_peer=ALICE.peer_id, expect=TOKENS_CTX, limits=loose, replay=ReplayGuard(), now=NOW
        )
        with pytest.raises(TensorPolicyError) as e:
            SHAPE.widen_tokens(got)
        assert e.value.reason == token_wire.BAD_TOKENS
    # a run's limits admit its own token dtype only (int32 and uint8 are not 1000's)
    assert {"uint16", "int64"} <= SHAPE.limits.allowed_dtypes
    assert not {"int32", "uint8"} & SHAPE.limits.allowed_dtypes


def test_the_stage_computes_the_same_activation_from_narrow_tokens() -> None:
    _, first, _ = local.service_pair()
    tokens, _ = local.batch(1)
    route = first.routes()[FORWARD_RPC].handler
    outs = []
    for mb, sent in ((9, tokens), (10, token_wire.narrow(tokens, first.core.shape.vocab_size))):
        frame = local.request(first, Kind.TOKENS, Direction.FORWARD, mb, sent)
        outs.append(
            local.answer(
                first, local.run(route(frame, local.VERIFIER.peer_id)), Kind.ACTIVATION, Direction.FORWARD
            )
        )
    assert torch.equal(outs[0], outs[1])


def test_the_pipeline_sends_narrow_tokens_and_trains_alike() -> None:
    losses, sent = {}, {}
    for narrow in (True, False):
        run = dataclasses.replace(local.manifest(), wire=WireSpec(max_batch=8))
        pipe = local.build_pipeline(run)
        counter = CountingTransport(pipe.driver.transport)
        pipe.driver.hops.transport = counter
        if not narrow:  # negative control: the driver sends int64 ids, as before
            pipe.driver.hops.vocab_size = None
        outcomes = local.drive_all(pipe, range(1, 4))
        assert all(o.completed for o in outcomes)
        losses[narrow], sent[narrow] = [o.loss for o in outcomes], counter.bytes
    assert losses[True] == losses[False]  # the same ids, the same training
    # two int64 tensors a microbatch (tokens to the first stage, targets to the last) 8x smaller (vocabulary 256)
    tokens = 4 * int(local.manifest().model["context_len"])
    assert sent[False] - sent[True] >= 3 * 2 * 7 * tokens
