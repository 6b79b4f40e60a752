"""Split generated text into reasoning (`<think>…</think>`) and content, incrementally.

Qwen3.5's template pre-opens `<think>\\n` in the generation prompt when thinking is on, so the model's
output usually starts inside reasoning and only `</think>` is generated. The template writes historical
reasoning as `<think>\\n` + reasoning|trim + `\\n</think>\\n\\n` + content, so we strip the whitespace
around the reasoning and the whitespace right after `</think>`: re-rendering a parsed turn gives the
same text back.

Qwen3.5 often emits a tool call before closing its thinking. `<tool_call>` followed (after optional
whitespace) by `<function=` therefore ends reasoning: the text from `<tool_call>` on is content, for
the tool-call parser. A `<tool_call>` not followed by `<function=` stays in the reasoning.

Every decision depends only on the text seen so far, never on how it was split into deltas: text that
might still turn into a tag (a partial `</think>`, a `<tool_call>` whose next characters are not known,
trailing whitespace that might precede `</think>`) is held back until it is decided.
"""
from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALL_OPEN = "<tool_call>"
FUNCTION_OPEN = "<function="

REASONING = "reasoning"
CONTENT = "content"


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when a rendered prompt ends inside an open `<think>` block (generation starts in reasoning).

    Only the last message block (after the last `<|im_start|>`) is looked at, so tags quoted in
    earlier messages do not count.
    """
    tail = prompt_text[max(prompt_text.rfind("<|im_start|>"), 0):]
    return tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper suffix of `text` that is a prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _implicit_end(after: str) -> bool | None:
    """Whether the text after a `<tool_call>` starts a function: True, False, or None (not known yet)."""
    rest = after.lstrip()
    if len(rest) >= len(FUNCTION_OPEN):
        return rest.startswith(FUNCTION_OPEN)
    return None if FUNCTION_OPEN.startswith(rest) else False


class ReasoningSplitter:
    """Incremental reasoning/content splitter; `push` and `flush` return `(kind, text)` pieces.

    kind is "reasoning" or "content"; pieces are never empty. Concatenating all pieces of one kind over
    a whole generation gives the same text whatever the deltas were.
    """

    def __init__(self, starts_in_reasoning: bool, tool_call_ends_reasoning: bool = True):
        self._in_reasoning = starts_in_reasoning
        self._tool_call_ends = tool_call_ends_reasoning
        self._at_start = True        # an explicit `<think>` may still open (or repeat) the block
        self._strip_leading = starts_in_reasoning  # drop whitespace at the start of the current part
        self._buf = ""

    @property
    def in_reasoning(self) -> bool:
        """True while the text seen so far ends inside reasoning (used to count reasoning tokens)."""
        return self._in_reasoning

    def push(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while self._buf and self._step(out):
            pass
        return out

    def flush(self) -> list[tuple[str, str]]:
        """End of generation: release held-back text (an unclosed think's trailing whitespace is dropped)."""
        out: list[tuple[str, str]] = []
        buf, self._buf = self._buf, ""
        self._at_start = False
        if self._strip_leading:
            buf = buf.lstrip()
        if self._in_reasoning:
            buf = buf.rstrip()
        self._emit(out, REASONING if self._in_reasoning else CONTENT, buf)
        return out

    # One decision on the buffer; returns False when more text is needed.
    def _step(self, out: list[tuple[str, str]]) -> bool:
        if self._at_start:
            return self._step_start()
        if self._strip_leading:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._strip_leading = False
        if self._in_reasoning:
            return self._step_reasoning(out)
        self._emit(out, CONTENT, self._buf)
        self._buf = ""
        return False

    def _step_start(self) -> bool:
        head = self._buf.lstrip()
        if len(head) < len(THINK_OPEN) and THINK_OPEN.startswith(head):
            return False
        self._at_start = False
        if head.startswith(THINK_OPEN):
            self._buf = head[len(THINK_OPEN):]
            self._in_reasoning = True
            self._strip_leading = True
        return True

    def _step_reasoning(self, out: list[tuple[str, str]]) -> bool:
        buf = self._buf
        close = buf.find(THINK_CLOSE)
        search_end = close if close >= 0 else len(buf)
        call = buf.find(TOOL_CALL_OPEN, 0, search_end) if self._tool_call_ends else -1
        while call >= 0:
            decided = _implicit_end(buf[call + len(TOOL_CALL_OPEN):search_end])
            if decided is None and close < 0:
                self._emit_reasoning_upto(out, call)
                return False
            if decided:
                self._emit(out, REASONING, buf[:call].rstrip())
                self._buf = buf[call:]
                self._in_reasoning = False
                return True
            call = buf.find(TOOL_CALL_OPEN, call + 1, search_end)
        if close >= 0:
            self._emit(out, REASONING, buf[:close].rstrip())
            self._buf = buf[close + len(THINK_CLOSE):]
            self._in_reasoning = False
            self._strip_leading = True
            return True
        hold = max(partial_suffix(buf, THINK_CLOSE),
                   partial_suffix(buf, TOOL_CALL_OPEN) if self._tool_call_ends else 0)
        self._emit_reasoning_upto(out, len(buf) - hold)
        return False

    def _emit_reasoning_upto(self, out: list[tuple[str, str]], end: int) -> None:
        """Emit reasoning up to `end`, holding back trailing whitespace (it may precede `</think>`)."""
        text = self._buf[:end].rstrip()
        self._emit(out, REASONING, text)
        self._buf = self._buf[len(text):]

    @staticmethod
    def _emit(out: list[tuple[str, str]], kind: str, text: str) -> None:
        if not text:
            return
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
