"""Every field of OpenAI's chat and completions request schemas: a valid value is honoured or refused with a
400 naming the field, as README.md's table says; `null` is the same as leaving a field out."""
from __future__ import annotations

import json

import httpx
import pytest

MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
STREAM = {"stream": True}

# field -> (a valid value, extra fields the value needs, the param of the 400 or None when honoured)
CHAT_FIELDS = {
    "messages": (MSGS, {}, None),
    "model": ("tiny", {}, None),
    "audio": ({"voice": "alloy", "format": "wav"}, {}, "audio"),
    "frequency_penalty": (0.5, {}, None),
    "function_call": ("auto", {}, "function_call"),
    "functions": ([TOOL["function"]], {}, "functions"),
    "logit_bias": ({"11": 1}, {}, None),
    "logprobs": (True, {}, None),
    "max_completion_tokens": (1, {}, None),
    "max_tokens": (1, {}, None),
    "metadata": ({"team": "eval"}, {}, None),
    "modalities": (["text"], {}, None),
    "moderation": ({"model": "omni-moderation-latest"}, {}, "moderation"),
    "n": (2, {}, None),
    "parallel_tool_calls": (False, {"tools": [TOOL]}, None),
    "prediction": ({"type": "content", "content": "x"}, {}, "prediction"),
    "presence_penalty": (0.5, {}, None),
    "prompt_cache_key": ("conversation-1", {}, None),
    "prompt_cache_options": ({"mode": "implicit", "ttl": "30m"}, {}, None),
    "prompt_cache_retention": ("24h", {}, None),
    "reasoning_effort": ("low", {}, None),
    "response_format": ({"type": "text"}, {}, None),
    "safety_identifier": ("user-hash", {}, None),
    "seed": (1, {}, None),
    "service_tier": ("auto", {}, None),
    "stop": (["\n\n"], {}, None),
    "store": (False, {}, None),
    "stream": (True, {}, None),
    "stream_options": ({"include_usage": True}, STREAM, None),
    "temperature": (0.5, {}, None),
    "tool_choice": ("auto", {"tools": [TOOL]}, None),
    "tools": ([TOOL], {}, None),
    "top_logprobs": (2, {"logprobs": True}, None),
    "top_p": (0.9, {}, None),
    "user": ("user-1", {}, None),
    "verbosity": ("medium", {}, None),
    "web_search_options": ({}, {}, "web_search_options"),
}

