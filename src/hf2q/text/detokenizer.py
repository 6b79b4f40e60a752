"""Streaming token ids -> text without ever emitting half a character.

Byte-level tokens often split a UTF-8 character (emoji, CJK) across tokens, so decoding one token at a
time would print U+FFFD. Each token's bytes go through Python's incremental UTF-8 decoder instead: it holds
back an incomplete character until it completes, and turns a sequence that can never complete into U+FFFD
as soon as that is certain. The cost per token is constant, and the final text equals a one-shot decode.
"""
from __future__ import annotations

import codecs

from hf2q.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces; `text` is everything emitted so far."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = tokenizer.control_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is still partial)."""
        if token_id in self._skip:
            return ""
        return self._emit(self._decoder.decode(self._tokenizer.token_bytes(token_id)))

    def flush(self) -> str:
        """End of stream: a still-incomplete character becomes U+FFFD."""
        return self._emit(self._decoder.decode(b"", final=True))

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _emit(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece
