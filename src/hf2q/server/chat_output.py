"""One chat choice's output: engine deltas -> OpenAI deltas (reasoning, content, tool calls) and the final message.

Streaming and non-streaming responses are both built from the deltas this class returns, so the final
message a streaming client assembles is the non-streaming message by construction.
"""
from __future__ import annotations

from typing import Optional

from hf2q.engine.request import RequestOutput
from hf2q.text.output_router import OutputRouter, RouterDelta
from hf2q.text.tool_calls import ToolCallArgs, ToolCallStart


class ChatOutput:
    def __init__(self, starts_in_reasoning: bool, tools: Optional[list[dict]], tool_choice,
                 parallel_tool_calls: bool = True):
        self.router = OutputRouter(starts_in_reasoning, tools, tool_choice or "auto")
        self.parallel = parallel_tool_calls
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: dict[int, dict] = {}
        self.reasoning_tokens = 0
        self.cut = False  # a second call under parallel_tool_calls=false ended the turn

    def feed(self, out: RequestOutput) -> dict:
        """The OpenAI delta fields for one engine delta (empty dict when nothing is ready to send)."""
        if self.router.in_reasoning:
            self.reasoning_tokens += len(out.new_token_ids)
        delta = self.router.push(out.new_text)
        if out.finished:
            tail = self.router.flush()
            delta = RouterDelta(delta.reasoning + tail.reasoning, delta.content + tail.content,
                                delta.tool_calls + tail.tool_calls)
        return self._openai_delta(delta)

    def finish_reason(self, engine_reason: Optional[str]) -> str:
        if self.cut:
            return "tool_calls"
        override = self.router.finish().finish_reason_override
        return override or engine_reason or "stop"

    def message(self) -> dict:
        calls = [self.calls[i] for i in sorted(self.calls)]
        content = "".join(self.content)
        msg: dict = {"role": "assistant", "content": content if content or not calls else None}
        reasoning = "".join(self.reasoning)
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = calls
        return msg

    def _openai_delta(self, delta: RouterDelta) -> dict:
        out: dict = {}
        if self.cut:
            return out
        if delta.reasoning:
            self.reasoning.append(delta.reasoning)
            out["reasoning_content"] = delta.reasoning
        if delta.content:
            self.content.append(delta.content)
            out["content"] = delta.content
        entries: list[dict] = []
        for event in delta.tool_calls:
            if event.index > 0 and not self.parallel:
                self.cut = True
                break
            entries.append(self._tool_entry(event, entries))
        entries = [e for e in entries if e is not None]
        if entries:
            out["tool_calls"] = entries
        return out

    def _tool_entry(self, event, entries: list[dict]) -> Optional[dict]:
        """Record the event; returns a new delta entry, or None when merged into the previous one."""
        if isinstance(event, ToolCallStart):
            call = {"id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}}
            self.calls[event.index] = call
            return {"index": event.index, "id": event.id, "type": "function",
                    "function": {"name": event.name, "arguments": ""}}
        assert isinstance(event, ToolCallArgs)
        self.calls[event.index]["function"]["arguments"] += event.json_fragment
        last = next((e for e in reversed(entries) if e is not None), None)
        if last is not None and last["index"] == event.index:
            last["function"]["arguments"] += event.json_fragment
            return None
        return {"index": event.index, "function": {"arguments": event.json_fragment}}


def add_delta(pieces: list[tuple[dict, Optional[list]]], delta: dict, lp: Optional[list]) -> None:
    """Append one OpenAI delta (and its logprobs entries) to `pieces`, merged into the last piece when both
    carry one kind (reasoning, content or tool calls) or one carries nothing but logprobs: a stream that
    is behind sends fewer, larger chunks, and a client still sees every kind change at a chunk boundary."""
    if pieces:
        prev, prev_lp = pieces[-1]
        if len(prev) <= 1 and len(delta) <= 1 and (not prev or not delta or prev.keys() == delta.keys()):
            merged = dict(prev)
            for key, value in delta.items():
                merged[key] = _merge_calls(prev.get(key, []), value) if key == "tool_calls" else prev.get(key, "") + value
            lps = None if prev_lp is None and lp is None else (prev_lp or []) + (lp or [])
            pieces[-1] = (merged, lps)
            return
    pieces.append((delta, lp))


def _merge_calls(entries: list[dict], more: list[dict]) -> list[dict]:
    """Tool-call delta entries, an argument fragment joined to the entry before it when both are one call's."""
    out = [dict(e, function=dict(e["function"])) for e in entries]
    for e in more:
        if out and "id" not in e and out[-1]["index"] == e["index"]:
            out[-1]["function"]["arguments"] += e["function"]["arguments"]
        else:
            out.append(dict(e, function=dict(e["function"])))
    return out
