"""Stop strings over streamed text: never emit what might turn out to be the start of a stop string."""
from __future__ import annotations

from typing import Sequence


class StopStringMatcher:
    """Feed decoded text deltas; get back the text that is safe to show and whether a stop string hit.

    Text that could still be the beginning of a stop string is held back until it either completes one
    (then it is dropped with everything after it) or can no longer do so (then it is emitted). The stop
    string that completes first in the text wins, ties going to the earliest start (the longest string):
    this is what a character-by-character stream would see, so the result never depends on how the
    tokenizer split the text into deltas. With no stop strings nothing is held back.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(s for s in stop if s)
        self._held = ""
        self.stopped = False

    def push(self, delta: str) -> tuple[str, bool]:
        """(text to emit now, whether a stop string was matched). After a stop, emits nothing."""
        if self.stopped:
            return "", True
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            self._held = ""
            self.stopped = True
            return text[:match], True
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text, at the end of generation (it never completed a stop string)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> int | None:
        best: tuple[int, int] | None = None  # (end, start) of the winning occurrence
        for s in self.stop:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best):
                best = (start + len(s), start)
        return None if best is None else best[1]

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
