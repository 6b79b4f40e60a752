"""The request fields that are not sampling knobs: each one honoured, logged, or refused with a 400 naming it.

The rule: a field whose value would change the answer in a way hf2q cannot (audio output, web search,
stored completions) is refused; a field that only labels the request (`user`, `metadata`, ...) is logged.
README.md has the table of every field.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Union

from hf2q.server.errors import bad_request
from hf2q.server.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("hf2q.requests")

# reasoning_effort -> thinking: off, or on with this many reasoning tokens before `</think>` is forced.
THINKING_OFF = ("none", "minimal")
REASONING_BUDGETS = {"low": 1024, "medium": 4096}  # "high", "xhigh", "max": no budget

# Chat fields refused unless null, and why.
CANNOT = {
    "audio": "audio output is not supported: this server generates text only",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported: this server has no search tool",
    "moderation": "moderation is not supported: this server runs no moderation model",
    "functions": "functions is the deprecated form of tools; send tools instead",
    "function_call": "function_call is the deprecated form of tool_choice; send tool_choice instead",
}


def check_stream_options(req) -> None:
    """As OpenAI: stream_options only with stream true; obfuscation padding is not offered (chat,
    completions and responses requests alike)."""
    opts = req.stream_options
    if opts is None:
        return
    if not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    if opts.include_obfuscation:
        raise bad_request("stream obfuscation is not supported; leave include_obfuscation out or false",
                          param="stream_options.include_obfuscation")


def refuse_unless_null(req, reasons: dict[str, str]) -> None:
    """A 400 naming the first of `reasons`' fields that the request sets, with its reason."""
    for name, why in reasons.items():
        if getattr(req, name) is not None:
            raise bad_request(why, param=name)


def check_chat_fields(req: ChatCompletionRequest) -> None:
    """A 400 naming the first field whose value this server cannot honour."""
    check_stream_options(req)
    refuse_unless_null(req, CANNOT)
    if req.store:
        raise bad_request("store true is not supported: this server keeps no completions; send false or "
                          "leave it out", param="store")
    if req.service_tier not in (None, "auto", "default"):
        raise bad_request(f"service_tier {req.service_tier!r} is not offered; use 'auto' or 'default'",
                          param="service_tier")
    if req.modalities is not None and req.modalities != ["text"]:
        raise bad_request("only the 'text' modality is supported", param="modalities")
    if req.verbosity not in (None, "medium"):
        raise bad_request(f"verbosity {req.verbosity!r} is not supported; the model answers at its own "
                          f"('medium') verbosity", param="verbosity")
    _check_metadata(req.metadata)
    for i, m in enumerate(req.messages):
        if m.audio is not None:
            raise bad_request("audio in messages is not supported", param=f"messages[{i}].audio")
        if m.function_call is not None:
            raise bad_request("function_call is the deprecated form of tool_calls; send tool_calls instead",
                              param=f"messages[{i}].function_call")
    enable = (req.chat_template_kwargs or {}).get("enable_thinking")
    if req.reasoning_effort is not None and enable is not None and enable != thinking_on(req.reasoning_effort):
        raise bad_request(f"reasoning_effort {req.reasoning_effort!r} contradicts chat_template_kwargs "
                          f"enable_thinking {enable!r}", param="reasoning_effort")


def _check_metadata(metadata: Optional[dict[str, str]]) -> None:
    """OpenAI's limits: at most 16 pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return
    if len(metadata) > 16:
        raise bad_request(f"metadata has {len(metadata)} pairs; at most 16 are allowed", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise bad_request(f"metadata key {key[:64]!r}: keys may have 64 characters, values 512",
                              param="metadata")


def thinking_on(effort: str) -> bool:
    return effort not in THINKING_OFF


def thinking_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """The chat template variables reasoning_effort sets (the request's own chat_template_kwargs agree)."""
    return {} if req.reasoning_effort is None else {"enable_thinking": thinking_on(req.reasoning_effort)}


def thinking_budget(req: ChatCompletionRequest) -> Optional[int]:
    """thinking_budget when given, else the budget of the reasoning_effort."""
    if req.thinking_budget is not None:
        return req.thinking_budget
    return REASONING_BUDGETS.get(req.reasoning_effort or "")


def log_labels(kind: str, request_id: str, req: Union[ChatCompletionRequest, CompletionRequest]) -> None:
    """The fields that only label a request go to the log, with the request id they belong to."""
    names = ("user", "safety_identifier", "prompt_cache_key", "metadata")
    labels = {n: getattr(req, n, None) for n in names}
    labels = {n: v for n, v in labels.items() if v is not None}
    if labels:
        log.info("%s %s %s", kind, request_id, " ".join(f"{n}={v!r}" for n, v in labels.items()))
