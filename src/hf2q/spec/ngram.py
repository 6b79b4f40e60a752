"""Prompt lookup: the newest earlier occurrence of the history's last tokens proposes what followed it.

Code edits, quoting and summaries repeat spans of their context; when the last n tokens appeared
before, the tokens after that occurrence are a cheap, often right guess. No model work at all.
"""
from __future__ import annotations

from typing import Sequence


class NgramProposer:
    """Match the longest suffix (`max_n` tokens down to `min_n`), newest occurrence first.

    An index from each `min_n`-gram to the positions where it ends is extended with the new history
    tokens on every call, so a proposal costs the candidates of one key, not a scan of the history.
    """

    def __init__(self, min_n: int = 2, max_n: int = 8):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # min_n-gram -> end positions, oldest first
        self.heads: dict[tuple[int, ...], int] = {}  # (min_n - 1)-gram -> how often it occurs

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        self._extend(history)
        toks, m = self.tokens, self.min_n
        last = len(toks) - 1
        if k <= 0 or len(toks) <= m:
            return []
        best_end, best_len = -1, 0
        for end in reversed(self.ends.get(tuple(toks[last - m + 1:]), ())):
            if end == last:
                continue  # the suffix itself
            n = m
            while n < self.max_n and end - n >= 0 and toks[end - n] == toks[last - n]:
                n += 1
            if n > best_len:  # strictly longer: among equal lengths the newest (seen first) wins
                best_end, best_len = end, n
                if n == self.max_n:
                    break
        return toks[best_end + 1:best_end + 1 + k] if best_end >= 0 else []

    def may_propose_after_one_more(self, history: Sequence[int]) -> bool:
        """Whether `propose` could return drafts once one more token, not known yet, follows `history`. A match
        then needs the newest min_n - 1 tokens of `history` to occur earlier too (the new token comes after
        both): where they do not, no draft can come, whatever that token is."""
        self._extend(history)
        m = self.min_n
        if len(self.tokens) < m:
            return False
        return m == 1 or self.heads.get(tuple(self.tokens[len(self.tokens) - m + 1:]), 0) >= 2

    def _extend(self, history: Sequence[int]) -> None:
        if len(history) < len(self.tokens):
            raise ValueError("the history shrank: a proposer only sees verified tokens")
        m = self.min_n
        for i in range(len(self.tokens), len(history)):
            self.tokens.append(history[i])
            if i + 1 >= m:
                self.ends.setdefault(tuple(self.tokens[i + 1 - m:]), []).append(i)
            if i + 2 >= m and m > 1:
                key = tuple(self.tokens[i + 2 - m:])
                self.heads[key] = self.heads.get(key, 0) + 1
