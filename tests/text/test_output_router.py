"""OutputRouter: reasoning + content + tool calls, streaming == non-streaming, and a round trip
through the real Qwen3.5 chat template (render a turn, parse its generated part, render it again)."""
import json

import pytest

from hf2q.text.output_router import OutputRouter, RouterResult
from hf2q.text.reasoning import prompt_opens_reasoning
from hf2q.text.tool_calls import ToolCallArgs, ToolCallStart
from tests.text.test_reasoning import chunkings
from tests.text.test_tool_calls import TOOLS, call


def route(chunks, starts_in_reasoning=True, tools=TOOLS, tool_choice="auto", parse_tools=True) -> RouterResult:
    """Stream the chunks through a router and check the deltas add up to its final result."""
    router = OutputRouter(starts_in_reasoning, tools, tool_choice, parse_tools)
    deltas = [router.push(chunk) for chunk in chunks] + [router.flush()]
    result = router.finish()
    assert "".join(d.reasoning for d in deltas) == result.reasoning_content
    assert "".join(d.content for d in deltas) == result.content
    events = [e for d in deltas for e in d.tool_calls]
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [(s.id, s.name) for s in starts] == [(c.id, c.name) for c in result.tool_calls]
    for i, c in enumerate(result.tool_calls):
        assert "".join(e.json_fragment for e in events if isinstance(e, ToolCallArgs) and e.index == i) == c.arguments
    return result


def summary(result: RouterResult):
    calls = [(c.name, json.loads(c.arguments) if c.complete else c.arguments) for c in result.tool_calls]
    return result.reasoning_content, result.content, calls, result.finish_reason_override


def check_all_chunkings(text, expected, **kw):
    for i, chunks in enumerate(chunkings(text, seed=len(text))):
        assert summary(route(chunks, **kw)) == expected, f"chunking #{i}: {chunks!r}"


def test_reasoning_content_and_calls():
    text = ("The user wants the weather.\n</think>\n\nLet me look.\n\n"
            + call("get_weather", location="Paris", days="2") + "\n" + call("search", query="Paris events"))
    check_all_chunkings(text, ("The user wants the weather.", "Let me look.", [
        ("get_weather", {"location": "Paris", "days": 2}), ("search", {"query": "Paris events"})], "tool_calls"))


def test_tool_call_inside_unclosed_think():
    text = "I need the weather, so I will call the tool.\n\n" + call("get_weather", location="Oslo", verbose="False")
    check_all_chunkings(text, ("I need the weather, so I will call the tool.", "",
                               [("get_weather", {"location": "Oslo", "verbose": False})], "tool_calls"))


def test_thinking_off_and_empty_think_block():
    check_all_chunkings("Plain answer.", ("", "Plain answer.", [], None), starts_in_reasoning=False)
    check_all_chunkings("<think>\n\n</think>\n\nPlain answer.", ("", "Plain answer.", [], None),
                        starts_in_reasoning=False)


@pytest.mark.parametrize("kw", [dict(tool_choice="none"), dict(tools=None), dict(tools=[]), dict(parse_tools=False)])
def test_no_parsing_leaves_tool_markup_in_place(kw):
    inner = call("search", query="x")
    # inside reasoning the markup stays reasoning; after </think> it stays content
    check_all_chunkings(f"think {inner}\n</think>\n\nsay {inner}", (f"think {inner}", f"say {inner}", [], None), **kw)


def test_forced_function_accepts_only_that_function():
    forced = {"type": "function", "function": {"name": "search"}}
    text = call("get_weather", location="Paris") + call("search", query="q")
    expected_content = call("get_weather", location="Paris")
    check_all_chunkings(text, ("", expected_content, [("search", {"query": "q"})], "tool_calls"),
                        starts_in_reasoning=False, tool_choice=forced)


def test_truncated_call_keeps_the_engines_finish_reason():
    text = "ok\n</think>\n\n<tool_call>\n<function=search>\n<parameter=query>\nwea"
    check_all_chunkings(text, ("ok", "", [("search", '{"query": "wea')], None))
    assert route([text]).tool_calls[0].complete is False


def test_flush_is_idempotent_and_finish_flushes():
    router = OutputRouter(True, TOOLS)
    router.push("abc\n</think")
    assert router.in_reasoning
    result = router.finish()
    assert (result.reasoning_content, result.content) == ("abc\n</think", "")
    assert not router.flush()


# --- round trip through the real chat template ------------------------------------------------------

def render(messages, tools, **kw) -> str:
    try:
        from tests.support.llama_cpp_sources import SourcesUnavailable, qwen35_chat_template
        template = qwen35_chat_template()
    except (SourcesUnavailable, OSError) as err:
        pytest.skip(f"Qwen3.5 chat template unavailable: {err}")
    from transformers.utils.chat_template_utils import render_jinja_template
    rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=template, **kw)
    return rendered[0]


ROUND_TRIP_ARGS = [
    ("get_weather", {"location": "São Paulo\nBrazil", "verbose": True, "days": 3, "threshold": 0.25,
                     "unit": None, "filters": {"rain": False, "max": [1, 2]}, "hours": [9, 12], "note": 7}),
    ("search", {"query": "<b>bold</b> & 100%"}),
]


@pytest.mark.parametrize("thinking, reasoning, content, calls", [
    (True, "The user asks about weather.\nI will call two tools.", "Checking now.", ROUND_TRIP_ARGS),
    (True, "No tools needed.", "It is sunny.", []),
    (True, "Call directly.", "", ROUND_TRIP_ARGS[1:]),
    (False, "", "Checking.", ROUND_TRIP_ARGS[:1]),
])
def test_round_trip_through_the_chat_template(thinking, reasoning, content, calls):
    messages = [{"role": "system", "content": "You are helpful."},
                {"role": "user", "content": "Weather in São Paulo?"}]
    assistant = {"role": "assistant", "content": content, "reasoning_content": reasoning,
                 "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                                for i, (n, a) in enumerate(calls)]}
    prompt = render(messages, TOOLS, add_generation_prompt=True, enable_thinking=thinking)
    full = render(messages + [assistant], TOOLS)
    assert full.startswith(prompt) and full.endswith("<|im_end|>\n")
    generated = full[len(prompt):-len("<|im_end|>\n")]
    assert prompt_opens_reasoning(prompt) is thinking

    expected = (reasoning, content, [(n, a) for n, a in calls], "tool_calls" if calls else None)
    for chunks in chunkings(generated, n_random=4):
        result = route(chunks, starts_in_reasoning=thinking)
        assert summary(result) == expected
    parsed = {"role": "assistant", "content": result.content, "reasoning_content": result.reasoning_content,
              "tool_calls": [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                             for c in result.tool_calls]}
    assert render(messages + [parsed], TOOLS) == full


FRAGMENTS = ["<think>", "</think>", "<tool_call>", "<tool_call>\n<function=search>\n", "<parameter=query>\nx\n",
             "</tool_call>", "<function=search>", "<function=nope>",
             "<parameter=query>", "</parameter>", "</function>", "\n", "\n\n", " ", "text", "<", ">", "</",
             "<tool_", "=", "42", "True", "None"]


@pytest.mark.parametrize("seed", range(40))
def test_random_markup_gives_the_same_result_in_every_chunking(seed):
    import random
    rng = random.Random(seed)
    text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(5, 40)))
    starts = bool(seed % 2)
    whole = summary(route([text], starts_in_reasoning=starts))
    for chunks in chunkings(text, seed=seed, n_random=4):
        assert summary(route(chunks, starts_in_reasoning=starts)) == whole, f"{text!r} as {chunks!r}"
