"""A generation request as the engine tracks it, and what the engine reports back each step."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from hf2q.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What one engine step produced for one request (a delta; `finished` marks the last)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: Optional[list[TokenLogprob]] = None
    error: Optional[str] = None  # why the request failed (finish_reason "error")
    # With the first output of a request that asked for them: one entry per prompt token, None for the first.
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    embedding: Optional[Any] = None  # an embedding request's pooled, L2-normalised fp32 vector (CPU tensor)


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one: what a stream sends when its client reads slower than the
    engine makes tokens. Texts, tokens and logprobs are concatenated; the counts and finish are the last's."""
    if len(outs) == 1:
        return outs[0]
    first, last = outs[0], outs[-1]
    logprobs = None
    if any(o.logprobs is not None for o in outs):
        logprobs = [lp for o in outs for lp in o.logprobs or []]
    return RequestOutput(first.request_id, [t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs),
                         finished=last.finished, finish_reason=last.finish_reason,
                         num_prompt_tokens=last.num_prompt_tokens, num_output_tokens=last.num_output_tokens,
                         num_cached_tokens=last.num_cached_tokens, logprobs=logprobs, error=last.error,
                         prompt_logprobs=first.prompt_logprobs, embedding=last.embedding)


@dataclass(frozen=True)
class RequestOptions:
    """What a request asks of the engine besides its prompt and sampling parameters (`Engine.add_request`)."""
    thinking_budget: Optional[int] = None  # reasoning tokens before "</think>" is forced (with starts_in_reasoning)
    starts_in_reasoning: bool = False  # the prompt ends inside a reasoning block
    group: Optional[str] = None  # choices of one API request (n > 1): later ones fork the first one's prompt
    grammar: Any = None  # hf2q.engine.grammar.Grammar: each sampled row is masked to what it allows next
    prefill_only: bool = False  # compute the prompt and finish without sampling
    prompt_logprobs: Optional[int] = None  # the first output carries the prompt tokens' logprobs (top entries)
    pooling: Optional[str] = None  # "last" | "mean": an embedding request (prefill only)
    anchor: Optional[int] = None  # the prompt length the next turn of a conversation will extend
    images: tuple = ()  # hf2q.vision.ImageInput, in prompt order: each fills one run of image pad tokens
    # The one test aid in the product path (`hf2q serve --scripted-replies`): tokens forced instead of sampled.
    scripted_ids: Optional[tuple[int, ...]] = None


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V and linear state are in the cache
    num_cached: int = 0  # prompt tokens restored from a retained prefix
    slot: Optional[int] = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: Optional[str] = None
    max_total_len: int = 0  # prompt + max_tokens: what the cache reserved for it
    group: Optional[str] = None  # choices of one request (n > 1): later ones fork the first one's prompt
    fork_point: Optional[int] = None  # a group leader pauses here until its siblings have forked
    siblings: list["Request"] = field(default_factory=list)  # waiting to fork from this leader
    anchor: Optional[int] = None  # prompt tokens the next turn will reuse (the prompt minus the generation suffix)
    draft_ids: list[int] = field(default_factory=list)  # this step's proposed tokens, fed after the known ones
    arrival: float = field(default_factory=time.monotonic)
    extras: dict[str, Any] = field(default_factory=dict)
    # Its engine/sequence_output.SequenceOutput: sampler row, detokenizer, stop rules, thinking budget, grammar.
    output: Any = field(default=None, repr=False, compare=False)
    prefill_only: bool = False  # computes its prompt and finishes without sampling (max_tokens 0, embeddings)
    prompt_logprobs: Optional[int] = None  # top entries per prompt token's logprobs, when they are wanted
    pooling: Optional[str] = None  # "last" | "mean": an embedding request
    # A re-render prefill (`Engine.prefill_in_background`): no output, a checkpoint at its end, run only when
    # the engine has no user work, unless `awaited`: a waiting user request's prompt extends it.
    background: bool = False
    awaited: bool = False
    hidden: list[Any] = field(default_factory=list)  # prompt hidden-state chunks, kept only when keeps_hidden
    # A prompt with images (hf2q.vision): the images, the prompt as the prefix cache keys it (each image's pad
    # rows stand for its content hash) and its multimodal rotary positions plus the delta after the prompt.
    images: list[Any] = field(default_factory=list)
    key_tokens: Optional[list[int]] = None
    mrope: Optional[tuple[Any, int]] = None

    @property
    def keeps_hidden(self) -> bool:
        """The runner keeps this request's prompt hidden rows: for prompt logprobs or an embedding."""
        return self.prompt_logprobs is not None or self.pooling is not None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without joining the two lists (this runs every step)."""
        n = len(self.prompt_ids)
        head = self.prompt_ids[start:end] if start < n else []
        tail = self.output_ids[max(start - n, 0):end - n] if end > n else []
        return head + tail

    def key(self, start: int, end: int) -> list[int]:
        """`tokens(start, end)` as the prefix cache keys them: image pad rows carry their image's hash."""
        if self.key_tokens is None:
            return self.tokens(start, end)
        n = len(self.prompt_ids)
        return self.key_tokens[start:end] + (self.output_ids[max(start - n, 0):end - n] if end > n else [])

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
