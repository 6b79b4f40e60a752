"""/v1/responses: a Responses request runs as a chat completion; its output comes back as Response items.

The request is translated into a ChatCompletionRequest (input items -> messages, flat tools -> chat tools,
`text.format` -> response_format, `reasoning.effort` -> reasoning_effort), so every check and every
generation knob is the chat path's. One `_Items` builder turns the chat deltas into output items and the
stream events they imply, so the streamed and the non-streamed Response are built the same way.
"""
from __future__ import annotations

import copy
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from hf2q.server.chat_output import ChatOutput
from hf2q.server.choices import Choices
from hf2q.server.errors import APIError, bad_request, validation_error
from hf2q.server.prompt_images import NO_VISION
from hf2q.server.request_fields import CANNOT, check_stream_options, log_labels, refuse_unless_null
from hf2q.server.response_store import ResponseStore, input_items
from hf2q.server.schemas import (ChatCompletionRequest, FunctionCallItem, FunctionCallOutputItem, InputMessage,
                                 ReasoningItem, ResponsesRequest)
from hf2q.server.serving_chat import ChatServing
from hf2q.server.sse import json_data, unless_disconnected
from hf2q.server.state import ServerState

def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text"):
            raise bad_request(f"content part type {part.type!r} is not supported: this server accepts text "
                              f"parts only", param=f"{where}.content[{j}]")
        parts.append(part.text)
    return "".join(parts)


def _user_content(content, where: str, vision: bool):
    """A user message's content: its text, or chat parts when it carries `input_image` items."""
    if isinstance(content, str) or all(part.type != "input_image" for part in content):
        return _text(content, where)
    parts = []
    for j, part in enumerate(content):
        if part.type == "input_image" and not vision:
            raise bad_request(NO_VISION, param=f"{where}.content[{j}]")
        if part.type != "input_image":
            parts.append({"type": "text", "text": _text([part], where)})
            continue
        extra = part.model_extra or {}
        if not isinstance(extra.get("image_url"), str):
            raise bad_request("input_image needs an image_url (a file_id is not supported)",
                              param=f"{where}.content[{j}].image_url")
        parts.append({"type": "image_url", "image_url": {"url": extra["image_url"], "detail": extra.get("detail")}})
    return parts


