"""Route generated text to `reasoning_content`, `content` and tool calls, for one chat completion.

The reasoning splitter runs first; its content goes to the tool-call parser when tool parsing is on
(tools given, `tool_choice` not "none"). The server streams each `push`/`flush` delta as it comes
(streaming) or feeds the whole text and reads `finish()` (non-streaming); the two agree on every
final field because both run the same incremental machine (see `hf2q.text.tool_calls` for the rule
that governs what a streamed tool-call delta commits to).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hf2q.text.reasoning import REASONING, ReasoningSplitter
from hf2q.text.tool_calls import ToolCall, ToolCallArgs, ToolCallParser, ToolCallStart


@dataclass
class RouterDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallStart | ToolCallArgs] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass(frozen=True)
class RouterResult:
    reasoning_content: str
    content: str
    tool_calls: list[ToolCall]
    finish_reason_override: str | None  # "tool_calls" when calls were parsed, else keep the engine's


def tools_for_choice(tools: list[dict] | None, tool_choice) -> list[dict] | None:
    """The tools the parser may accept: none for "none", only the named one for a forced function."""
    if not tools or tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        wanted = (tool_choice.get("function") or {}).get("name")
        chosen = [t for t in tools if t.get("function", t).get("name") == wanted]
        return chosen or None
    return tools


class OutputRouter:
    """Composes ReasoningSplitter and ToolCallParser; `push(delta)` -> RouterDelta, `finish()` -> RouterResult."""

    def __init__(self, starts_in_reasoning: bool, tools: list[dict] | None = None,
                 tool_choice: str | dict | None = "auto", parse_tools: bool = True):
        parser_tools = tools_for_choice(tools, tool_choice) if parse_tools else None
        self._parser = ToolCallParser(parser_tools) if parser_tools else None
        self._splitter = ReasoningSplitter(starts_in_reasoning, tool_call_ends_reasoning=self._parser is not None)
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._flushed = False

    @property
    def in_reasoning(self) -> bool:
        return self._splitter.in_reasoning

    def push(self, text: str) -> RouterDelta:
        return self._route(self._splitter.push(text), final=False)

    def flush(self) -> RouterDelta:
        """End of generation: the last deltas (held-back text, the close of an open tool call)."""
        if self._flushed:
            return RouterDelta()
        self._flushed = True
        return self._route(self._splitter.flush(), final=True)

    def finish(self) -> RouterResult:
        """The whole turn; flushes first if the caller did not."""
        self.flush()
        calls = self._parser.finish().tool_calls if self._parser else []
        override = "tool_calls" if calls and all(c.complete for c in calls) else None
        return RouterResult("".join(self._reasoning), "".join(self._content), calls, override)

    def _route(self, pieces: list[tuple[str, str]], final: bool) -> RouterDelta:
        delta = RouterDelta()
        events: list = []
        for kind, text in pieces:
            if kind == REASONING:
                delta.reasoning += text
            elif self._parser is None:
                events.append(text)
            else:
                events += self._parser.push(text)
        if final and self._parser is not None:
            events += self._parser.flush()
        for event in events:
            if isinstance(event, str):
                delta.content += event
            else:
                delta.tool_calls.append(event)
        self._reasoning.append(delta.reasoning)
        self._content.append(delta.content)
        return delta
