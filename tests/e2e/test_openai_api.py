"""The OpenAI API through a real `hf2q serve` process and the official `openai` client."""
from __future__ import annotations

import json
import re
import time

import httpx
import pytest

MODEL = "tiny"
HELLO = [{"role": "user", "content": "Say hello."}]


def chat(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", HELLO)
    kw.setdefault("max_tokens", 6)
    return client.chat.completions.create(**kw)


def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_non_stream_usage(client):
    r = chat(client, temperature=0, max_tokens=5)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("length", "stop")
    u = r.usage
    assert u.prompt_tokens > 5 and u.completion_tokens <= 5
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    # The template pre-opens <think>: random weights never close it, so every token is reasoning.
    assert u.completion_tokens_details.reasoning_tokens == u.completion_tokens
    assert choice.message.model_extra.get("reasoning_content") or u.completion_tokens == 0


def test_stream_matches_non_stream(client):
    full = chat(client, temperature=0, max_tokens=8, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    chunks = list(chat(client, temperature=0, max_tokens=8, stream=True, stream_options={"include_usage": True},
                       extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert full.usage.completion_tokens_details.reasoning_tokens == 0  # thinking off: empty think block


def test_seed_reproducible_and_n(client):
    a = chat(client, temperature=1.0, seed=7, max_tokens=8)
    b = chat(client, temperature=1.0, seed=7, max_tokens=8)
    assert a.choices[0].message.model_extra["reasoning_content"] == b.choices[0].message.model_extra[
        "reasoning_content"]
    others = {chat(client, temperature=1.0, seed=s, max_tokens=8).choices[0].message.model_extra["reasoning_content"]
              for s in (8, 9)}
    assert others != {a.choices[0].message.model_extra["reasoning_content"]}
    two = chat(client, temperature=1.0, seed=7, max_tokens=8, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    # choice 0 of a seeded n=2 request is the seeded n=1 request; choice 1 uses seed + 1
    assert two.choices[0].message.model_extra["reasoning_content"] == a.choices[0].message.model_extra[
        "reasoning_content"]
    assert 2 <= two.usage.completion_tokens <= 16


def test_logprobs(client):
    r = chat(client, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.logprob == pytest.approx(max(t.logprob for t in e.top_logprobs), abs=1e-4)  # greedy
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                  logprobs=2)
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason in ("length", "stop")
    assert len(c.logprobs.tokens) == r.usage.completion_tokens
    assert all(len(top) == 2 for top in c.logprobs.top_logprobs)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True) if ch.choices)
    assert streamed == c.text


def test_sampling_knobs_accepted(client):
    r = chat(client, temperature=0.7, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5, max_tokens=4,
             seed=1, logit_bias={"11": 5}, stop=["\n\n"],
             extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    assert r.choices[0].finish_reason in ("length", "stop")


def test_logit_bias_forces_token(client):
    comma = 11  # "," in the Qwen vocabulary
    r = chat(client, temperature=0, max_tokens=3, logit_bias={str(comma): 100}, logprobs=True)
    assert [bytes(e.bytes) for e in r.choices[0].logprobs.content] == [b","] * 3


def test_thinking_budget_forces_end_of_reasoning(client):
    r = chat(client, temperature=0, max_tokens=12, extra_body={"thinking_budget": 2})
    details = r.usage.completion_tokens_details
    assert details.reasoning_tokens < r.usage.completion_tokens
    assert r.choices[0].message.content is not None


def test_metrics_scrape(client, plain_server):
    chat(client, max_tokens=2)
    text = httpx.get(plain_server.url + "/metrics").text
    ok = re.search(r'hf2q_requests_total\{route="/v1/chat/completions",status="200"\} (\d+)', text)
    assert ok and float(ok.group(1)) >= 1
    assert float(re.search(r"^hf2q_generation_tokens_total (\S+)$", text, re.M).group(1)) >= 2
    assert float(re.search(r"^hf2q_time_to_first_token_seconds_count (\S+)$", text, re.M).group(1)) >= 1
    for gauge in ("hf2q_num_requests_running", "hf2q_num_requests_waiting", "hf2q_kv_cache_usage_ratio"):
        assert re.search(rf"^{gauge} ", text, re.M), gauge
    steps = float(re.search(r"^hf2q_batch_size_sequences_count (\S+)$", text, re.M).group(1))
    assert steps >= 2  # a prefill step and at least one decode step


def test_streamed_text_with_unicode_line_separators_survives_line_readers(plain_server):
    # httpx's iter_lines splits as `str.splitlines` does, at U+2028, U+2029 and U+0085 too: each event's JSON
    # must still be one line (the echoed prompt carries the characters)
    prompt = "a\u2028b\u2029c\x85d"
    body = {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 1, "stream": True}
    with httpx.stream("POST", plain_server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).startswith(prompt)


def test_disconnect_mid_stream_aborts(plain_server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", plain_server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    running = None
    for _ in range(50):
        text = httpx.get(plain_server.url + "/metrics").text
        running = float(re.search(r"^hf2q_num_requests_running (\S+)$", text, re.M).group(1))
        if running == 0:
            break
        time.sleep(0.1)
    assert running == 0
    assert plain_server.healthy()
