"""Reasoning and tool-call parsing through the real HTTP layer, on scripted model output.

Random weights never produce tags, so this server runs with `--scripted-replies`: generation i emits
reply i mod len(REPLIES). `ScriptedClient` keeps count of generations and pads with one-token requests
so each test gets the reply it names whatever tests ran before it. The server also requires an API key.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

KEY = "sk-test-123"
REASONING = "The user wants the weather.\nParis is in France.\n</think>\n\nIt is sunny in Paris."
TOOLS_IN_THINKING = (
    "Look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n"
    "3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
    "<parameter=note>\nNone\n</parameter>\n<parameter=opts>\n{\"u\": 1}\n</parameter>\n<parameter=tags>\n[\"a\"]\n"
    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
MALFORMED = "Done.\n</think>\n\n<tool_call>\n<function=not_a_tool>\n</function>\n</tool_call>"
REPLIES = [REASONING, TOOLS_IN_THINKING, MALFORMED]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "ratio": {"type": "number"}, "note": {"type": ["string", "null"]}, "opts": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}}},
]
WEATHER_ARGS = {"city": "Paris", "days": 3, "metric": True, "ratio": 0.5, "note": None, "opts": {"u": 1},
                "tags": ["a"]}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class ScriptedClient:
    """Requests that get a chosen scripted reply. The server's reply counter is shared by every module that
    uses this server, so it is read once, from the first token of a one-token request."""

    def __init__(self, server):
        self.server = server
        self.client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        first = self._one_token().strip()
        starts = [r.split()[0] for r in REPLIES]
        self.count = next(i for i, s in enumerate(starts) if first and s.startswith(first)) + 1

    def _one_token(self) -> str:
        r = self.client.chat.completions.create(model="scripted", messages=ASK, max_tokens=1)
        return (r.choices[0].message.model_extra or {}).get("reasoning_content") or r.choices[0].message.content

    def next(self, reply: int, n: int = 1) -> openai.OpenAI:
        """The client, once the server's next generation is scripted reply `reply` (n of them in a row)."""
        while self.count % len(REPLIES) != reply:
            self._one_token()
            self.count += 1
        self.count += n
        return self.client

    def chat(self, reply: int, **kw):
        self.next(reply, kw.get("n", 1))
        kw.setdefault("max_tokens", 300)
        kw.setdefault("messages", ASK)
        return self.client.chat.completions.create(model="scripted", **kw)


@pytest.fixture(scope="module")
def sc(server_factory):
    return ScriptedClient(server_factory("--api-key", KEY, "--served-model-name", "scripted", scripted=REPLIES))


