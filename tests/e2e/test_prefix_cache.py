"""Retained-prefix reuse through the real server (on by default): the next turn of a chat, and a completion
that extends an earlier one, report their resumed tokens as `cached_tokens`."""
from __future__ import annotations

import re

import httpx
import pytest

from tests.e2e.test_scripted import KEY, REPLIES, TOOLS, ScriptedClient, assembled

MODEL = "tiny"
TOOL_CALLS, ANSWER = 1, 0  # indices into REPLIES: tool calls in the thinking, an answer after it


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


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return float(re.search(rf"^{name} (\S+)", text, re.M).group(1))


@pytest.fixture(scope="module")
def scripted(server_factory):
    server = server_factory("--api-key", KEY, "--served-model-name", "scripted", scripted=REPLIES)
    return server, ScriptedClient(server)


def test_user_turn_after_an_agent_loop_is_cached(scripted):
    """Tool calls, their results, a streamed answer, then the user asks again: that turn resumes from the
    history the server prefilled in the background as the template renders it once a user speaks (no think
    blocks), not only from where the loop began. Then a plain (non-streamed) answer and one more question."""
    server, sc = scripted
    before = _metric(server, "hf2q_prefix_rerender_prefills_total")
    messages = [{"role": "system", "content": "You look up the weather for travellers. " * 8},
                {"role": "user", "content": "Weather in Paris?"}]
    calls = sc.chat(TOOL_CALLS, messages=messages, tools=TOOLS).choices[0].message
    assert calls.tool_calls
    messages.append(calls.model_dump(exclude_none=True))  # sent back as received, reasoning and all
    messages += [{"role": "tool", "tool_call_id": c.id, "content": "Sunny, 21 C."} for c in calls.tool_calls]
    answer = assembled(sc.chat(ANSWER, messages=messages, tools=TOOLS, stream=True))
    assert answer["finish_reason"] == "stop" and answer["content"] and not answer["tool_calls"]
    for turn, question in enumerate(("And tomorrow?", "And on Sunday?")):
        messages += [{"role": "assistant", "content": answer["content"],
                      "reasoning_content": answer["reasoning_content"]},
                     {"role": "user", "content": question}]
        r = sc.chat(ANSWER, messages=messages, tools=TOOLS)
        u = r.usage
        assert u.prompt_tokens_details.cached_tokens >= 0.9 * u.prompt_tokens, (turn, u)
        m = r.choices[0].message
        answer = {"content": m.content, "reasoning_content": (m.model_extra or {}).get("reasoning_content")}
    # The streamed answer's and the first plain answer's histories were prefilled, each before the next turn
    # resumed from it; the second plain answer's may still be running.
    assert _metric(server, "hf2q_prefix_rerender_prefills_total") >= before + 2


def test_response_continued_by_previous_response_id_resumes_after_its_answer(scripted):
    """/v1/responses too: an answered response's history is prefilled as its continuation will render it."""
    server, sc = scripted
    client = sc.next(ANSWER)
    before = _metric(server, "hf2q_prefix_rerender_prefills_total")
    first = client.responses.create(model="scripted", input=[
        {"role": "system", "content": "You look up the weather for travellers. " * 30},
        {"role": "user", "content": "Weather in Paris?"}])
    assert first.output_text == "It is sunny in Paris."
    sc.count += 1  # the next generation is the following scripted reply, cut short: only its prompt matters
    second = client.responses.create(model="scripted", previous_response_id=first.id, input="And tomorrow?",
                                     max_output_tokens=2)
    u = second.usage
    assert u.input_tokens_details.cached_tokens >= 0.9 * u.input_tokens, u
    assert _metric(server, "hf2q_prefix_rerender_prefills_total") >= before + 1
