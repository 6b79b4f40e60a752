"""Retained-prefix reuse through the real server (on by default): the next turn of a chat, and a completion
that extends an earlier one, report their resumed tokens as `cached_tokens`."""
from __future__ import annotations

import re

import httpx

MODEL = "tiny"


def test_second_chat_turn_reports_cached_tokens(client):
    messages = [{"role": "system", "content": "You are a terse assistant for prefix tests. " * 30},
                {"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    u = second.usage
    assert u.prompt_tokens_details.cached_tokens >= 0.9 * u.prompt_tokens, u


def test_completion_extending_an_earlier_one_is_cached(client, plain_server):
    prompt = list(range(5000, 5120))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details is None or first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL, prompt=prompt + [7, 8, 9], max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == len(prompt)
    text = httpx.get(plain_server.url + "/metrics").text
    assert float(re.search(r"^hf2q_prefix_cache_hits_total (\S+)", text, re.M).group(1)) >= 1
    assert float(re.search(r"^hf2q_prefix_cache_bytes (\S+)", text, re.M).group(1)) > 0