# Values of accepted fields that cannot be honoured.
CHAT_REFUSED_VALUES = [
    ("store", True, {}, "store"),
    ("service_tier", "flex", {}, "service_tier"),
    ("modalities", ["text", "audio"], {}, "modalities"),
    ("verbosity", "low", {}, "verbosity"),
    ("stream_options", {"include_usage": True}, {}, "stream_options"),  # without stream, as OpenAI
    ("stream_options", {"include_obfuscation": True}, STREAM, "stream_options.include_obfuscation"),
    ("metadata", {f"k{i}": "v" for i in range(17)}, {}, "metadata"),
    ("reasoning_effort", "none", {"chat_template_kwargs": {"enable_thinking": True}}, "reasoning_effort"),
    ("tools", [{"type": "custom", "custom": {"name": "x"}}], {}, "tools[0].type"),
    ("tool_choice", {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, {"tools": [TOOL]},
     "tool_choice"),
]

COMPLETION_FIELDS = {
    "model": ("tiny", {}, None),
    "prompt": ("hello", {}, None),
    "best_of": (1, {}, None),
    "echo": (True, {}, None),
    "frequency_penalty": (0.5, {}, None),
    "logit_bias": ({"11": 1}, {}, None),
    "logprobs": (2, {}, None),
    "max_tokens": (1, {}, None),
    "n": (2, {}, None),
    "presence_penalty": (0.5, {}, None),
    "seed": (1, {}, None),
    "stop": ("\n", {}, None),
    "stream": (True, {}, None),
    "stream_options": ({"include_usage": True}, STREAM, None),
    "suffix": ("x", {}, "suffix"),
    "temperature": (0.5, {}, None),
    "top_p": (0.9, {}, None),
    "user": ("user-1", {}, None),
}


def sdk_fields(module) -> set[str]:
    params = module.CompletionCreateParamsStreaming
    return set(params.__required_keys__) | set(params.__optional_keys__)


def test_tables_cover_the_sdk():
    """A field the installed openai SDK can send and this test does not know of fails here."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    assert sdk_fields(chat_params) <= set(CHAT_FIELDS)
    assert sdk_fields(completion_create_params) <= set(COMPLETION_FIELDS)


def send(server, path: str, body: dict) -> httpx.Response:
    if body.get("stream"):
        with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
            r.read()
            return r
    return httpx.post(server.url + path, json=body, timeout=60)


def check(r: httpx.Response, refused: str | None) -> None:
    if refused is None:
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    else:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == refused


@pytest.mark.parametrize("field", sorted(CHAT_FIELDS))
def test_chat_field(plain_server, field):
    value, extra, refused = CHAT_FIELDS[field]
    body = {"messages": MSGS, "max_tokens": 1, **extra, field: value}
    if field == "max_completion_tokens":
        del body["max_tokens"]
    check(send(plain_server, "/v1/chat/completions", body), refused)


@pytest.mark.parametrize("field,value,extra,refused", CHAT_REFUSED_VALUES,
                         ids=[f"{c[0]}={json.dumps(c[1])[:20]}" for c in CHAT_REFUSED_VALUES])
def test_chat_value_refused(plain_server, field, value, extra, refused):
    check(send(plain_server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1, **extra, field: value}),
          refused)


@pytest.mark.parametrize("field", sorted(COMPLETION_FIELDS))
def test_completion_field(plain_server, field):
    value, extra, refused = COMPLETION_FIELDS[field]
    check(send(plain_server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, **extra, field: value}), refused)


def test_null_is_absent(plain_server):
    """Every optional field null at once, as clients that serialise unset fields send them."""
    nulls = {f: None for f in CHAT_FIELDS if f != "messages"}
    check(send(plain_server, "/v1/chat/completions", {**nulls, "messages": MSGS, "max_tokens": 1}), None)
    nulls = {f: None for f in COMPLETION_FIELDS if f != "prompt"}
    check(send(plain_server, "/v1/completions", {**nulls, "prompt": "hi", "max_tokens": 1}), None)
    message = {"role": "assistant", "content": "x", "refusal": None, "audio": None, "function_call": None,
               "annotations": None, "tool_calls": None, "name": None}
    check(send(plain_server, "/v1/chat/completions", {"messages": MSGS + [message] + MSGS, "max_tokens": 1}), None)


def test_reasoning_effort_switches_thinking(client):
    """"none"/"minimal" turn thinking off; "low" and up keep it on (random weights never close it)."""
    kw = {"model": "tiny", "messages": MSGS, "max_tokens": 4, "temperature": 0}
    off = client.chat.completions.create(reasoning_effort="none", **kw)
    on = client.chat.completions.create(reasoning_effort="low", **kw)
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    assert on.usage.completion_tokens_details.reasoning_tokens == on.usage.completion_tokens > 0


def test_service_tier_echoed(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1, service_tier="auto")
    assert r.service_tier == "default"


def test_sdk_message_appended_back(client):
    """An agent loop: the SDK's own message objects, dumped, go back into the conversation."""
    from openai.types.chat import ChatCompletionMessage

    first = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2)
    called = ChatCompletionMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]})
    messages = [{"role": "developer", "content": "Be brief."}, *MSGS, first.choices[0].message.model_dump(),
                {"role": "user", "content": "again"}, called.model_dump(),
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[TOOL], max_tokens=1)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_continuous_usage_stats(plain_server):
    body = {"messages": MSGS, "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    lines = send(plain_server, "/v1/chat/completions", body).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4
    assert all(c["usage"]["prompt_tokens"] > 0 for c in chunks)
