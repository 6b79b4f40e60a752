"""A stream that is behind the engine sends what piled up as one chunk: same text, logprobs and usage."""
import asyncio
import json
from types import SimpleNamespace

from hf2q.engine.request import RequestOutput, TokenLogprob, merge_outputs
from hf2q.engine.sampling_params import SamplingParams
from hf2q.server.chat_output import ChatOutput, add_delta
from hf2q.server.choices import Choices
from hf2q.server.metrics import Metrics
from hf2q.server.serving_chat import ChatServing
from hf2q.server.serving_completions import CompletionLogprobs, CompletionServing

TEXT = ("<think>why not</think>Sure.\n<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n"
        "</tool_call>")
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}]


def _outputs(text: str, size: int = 2, logprobs: bool = True) -> list[RequestOutput]:
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    last = len(pieces) - 1
    return [RequestOutput("r", [i], p, finished=i == last, finish_reason="length" if i == last else None,
                          num_prompt_tokens=3, num_output_tokens=i + 1,
                          logprobs=[TokenLogprob(i, -0.5, [(i, -0.5)])] if logprobs else None)
            for i, p in enumerate(pieces)]


def test_merge_outputs_concatenates_and_keeps_the_last_finish():
    outs = _outputs("abcdef")
    outs[0].prompt_logprobs = [None]
    merged = merge_outputs(outs)
    assert (merged.new_text, merged.new_token_ids) == ("abcdef", [0, 1, 2])
    assert [lp.token_id for lp in merged.logprobs] == [0, 1, 2]
    assert (merged.finished, merged.finish_reason, merged.num_output_tokens) == (True, "length", 3)
    assert merged.prompt_logprobs == [None]
    assert merge_outputs(_outputs("abcd", logprobs=False)).logprobs is None


def test_add_delta_merges_one_kind_only():
    pieces: list = []
    add_delta(pieces, {"reasoning_content": "a"}, [1])
    add_delta(pieces, {"reasoning_content": "b"}, [2])
    add_delta(pieces, {}, [3])
    add_delta(pieces, {"content": "c"}, None)
    add_delta(pieces, {"tool_calls": [{"index": 0, "id": "x", "type": "function",
                                       "function": {"name": "f", "arguments": ""}}]}, None)
    add_delta(pieces, {"tool_calls": [{"index": 0, "function": {"arguments": "{\"x\""}}]}, None)
    add_delta(pieces, {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, None)
    assert pieces == [({"reasoning_content": "ab"}, [1, 2, 3]), ({"content": "c"}, None),
                      ({"tool_calls": [{"index": 0, "id": "x", "type": "function",
                                        "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}, None)]


class _Engine:
    """Yields every delta at once, as an engine far ahead of its stream does."""

    def __init__(self, outs):
        self.outs = outs

    async def generate(self, request_id, prompt_ids, params, options):
        for out in self.outs:
            yield out


def _state(outs):
    tok = SimpleNamespace(token_bytes=lambda t: f"<{t}>".encode())
    return SimpleNamespace(engine=_Engine(outs), metrics=Metrics("m"), next_script=lambda: None,
                           model=SimpleNamespace(tokenizer=tok))


def _events(state, make_stream) -> list[dict]:
    async def run():
        choices = Choices(state, [[1, 2, 3]], SamplingParams(max_tokens=64), "prompt")
        await choices.start()
        return [e async for e in make_stream(choices)]
    frames = asyncio.run(run())
    assert frames[-1] == "data: [DONE]\n\n"
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


def test_completion_stream_behind_the_engine_sends_fewer_chunks_same_text():
    outs = _outputs("hello world, coalesced")
    state = _state(outs)
    serving = CompletionServing(state)
    events = _events(state, lambda c: serving._stream(c, {"id": "x"}, [CompletionLogprobs(state.model.tokenizer)],
                                                      None, True))
    chunks, usage = events[:-1], events[-1]["usage"]
    assert 1 <= len(chunks) < len(outs)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hello world, coalesced"
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == len(outs)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage == {"prompt_tokens": 3, "completion_tokens": len(outs), "total_tokens": 3 + len(outs),
                     "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_stream_behind_the_engine_keeps_kinds_apart_and_the_same_message():
    outs = _outputs(TEXT, size=3, logprobs=False)
    alone = ChatOutput(False, TOOLS, "auto")
    for out in outs:  # the message and reasoning count of a stream that kept up, token by token
        alone.feed(out)
    state = _state(outs)
    serving = ChatServing(state)
    events = _events(state, lambda c: serving._stream(c, [ChatOutput(False, TOOLS, "auto")], {"id": "x"}, False, True))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert len(deltas) < len(outs)
    assert all(len(d) <= 1 or "role" in d for d in deltas)  # never two kinds in one chunk
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    args = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []))
    message = alone.message()
    assert (reasoning, content) == (message["reasoning_content"], message["content"] or "")
    assert args == message["tool_calls"][0]["function"]["arguments"]
    assert events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": alone.reasoning_tokens}
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "tool_calls"
