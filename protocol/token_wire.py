"""Token ids on the pipeline's wire (issue 20): tokens and targets travel in the narrowest unsigned dtype the run's
vocabulary needs (`token_dtype`: uint8 up to 256 ids, uint16 up to 65536, else int32) instead of int64, 8x, 4x or 2x
fewer bytes; the receiver widens them back to int64 before anything reads them (`widen`).

The sender narrows only ids inside the vocabulary (`narrow`; an id outside it travels as int64, as before, and is
refused by the receiver's `BoundaryShape.check_tokens` as it always was: narrowing must not wrap a bad id into a good
one). The receiver accepts int64 (the old form) or exactly `token_dtype(vocab)`; any other dtype, or a narrow id of
the vocabulary size or more (a uint16 frame in a 1000-token run), is a TensorPolicyError ("bad tokens") before the
stage computes. The frame decoder already checked the byte length against the declared shape and dtype.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from protocol.codec import DTYPE_NAMES
from protocol.envelope import Opened
from protocol.errors import TensorPolicyError

BAD_TOKENS = "bad tokens"


def token_dtype(vocab_size: int) -> torch.dtype:
    """The narrowest wire dtype that holds every id in [0, vocab_size)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if vocab_size <= 1 << 8:
        return torch.uint8
    return torch.uint16 if vocab_size <= 1 << 16 else torch.int32


def token_dtype_name(vocab_size: int) -> str:
    return DTYPE_NAMES[token_dtype(vocab_size)]


def narrow(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`tokens` (int64) in `token_dtype(vocab_size)` when every id is in the vocabulary; else unchanged."""
    if tokens.dtype != torch.int64 or tokens.numel() == 0:
        return tokens
    if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
        return tokens
    return tokens.to(token_dtype(vocab_size))


def widen(opened: Opened, names: Collection[str], vocab_size: int) -> Opened:
    """`opened` with its token tensors among `names` as int64; refuses a dtype other than int64 and the
    vocabulary's own, and a narrow id outside the vocabulary."""
    narrow_dtype = token_dtype(vocab_size)
    widened: dict[str, torch.Tensor] = {}
    for name in names:
        tensor = opened.tensors.get(name)
        if tensor is None or tensor.dtype == torch.int64:
            continue
        if tensor.dtype != narrow_dtype:
            raise TensorPolicyError(
                f"token ids travel as int64 or {DTYPE_NAMES[narrow_dtype]} in this run, got {tensor.dtype}",
                reason=BAD_TOKENS,
            )
        ids = tensor.to(torch.int64)
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise TensorPolicyError(f"a token id outside [0, {vocab_size})", reason=BAD_TOKENS)
        widened[name] = ids
    if not widened:
        return opened
    return Opened(opened.header, {**opened.tensors, **widened})
