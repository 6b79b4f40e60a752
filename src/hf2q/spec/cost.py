"""Per-request, per-proposer cost control: a proposer that does not save time is switched off.

Drafts that are rarely right, or a verify that costs more than the tokens it saves, make speculation
slower than plain decoding. Each request keeps one controller per proposer. Plain decode steps give the
baseline (the cumulative mean time of one step); speculative rounds are judged in windows of `window`
rounds against what plain steps would have taken for the same tokens. After `patience` windows in a row
with no gain (a tie counts as none) the proposer is off for the rest of the request. Times are wall-clock
seconds taken after the device has finished the step, so they include the GPU work. A window of 0 rounds
turns the control off: the proposer always drafts, from the first decode step (benchmarks, tests).
"""
from __future__ import annotations

WINDOW_ROUNDS = 4
UNPROFITABLE_WINDOWS_TO_DISABLE = 2


class CostController:
    def __init__(self, window: int = WINDOW_ROUNDS, patience: int = UNPROFITABLE_WINDOWS_TO_DISABLE):
        self.window, self.patience, self.enabled = window, patience, True
        self._plain_total, self._plain_steps = 0.0, 0  # the baseline: every timed plain step
        self._rounds, self._spec_time, self._plain_equivalent = 0, 0.0, 0.0  # the open window
        self._losing_windows = 0
        self.windows_won = 0  # windows that showed a gain (the speculator's memory across requests reads it)

    def may_speculate(self) -> bool:
        """On, and a plain step has been timed (no baseline, no judgement: the first decode step is plain)."""
        return self.enabled and (self._plain_steps > 0 or self.window == 0)

    def observe_plain(self, elapsed: float) -> None:
        if elapsed > 0:
            self._plain_total += elapsed
            self._plain_steps += 1

    def observe_round(self, tokens: int, elapsed: float) -> bool:
        """A speculative round that emitted `tokens` tokens in `elapsed` seconds; returns whether the
        proposer stays on."""
        if self.window == 0 or not self.may_speculate() or tokens <= 0 or elapsed <= 0:
            return self.enabled
        self._plain_equivalent += self._plain_total / self._plain_steps * tokens
        self._spec_time += elapsed
        self._rounds += 1
        if self._rounds == self.window:
            if self._spec_time >= self._plain_equivalent:
                self._losing_windows += 1
                self.enabled = self._losing_windows < self.patience
            else:
                self._losing_windows = 0
                self.windows_won += 1
            self._rounds, self._spec_time, self._plain_equivalent = 0, 0.0, 0.0
        return self.enabled
