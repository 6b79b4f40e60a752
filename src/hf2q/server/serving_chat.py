"""POST /v1/chat/completions: render the template, generate, route reasoning/tool calls, answer or stream."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Optional, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hf2q.engine.request import RequestOptions
from hf2q.server.chat_output import ChatOutput, add_delta
from hf2q.server.choices import Choices, by_choice, logprob_entries
from hf2q.server.errors import APIError, bad_request
from hf2q.server.media import load_images
from hf2q.server.prompt_images import check_fits, expand_image_pads, image_urls, widen
from hf2q.server.request_fields import check_chat_fields, log_labels, thinking_budget, thinking_kwargs
from hf2q.server.sampling import build_params
from hf2q.server.schemas import ChatCompletionRequest, Message
from hf2q.server.sse import DONE, event, unless_disconnected
from hf2q.server.state import ServerState
from hf2q.text.reasoning import prompt_opens_reasoning
from hf2q.text.tokenizer import MESSAGE_START
from hf2q.vision.inputs import ImageInput
from hf2q.vision.prompt import image_pad_id

log = logging.getLogger(__name__)

# Arguments of `ChatTemplate.render` itself: chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")


def _template_message(i: int, m: Message) -> dict:
    """A message as the chat template sees it (transformers' conventions)."""
    if isinstance(m.content, list):
        for j, part in enumerate(m.content):
            if part.type not in ("text", "image_url"):
                raise bad_request(f"content part type {part.type!r} is not supported: this server accepts text "
                                  f"and image_url parts", param=f"messages[{i}].content[{j}]")
    msg = m.model_dump(exclude_none=True, exclude={"annotations", "refusal"})
    if isinstance(m.content, list):  # the template needs only where an image is, not its data
        msg["content"] = [{"type": "image"} if p["type"] == "image_url" else p for p in msg["content"]]
    if m.role == "developer":  # OpenAI's newer name for the system message
        msg["role"] = "system"
    if m.refusal and not m.content:  # an earlier answer that was a refusal: it is what the assistant said
        msg["content"] = m.refusal
    for j, call in enumerate(msg.get("tool_calls") or []):
        args = call["function"]["arguments"]
        if isinstance(args, str):  # OpenAI sends a JSON string; Qwen's template iterates a mapping
            try:
                parsed = json.loads(args) if args.strip() else {}
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):
                raise bad_request("tool call arguments must be a JSON object",
                                  param=f"messages[{i}].tool_calls[{j}].function.arguments")
            call["function"]["arguments"] = parsed
    return msg


def _check_unsupported(req: ChatCompletionRequest) -> None:
    # Both token limits are checked, not only the one used: max_completion_tokens wins when both are given.
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name)
        if value is not None and value < 1:
            raise bad_request(f"{name} must be an integer >= 1, got {value}", param=name)
    if req.thinking_budget is not None and req.thinking_budget < 0:
        raise bad_request(f"thinking_budget must be an integer >= 0, got {req.thinking_budget}",
                          param="thinking_budget")
    choice = req.tool_choice
    names = [t.function.name for t in req.tools or []]
    if choice is None or choice in ("auto", "none"):
        return
    if not names:
        raise bad_request("tool_choice requires tools", param="tool_choice")
    if not isinstance(choice, str) and choice.function.name not in names:
        raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools "
                          f"({', '.join(names)})", param="tool_choice")


def _tool_choice(req: ChatCompletionRequest):
    """tool_choice as plain data: "auto" / "none" / "required" or {"type": "function", "function": {...}}."""
    choice = req.tool_choice
    return choice.model_dump() if choice is not None and not isinstance(choice, str) else choice


def _constrained(req: ChatCompletionRequest) -> bool:
    """Whether the output must follow a grammar (a forced tool call, or a JSON response_format)."""
    forced = req.tool_choice is not None and req.tool_choice not in ("auto", "none")
    return forced or (req.response_format is not None and req.response_format.type != "text")


