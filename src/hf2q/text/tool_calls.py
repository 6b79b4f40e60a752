"""Incremental parser for Qwen3.5's XML tool calls, with schema-typed argument values.

Format (what the chat template writes and the model is told to produce):
    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n…</function>\\n</tool_call>
Values are raw text: the template renders scalars with Python's `str` (`True`, `None`) and mappings and
lists as JSON, so each value is converted back using the tool's JSON schema for that parameter.

Streaming rule (keeps streaming and non-streaming identical, since text already streamed as a tool-call
delta cannot be taken back):
- A call is *committed* once `<tool_call>`, optional whitespace and a complete `<function=NAME>` have been
  seen and NAME is valid (a known tool when `tools` are given). Only then are deltas emitted
  (`ToolCallStart`, then one `ToolCallArgs` per parameter once its value is complete, then the closing `}`).
- Until then nothing is emitted; if the header turns out malformed (no `<function=`, unknown name, or the
  generation ends first), its text goes out as plain content, verbatim.
- A committed call is never turned back into content. If generation ends inside it (`max_tokens`, a stop
  string), nothing is invented to close it: `arguments` is what was produced so far, the JSON of the
  complete parameters followed by the cut one as raw partial text (a string value as an unterminated JSON
  string), with no closing `}` - visibly not JSON, as OpenAI returns a truncated call. `ToolCall.complete`
  is False then, and the finish reason stays the engine's ("length").
- A parameter value ends at the first `</parameter>`, `<parameter=`, `</function>` or `</tool_call>`.
- Whitespace around calls is the template's separator: trailing whitespace of the content before a
  committed call and leading whitespace after a call are dropped.
Non-streaming use is the same machine fed the whole text, so both modes agree by construction.
"""
from __future__ import annotations

import ast
import json
import math
import re
import secrets
from dataclasses import dataclass

from hf2q.text.reasoning import partial_suffix

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"
_VALUE_ENDS = (PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE)
_BODY_TAGS = (PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE)
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.:\-]*")
_MAX_NAME = 256


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    """A piece of the arguments JSON; the pieces of one call concatenate to its `arguments`."""
    index: int
    json_fragment: str


ToolEvent = str | ToolCallStart | ToolCallArgs  # str: plain content text outside tool calls


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str          # JSON object text; only its unclosed beginning when `complete` is False
    complete: bool = True   # False when the generation ended inside the call

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolParseResult:
    content: str
    tool_calls: list[ToolCall]


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """Map function name -> its `parameters` JSON schema, from an OpenAI `tools` list."""
    out: dict[str, dict] = {}
    for tool in tools or []:
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters") or {}
    return out


def _schema_types(schema: dict | None) -> list[str]:
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else list(declared or [])
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types += [t for t in _schema_types(sub) if t not in types]
    if not types and "enum" in schema:
        types = ["enum"]
    return types


def _as_json(raw: str):
    try:
        return True, json.loads(raw)
    except ValueError:
        return False, None


def _convert_as(kind: str, raw: str):
    """Convert `raw` to schema type `kind`; returns (ok, value)."""
    text = raw.strip()
    if kind == "string":
        return True, raw
    if kind == "null":
        return (True, None) if text in ("None", "null") else (False, None)
    if kind == "boolean":
        low = text.lower()
        return (True, low == "true") if low in ("true", "false") else (False, None)
    if kind == "integer":
        try:
            return True, int(text)
        except ValueError:
            ok, value = _as_json(text)
            ok = ok and isinstance(value, float) and value.is_integer()
            return (True, int(value)) if ok else (False, None)
    if kind == "number":
        ok, value = _as_json(text)
        if ok and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, value
        try:
            value = float(text)
        except ValueError:
            return False, None
        return (True, value) if math.isfinite(value) else (False, None)
    if kind in ("object", "array"):
        wanted = dict if kind == "object" else list
        ok, value = _as_json(text)
        if not ok:
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return False, None
        if isinstance(value, str):  # double-encoded: a JSON string holding the JSON value
            return _convert_as(kind, value) if value.strip() != text else (False, None)
        return (True, value) if isinstance(value, wanted) else (False, None)
    if kind == "enum":
        ok, value = _as_json(text)
        return (True, value) if ok else (True, raw)
    return False, None


