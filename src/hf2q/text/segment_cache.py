"""Token ids of recently encoded text segments, so a conversation's earlier messages are not encoded again.

A chat's follow-up request re-sends the whole history; its messages are identical from turn to turn, so
their ids can be reused (an ~8,000-token conversation: about 8 ms to encode whole on a 2-core Xeon, 0.3 to
0.8 ms for its next turn). Bounded by the characters it holds (least recently used first out) and locked:
server threads encode concurrently.
"""
from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from typing import Iterable


class SegmentCache:
    """Least-recently-used map of segment text -> token ids, holding at most `max_chars` characters of text."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        self.chars = 0
        self._ids: OrderedDict[str, array] = OrderedDict()  # 4 bytes a token instead of a list's int objects
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, segment: str) -> bool:
        return segment in self._ids

    def lookup(self, segments: Iterable[str]) -> dict[str, array]:
        """The ids of those `segments` held, each marked as just used."""
        found = {}
        with self._lock:
            for segment in segments:
                ids = self._ids.get(segment)
                if ids is not None:
                    self._ids.move_to_end(segment)
                    found[segment] = ids
        return found

    def store(self, segment: str, ids: list[int]) -> array:
        """Hold `segment`'s ids (not when the segment alone exceeds the bound), evicting the oldest to fit."""
        held = array("i", ids)
        if len(segment) > self.max_chars:
            return held
        with self._lock:
            if segment not in self._ids:
                self.chars += len(segment)
            self._ids[segment] = held
            self._ids.move_to_end(segment)
            while self.chars > self.max_chars:
                old, _ = self._ids.popitem(last=False)
                self.chars -= len(old)
        return held
