"""tool_choice "required" / named and JSON response_format through a real server: the random-weight model,
held to the grammar, still answers with calls of the right functions and arguments that fit their schemas."""
from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("xgrammar")

MODEL = "tiny"
MSGS = [{"role": "user", "content": "What's the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# Bounded values only (enum, boolean): free-text values of a random model would run to max_tokens.
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                     "alerts": {"type": "boolean"}},
    "required": ["unit", "alerts"]}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, PING]


def chat(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", MSGS)
    kw.setdefault("max_tokens", 150)
    return client.chat.completions.create(**kw)


def check_calls(message, names: set[str]) -> list:
    calls = message.tool_calls or []
    assert calls, message
    assert not message.content
    for call in calls:
        assert call.function.name in names
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert args["unit"] in ("celsius", "fahrenheit") and isinstance(args["alerts"], bool)
        else:
            assert args == {}
    return calls


@pytest.mark.parametrize("temperature,seed", [(0, None), (1.0, 3), (1.0, 11)])
def test_required_gives_tool_calls(client, temperature, seed):
    r = chat(client, tools=TOOLS, tool_choice="required", temperature=temperature, seed=seed,
             extra_body=NO_THINKING)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message, {"get_weather", "ping"})


def test_named_choice_calls_that_function_once(client):
    r = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
             temperature=1.0, seed=5, n=2, extra_body=NO_THINKING)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in check_calls(choice.message, {"get_weather"})] == ["get_weather"]


def test_single_call_without_parallel_tool_calls(client):
    r = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=1,
             extra_body=NO_THINKING)
    assert len(check_calls(r.choices[0].message, {"get_weather", "ping"})) == 1


def test_streamed_named_call_matches_the_schema(client):
    stream = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  temperature=0, stream=True, extra_body=NO_THINKING)
    name, args, finish = "", "", None
    for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or []:
            name += call.function.name or ""
            args += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_weather" and finish == "tool_calls"
    assert json.loads(args)["unit"] in ("celsius", "fahrenheit")


def test_reasoning_first_then_the_call(client):
    """Thinking on: free reasoning (ended here by the thinking budget) comes before the constrained call."""
    r = chat(client, tools=TOOLS, tool_choice="required", temperature=0, extra_body={"thinking_budget": 5})
    message = r.choices[0].message
    assert message.model_extra.get("reasoning_content")
    check_calls(message, {"get_weather", "ping"})
    assert r.usage.completion_tokens_details.reasoning_tokens >= 5


def test_json_schema_response_format(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "mood": {"enum": ["calm", "busy"]}},
              "required": ["ok", "mood"]}
    r = chat(client, temperature=1.0, seed=2, extra_body=NO_THINKING,
             response_format={"type": "json_schema", "json_schema": {"name": "status", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    assert isinstance(value["ok"], bool) and value["mood"] in ("calm", "busy")


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format.json_schema.schema"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_constraints_are_400(plain_server, body, param):
    r = httpx.post(plain_server.url + "/v1/chat/completions", json={"messages": MSGS, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