def input_messages(items, vision: bool = False) -> list[dict]:
    """Responses input (a string, or items) as chat messages. Reasoning items go to the next assistant
    message's `reasoning_content`; consecutive function calls become one assistant message's tool calls."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    reasoning: Optional[str] = None

    def assistant() -> dict:
        nonlocal reasoning
        msg = {"role": "assistant", "content": None}
        if reasoning is not None:
            msg["reasoning_content"], reasoning = reasoning, None
        messages.append(msg)
        return msg

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, ReasoningItem):
            if item.encrypted_content is not None:
                raise bad_request("encrypted reasoning is not supported; send its text",
                                  param=f"{where}.encrypted_content")
            reasoning = (reasoning or "") + "".join(p.text for p in (item.content or item.summary))
        elif isinstance(item, InputMessage) and item.role == "assistant":
            assistant()["content"] = _text(item.content, where)
        elif isinstance(item, InputMessage):
            content = _user_content(item.content, where, vision) if item.role == "user" else _text(item.content, where)
            messages.append({"role": item.role, "content": content})
        elif isinstance(item, FunctionCallItem):
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or reasoning is not None:
                last = assistant()
            last.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        else:
            assert isinstance(item, FunctionCallOutputItem)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, where)})
    return messages


# Responses fields refused unless null, and why.
_CANNOT = {
    "conversation": "conversations are not stored here: send the history as input, or use previous_response_id",
    "prompt": "stored prompt templates are not served here: send instructions and input",
    "moderation": CANNOT["moderation"],
    "context_management": "context management is not supported: a conversation longer than the context is "
                          "refused",
    "access_programs": "access programs are not offered by this server",
    "background_options": "background responses are not supported: this server answers in the request",
    "image": "request-level image options are not supported (images in input parts are)",
}


def _check(req: ResponsesRequest) -> None:
    check_stream_options(req)
    refuse_unless_null(req, _CANNOT)
    if req.max_tool_calls is not None and req.max_tool_calls < 0:  # no built-in tools run here: never reached
        raise bad_request(f"max_tool_calls must be an integer >= 0, got {req.max_tool_calls}", param="max_tool_calls")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise bad_request(f"top_logprobs must be between 0 and 20, got {req.top_logprobs}", param="top_logprobs")
    if req.top_logprobs:
        raise bad_request("output log-probabilities are not returned by /v1/responses here (include "
                          "message.output_text.logprobs is not supported); use /v1/chat/completions with logprobs",
                          param="top_logprobs")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be an integer >= 1, got {req.max_output_tokens}",
                          param="max_output_tokens")
    if req.background:
        raise bad_request("background responses are not supported: this server answers in the request",
                          param="background")
    if req.include:
        raise bad_request(f"include {req.include!r} is not supported: nothing extra can be included",
                          param="include")
    if req.reasoning is not None:
        for field in ("summary", "generate_summary"):
            if getattr(req.reasoning, field) is not None:
                raise bad_request("reasoning summaries are not generated: the reasoning comes back whole as a "
                                  f"reasoning item; leave reasoning.{field} out", param=f"reasoning.{field}")
    if req.truncation == "auto":
        raise bad_request("truncation 'auto' is not supported: a conversation longer than the context is "
                          "refused; send 'disabled' or leave it out", param="truncation")


def to_chat(req: ResponsesRequest, history: list[dict],
            vision: bool = False) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request a Responses request runs as, and its conversation (without the instructions);
    `vision`: the model reads images, so `input_image` parts become chat image parts."""
    conversation = history + input_messages(req.input, vision)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else [])
    body: dict = {"model": req.model, "messages": messages + conversation, "stream": req.stream,
                  "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                  "parallel_tool_calls": req.parallel_tool_calls, "user": req.user, "metadata": req.metadata,
                  "safety_identifier": req.safety_identifier, "prompt_cache_key": req.prompt_cache_key,
                  "service_tier": req.service_tier}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in req.tools]
    choice = req.tool_choice
    body["tool_choice"] = choice if choice is None or isinstance(choice, str) else \
        {"type": "function", "function": {"name": choice.name}}
    if req.reasoning is not None:
        body["reasoning_effort"] = req.reasoning.effort
    if req.text is not None:
        body["verbosity"] = req.text.verbosity
        fmt = req.text.format
        if fmt is not None and fmt.type == "json_schema":
            spec = {"name": fmt.name or "response", "description": fmt.description, "strict": fmt.strict,
                    "schema": fmt.json_schema if fmt.json_schema is not None else True}
            body["response_format"] = {"type": "json_schema", "json_schema": {k: v for k, v in spec.items()
                                                                              if v is not None}}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
    try:
        return ChatCompletionRequest.model_validate(body), conversation
    except ValidationError as exc:
        raise validation_error(RequestValidationError(exc.errors())) from None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Items:
    """Output items built from chat deltas; `feed` and `finish` return the stream events they imply."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: Optional[dict] = None  # the item receiving deltas
        self.calls: dict[int, dict] = {}  # chat tool-call index -> its function_call item

    def feed(self, delta: dict) -> list[dict]:
        events: list[dict] = []
        for kind, key in (("reasoning", "reasoning_content"), ("message", "content")):
            text = delta.get(key)
            if not text:
                continue
            if self.open is None or self.open["type"] != kind:
                events += self._close("completed") + self._add(kind)
            item = self.open
            item["content"][0]["text"] += text
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            events.append({"type": name, **self._where(item), "content_index": 0, "delta": text,
                           **({"logprobs": []} if kind == "message" else {})})
        for entry in delta.get("tool_calls") or []:
            if "id" in entry:
                events += self._close("completed") + self._add_call(entry)
            fragment = entry["function"].get("arguments")
            if fragment:
                item = self.calls[entry["index"]]
                item["arguments"] += fragment
                events.append({"type": "response.function_call_arguments.delta", **self._where(item),
                               "delta": fragment})
        return events

    def finish(self, incomplete: bool) -> list[dict]:
        """Close the last item: "incomplete" when the token limit cut it."""
        return self._close("incomplete" if incomplete else "completed")

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _add(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.items.append(item)
        self.open = item
        events = [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                   "item": {**copy.deepcopy(item), "content": []}}]
        if kind == "message":
            events.append({"type": "response.content_part.added", **self._where(item), "content_index": 0,
                           "part": copy.deepcopy(item["content"][0])})
        return events

    def _add_call(self, entry: dict) -> list[dict]:
        item = {"id": _new_id("fc"), "type": "function_call", "call_id": entry["id"],
                "name": entry["function"]["name"], "arguments": "", "status": "in_progress"}
        self.items.append(item)
        self.calls[entry["index"]] = item
        self.open = item  # calls stream one after the other: the next item closes this one
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}]

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        return [] if item is None else self._done(item, status)

    def _done(self, item: dict, status: str) -> list[dict]:
        item["status"] = status
        where = self._where(item)
        if item["type"] == "function_call":
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": item["arguments"]}]
        elif item["type"] == "reasoning":
            events = [{"type": "response.reasoning_text.done", **where, "content_index": 0,
                       "text": item["content"][0]["text"]}]
        else:
            part = item["content"][0]
            events = [{"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"],
                       "logprobs": []},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": copy.deepcopy(part)}]
        return events + [{"type": "response.output_item.done", "output_index": where["output_index"],
                          "item": copy.deepcopy(item)}]


class ResponsesServing:
    def __init__(self, state: ServerState, chat: ChatServing):
        self.state = state
        self.chat = chat
        self.store = ResponseStore()

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        _check(req)
        history = self.store.conversation(req.previous_response_id) if req.previous_response_id is not None else []
        chat_req, conversation = to_chat(req, history, self.state.vision is not None)
        choices, outputs, head = await self.chat.start(chat_req)
        response = self._response(req, _new_id("resp"), head["created"])
        log_labels("responses", response["id"], req)
        run = _Run(self, req, response, conversation, choices, outputs[0], chat_req)
        if req.stream:
            return StreamingResponse(run.stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        body = await unless_disconnected(raw, run.collect())
        return JSONResponse(body) if body is not None else Response(status_code=499)

    def _response(self, req: ResponsesRequest, response_id: str, created: int) -> dict:
        """The Response object before any output (what `response.created` carries)."""
        reasoning = req.reasoning.model_dump() if req.reasoning else {"effort": None, "summary": None}
        fmt = req.text.format if req.text and req.text.format else None
        return {"id": response_id, "object": "response", "created_at": created, "status": "in_progress",
                "model": self.state.config.model_name, "output": [], "error": None, "incomplete_details": None,
                "instructions": req.instructions, "metadata": req.metadata or {},
                "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": req.temperature,
                "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
                "tool_choice": req.tool_choice.model_dump() if req.tool_choice and not isinstance(
                    req.tool_choice, str) else (req.tool_choice or "auto"),
                "tools": [t.model_dump() for t in req.tools or []],
                "previous_response_id": req.previous_response_id, "reasoning": reasoning,
                "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}},
                "store": req.store is not False, "truncation": "disabled", "user": req.user, "usage": None}


class _Run:
    """One response being generated: chat deltas in, output items (and stream events) out."""

    def __init__(self, serving: ResponsesServing, req: ResponsesRequest, response: dict, conversation: list[dict],
                 choices: Choices, output: ChatOutput, chat_req: ChatCompletionRequest):
        self.serving, self.req, self.response = serving, req, response
        self.conversation, self.choices, self.output = conversation, choices, output
        self.chat_req = chat_req
        self.items = _Items()

    async def deltas(self) -> AsyncIterator[list[dict]]:
        """The stream events of each engine delta, then those closing the items."""
        reason = None
        async with aclosing(self.choices.stream()) as stream:
            async for _, out in stream:
                yield self.items.feed(self.output.feed(out))
                if out.finished or self.output.cut:
                    reason = self.output.finish_reason(out.finish_reason if out.finished else None)
                    break
        incomplete = reason == "length"
        yield self.items.finish(incomplete)
        self._final(incomplete)
        if reason is not None:  # before the last event: a later response may continue this one at once
            await self.serving.chat.prefill_next_turn(self.chat_req, self.output, reason)

    def _final(self, incomplete: bool) -> None:
        usage = self.choices.usage(self.output.reasoning_tokens)
        self.response.update(
            status="incomplete" if incomplete else "completed", output=self.items.items,
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage={"input_tokens": usage["prompt_tokens"],
                   "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                   "output_tokens": usage["completion_tokens"],
                   "output_tokens_details": {"reasoning_tokens": self.output.reasoning_tokens},
                   "total_tokens": usage["total_tokens"]})
        if self.req.store is not False:
            self.serving.store.put(self.response, self.conversation + [self.output.message()],
                                   input_items(self.req.input))

    async def collect(self) -> dict:
        async with aclosing(self.deltas()) as deltas:
            async for _ in deltas:
                pass
        return self.response

    async def stream(self) -> AsyncIterator[str]:
        seq = 0

        def frame(payload: dict) -> str:
            nonlocal seq
            payload = {**payload, "sequence_number": seq}
            seq += 1
            return f"event: {payload['type']}\ndata: {json_data(payload)}\n\n"

        yield frame({"type": "response.created", "response": copy.deepcopy(self.response)})
        yield frame({"type": "response.in_progress", "response": copy.deepcopy(self.response)})
        try:
            async with aclosing(self.deltas()) as deltas:  # a client gone mid-stream aborts the generation
                async for events in deltas:
                    for e in events:
                        yield frame(e)
        except Exception as exc:  # the status line is already sent: report in the stream
            error = exc if isinstance(exc, APIError) else APIError(500, f"internal error: {exc}", code="internal_error")
            yield frame({"type": "error", "code": error.code, "message": error.message, "param": error.param})
            return
        done = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        yield frame({"type": done, "response": self.response})
