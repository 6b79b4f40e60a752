"""The demo model: its compact chat template renders text conversations exactly as Qwen3.5's official one,
and its weights are deterministic and fit the model's tensor table."""
from __future__ import annotations

import numpy as np
import pytest

from hf2q.checkpoint.names import param_name
from hf2q.demo import CHAT_TEMPLATE, LAYERS, _tensors
from hf2q.text.chat_template import ChatTemplate

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                     "arguments": {"city": "Paris", "days": 2, "flag": True,
                                                                   "opts": {"a": [1, None]}}}}
CONVERSATIONS = [
    ([{"role": "user", "content": "Hi"}], None, {}),
    ([{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"}], None,
     {"enable_thinking": False}),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], None, {}),
    ([{"role": "system", "content": "Sys"}, {"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": "Checking.", "reasoning_content": "need tool", "tool_calls": [CALL, CALL]},
      {"role": "tool", "content": "22C"}, {"role": "tool", "content": "23C"}], TOOLS, {}),
    ([{"role": "user", "content": "one"}, {"role": "assistant", "content": "<think>\nold\n</think>\n\nA1"},
      {"role": "user", "content": "two"}, {"role": "assistant", "content": "A2", "reasoning_content": "r2"},
      {"role": "user", "content": "three"}], TOOLS, {"enable_thinking": True}),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
      {"role": "tool", "content": "ok"}], TOOLS, {}),
]


@pytest.fixture(scope="module")
def official() -> ChatTemplate:
    from tests.support.llama_cpp_sources import SourcesUnavailable, qwen35_chat_template

    try:
        return ChatTemplate(qwen35_chat_template())
    except SourcesUnavailable as exc:
        pytest.skip(f"official Qwen3.5 template unavailable: {exc}")


@pytest.mark.parametrize("messages,tools,kwargs", CONVERSATIONS)
def test_demo_template_matches_official(official, messages, tools, kwargs):
    ours = ChatTemplate(CHAT_TEMPLATE)
    for gen in (True, False):
        assert ours.render(messages, tools=tools, add_generation_prompt=gen, **kwargs) == \
            official.render(messages, tools=tools, add_generation_prompt=gen, **kwargs)


def test_demo_weights_deterministic_and_named():
    a, b = _tensors(np.random.default_rng(0)), _tensors(np.random.default_rng(0))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert all(param_name(name, LAYERS) is not None for name in a)
