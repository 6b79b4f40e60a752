"""Bad requests get 4xx answers in OpenAI's error envelope, never a 500 or a hang; the server stays healthy."""
from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import PLAIN_FLAGS

MAX_MODEL_LEN = int(PLAIN_FLAGS[PLAIN_FLAGS.index("--max-model-len") + 1])
MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def post(server, body, path="/v1/chat/completions", **kw):
    return httpx.post(server.url + path, timeout=60, **({"json": body} if body is not None else {}), **kw)


def envelope(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


CASES = [
    ("wrong type", {"messages": MSGS, "temperature": "hot"}, "temperature"),
    ("int as string", {"messages": MSGS, "max_tokens": "5"}, "max_tokens"),
    ("negative max_tokens", {"messages": MSGS, "max_tokens": -1}, "max_tokens"),
    ("zero max_tokens", {"messages": MSGS, "max_tokens": 0}, "max_tokens"),
    ("top_p out of range", {"messages": MSGS, "top_p": 0}, "top_p"),
    ("top_logprobs without logprobs", {"messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
    ("unknown field", {"messages": MSGS, "frobnicate": 1}, "frobnicate"),
    ("empty messages", {"messages": []}, "messages"),
    ("bad role", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("image part", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "messages[0].content[0]"),
    ("json_schema without its schema", {"messages": MSGS, "response_format": {"type": "json_schema"}},
     "response_format"),
    ("unknown tool in tool_choice", {"messages": MSGS, "tools": [TOOL],
                                     "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("tool_choice without tools", {"messages": MSGS, "tool_choice": "required"}, "tool_choice"),
    ("bad tool call arguments", {"messages": MSGS + [{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("reserved template kwarg", {"messages": MSGS, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("negative thinking budget", {"messages": MSGS, "thinking_budget": -1}, "thinking_budget"),
    ("logit bias outside vocab", {"messages": MSGS, "logit_bias": {"999999999": 1}}, "logit_bias"),
    ("n too large", {"messages": MSGS, "n": 0}, "n"),
    ("zero max_tokens beside max_completion_tokens", {"messages": MSGS, "max_tokens": 0, "max_completion_tokens": 4},
     "max_tokens"),
    ("zero max_completion_tokens", {"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("repetition_penalty beyond float32", {"messages": MSGS, "repetition_penalty": 1e39}, "repetition_penalty"),
    ("temperature above 2", {"messages": MSGS, "temperature": 2.5}, "temperature"),
    ("seed beyond int64", {"messages": MSGS, "seed": 2**63}, "seed"),
    # the rest of OpenAI's ranges
    ("negative temperature", {"messages": MSGS, "temperature": -0.1}, "temperature"),
    ("top_p above 1", {"messages": MSGS, "top_p": 1.5}, "top_p"),
    ("presence_penalty above 2", {"messages": MSGS, "presence_penalty": 2.5}, "presence_penalty"),
    ("frequency_penalty below -2", {"messages": MSGS, "frequency_penalty": -3}, "frequency_penalty"),
    ("top_logprobs above 20", {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("n above 16", {"messages": MSGS, "n": 17}, "n"),
    ("seed below int64", {"messages": MSGS, "seed": -2**63 - 1}, "seed"),
]


@pytest.mark.parametrize("body,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_chat_request(plain_server, body, param):
    err = envelope(post(plain_server, body), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


def test_images_without_a_vision_projector_say_so(plain_server):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    err = envelope(post(plain_server, {"messages": [{"role": "user", "content": [image]}]}), 400)
    assert "no vision projector" in err["message"] and "--mmproj" in err["message"]
    item = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
    err = envelope(post(plain_server, {"input": [{"role": "user", "content": [item]}]}, "/v1/responses"), 400)
    assert "no vision projector" in err["message"] and err["param"] == "input[0].content[0]"
    assert post(plain_server, {"messages": MSGS, "max_tokens": 1}).status_code == 200


def test_invalid_schema_message_is_plain(plain_server):
    """The grammar compiler's complaint, without the C++ source location xgrammar prefixes it with."""
    bad = {"type": "object", "properties": {"a": {"type": "foo"}}}
    for body, param in [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}},
                         "response_format"),
                        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}],
                          "tool_choice": "required"}, "tool_choice")]:
        err = envelope(post(plain_server, {"messages": MSGS, **body}), 400)
        assert err["param"] == param and 'Unsupported type "foo"' in err["message"], err
        assert ".cc:" not in err["message"] and "/project" not in err["message"], err


def test_malformed_json(plain_server):
    err = envelope(post(plain_server, None, content=b'{"messages": [', headers={"content-type": "application/json"}),
                   400)
    assert "JSON" in err["message"]
    envelope(post(plain_server, None, content=b"[1, 2]", headers={"content-type": "application/json"}), 400)


def test_too_long_prompt(plain_server):
    long = [{"role": "user", "content": "word " * (MAX_MODEL_LEN + 10)}]
    err = envelope(post(plain_server, {"messages": long, "max_tokens": 4}), 400)
    assert err["code"] == "context_length_exceeded"
    err = envelope(post(plain_server, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN * 2}, "/v1/completions"), 400)
    assert err["code"] == "context_length_exceeded"


def test_unknown_model_and_route(plain_server):
    err = envelope(post(plain_server, {"model": "gpt-17", "messages": MSGS}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    envelope(httpx.get(plain_server.url + "/v1/models/gpt-17"), 404)
    envelope(httpx.get(plain_server.url + "/v2/nothing"), 404)
    envelope(httpx.get(plain_server.url + "/v1/chat/completions"), 405)


def test_bad_completions_requests(plain_server):
    for body, param in [({"prompt": ["a", ""]}, "prompt"), ({"prompt": [[5], []]}, "prompt"), ({"prompt": []}, "prompt"),
                        ({"prompt": "hi", "suffix": "x"}, "suffix"), ({"prompt": ""}, "prompt"),
                        ({"prompt": [999999999]}, "prompt"), ({"prompt": "hi", "logprobs": 21}, "logprobs"),
                        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options")]:
        assert envelope(post(plain_server, body, "/v1/completions"), 400)["param"] == param, body


def test_bad_request_leaves_a_running_stream_alone(plain_server):
    """The request that once failed the engine step, and every stream with it (issue 26), sent while a stream
    is open: a 400, and the stream ends normally."""
    body = {"prompt": "count with me", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", plain_server.url + "/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")).startswith('data: {"id"')
        bad = {"prompt": "hi", "max_tokens": 4, "repetition_penalty": 1e39}
        assert envelope(post(plain_server, bad, "/v1/completions"), 400)["param"] == "repetition_penalty"
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and '"error"' not in "".join(rest)
    assert '"finish_reason":"length"' in rest[-2].replace(" ", "")


def test_server_still_healthy(plain_server):
    assert plain_server.healthy()
    r = post(plain_server, {"messages": MSGS, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
