"""Thinking budget: after `limit` reasoning tokens, force the end-of-reasoning tokens.

Active only when the prompt leaves reasoning open (Qwen3.5's template pre-opens `<think>`). A natural
`</think>` or an opened tool call closes the budget; forced tokens replace the model's prediction.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ThinkingBudget:
    limit: int
    forced: list[int]  # e.g. the tokens of "\n</think>\n\n"
    close: list[int]  # e.g. the tokens of "</think>"
    reasoning_tokens: int = 0
    cursor: int | None = None
    closed: bool = False

    def next_forced_token(self) -> int | None:
        """The token to emit instead of sampling, or None to sample normally."""
        if self.closed:
            return None
        if self.cursor is None:
            if self.reasoning_tokens < self.limit:
                return None
            self.cursor = 0
        if self.cursor >= len(self.forced):
            return None
        token = self.forced[self.cursor]
        self.cursor += 1
        return token

    def observe(self, generated: list[int], tool_opened: bool = False) -> None:
        if self.closed:
            return
        if tool_opened or (self.close and generated[-len(self.close):] == self.close):
            self.closed = True
        elif self.cursor is None:
            self.reasoning_tokens += 1

    @property
    def was_forced_closed(self) -> bool:
        return self.cursor is not None and self.closed