def assembled(stream) -> dict:
    """The final message a streaming client builds from the deltas (as the OpenAI SDK helpers do)."""
    msg = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            d = c.delta
            msg["content"] += d.content or ""
            msg["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                call = msg["tool_calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                assert tc.id is None or call["id"] is None, "id sent twice"
                if tc.id:
                    assert call["name"] == "" and tc.function.name, "id and name come first, together"
                    call["id"], call["name"] = tc.id, tc.function.name
                call["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    msg["tool_calls"] = [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])]
    return {**msg, "finish_reason": finish}


def final(r) -> dict:
    c = r.choices[0]
    m = c.message
    calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in m.tool_calls or []]
    return {"content": m.content or "", "reasoning_content": (m.model_extra or {}).get("reasoning_content") or "",
            "tool_calls": calls, "finish_reason": c.finish_reason}


def same_ignoring_ids(a: dict, b: dict) -> None:
    strip = lambda m: {**m, "tool_calls": [{**t, "id": None} for t in m["tool_calls"]]}  # noqa: E731
    assert strip(a) == strip(b)


def test_reasoning_split_stream_and_non_stream(sc):
    r = sc.chat(0)
    got = final(r)
    assert got == {"content": "It is sunny in Paris.", "finish_reason": "stop", "tool_calls": [],
                   "reasoning_content": "The user wants the weather.\nParis is in France."}
    details = r.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < r.usage.completion_tokens
    same_ignoring_ids(assembled(sc.chat(0, stream=True)), got)


def test_tool_calls_inside_unclosed_thinking(sc):
    r = sc.chat(1, tools=TOOLS)
    got = final(r)
    assert got["finish_reason"] == "tool_calls"
    assert got["reasoning_content"] == "Look it up."
    assert got["content"] == "" and r.choices[0].message.content is None
    assert [t["name"] for t in got["tool_calls"]] == ["get_weather", "get_time"]
    assert json.loads(got["tool_calls"][0]["arguments"]) == WEATHER_ARGS
    assert json.loads(got["tool_calls"][1]["arguments"]) == {}
    assert all(t["id"].startswith("call_") for t in got["tool_calls"])
    same_ignoring_ids(assembled(sc.chat(1, tools=TOOLS, stream=True)), got)


def test_parallel_tool_calls_false_keeps_first(sc):
    got = assembled(sc.chat(1, tools=TOOLS, parallel_tool_calls=False, stream=True))
    assert [t["name"] for t in got["tool_calls"]] == ["get_weather"] and got["finish_reason"] == "tool_calls"
    assert json.loads(got["tool_calls"][0]["arguments"]) == WEATHER_ARGS


@pytest.mark.parametrize("max_tokens, arguments", [(20, '{"city": "Paris'), (33, '{"city": "Paris", "days": 3')])
def test_call_cut_by_max_tokens_keeps_raw_partial_arguments(sc, max_tokens, arguments):
    """No invented closure: the arguments are what the model wrote, visibly unfinished, finish "length"."""
    got = final(sc.chat(1, tools=TOOLS, max_tokens=max_tokens))
    assert got["finish_reason"] == "length" and got["reasoning_content"] == "Look it up."
    assert [(t["name"], t["arguments"]) for t in got["tool_calls"]] == [("get_weather", arguments)]
    same_ignoring_ids(assembled(sc.chat(1, tools=TOOLS, max_tokens=max_tokens, stream=True)), got)


def test_tool_choice_none_leaves_tags_as_text(sc):
    got = final(sc.chat(1, tools=TOOLS, tool_choice="none"))  # no parsing: the unclosed think holds everything
    assert got["tool_calls"] == [] and got["finish_reason"] == "stop"
    assert got["reasoning_content"] == TOOLS_IN_THINKING


def test_malformed_call_is_content(sc):
    got = final(sc.chat(2, tools=TOOLS))
    assert got["tool_calls"] == [] and got["finish_reason"] == "stop"
    assert got["content"] == "<tool_call>\n<function=not_a_tool>\n</function>\n</tool_call>"
    same_ignoring_ids(assembled(sc.chat(2, tools=TOOLS, stream=True)), got)


def test_stop_string_cuts_scripted_text(sc):
    got = final(sc.chat(0, stop=["sunny"]))
    assert got["content"] == "It is " and got["finish_reason"] == "stop"


def test_n2_each_choice_parsed(sc):
    r = sc.chat(2, n=2, tools=TOOLS)  # choice 0 gets reply 2, choice 1 the next one (reply 0)
    assert [c.message.content for c in r.choices] == [
        "<tool_call>\n<function=not_a_tool>\n</function>\n</tool_call>", "It is sunny in Paris."]
    assert [c.message.model_extra["reasoning_content"] for c in r.choices] == [
        "Done.", "The user wants the weather.\nParis is in France."]


def test_tool_history_renders(sc):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
    ]
    r = sc.chat(0, messages=history, tools=TOOLS)
    assert r.choices[0].message.content == "It is sunny in Paris."


def test_api_key_required(sc):
    bad = openai.OpenAI(base_url=sc.server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.models.list()
    assert err.value.body["code"] == "invalid_api_key"
    r = httpx.post(sc.server.url + "/v1/chat/completions", json={"messages": ASK})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(sc.server.url + "/health").status_code == 200
    assert [m.id for m in sc.client.models.list().data] == ["scripted"]
