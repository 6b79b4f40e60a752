"""POST /v1/completions: raw text (or token ids) in, text out; no template, no reasoning split.

Several prompts in one request are batched through the scheduler, one choice each (n per prompt); `echo`
prepends the prompt, and with `logprobs` its tokens' log-probabilities (what log-likelihood evaluation reads).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hf2q.engine.request import RequestOptions, merge_outputs
from hf2q.engine.sampling_params import MAX_TOP_LOGPROBS
from hf2q.server.choices import Choices, by_choice
from hf2q.server.errors import APIError, bad_request
from hf2q.server.request_fields import check_stream_options, log_labels
from hf2q.server.sampling import build_params
from hf2q.server.schemas import CompletionRequest
from hf2q.server.sse import DONE, event, unless_disconnected
from hf2q.server.state import ServerState


class CompletionLogprobs:
    """The legacy completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.offset = 0

    def piece(self, logprobs) -> dict:
        return self._entries([(lp.token_id, lp) for lp in logprobs or []])

    def prompt_piece(self, prompt_ids: list[int], logprobs: list) -> dict:
        """The echoed prompt's entries: the first token has null logprob and null top_logprobs, as OpenAI."""
        return self._entries(list(zip(prompt_ids, logprobs)))

    def _entries(self, pairs) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in pairs:
            token = self._text(token_id)
            out["tokens"].append(token)
            out["token_logprobs"].append(None if lp is None else _finite(lp.logprob))
            out["top_logprobs"].append(None if lp is None else {self._text(t): _finite(v) for t, v in lp.top})
            out["text_offset"].append(self.offset)
            self.offset += len(token)
        return out

    def _text(self, token_id: int) -> str:
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def _finite(logprob: float) -> float:
    return max(float(logprob), -9999.0)  # JSON has no -inf


def _merge(into: dict, piece: dict) -> None:
    for key, values in piece.items():
        into.setdefault(key, []).extend(values)


def prompt_items(value, param: str) -> list:
    """A `Prompts` field as a list of items, each a string or a token-id list; a 400 if any is empty."""
    if isinstance(value, str) or (value and all(isinstance(t, int) for t in value)):
        value = [value]
    if not value or any(len(item) == 0 for item in value):
        raise bad_request(f"the {param} is empty" if len(value) <= 1 else f"{param} has an empty item", param=param)
    return list(value)


def encode_items(tokenizer, items: list) -> list[list[int]]:
    return [tokenizer.encode(item) if isinstance(item, str) else list(item) for item in items]


class CompletionServing:
    def __init__(self, state: ServerState):
        self.state = state

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        self.state.check_model(req.model)
        check_stream_options(req)
        if req.suffix is not None:
            raise bad_request("suffix (fill-in-the-middle) is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}",
                              param="logprobs")
        tokenizer = self.state.model.tokenizer
        items = prompt_items(req.prompt, "prompt")
        prompts = await asyncio.to_thread(encode_items, tokenizer, items)  # long prompts tokenize off the event loop
        want_lp = req.logprobs is not None
        # max_tokens 0 (with echo: the prompt's logprobs only) computes the prompt and samples nothing.
        prefill_only = req.max_tokens == 0
        max_tokens = 16 if req.max_tokens is None else 1 if prefill_only else req.max_tokens
        params = build_params(req, self.state.model.config.vocab_size, max_tokens, want_lp, req.logprobs or 0,
                              self.state.config.sampling_defaults)
        prompt_logprobs = req.logprobs if req.echo and want_lp else None
        choices = Choices(self.state, prompts, params, "prompt",
                          RequestOptions(prefill_only=prefill_only, prompt_logprobs=prompt_logprobs))
        await choices.start()
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.state.config.model_name}
        log_labels("completion", head["id"], req)
        n = len(prompts) * params.n
        lps = [CompletionLogprobs(tokenizer) if want_lp else None for _ in range(n)]
        echoes = [item if isinstance(item, str) else tokenizer.decode(item) for item in items] if req.echo else None
        if req.stream:
            opts = req.stream_options
            usage = "continuous" if opts and opts.continuous_usage_stats else bool(opts and opts.include_usage)
            return StreamingResponse(self._stream(choices, head, lps, echoes, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        body = await unless_disconnected(raw, self._collect(choices, head, lps, echoes))
        return JSONResponse(body) if body is not None else Response(status_code=499)

    def _first(self, choices: Choices, gen, out, lp, echoes) -> tuple[str, Optional[dict]]:
        """A choice's first text and logprobs: with echo, its prompt (and the prompt's logprobs) come first."""
        logprobs = {} if lp is not None else None
        text = ""
        if echoes is not None:
            text = echoes[gen.prompt]
            if lp is not None and out.prompt_logprobs is not None:
                _merge(logprobs, lp.prompt_piece(choices.prompts[gen.prompt], out.prompt_logprobs))
                lp.offset = len(text)
        if lp is not None:
            _merge(logprobs, lp.piece(out.logprobs))
        return text + out.new_text, logprobs

    async def _collect(self, choices: Choices, head: dict, lps: list, echoes) -> dict:
        texts = [[] for _ in lps]
        logprobs: list[Optional[dict]] = [None] * len(lps)
        reasons: list[Optional[str]] = [None] * len(lps)
        started: set[int] = set()
        async with aclosing(choices.stream()) as stream:
            async for gen, out in stream:
                i, lp = gen.index, lps[gen.index]
                if i not in started:
                    started.add(i)
                    text, logprobs[i] = self._first(choices, gen, out, lp, echoes)
                    texts[i].append(text)
                else:
                    texts[i].append(out.new_text)
                    if lp is not None:
                        _merge(logprobs[i], lp.piece(out.logprobs))
                if out.finished:
                    reasons[i] = out.finish_reason
        result = [{"index": i, "text": "".join(t), "logprobs": logprobs[i], "finish_reason": reasons[i]}
                  for i, t in enumerate(texts)]
        return {**head, "choices": result, "usage": choices.usage()}

    async def _stream(self, choices: Choices, head: dict, lps: list, echoes, include_usage) -> AsyncIterator[str]:
        """include_usage: False, True (a last chunk with the usage) or "continuous" (usage on every chunk too)."""
        started: set[int] = set()
        try:
            async with aclosing(choices.batches()) as batches:
                async for batch in batches:
                    for gen, outs in by_choice(batch):
                        out, lp = merge_outputs(outs), lps[gen.index]
                        if gen.index not in started:
                            started.add(gen.index)
                            text, logprobs = self._first(choices, gen, out, lp, echoes)
                        else:
                            text, logprobs = out.new_text, lp.piece(out.logprobs) if lp is not None else None
                        chunk = {**head, "choices": [{"index": gen.index, "text": text,
                                                      "finish_reason": out.finish_reason, "logprobs": logprobs}]}
                        if include_usage == "continuous":
                            chunk["usage"] = choices.usage()
                        yield event(chunk)
            if include_usage:
                yield event({**head, "choices": [], "usage": choices.usage()})
        except Exception as exc:  # the status line is already sent: report in the stream
            error = exc if isinstance(exc, APIError) else APIError(500, f"internal error: {exc}", code="internal_error")
            yield event(error.body())
        yield DONE
