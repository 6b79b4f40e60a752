"""Per-request sampling knobs, validated once, in the one place their rules live.

The server maps request fields onto `SamplingParams` and turns the `ValueError` into an HTTP 400; the
sampler and the stop logic trust the values they get.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

# Below this temperature a row is sampled greedily (argmax): dividing by it would only overflow.
GREEDY_TEMPERATURE = 1e-5
MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0  # OpenAI's documented range is [0, 2]
# The sampler applies the repetition penalty as a float32 factor: it must be a normal float32, never 0 or inf.
FLOAT32_TINY = 1.1754943508222875e-38
FLOAT32_MAX = 3.4028234663852886e38
# Seeds are int64, as vLLM's (torch.long) and OpenAI's.
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fail(name: str, rule: str, value: Any) -> None:
    raise ValueError(f"{name} must be {rule}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler and of the stop logic.

    Semantics follow vLLM / OpenAI: `repetition_penalty` divides positive and multiplies negative logits of
    every token seen in prompt or output (1 = off); `presence_penalty` / `frequency_penalty` subtract
    `p` once / `f * count` for tokens of the output only; `top_k` 0 or -1 = off; `temperature` 0 = greedy.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1

    def __post_init__(self) -> None:
        self._check_floats()
        self._check_ints()
        self._normalise_collections()

    def _check_floats(self) -> None:
        t = self.temperature
        if not (_is_number(t) and 0 <= t <= MAX_TEMPERATURE):
            _fail("temperature", f"in [0, {MAX_TEMPERATURE:g}]", t)
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            _fail("top_p", "in (0, 1]", self.top_p)
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            _fail("min_p", "in [0, 1]", self.min_p)
        rp = self.repetition_penalty
        if not (_is_number(rp) and FLOAT32_TINY <= rp <= FLOAT32_MAX):
            _fail("repetition_penalty", f"a number > 0 that float32 holds (in [{FLOAT32_TINY:.3g}, {FLOAT32_MAX:.3g}])",
                  rp)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_number(value) and -2 <= value <= 2):
                _fail(name, "in [-2, 2]", value)

    def _check_ints(self) -> None:
        if not (_is_int(self.top_k) and (self.top_k >= 1 or self.top_k in (0, -1))):
            _fail("top_k", "0 or -1 (off) or an integer >= 1", self.top_k)
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            _fail("seed", f"an integer in [{SEED_MIN}, {SEED_MAX}] or None", self.seed)
        if self.max_tokens is not None and not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            _fail("max_tokens", "an integer >= 1 or None", self.max_tokens)
        if not (_is_int(self.min_tokens) and self.min_tokens >= 0):
            _fail("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", "a boolean", self.ignore_eos)
        if not isinstance(self.logprobs, bool):
            _fail("logprobs", "a boolean", self.logprobs)
        if not (_is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            _fail("top_logprobs", f"an integer in [0, {MAX_TOP_LOGPROBS}]", self.top_logprobs)
        if self.top_logprobs > 0 and not self.logprobs:
            _fail("top_logprobs", "0 unless logprobs is true", self.top_logprobs)
        if not (_is_int(self.n) and self.n >= 1):
            _fail("n", "an integer >= 1", self.n)

    def _normalise_collections(self) -> None:
        # Frozen: normalised values are written with object.__setattr__, copies so callers can't mutate them.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            _fail("stop", "a non-empty string or a list of non-empty strings", self.stop)
        object.__setattr__(self, "stop", tuple(stop))

        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            _fail("stop_token_ids", "a list of integers >= 0", ids)
        object.__setattr__(self, "stop_token_ids", tuple(ids))

        if not isinstance(self.logit_bias, dict):
            _fail("logit_bias", "a mapping of token id to bias", self.logit_bias)
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            # JSON object keys are strings: "50256" is token 50256.
            token = int(key) if isinstance(key, str) and key.strip().isdecimal() else key
            if not (_is_int(token) and token >= 0):
                _fail("logit_bias", "keyed by token ids >= 0", key)
            if not (_is_number(value) and -100 <= value <= 100):
                _fail("logit_bias", f"values in [-100, 100] (token {token})", value)
            bias[token] = float(value)
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse token ids the model does not have (the sampler indexes logits with them)."""
        for token in self.logit_bias:
            if token >= vocab_size:
                _fail("logit_bias", f"keyed by token ids < vocab size {vocab_size}", token)
        for token in self.stop_token_ids:
            if token >= vocab_size:
                _fail("stop_token_ids", f"token ids < vocab size {vocab_size}", token)

    def for_choice(self, index: int) -> "SamplingParams":
        """Params for choice `index` of an n > 1 request: n = 1 and, if seeded, seed + index (as vLLM),
        so the choices differ yet each one is reproducible. The sum wraps within int64."""
        seed = None if self.seed is None else (self.seed + index - SEED_MIN) % 2**64 + SEED_MIN
        return dataclasses.replace(self, n=1, seed=seed)
