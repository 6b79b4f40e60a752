"""POST /v1/completions: raw text (or token ids) in, text out; no template, no reasoning split."""
from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hf2q.engine.sampling_params import MAX_TOP_LOGPROBS
from hf2q.server.choices import Choices
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
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in logprobs or []:
            token = self._text(lp.token_id)
            out["tokens"].append(token)
            out["token_logprobs"].append(float(lp.logprob))
            out["top_logprobs"].append({self._text(t): float(v) for t, v in lp.top})
            out["text_offset"].append(self.offset)
            self.offset += len(token)
        return out

    def _text(self, token_id: int) -> str:
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def _merge(into: dict, piece: dict) -> None:
    for key, values in piece.items():
        into.setdefault(key, []).extend(values)


class CompletionServing:
    def __init__(self, state: ServerState):
        self.state = state

    def prompt_ids(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise bad_request("batched prompts are not supported; send one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.state.model.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise bad_request("the prompt is empty", param="prompt")
        return ids

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        self.state.check_model(req.model)
        check_stream_options(req)
        if req.echo:
            raise bad_request("echo is not supported", param="echo")
        if req.suffix is not None:
            raise bad_request("suffix (fill-in-the-middle) is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}",
                              param="logprobs")
        ids = await asyncio.to_thread(self.prompt_ids, req)  # a long prompt tokenizes off the event loop
        want_lp = req.logprobs is not None
        params = build_params(req, self.state.model.config.vocab_size, req.max_tokens if req.max_tokens is not None
                              else 16, want_lp, req.logprobs or 0)
        choices = Choices(self.state, ids, params, "prompt")
        await choices.start()
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.state.config.model_name}
        log_labels("completion", head["id"], req)
        lps = [CompletionLogprobs(self.state.model.tokenizer) if want_lp else None for _ in range(params.n)]
        if req.stream:
            opts = req.stream_options
            usage = "continuous" if opts and opts.continuous_usage_stats else bool(opts and opts.include_usage)
            return StreamingResponse(self._stream(choices, head, lps, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        body = await unless_disconnected(raw, self._collect(choices, head, lps))
        return JSONResponse(body) if body is not None else Response(status_code=499)

    async def _collect(self, choices: Choices, head: dict, lps: list) -> dict:
        texts = [[] for _ in lps]
        logprobs: list[Optional[dict]] = [{} if lp is not None else None for lp in lps]
        reasons: list[Optional[str]] = [None] * len(lps)
        async with aclosing(choices.stream()) as stream:
            async for gen, out in stream:
                texts[gen.index].append(out.new_text)
                if lps[gen.index] is not None:
                    _merge(logprobs[gen.index], lps[gen.index].piece(out.logprobs))
                if out.finished:
                    reasons[gen.index] = out.finish_reason
        result = [{"index": i, "text": "".join(t), "logprobs": logprobs[i], "finish_reason": reasons[i]}
                  for i, t in enumerate(texts)]
        return {**head, "choices": result, "usage": choices.usage()}

    async def _stream(self, choices: Choices, head: dict, lps: list, include_usage) -> AsyncIterator[str]:
        """include_usage: False, True (a last chunk with the usage) or "continuous" (usage on every chunk too)."""
        try:
            async with aclosing(choices.stream()) as stream:
                async for gen, out in stream:
                    lp = lps[gen.index]
                    chunk = {**head, "choices": [{
                        "index": gen.index, "text": out.new_text, "finish_reason": out.finish_reason,
                        "logprobs": lp.piece(out.logprobs) if lp is not None else None}]}
                    if include_usage == "continuous":
                        chunk["usage"] = choices.usage()
                    yield event(chunk)
            if include_usage:
                yield event({**head, "choices": [], "usage": choices.usage()})
        except Exception as exc:  # the status line is already sent: report in the stream
            error = exc if isinstance(exc, APIError) else APIError(500, f"internal error: {exc}", code="internal_error")
            yield event(error.body())
        yield DONE
