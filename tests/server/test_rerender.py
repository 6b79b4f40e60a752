"""Which chat completions have their history re-rendered and prefilled for the next turn, and where the cut is
(the real Qwen3.5 template; a byte tokenizer stands in for the model's, whose split is checked in
tests/engine/test_prefix_cache.py)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from hf2q.server.chat_output import ChatOutput
from hf2q.server.schemas import ChatCompletionRequest
from hf2q.server.serving_chat import ChatServing
from hf2q.server.state import ServerConfig
from hf2q.text.chat_template import ChatTemplate
from tests.support.llama_cpp_sources import SourcesUnavailable, qwen35_chat_template

ANSWER = "Sunny in Paris.\n</think>\n\nIt is sunny."  # what the model wrote after the prompt's <think>
CALL = "<tool_call>\n<function=f>\n</function>\n</tool_call>"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
LOOP = [{"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Look it up.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny."}]


class _Engine:
    def __init__(self):
        self.prefilled: list[list[int]] = []

    def prefill_in_background(self, ids):
        self.prefilled.append(ids)


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    try:
        return ChatTemplate(qwen35_chat_template())
    except SourcesUnavailable as exc:
        pytest.skip(str(exc))


def _prefilled(template, text: str, rerender: bool = True, **fields) -> list[str]:
    tokenizer = SimpleNamespace(encode=lambda s: list(s.encode()))
    state = SimpleNamespace(model=SimpleNamespace(chat_template=template, tokenizer=tokenizer), engine=_Engine(),
                            vision=None, config=ServerConfig("m", prefix_rerender=rerender))
    req = ChatCompletionRequest(messages=LOOP, tools=TOOLS, **fields)
    out = ChatOutput(True, TOOLS, "auto")
    out.feed(SimpleNamespace(new_text=text, new_token_ids=[1], finished=True))
    asyncio.run(ChatServing(state).prefill_next_turn(req, out, out.finish_reason("stop")))
    return [bytes(ids).decode() for ids in state.engine.prefilled]


def test_an_answer_prefills_the_history_up_to_the_next_user_message(template):
    (history,) = _prefilled(template, ANSWER)
    # The loop's tool call and the answer as a later turn renders them: no think blocks, and the cut is where
    # the next user message's <|im_start|> would be.
    assert history.endswith("<|im_start|>assistant\nIt is sunny.<|im_end|>\n")
    assert "Look it up." not in history and "Sunny in Paris." not in history
    assert history.startswith("<|im_start|>system\n") and "<|im_start|>user\n<tool_response>\nSunny." in history


def test_tool_calls_several_choices_and_the_flag_prefill_nothing(template):
    assert _prefilled(template, CALL) == []  # the loop goes on: its next turn is not a user's
    assert _prefilled(template, ANSWER, n=2) == []  # which choice comes back is the client's
    assert _prefilled(template, ANSWER, rerender=False) == []  # --no-prefix-rerender
