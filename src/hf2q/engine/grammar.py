"""Grammar-constrained decoding: per-request token masks from xgrammar.

The engine knows only the `Constraint` protocol: mask the row's logits before sampling, accept each
token that is appended (sampled or forced), and report when the grammar is complete. `GrammarCompiler`
is built once per tokenizer (the 248k-token vocabulary takes seconds to index); each request compiles a
structural tag (cached by xgrammar when the same tools come again) into a `Grammar`, and every choice
of the request gets its own matcher from it.

The formats are Qwen3.5's: tool calls as `<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>
…</function>\\n</tool_call>` with values typed by the tool's JSON schema (xgrammar's `qwen_xml` style),
JSON answers for `response_format`, and, when the prompt pre-opens `<think>`, free reasoning up to
`</think>` first. Control markers are matched as their own tokens, so the output re-tokenizes the
way the template writes it.
"""
from __future__ import annotations

import re
import threading
import weakref
from typing import Any, Optional, Protocol

import torch
import xgrammar as xgr

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# Special tokens the formats may produce; every other control token is never allowed by a grammar.
MARKER_TOKENS = (THINK_OPEN, THINK_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
# Between two calls the template writes one newline; after `</think>`, a blank line.
CALL_SEPARATOR = "\n"
AFTER_REASONING = "\n\n"
COMPILER_CACHE_BYTES = 256 << 20
# Longest whitespace run inside JSON: room for indentation, yet a model cannot pad forever.
JSON_MAX_WHITESPACE = 16
PARAMETER_END = "\n</parameter>\n"
PARAMETER_NAME = r"[A-Za-z0-9_.:\-]+"
# Text a free-text value may not contain: the tool-call parser would end the value there.
VALUE_EXCLUDES = ("<parameter=", "</parameter>", "</function>", "<tool_call>", "</tool_call>")
# String keywords json_schema mode enforces; a string parameter carrying one is built by xgrammar's own
# JSON-schema converter in its `qwen_xml` style (the raw, unquoted value the template writes).
STRING_KEYWORDS = ("maxLength", "minLength", "pattern", "format")


class Constraint(Protocol):
    """What the engine calls for a constrained request (one object per sequence)."""

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits of tokens the grammar forbids next to -inf, in place ([V] row)."""

    def accept(self, token: int) -> bool:
        """Advance past `token`; False (and no state change) if the grammar forbids it."""

    def is_terminated(self) -> bool:
        """True once the grammar is complete, its stop token included."""


class GrammarConstraint:
    """One sequence's xgrammar matcher and its reusable bitmask."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> None:
        self.matcher.fill_next_token_bitmask(self.bitmask)
        row = logits.view(1, -1)
        bitmask = self.bitmask if row.device.type == "cpu" else self.bitmask.to(row.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(row, bitmask, vocab_size=self.vocab_size)

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class Grammar:
    """A compiled grammar for one API request; immutable, so its choices share it."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int):
        self.compiled = compiled
        self.vocab_size = vocab_size

    def constraint(self) -> GrammarConstraint:
        return GrammarConstraint(self.compiled, self.vocab_size)


class GrammarCompiler:
    """xgrammar's compiler over hf2q's own tokenizer: token bytes as decoded text gives them.

    `vocab_size` is the width of the logits (it may exceed the tokenizer's table: the extra ids are never
    allowed). Control tokens other than `MARKER_TOKENS` get no text, so no grammar can produce them; the
    tokenizer's EOS ids are the grammar's stop tokens.
    """

    def __init__(self, tokenizer, vocab_size: int, max_threads: int = 2):
        keep = {tokenizer.token_to_id(t) for t in MARKER_TOKENS}
        vocab = [b"" if i in tokenizer.special_ids and i not in keep else tokenizer.token_bytes(i)
                 for i in range(tokenizer.vocab_size)]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=sorted(tokenizer.eos_token_ids))
        self.vocab_size = vocab_size
        self.markers = {t for t in MARKER_TOKENS if tokenizer.token_to_id(t) is not None}
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_limit_bytes=COMPILER_CACHE_BYTES)

    def compile(self, fmt: dict) -> Grammar:
        """Compile an xgrammar structural-tag format; ValueError if it is invalid for this vocabulary."""
        missing = sorted(m for m in _token_markers(fmt) if m not in self.markers)
        if missing:
            raise ValueError(f"this model's vocabulary has no {', '.join(missing)} token")
        try:
            tag = xgr.StructuralTag.model_validate({"type": "structural_tag", "format": fmt})
            compiled = self._compiler.compile_structural_tag(tag)
        except (RuntimeError, ValueError) as exc:  # a schema xgrammar cannot turn into a grammar
            raise ValueError(f"cannot build a grammar for this request: {_plain_message(exc)}") from None
        return Grammar(compiled, self.vocab_size)


# xgrammar's C++ errors start "[12:00:00] /project/cpp/json_schema_converter.cc:5082: ": its source, not ours.
_CPP_LOCATION = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*")


def _plain_message(exc: Exception) -> str:
    """The first line of a compiler error, without the C++ source location xgrammar puts in front."""
    lines = str(exc).strip().splitlines()
    return _CPP_LOCATION.sub("", lines[0]) if lines else type(exc).__name__


_compilers: "weakref.WeakKeyDictionary[Any, GrammarCompiler]" = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer, vocab_size: int) -> GrammarCompiler:
    """The one compiler of this tokenizer (built on first use, shared by all requests and threads)."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None or compiler.vocab_size != vocab_size:
            compiler = _compilers[tokenizer] = GrammarCompiler(tokenizer, vocab_size)
        return compiler


JSON_OBJECT = {"type": "json_object"}


def prepare(tokenizer, vocab_size: int) -> GrammarCompiler:
    """Build the tokenizer's compiler and compile the formats that do not depend on the request (`response_format`
    json_object, with and without a reasoning prefix), so that a first constrained request pays neither: on a
    2-core host the import, the vocabulary's index and a JSON compile took 1.3 s of a first `tool_choice`
    'required' request's 1.6 s. xgrammar keeps compiled formats in the compiler's cache. Host work only."""
    compiler = compiler_for(tokenizer, vocab_size)
    for opens_reasoning in (False, True):
        compiler.compile(after_reasoning(json_format(JSON_OBJECT), opens_reasoning))
    return compiler


def mask_once(compiler: GrammarCompiler, device) -> None:
    """Mask one fp32 logits row on `device` as a constrained request does: on CUDA, xgrammar's Triton kernel
    compiles on first use."""
    constraint = compiler.compile(json_format(JSON_OBJECT)).constraint()
    constraint.mask(torch.zeros(compiler.vocab_size, device=device))


# ---- formats (xgrammar structural-tag JSON) --------------------------------------------------------

def _token(text: str) -> dict:
    return {"type": "token", "token": text}


def _token_markers(fmt: Any) -> set[str]:
    """Every token marker a format names (to refuse a vocabulary that lacks one, by name)."""
    if isinstance(fmt, dict):
        found = {fmt["token"]} if fmt.get("type") == "token" and isinstance(fmt.get("token"), str) else set()
        for key in ("exclude_tokens", "trigger_tokens"):
            found |= {t for t in fmt.get(key, ()) if isinstance(t, str)}
        for value in fmt.values():
            found |= _token_markers(value)
        return found
    if isinstance(fmt, list):
        return set().union(*(_token_markers(v) for v in fmt)) if fmt else set()
    return set()


def _is_text(schema: Any) -> bool:
    """Values the template writes verbatim: strings, and anything whose schema does not say."""
    if not isinstance(schema, dict):
        return True
    if "enum" in schema or "const" in schema:
        return False
    kind = schema.get("type")
    return kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind)


def _value(schema: Any) -> dict:
    """A parameter value: free text for strings (up to the closing tag), else JSON of its schema.

    Strings with length, pattern or format keywords are checked by xgrammar as in json_schema mode, so
    tool arguments honour every keyword a JSON answer does (numbers' bounds come with the JSON schema).
    Such a value may then contain a closing tag, but only where the schema itself allows that text."""
    if _is_text(schema):
        if isinstance(schema, dict) and any(k in schema for k in STRING_KEYWORDS):
            typed = schema if "type" in schema else {**schema, "type": "string"}
            return {"type": "json_schema", "json_schema": typed, "style": "qwen_xml"}
        return {"type": "any_text", "excludes": list(VALUE_EXCLUDES)}
    if isinstance(schema, dict) and isinstance(schema.get("const"), str):
        return {"type": "const_string", "value": schema["const"]}
    if isinstance(schema, dict) and schema.get("enum") and all(isinstance(v, str) for v in schema["enum"]):
        return {"type": "or", "elements": [{"type": "const_string", "value": v} for v in schema["enum"]]}
    return _json(schema)


def _json(schema: Any) -> dict:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": JSON_MAX_WHITESPACE}


def _parameter(name: str, schema: Any) -> dict:
    return {"type": "tag", "begin": f"<parameter={name}>\n", "content": _value(schema), "end": PARAMETER_END}


def _free_parameters() -> dict:
    """Any parameters, any text values: for a tool without a schema or with `strict: false`."""
    named = {"type": "regex", "pattern": PARAMETER_NAME}
    value = {"type": "tag", "begin": ">\n", "content": _value(None), "end": PARAMETER_END}
    return {"type": "star", "content": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<parameter="}, named, value]}}


def _parameters(function: dict) -> list[dict]:
    """The function's parameters in schema order, required ones mandatory, as the template writes them."""
    params = function.get("parameters")
    props = params.get("properties") if isinstance(params, dict) else None
    if function.get("strict") is False or not isinstance(props, dict) or params.get("additionalProperties"):
        return [_free_parameters()]
    required = set(params.get("required") or ())
    return [_parameter(k, v) if k in required else {"type": "optional", "content": _parameter(k, v)}
            for k, v in props.items()]


def tool_call(function: dict) -> dict:
    """One `<tool_call>` of this function, byte for byte as the chat template writes one."""
    return {
        "type": "tag", "begin": _token(TOOL_CALL_OPEN),
        "content": {"type": "sequence", "elements": [
            {"type": "const_string", "value": f"\n<function={function['name']}>\n"},
            *_parameters(function),
            {"type": "const_string", "value": "</function>\n"},
        ]},
        "end": _token(TOOL_CALL_CLOSE),
    }


def tool_calls_format(tools: list[dict], choice: Any, parallel: bool) -> dict:
    """`tool_choice` 'required': one or more calls of the given tools (one if not `parallel`), newline
    separated; a named choice ({"type": "function", "function": {"name": ...}}): exactly one call of it."""
    functions = [t["function"] for t in tools]
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        return tool_call(next(f for f in functions if f["name"] == name))
    if choice != "required":
        raise ValueError(f"tool_choice {choice!r} needs no grammar")
    return {"type": "tags_with_separator", "tags": [tool_call(f) for f in functions], "separator": CALL_SEPARATOR,
            "at_least_one": True, "stop_after_first": not parallel}


def json_format(response_format: dict) -> dict:
    """`response_format` json_object (any JSON object) or json_schema (OpenAI's `json_schema.schema`)."""
    kind = response_format.get("type")
    if kind == "json_object":
        return _json({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise ValueError("response_format json_schema must be an object with a 'schema' JSON schema")
        return _json(spec.get("schema", True))
    raise ValueError(f"response_format {kind!r} needs no grammar")


def after_reasoning(fmt: dict, opens_reasoning: bool) -> dict:
    """Prefix `fmt` with free reasoning up to `</think>` when the prompt pre-opened `<think>`."""
    if not opens_reasoning:
        return fmt
    reasoning = {"type": "tag", "begin": "", "end": _token(THINK_CLOSE),
                 "content": {"type": "any_tokens", "exclude_tokens": [THINK_OPEN, THINK_CLOSE]}}
    return {"type": "sequence", "elements": [reasoning, {"type": "const_string", "value": AFTER_REASONING}, fmt]}


def request_format(tools: Optional[list[dict]], tool_choice: Any, parallel: bool,
                   response_format: Optional[dict], opens_reasoning: bool) -> Optional[dict]:
    """The format a chat request constrains its output to, or None when it is unconstrained."""
    if tool_choice == "required" or isinstance(tool_choice, dict):
        if response_format is not None and response_format.get("type") != "text":
            raise ValueError("response_format cannot be combined with tool_choice 'required' or a named tool")
        return after_reasoning(tool_calls_format(tools or [], tool_choice, parallel), opens_reasoning)
    if response_format is not None and response_format.get("type") != "text":
        return after_reasoning(json_format(response_format), opens_reasoning)
    return None