def render_prompt(state: ServerState, messages: list[Message], tools: Optional[list[dict]], extra: dict,
                  add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation: the model's chat template, the server's default kwargs under `extra`."""
    rendered, kwargs = _template_args(state, messages, extra)
    try:
        return state.model.chat_template.render(rendered, tools=tools, add_generation_prompt=add_generation_prompt,
                                                **kwargs)
    except Exception as exc:  # TemplateError, or a template raising on a message it refuses
        raise bad_request(f"the chat template could not render these messages: {exc}", param="messages")


def turn_anchor(state: ServerState, messages: list[Message], tools: Optional[list[dict]], extra: dict,
                prompt_ids: list[int], images: Sequence[ImageInput] = (), prompt_text: Optional[str] = None
                ) -> Optional[int]:
    """How many prompt tokens the next turn of this conversation will extend: the engine keeps a
    checkpoint there. Compared in tokens (the text can agree where the tokens do not: `<think>\n` then
    `\n</think>` merges newlines), and one token short of the whole prompt at most, since a resumed
    prompt computes at least one token. None when the template will not render a probe next turn. With
    the prompt's text (and no images), only the probe's text from the last message start the two texts
    share is tokenized (`_shared_tokens`): the rest of a long conversation is not tokenized a second time."""
    rendered, kwargs = _template_args(state, messages, extra)
    try:
        probe = state.model.chat_template.next_turn_probe(rendered, tools=tools, **kwargs)
    except Exception:
        return None
    tokenizer = state.model.tokenizer
    shared = _shared_tokens(tokenizer, probe, prompt_text, prompt_ids) if prompt_text and not images else None
    if shared is None:
        ids = tokenizer.encode(probe)
        if images:
            ids = widen(ids, image_pad_id(tokenizer), list(images))
        shared = (0, ids)
    offset, ids = shared
    rest = prompt_ids[offset:]
    n = offset + next((i for i, (a, b) in enumerate(zip(ids, rest)) if a != b), min(len(ids), len(rest)))
    return min(n, len(prompt_ids) - 1) or None


def _shared_tokens(tokenizer, probe: str, prompt_text: str, prompt_ids: list[int]
                   ) -> Optional[tuple[int, list[int]]]:
    """(token offset, ids of the probe from there): the probe's text cut at the last message start inside the
    text it shares with the prompt. A message start is a special token, so the text before it tokenizes to
    the prompt's ids before the same count of those tokens. None where that cannot be found."""
    start_id = tokenizer.token_to_id(MESSAGE_START)
    if start_id is None:
        return None
    lo, hi = 0, min(len(probe), len(prompt_text))  # the shared text's length, by bisection (slices compare in C)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if probe[:mid] == prompt_text[:mid] else (lo, mid - 1)
    cut = prompt_text.rfind(MESSAGE_START, 0, lo)
    if cut <= 0:
        return None
    offset = -1
    try:
        for _ in range(prompt_text.count(MESSAGE_START, 0, cut) + 1):
            offset = prompt_ids.index(start_id, offset + 1)
    except ValueError:
        return None
    return offset, tokenizer.encode(probe[cut:])


_NEXT_USER = "Next question."


def next_turn_history(state: ServerState, messages: list[Message], tools: Optional[list[dict]], extra: dict,
                      answer: dict) -> Optional[list[int]]:
    """The token ids the next user turn of this conversation will start with, once `answer` (this turn's
    assistant message) is sent back: the history up to where that user message begins. The template may
    render the history differently from this turn's prompt (Qwen3.5 drops the think blocks of an agent
    loop's messages once a user speaks), so these ids can be new to every checkpoint held. None when the
    template does not render the conversation that way."""
    rendered, kwargs = _template_args(state, messages, extra)
    following = [*rendered, answer, {"role": "user", "content": _NEXT_USER}]
    try:
        text = state.model.chat_template.render(following, tools=tools, add_generation_prompt=False, **kwargs)
    except Exception:
        return None
    start = text.rfind(MESSAGE_START, 0, max(text.rfind(_NEXT_USER), 0))
    return state.model.tokenizer.encode(text[:start]) if start > 0 else None


def _template_args(state: ServerState, messages: list[Message], extra: dict) -> tuple[list[dict], dict]:
    kwargs = {**state.config.default_chat_template_kwargs, **extra}
    bad = [k for k in kwargs if k in _RESERVED_TEMPLATE_KWARGS]
    if bad:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(bad)}", param="chat_template_kwargs")
    return [_template_message(i, m) for i, m in enumerate(messages)], kwargs


