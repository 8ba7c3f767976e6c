"""The run's tokenizer: raw bytes (the default) or a byte-level BPE trained with `tokenizers`.

A BPE tokenizer is one `tokenizer.json` blob. The signed manifest names its sha256 and vocabulary size
(`[tokenizer]`); whoever holds a blob checks it against those with `verify_tokenizer` before using it, so
a peer can fetch it from anyone (the bootstrap serves it by hash) and still train on exactly the owner's
vocabulary. Trained from the run's corpus by `python -m bootstrap tokenizer train`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from protocol.errors import TokenizerMismatch

logger = logging.getLogger(__name__)

END_OF_TEXT = "<|endoftext|>"  # the one special token: separates documents, and ends generation
MAX_TOKENIZER_BYTES = 64 * 2**20  # a 128k-entry BPE is ~10 MB of JSON; anything larger is refused unread


def tokenizer_sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


class Tokenizer:
    """A loaded BPE tokenizer: bytes -> token ids. Build with `from_bytes` (after `verify_tokenizer`)."""

    def __init__(self, blob: bytes) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        if len(blob) > MAX_TOKENIZER_BYTES:
            raise TokenizerMismatch(f"tokenizer of {len(blob)} bytes exceeds {MAX_TOKENIZER_BYTES}")
        try:
            self._tokenizer = HFTokenizer.from_str(blob.decode())
        except (UnicodeDecodeError, Exception) as e:  # tokenizers raises a plain Exception on bad JSON
            raise TokenizerMismatch(f"tokenizer.json does not load: {type(e).__name__}: {e}") from None
        self.blob = blob
        self.sha256 = tokenizer_sha256(blob)
        self.vocab_size: int = self._tokenizer.get_vocab_size()
        self.end_of_text: int | None = self._tokenizer.token_to_id(END_OF_TEXT)

    def encode(self, data: bytes) -> list[int]:
        ids: list[int] = self._tokenizer.encode(data.decode("utf-8", errors="replace")).ids
        return ids

    def decode(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(ids)
        return text


def verify_tokenizer(blob: bytes, spec: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer in `blob` if it is the one `spec` (the manifest's `[tokenizer]`) names; else
    TokenizerMismatch naming both hashes."""
    expected = spec.get("sha256")
    actual = tokenizer_sha256(blob)
    if actual != expected:
        logger.error("tokenizer refused: sha256 %s, the run names %s", actual[:16], str(expected)[:16])
        raise TokenizerMismatch(
            f"tokenizer sha256 {actual} is not the run's {expected}: refusing to train on another vocabulary"
        )
    tokenizer = Tokenizer(blob)
    if tokenizer.vocab_size != spec.get("vocab_size"):
        raise TokenizerMismatch(
            f"tokenizer has {tokenizer.vocab_size} tokens, the run's manifest says {spec.get('vocab_size')}"
        )
    return tokenizer


def train_bpe(texts: Iterator[str], vocab_size: int, *, show_progress: bool = True) -> bytes:
    """A byte-level BPE (GPT-2 style pre-tokenization, every byte in the base alphabet, so nothing is ever
    unknown) trained on `texts`; returns tokenizer.json bytes."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise ValueError(f"a byte-level BPE needs more than 257 tokens, got vocab_size {vocab_size}")
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    blob: bytes = tokenizer.to_str().encode()
    return blob


def tokenizer_spec(blob: bytes) -> dict[str, Any]:
    """The manifest's `[tokenizer]` table for `blob`."""
    tokenizer = Tokenizer(blob)
    return {"sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size}
