"""The model's chat template, rendered exactly as HF `apply_chat_template(..., tokenize=False)` renders it.

Templates are untrusted code shipped inside model files, so they run in jinja2's immutable sandbox, with time
and size limits (text/template_limits.py), and the same globals and filters HF provides (`raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII text); messages are normalised the way HF normalises them.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext

from hf2q.text.template_limits import TIME_LIMIT_S, LimitedSandbox, TemplateLimitError, render_limited

# Names a message's reasoning may arrive under; templates read `reasoning_content` (HF also fills `thinking`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateError(ValueError):
    """The template refused the conversation (its own message) or could not be parsed or rendered."""


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own filter escapes HTML characters and ASCII-escapes text; HF's (which templates expect) does not.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """`dict` for templates: builds dicts, but is not the type itself (no type attributes to reach)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, so a template cannot reach interpreter internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed in a chat template")


@lru_cache(maxsize=1)
def _environment() -> LimitedSandbox:
    env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _Dict()
    return env


def _plain(value: Any) -> Any:
    """Plain JSON-like data: pydantic models and other mappings become dicts, tuples stay sequences."""
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def _message(message: Any) -> dict:
    # As HF: keys set to None are dropped (OpenAI clients send content=None beside tool_calls), and reasoning
    # given under any of its names is visible under all of them.
    message = {k: v for k, v in _plain(message).items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


class ChatTemplate:
    """A compiled chat template plus the special-token strings templates may reference."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None,
                 time_limit_s: float = TIME_LIMIT_S):
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template does not parse (line {exc.lineno}): {exc.message}") from exc
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.time_limit_s = time_limit_s
        self._probe()

    def _probe(self) -> None:
        """Refuse at load a template that breaks a limit on a one-line conversation: it would on every request."""
        try:
            self.render([{"role": "user", "content": "hi"}])
        except TemplateError as exc:
            if isinstance(exc.__cause__, TemplateLimitError):
                raise TemplateError(f"chat template refused: {exc}") from None

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "ChatTemplate":
        """The template in `tokenizer.chat_template`, with BOS/EOS strings from the GGUF's token ids."""
        source = meta.get("tokenizer.chat_template")
        if not source:
            raise TemplateError("the GGUF has no tokenizer.chat_template; pass a chat template file")
        tokens = meta.get("tokenizer.ggml.tokens") or []

        def token(key: str) -> str | None:
            i = meta.get(key)
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        return cls(source, bos_token=token("tokenizer.ggml.bos_token_id"),
                   eos_token=token("tokenizer.ggml.eos_token_id"))

    @classmethod
    def from_file(cls, path: str | Path, bos_token: str | None = None,
                  eos_token: str | None = None) -> "ChatTemplate":
        """An override template (a `.jinja` file), e.g. a fixed upstream template for an older GGUF."""
        return cls(Path(path).read_text(encoding="utf-8"), bos_token=bos_token, eos_token=eos_token)

    def next_turn_probe(self, messages: Sequence[Any], tools: Sequence[Any] | None = None, **kwargs: Any) -> str:
        """The prompt of a probe next turn of this conversation: the start it shares with this turn's prompt is
        what the next turn will render again unchanged (for Qwen3.5 all but the generation suffix, `<think>\n`
        or the empty think block, which later turns drop). Rendered, so it follows whatever the template does.

        After tool results the next turn is most likely another tool call and its result (an agent loop): a
        user probe would stop before this turn's tool calls, which Qwen3.5 re-renders once a user speaks,
        and that earlier point already has its checkpoint from the turn that asked."""
        if messages and _message(messages[-1]).get("role") == "tool":
            call = {"type": "function", "function": {"name": "X", "arguments": {}}}
            probe = [*messages, {"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "content": "Y"}]
        else:
            probe = [*messages, {"role": "assistant", "content": "X"}, {"role": "user", "content": "Y"}]
        return self.render(probe, tools, True, **kwargs)

    def render(self, messages: Sequence[Any], tools: Sequence[Any] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text; extra keyword arguments (e.g. `enable_thinking`) become template variables."""
        variables = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token)) if v}
        variables.update(_plain(kwargs))
        variables.setdefault("documents", None)
        variables.update(messages=[_message(m) for m in messages], tools=None if tools is None else _plain(list(tools)),
                         add_generation_prompt=add_generation_prompt)
        try:
            return render_limited(self._template, variables, self.time_limit_s)
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(exc.message or str(exc)) from exc
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError,
                MemoryError) as exc:
            raise TemplateError(f"chat template failed on this conversation: {exc}") from exc
