"""Every field of OpenAI's chat and completions request schemas: a valid value is honoured, as README.md's
table says (each honoured field's effect is checked against the same request without it), or refused with a
400 naming the field; `null` is the same as leaving a field out. The fields that only label a request are
logged: tests/e2e/test_security.py::test_request_labels_logged_with_the_request_id."""
from __future__ import annotations

import json

import httpx
import pytest

MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
STREAM = {"stream": True}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
COMMA = "11"  # "," in the Qwen vocabulary
SEED = {"temperature": 1.0, "seed": 1}

# field -> (a valid value, extra fields the value needs, the param of the 400 or None when honoured)
CHAT_FIELDS = {
    "messages": (MSGS, {}, None),
    "model": ("tiny", {}, None),
    "audio": ({"voice": "alloy", "format": "wav"}, {}, "audio"),
    "frequency_penalty": (2.0, {}, None),
    "function_call": ("auto", {}, "function_call"),
    "functions": ([TOOL["function"]], {}, "functions"),
    "logit_bias": ({COMMA: 100}, {}, None),
    "logprobs": (True, {}, None),
    "max_completion_tokens": (3, {"max_tokens": 5}, None),  # it wins
    "max_tokens": (3, {}, None),
    "metadata": ({"team": "eval"}, {}, None),
    "modalities": (["text"], {}, None),
    "moderation": ({"model": "omni-moderation-latest"}, {}, "moderation"),
    "n": (2, {}, None),
    "parallel_tool_calls": (False, {"tools": [TOOL]}, None),
    "prediction": ({"type": "content", "content": "x"}, {}, "prediction"),
    "presence_penalty": (2.0, {}, None),
    "prompt_cache_key": ("conversation-1", {}, None),
    "prompt_cache_options": ({"mode": "implicit", "ttl": "30m"}, {}, None),
    "prompt_cache_retention": ("24h", {}, None),
    "reasoning_effort": ("low", {}, None),
    "response_format": ({"type": "text"}, {}, None),
    "safety_identifier": ("user-hash", {}, None),
    "seed": (1, {}, None),
    "service_tier": ("auto", {}, None),
    "stop": (["\n\n"], {}, None),  # the effect check takes its stop string from the greedy answer
    "store": (False, {}, None),
    "stream": (True, {}, None),
    "stream_options": ({"include_usage": True}, STREAM, None),
    "temperature": (1.0, {"seed": 1}, None),
    "tool_choice": ("auto", {"tools": [TOOL]}, None),
    "tools": ([TOOL], {}, None),
    "top_logprobs": (2, {"logprobs": True}, None),
    "top_p": (1e-6, SEED, None),
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
    "frequency_penalty": (2.0, {}, None),
    "logit_bias": ({COMMA: 100}, {}, None),
    "logprobs": (2, {}, None),
    "max_tokens": (3, {}, None),
    "n": (2, {}, None),
    "presence_penalty": (2.0, {}, None),
    "seed": (1, {}, None),
    "stop": ("\n", {}, None),  # the effect check takes its stop string from the greedy answer
    "stream": (True, {}, None),
    "stream_options": ({"include_usage": True}, STREAM, None),
    "suffix": ("x", {}, "suffix"),
    "temperature": (1.0, {"seed": 1}, None),
    "top_p": (1e-6, SEED, None),
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


def ask(server, path: str, **fields) -> httpx.Response:
    """A request of `fields` (with a prompt), checked to be answered."""
    r = send(server, path, {**({"messages": MSGS} if path == CHAT else {"prompt": "hi"}), **fields})
    check(r, None)
    return r


def tokens(server, path: str, **fields) -> list[str]:
    """The tokens the first choice generated: greedy and 3 long unless `fields` say otherwise."""
    body = {"temperature": 0, "max_tokens": 3, "ignore_eos": True, "logprobs": True if path == CHAT else 0, **fields}
    logprobs = ask(server, path, **body).json()["choices"][0]["logprobs"]
    return [e["token"] for e in logprobs["content"]] if path == CHAT else logprobs["tokens"]


_BASELINES: dict[str, list[str]] = {}


def baseline(server, path: str, **fields) -> list[str]:
    """tokens() of a request that several checks compare against, asked once."""
    key = json.dumps([server.url, path, fields], sort_keys=True)
    if key not in _BASELINES:
        _BASELINES[key] = tokens(server, path, **fields)
    return _BASELINES[key]


def text(path: str, choice: dict) -> str:
    """All a choice generated (a chat reply's reasoning included: thinking is on by default)."""
    if path == COMPLETIONS:
        return choice["text"]
    message = choice.get("message") or choice.get("delta") or {}
    return (message.get("reasoning_content") or "") + (message.get("content") or "")


def chunks(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def changes_nothing(server, path, field, value, extra):
    assert tokens(server, path, **extra, **{field: value}) == baseline(server, path, **extra)


def counts_the_prompt(server, path, field, value, extra):
    reply = ask(server, path, max_tokens=1, **{field: value}).json()
    body = {"messages": value, "add_generation_prompt": True} if path == CHAT else {"prompt": value}
    assert reply["usage"]["prompt_tokens"] == httpx.post(server.url + "/tokenize", json=body).json()["count"]


def names_the_model(server, path, field, value, extra):
    assert ask(server, path, max_tokens=1, model=value).json()["model"] == value


def fewer_repeats(server, path, field, value, extra):
    """A bias that makes the greedy answer mostly commas; the penalty takes the repeats away."""
    biased = {"logit_bias": {COMMA: 5}}
    assert baseline(server, path, **biased).count(",") > tokens(server, path, **biased, **{field: value}).count(",")


def biased(server, path, field, value, extra):
    assert tokens(server, path, logit_bias=value) == [","] * 3


def chat_logprobs(server, path, field, value, extra):
    entries = ask(server, path, max_tokens=3, ignore_eos=True, temperature=0, **extra, **{field: value}).json()[
        "choices"][0]["logprobs"]["content"]
    top = value if field == "top_logprobs" else 0
    assert len(entries) == 3 and all(e["logprob"] <= 0 and len(e["top_logprobs"]) == top for e in entries)
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in entries if top)  # greedy: the likeliest


def completion_logprobs(server, path, field, value, extra):
    logprobs = ask(server, path, max_tokens=3, ignore_eos=True, logprobs=value).json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 3
    assert [len(top) for top in logprobs["top_logprobs"]] == [value] * 3


def limits_the_answer(server, path, field, value, extra):
    reply = ask(server, path, ignore_eos=True, **extra, **{field: value}).json()
    assert reply["usage"]["completion_tokens"] == value and reply["choices"][0]["finish_reason"] == "length"


def n_choices(server, path, field, value, extra):
    assert [c["index"] for c in ask(server, path, max_tokens=1, n=value).json()["choices"]] == list(range(value))


def reproducible(server, path, field, value, extra):
    twice = [tokens(server, path, temperature=1.0, seed=value) for _ in range(2)]
    assert twice[0] == twice[1] != tokens(server, path, temperature=1.0, seed=value + 1)


def stops(server, path, field, value, extra):
    """A stop string from the greedy answer's third token: the answer ends before it."""
    greedy = baseline(server, path)
    choice = ask(server, path, temperature=0, max_tokens=3, ignore_eos=True, stop=[greedy[2]]).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and text(path, choice) == "".join(greedy[:2])


def streams(server, path, field, value, extra):
    whole = ask(server, path, temperature=0, max_tokens=4).json()["choices"][0]
    parts = chunks(ask(server, path, temperature=0, max_tokens=4, stream=value))
    assert "".join(text(path, c["choices"][0]) for c in parts if c["choices"]) == text(path, whole)


def usage_last(server, path, field, value, extra):
    parts = chunks(ask(server, path, max_tokens=3, ignore_eos=True, stream=True, stream_options=value))
    assert parts[-1]["choices"] == [] and parts[-1]["usage"]["completion_tokens"] == 3
    assert all(p.get("usage") is None for p in parts[:-1])


def samples(server, path, field, value, extra):
    assert tokens(server, path, **extra, temperature=value) != baseline(server, path)


def keeps_the_top(server, path, field, value, extra):
    """A nucleus this small holds the most likely token only: sampling is greedy."""
    assert tokens(server, path, **extra, top_p=value) == baseline(server, path)


def renders_the_tools(server, path, field, value, extra):
    prompt = [ask(server, path, max_tokens=1, **kw).json()["usage"]["prompt_tokens"] for kw in ({}, {field: value})]
    assert prompt[0] < prompt[1]


def thinks(server, path, field, value, extra):
    usage = ask(server, path, max_tokens=4, temperature=0, reasoning_effort=value).json()["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == usage["completion_tokens"] > 0


def default_tier(server, path, field, value, extra):
    assert ask(server, path, max_tokens=1, service_tier=value).json()["service_tier"] == "default"


def not_echoed(server, path, field, value, extra):
    assert "metadata" not in ask(server, path, max_tokens=1, metadata=value).json()
    changes_nothing(server, path, field, value, extra)


def accepted(server, path, field, value, extra):
    ask(server, path, max_tokens=1, **extra, **{field: value})


def echoes(server, path, field, value, extra):
    choice = ask(server, path, max_tokens=3, temperature=0, ignore_eos=True, echo=value).json()["choices"][0]
    assert choice["text"] == "hi" + "".join(baseline(server, path))


# What each honoured field does (README.md's table), for chat and completions alike.
EFFECTS = {
    "messages": counts_the_prompt, "prompt": counts_the_prompt, "model": names_the_model,
    "frequency_penalty": fewer_repeats, "presence_penalty": fewer_repeats, "logit_bias": biased,
    "max_tokens": limits_the_answer, "max_completion_tokens": limits_the_answer, "n": n_choices,
    "seed": reproducible, "stop": stops, "stream": streams, "stream_options": usage_last, "temperature": samples,
    "top_p": keeps_the_top, "tools": renders_the_tools, "reasoning_effort": thinks,
    "service_tier": default_tier, "metadata": not_echoed, "echo": echoes,
    # accepted hints and labels (logged: see the module's docstring) that leave the answer alone
    **dict.fromkeys(["prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "response_format",
                     "safety_identifier", "store", "tool_choice", "user", "verbosity", "modalities", "best_of"],
                    changes_nothing),
}
# Honoured fields whose effect another test shows (here: accepted).
SHOWN_ELSEWHERE = {"parallel_tool_calls": "tests/e2e/test_tool_choice.py::test_single_call_without_parallel_tool_calls"}
CHAT_EFFECTS = {**EFFECTS, "logprobs": chat_logprobs, "top_logprobs": chat_logprobs,
                **dict.fromkeys(SHOWN_ELSEWHERE, accepted)}
COMPLETION_EFFECTS = {**EFFECTS, "logprobs": completion_logprobs}


def test_every_honoured_field_has_its_effect_checked():
    assert {f for f, (_, _, refused) in CHAT_FIELDS.items() if refused is None} <= set(CHAT_EFFECTS)
    assert {f for f, (_, _, refused) in COMPLETION_FIELDS.items() if refused is None} <= set(COMPLETION_EFFECTS)


@pytest.mark.parametrize("field", sorted(CHAT_FIELDS))
def test_chat_field(plain_server, field):
    value, extra, refused = CHAT_FIELDS[field]
    if refused is None:
        CHAT_EFFECTS[field](plain_server, CHAT, field, value, extra)
    else:
        check(send(plain_server, CHAT, {"messages": MSGS, "max_tokens": 1, **extra, field: value}), refused)


@pytest.mark.parametrize("field,value,extra,refused", CHAT_REFUSED_VALUES,
                         ids=[f"{c[0]}={json.dumps(c[1])[:20]}" for c in CHAT_REFUSED_VALUES])
def test_chat_value_refused(plain_server, field, value, extra, refused):
    check(send(plain_server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1, **extra, field: value}),
          refused)


@pytest.mark.parametrize("field", sorted(COMPLETION_FIELDS))
def test_completion_field(plain_server, field):
    value, extra, refused = COMPLETION_FIELDS[field]
    if refused is None:
        COMPLETION_EFFECTS[field](plain_server, COMPLETIONS, field, value, extra)
    else:
        check(send(plain_server, COMPLETIONS, {"prompt": "hi", "max_tokens": 1, **extra, field: value}), refused)


def end_of_sequence(server) -> tuple[int, str]:
    """(id, text) of the token that ends an answer."""
    text = httpx.get(server.url + "/tokenizer_info", timeout=30).json()["eos_token"]
    return httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"][0], text


def one_token_left(server, path, field, value, extra):
    """top_k 1 or min_p 1 keeps only the most likely token: sampling is greedy."""
    assert tokens(server, path, **SEED, **{field: value}) == baseline(server, path)


def holds_off_eos(server, path, field, value, extra):
    """With the end of sequence made certain, min_tokens holds it off for that many tokens, ignore_eos for all."""
    eos, eos_text = end_of_sequence(server)
    certain = {"logit_bias": {str(eos): 100}, "max_tokens": 3, "logprobs": True}
    assert ask(server, path, **certain).json()["usage"]["completion_tokens"] == 1
    choice = ask(server, path, **certain, **{field: value}).json()["choices"][0]
    made = [e["token"] for e in choice["logprobs"]["content"]]
    if field == "min_tokens":
        assert choice["finish_reason"] == "stop" and eos_text not in made[:value], made
    else:
        assert choice["finish_reason"] == "length" and made == [eos_text] * 3, made


def stops_at_the_id(server, path, field, value, extra):
    reply = ask(server, path, max_tokens=3, ignore_eos=True, logit_bias={COMMA: 100}, **{field: value}).json()
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == 1


def thinking_off(server, path, field, value, extra):
    usage = ask(server, path, max_tokens=3, ignore_eos=True, **{field: value}).json()["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 0 < usage["completion_tokens"]


# The documented extensions (vLLM's; README.md lists them) -> (a valid value, its effect). thinking_budget and
# stream_options.continuous_usage_stats: tests/e2e/test_openai_api.py and test_continuous_usage_stats below.
EXTENSIONS = {
    "top_k": (1, one_token_left), "min_p": (1.0, one_token_left), "repetition_penalty": (2.0, fewer_repeats),
    "min_tokens": (2, holds_off_eos), "ignore_eos": (True, holds_off_eos),
    "stop_token_ids": ([int(COMMA)], stops_at_the_id),
    "chat_template_kwargs": ({"enable_thinking": False}, thinking_off),
}


@pytest.mark.parametrize("field", sorted(EXTENSIONS))
def test_extension_field(plain_server, field):
    value, effect = EXTENSIONS[field]
    effect(plain_server, CHAT, field, value, {})


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