def convert_value(raw: str, schema: dict | None):
    """Turn a parameter's raw text into a JSON value, guided by its JSON schema (None: unknown)."""
    types = _schema_types(schema)
    if types and types != ["string"] and raw.strip() in ("None", "null"):
        return None
    for kind in types:
        ok, value = _convert_as(kind, raw)
        if ok:
            return value
    ok, value = _as_json(raw)
    return value if ok else raw


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class ToolCallParser:
    """Streaming parser: `push(content_delta)` -> list of ToolEvent; `flush()` at end; `finish()` result."""

    def __init__(self, tools: list[dict] | None):
        self._schemas = tool_schemas(tools)
        self._restrict = tools is not None
        self._buf = ""
        self._state = "content"       # content | header | body | after_function
        self._held_ws = ""            # whitespace before a `<tool_call>` whose header is undecided
        self._strip_leading = False   # drop whitespace right after a call
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._flushed = False
        self._call_id = self._call_name = ""
        self._call_args = ""
        self._complete = True

    def push(self, text: str) -> list[ToolEvent]:
        self._buf += text
        out: list[ToolEvent] = []
        while self._step(out):
            pass
        return out

    def flush(self) -> list[ToolEvent]:
        """End of generation: decide everything still held back and close an open call."""
        out = self.push("")
        if self._state == "header":
            self._emit_content(out, self._held_ws + TOOL_CALL_OPEN + self._buf)
        elif self._state == "body":
            self._complete = False
            self._finish_body(out)
        elif self._state == "content":
            self._emit_content(out, self._buf.lstrip() if self._strip_leading else self._buf)
        if self._state in ("body", "after_function"):
            self._end_call()
        self._buf, self._held_ws, self._state = "", "", "content"
        self._flushed = True
        return out

    def finish(self) -> ToolParseResult:
        """The whole turn: all content (outside calls) and the parsed calls. Flushes first if needed."""
        if not self._flushed:
            self.flush()
        return ToolParseResult("".join(self._content), list(self._calls))

    # One decision on the buffer; returns False when more text is needed.
    def _step(self, out: list[ToolEvent]) -> bool:
        if self._state == "content":
            return self._step_content(out)
        if self._state == "header":
            return self._step_header(out)
        if self._state == "body":
            return self._step_body(out)
        return self._step_after_function(out)

    def _step_content(self, out: list[ToolEvent]) -> bool:
        if self._strip_leading:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._strip_leading = False
        start = self._buf.find(TOOL_CALL_OPEN)
        if start >= 0:
            before = self._buf[:start]
            text = before.rstrip()
            self._emit_content(out, text)
            self._held_ws = before[len(text):]
            self._buf = self._buf[start + len(TOOL_CALL_OPEN):]
            self._state = "header"
            return True
        # hold back a possible partial `<tool_call>` and the whitespace that may precede it
        text = self._buf[:len(self._buf) - partial_suffix(self._buf, TOOL_CALL_OPEN)].rstrip()
        self._emit_content(out, text)
        self._buf = self._buf[len(text):]
        return False

    def _step_header(self, out: list[ToolEvent]) -> bool:
        head = self._buf.lstrip()
        if len(head) < len(FUNCTION_OPEN) and FUNCTION_OPEN.startswith(head):
            return False
        if not head.startswith(FUNCTION_OPEN):
            return self._reject_header(out)
        name_end = head.find(">", len(FUNCTION_OPEN))
        name = head[len(FUNCTION_OPEN):name_end if name_end >= 0 else None]
        if _NAME_CHARS.fullmatch(name) is None or len(name) > _MAX_NAME:
            return self._reject_header(out)
        if name_end < 0:
            return False
        if not name or (self._restrict and name not in self._schemas):
            return self._reject_header(out)
        self._call_id, self._call_name = new_call_id(), name
        self._call_args, self._complete = "", True
        out.append(ToolCallStart(len(self._calls), self._call_id, name))
        self._held_ws = ""
        self._buf = head[name_end + 1:]
        self._state = "body"
        return True

    def _reject_header(self, out: list[ToolEvent]) -> bool:
        """Not a call: `<tool_call>` is plain content and the text after it is scanned again."""
        self._emit_content(out, self._held_ws + TOOL_CALL_OPEN)
        self._held_ws = ""
        self._state = "content"
        return True

    def _step_body(self, out: list[ToolEvent]) -> bool:
        body = self._buf.lstrip()
        self._buf = body
        if body.startswith(PARAMETER_OPEN):
            key_end = body.find(">")
            if key_end < 0:
                return False
            rest = body[key_end + 1:]
            ends = [(i, tag) for tag in _VALUE_ENDS if (i := rest.find(tag)) >= 0]
            if not ends:
                return False
            end, tag = min(ends)
            self._add_argument(out, body[len(PARAMETER_OPEN):key_end].strip(), rest[:end])
            self._buf = rest[end + len(tag):] if tag == PARAMETER_CLOSE else rest[end:]
            return True
        if body.startswith(FUNCTION_CLOSE):
            self._finish_body(out)
            self._buf = body[len(FUNCTION_CLOSE):]
            self._state = "after_function"
            return True
        if body.startswith(TOOL_CALL_CLOSE):
            self._finish_body(out)
            self._buf = body[len(TOOL_CALL_CLOSE):]
            self._end_call()
            return True
        if not body or any(tag.startswith(body) for tag in _BODY_TAGS):
            return False
        # stray text inside a committed call carries no argument: skip to the next tag
        next_tag = body.find("<", 1)
        self._buf = body[next_tag:] if next_tag >= 0 else ""
        return bool(self._buf)

    def _step_after_function(self, out: list[ToolEvent]) -> bool:
        rest = self._buf = self._buf.lstrip()
        if len(rest) < len(TOOL_CALL_CLOSE) and TOOL_CALL_CLOSE.startswith(rest):
            return False
        if rest.startswith(TOOL_CALL_CLOSE):  # a missing `</tool_call>` is tolerated
            self._buf = rest[len(TOOL_CALL_CLOSE):]
        self._end_call()
        return True

    def _add_argument(self, out: list[ToolEvent], key: str, raw: str) -> None:
        schema = self._schemas.get(self._call_name, {}).get("properties", {}).get(key)
        value = convert_value(_strip_one_newline(raw), schema)
        piece = ("{" if not self._call_args else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        self._emit_args(out, piece + json.dumps(value, ensure_ascii=False))

    def _finish_body(self, out: list[ToolEvent]) -> None:
        """Close the arguments object, unless the generation ended inside the call: then the cut
        parameter's partial text is appended as it is and the object stays open (no invented values)."""
        if self._complete:
            self._emit_args(out, "}" if self._call_args else "{}")
            return
        body = self._buf.lstrip()
        fragment = ", " if self._call_args else "{"
        if body.startswith(PARAMETER_OPEN) and ">" in body:
            key_end = body.find(">")
            value = body[key_end + 1:]
            value = _strip_one_newline(value[:len(value) - partial_suffix(value, PARAMETER_CLOSE)])
            self._emit_args(out, fragment + self._partial_argument(body[len(PARAMETER_OPEN):key_end].strip(), value))
        elif not self._call_args:
            self._emit_args(out, fragment)

    def _partial_argument(self, key: str, raw: str) -> str:
        """`"key": ` and the value cut short: an unterminated JSON string for string parameters, else the
        raw text (converting a number or object that is not finished would invent its end)."""
        schema = self._schemas.get(self._call_name, {}).get("properties", {}).get(key)
        text = json.dumps(raw, ensure_ascii=False)[:-1] if "string" in _schema_types(schema) else raw.strip()
        return json.dumps(key, ensure_ascii=False) + ": " + text

    def _emit_args(self, out: list[ToolEvent], fragment: str) -> None:
        self._call_args += fragment
        out.append(ToolCallArgs(len(self._calls), fragment))

    def _end_call(self) -> None:
        self._calls.append(ToolCall(self._call_id, self._call_name, self._call_args, self._complete))
        self._state = "content"
        self._strip_leading = True

    def _emit_content(self, out: list[ToolEvent], text: str) -> None:
        if not text:
            return
        self._content.append(text)
        if out and isinstance(out[-1], str):
            out[-1] += text
        else:
            out.append(text)