class ChatServing:
    def __init__(self, state: ServerState):
        self.state = state

    def render(self, req: ChatCompletionRequest) -> tuple[str, Optional[list[dict]]]:
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        return render_prompt(self.state, req.messages, self._template_tools(req, tools), self._extra(req)), tools

    def anchor(self, req: ChatCompletionRequest, tools: Optional[list[dict]], prompt_ids: list[int],
               images: list[ImageInput], prompt_text: str) -> Optional[int]:
        return turn_anchor(self.state, req.messages, self._template_tools(req, tools), self._extra(req), prompt_ids,
                           images, prompt_text)

    async def images(self, req: ChatCompletionRequest) -> list[ImageInput]:
        """The request's images, fetched and preprocessed (a 400 naming the part for any problem)."""
        urls = image_urls(req.messages, self.state.vision is not None)
        if not urls:
            return []
        return await load_images(urls, self.state.config.media, self.state.vision)

    def with_image_tokens(self, prompt_ids: list[int], images: list[ImageInput]) -> list[int]:
        """The prompt with each image's pad token widened to its soft-token count; it must fit the context."""
        if not images:
            return prompt_ids
        ids = expand_image_pads(prompt_ids, image_pad_id(self.state.model.tokenizer), images)
        check_fits(len(ids), images, self.state.config.max_model_len)
        return ids

    @staticmethod
    def _template_tools(req: ChatCompletionRequest, tools: Optional[list[dict]]) -> Optional[list[dict]]:
        return None if req.tool_choice == "none" else tools

    @staticmethod
    def _extra(req: ChatCompletionRequest) -> dict:
        return {**thinking_kwargs(req), **(req.chat_template_kwargs or {})}

    async def grammar(self, req: ChatCompletionRequest, tools: Optional[list[dict]], opens_reasoning: bool):
        """The request's compiled grammar (compiled off the event loop; the compiler is built once per model)."""
        from hf2q.engine import grammar  # xgrammar takes seconds to import: only constrained requests need it

        model = self.state.model
        response_format = req.response_format.model_dump(exclude_none=True, by_alias=True) if req.response_format else None
        try:
            fmt = grammar.request_format(tools, _tool_choice(req), req.parallel_tool_calls is not False,
                                         response_format, opens_reasoning)
            return await asyncio.to_thread(
                lambda: grammar.compiler_for(model.tokenizer, model.config.vocab_size).compile(fmt))
        except ValueError as exc:
            param = "response_format" if req.tool_choice in (None, "auto", "none") else "tool_choice"
            raise bad_request(str(exc), param=param) from None

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        choices, outputs, head = await self.start(req)
        log_labels("chat", head["id"], req)
        if req.stream:
            opts = req.stream_options
            usage = "continuous" if opts and opts.continuous_usage_stats else bool(opts and opts.include_usage)
            return StreamingResponse(self._stream(choices, outputs, head, req.logprobs, usage, req),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        body = await unless_disconnected(raw, self._collect(choices, outputs, head, req.logprobs, req))
        return JSONResponse(body) if body is not None else Response(status_code=499)

    async def start(self, req: ChatCompletionRequest) -> tuple[Choices, list[ChatOutput], dict]:
        """Check, render and submit a chat request: its running choices, one output router each, and the
        response head (id, created, model). /v1/responses runs its requests through here too."""
        self.state.check_model(req.model)
        check_chat_fields(req)
        _check_unsupported(req)
        # Rendering and tokenizing a large conversation takes a while: off the event loop, which keeps serving.
        images = await self.images(req)
        prompt_text, tools = await asyncio.to_thread(self.render, req)
        prompt_ids = await asyncio.to_thread(self.state.model.tokenizer.encode, prompt_text)
        prompt_ids = self.with_image_tokens(prompt_ids, images)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = build_params(req, self.state.model.config.vocab_size, max_tokens, req.logprobs,
                              req.top_logprobs or 0, self.state.config.sampling_defaults)
        starts = prompt_opens_reasoning(prompt_text)
        anchor = None
        if self.state.config.prefix_cache:  # one more render and tokenization: off the event loop too
            anchor = await asyncio.to_thread(self.anchor, req, tools, prompt_ids, images, prompt_text)
        grammar = await self.grammar(req, tools, starts) if _constrained(req) else None
        options = RequestOptions(thinking_budget=thinking_budget(req), starts_in_reasoning=starts, anchor=anchor,
                                 images=tuple(images or ()), grammar=grammar)
        choices = Choices(self.state, [prompt_ids], params, "messages", options)
        await choices.start()
        outputs = [ChatOutput(starts, tools, _tool_choice(req), req.parallel_tool_calls is not False)
                   for _ in range(params.n)]
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.state.config.model_name}
        if req.service_tier is not None:
            head["service_tier"] = "default"  # what "auto" resolves to here: the only tier
        return choices, outputs, head

    async def prefill_next_turn(self, req: ChatCompletionRequest, output: ChatOutput, finish_reason: str) -> None:
        """After an answer that is not a tool call, have the engine checkpoint this conversation's history as
        the next user turn will render it (`next_turn_history`), before the client can send that turn.
        One choice only (a client sends one back), and not with images (their pads are keyed by content)."""
        if not self.state.config.prefix_rerender or (req.n or 1) != 1 or finish_reason not in ("stop", "length") \
                or image_urls(req.messages, self.state.vision is not None):
            return
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            ids = await asyncio.to_thread(next_turn_history, self.state, req.messages,
                                          self._template_tools(req, tools), self._extra(req), output.message())
        except Exception:  # an optimisation: never the request's failure
            log.exception("re-rendering the conversation for the next turn failed")
            return
        if ids:
            self.state.engine.prefill_in_background(ids)

    async def _collect(self, choices: Choices, outputs: list[ChatOutput], head: dict, logprobs: bool,
                       req: Optional[ChatCompletionRequest] = None) -> dict:
        """The whole response; with `req`, an answer then has the next turn's history prefilled."""
        lps: list[list[dict]] = [[] for _ in outputs]
        reasons: list[Optional[str]] = [None] * len(outputs)
        async with aclosing(choices.stream()) as stream:
            async for gen, out in stream:
                o = outputs[gen.index]
                o.feed(out)
                if logprobs:
                    lps[gen.index] += logprob_entries(self.state.model.tokenizer, out.logprobs)
                if out.finished:
                    reasons[gen.index] = out.finish_reason
                if all(r is not None or c.cut for r, c in zip(reasons, outputs)):
                    break
        if req is not None:
            await self.prefill_next_turn(req, outputs[0], outputs[0].finish_reason(reasons[0]))
        result = []
        for i, o in enumerate(outputs):
            result.append({"index": i, "message": o.message(), "finish_reason": o.finish_reason(reasons[i]),
                           "logprobs": {"content": lps[i]} if logprobs else None})
        return {**head, "object": "chat.completion", "choices": result,
                "usage": choices.usage(sum(o.reasoning_tokens for o in outputs))}

    async def _stream(self, choices: Choices, outputs: list[ChatOutput], head: dict, logprobs: bool,
                      include_usage, req: Optional[ChatCompletionRequest] = None) -> AsyncIterator[str]:
        """include_usage: False, True (a last chunk with the usage) or "continuous" (usage so far on every
        chunk too, vLLM's continuous_usage_stats). With `req`, an answer has the next turn's history prefilled."""
        ends: dict[int, str] = {}
        chunk = {**head, "object": "chat.completion.chunk"}
        if include_usage:
            chunk["usage"] = None

        def frame(index: int, delta: dict, finish: Optional[str] = None, lp: Optional[list] = None) -> str:
            choice = {"index": index, "delta": delta, "finish_reason": finish}
            if logprobs:
                choice["logprobs"] = {"content": lp} if lp is not None else None
            if include_usage == "continuous":
                return event({**chunk, "choices": [choice],
                              "usage": choices.usage(sum(o.reasoning_tokens for o in outputs))})
            return event({**chunk, "choices": [choice]})

        try:
            for i in range(len(outputs)):
                yield frame(i, {"role": "assistant", "content": ""})
            open_choices = set(range(len(outputs)))
            async with aclosing(choices.batches()) as batches:
                async for batch in batches:
                    for gen, outs in by_choice(batch):
                        if gen.index not in open_choices:
                            continue
                        o, pieces, end = outputs[gen.index], [], None
                        for out in outs:
                            delta = o.feed(out)
                            lp = logprob_entries(self.state.model.tokenizer, out.logprobs) if logprobs else None
                            if delta or lp:
                                add_delta(pieces, delta, lp)
                            if out.finished or o.cut:
                                end = o.finish_reason(out.finish_reason if out.finished else None)
                                break
                        for delta, lp in pieces:
                            yield frame(gen.index, delta, lp=lp)
                        if end is not None:
                            ends[gen.index] = end
                            open_choices.discard(gen.index)
                            yield frame(gen.index, {}, end)
                    if not open_choices:
                        break
            if include_usage:
                usage = choices.usage(sum(o.reasoning_tokens for o in outputs))
                yield event({**chunk, "choices": [], "usage": usage})
            if req is not None and 0 in ends:  # before [DONE], which a client reads before its next turn
                await self.prefill_next_turn(req, outputs[0], ends[0])
        except Exception as exc:  # the status line is already sent: report in the stream
            error = exc if isinstance(exc, APIError) else APIError(500, f"internal error: {exc}", code="internal_error")
            yield event(error.body())
        yield DONE
