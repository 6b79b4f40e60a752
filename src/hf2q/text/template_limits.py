"""Time and size limits for chat templates, which are untrusted code shipped inside model files.

jinja2's sandbox already keeps a template away from Python internals (no `__class__`, `__globals__`, ...)
and caps `range()` at 100,000 items, but a template can still loop for ever (nested loops) or build a
string of any size (`'x' * 10**10`, `s ~ s` doubled in a chain, `'x'|center(10**10)`). Here every
operation that can make a large value checks its size before it allocates, the output is counted as it
is produced, and a render that runs past its time is stopped by an exception raised in its thread.
"""
from __future__ import annotations

import ctypes
import functools
import re
import threading
from typing import Any, Callable

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_TEXT = 1 << 24  # characters (or items) any one value, and the whole rendered prompt, may hold
MAX_INT_BITS = 1 << 16  # integers past this stop computing (a `10**10**10` would never finish)
TIME_LIMIT_S = 5.0  # a real template renders a long conversation in milliseconds

_NUMBER = re.compile(r"\d+")


class TemplateLimitError(jinja2.exceptions.SecurityError):
    """The template went past a size or time limit."""


def _too_big(what: str) -> TemplateLimitError:
    return TemplateLimitError(f"{what} would exceed the chat template's limit of {MAX_TEXT} characters")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _bounded(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise TemplateLimitError(f"an integer beyond {MAX_INT_BITS} bits in the chat template")
    if _size(value) > MAX_TEXT:
        raise _too_big("a value")
    return value


def _check_args(args, kwargs) -> None:
    # Widths and counts (center, ljust, zfill, indent, wordwrap, '%*s', ...) allocate that many characters.
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > MAX_TEXT:
            raise _too_big(f"an argument of {arg}")


def _check_format(fmt: Any) -> None:
    # A width written into a format string ('%999999999s', '{:>999999999}') allocates that many characters.
    if isinstance(fmt, str) and any(len(n) > 8 or int(n) > MAX_TEXT for n in _NUMBER.findall(fmt)):
        raise _too_big("a format width")


def _check_join(sep: str, items: Any) -> None:
    if isinstance(items, (list, tuple)) and sum(map(_size, items)) + len(sep) * len(items) > MAX_TEXT:
        raise _too_big("a join")


def _check_call(fn: Any, args: tuple, kwargs: dict) -> None:
    _check_args(args, kwargs)
    owner, name = getattr(fn, "__self__", None), getattr(fn, "__name__", "")
    if isinstance(owner, str):
        if name == "join" and args:
            _check_join(owner, args[0])
        elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            count = owner.count(args[0]) if args[0] else len(owner) + 1
            if len(owner) + count * (len(args[1]) - len(args[0])) > MAX_TEXT:
                raise _too_big("a replace")


def _checked_filter(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)  # keeps jinja's pass_context / pass_eval_context marks
    def checked(*args, **kwargs):
        values = [a for a in args if not isinstance(a, (jinja2.runtime.Context, jinja2.nodes.EvalContext,
                                                        jinja2.Environment))]
        _check_args(values[1:], kwargs)
        if name == "format" and values:
            _check_format(values[0])
        if name == "join" and values:
            items = list(values[0]) if not isinstance(values[0], (list, tuple, str, dict)) else values[0]
            _check_join(values[1] if len(values) > 1 else kwargs.get("d", ""), items)
            args = (*args[:len(args) - len(values)], items, *values[1:])
        return _bounded(fn(*args, **kwargs))

    return checked


class _CodeGenerator(CodeGenerator):
    """Compiles `a ~ b` through `environment.concat`, which checks the size first."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, with every large value refused before it is built."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})  # also keeps them from being folded at compile time

    def __init__(self, **options: Any):
        super().__init__(**options)
        self.filters = {name: _checked_filter(name, fn) for name, fn in self.filters.items()}

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            if max(left.bit_length(), 1) * right > MAX_INT_BITS and abs(left) > 1:
                raise TemplateLimitError(f"an integer beyond {MAX_INT_BITS} bits in the chat template")
        elif operator == "*":
            count, seq = (left, right) if isinstance(left, int) else (right, left)
            if isinstance(count, int) and _size(seq) and _size(seq) * count > MAX_TEXT:
                raise _too_big("a repetition")
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
            if "*" in left:
                _check_args(right if isinstance(right, tuple) else (right,), {})
        return _bounded(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        _check_call(__obj, args, kwargs)
        return _bounded(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any):
        wrapped = super().wrap_str_format(value)  # the sandbox's own str.format, checked here for widths
        if wrapped is not None:
            _check_format(value.__self__)
        return wrapped

    def concat(self, parts: tuple) -> str:
        parts = [str(p) for p in parts]
        if sum(map(len, parts)) > MAX_TEXT:
            raise _too_big("a concatenation")
        return "".join(parts)


def render_limited(template: jinja2.Template, variables: dict, time_limit_s: float) -> str:
    """The rendered text, or TemplateLimitError past MAX_TEXT characters or `time_limit_s` seconds.

    The render runs on its own thread; one that overruns gets an exception raised inside it, which stops
    the template's Python loops at their next step (what a sandboxed template can run is only those).
    """
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            out, size = [], 0
            for piece in template.generate(**variables):
                size += len(piece)
                if size > MAX_TEXT:
                    raise _too_big("the rendered prompt")
                out.append(piece)
            result["text"] = "".join(out)
        except BaseException as exc:  # handed to the caller, even the timeout raised into this thread
            result["error"] = exc

    thread = threading.Thread(target=run, name="hf2q-template", daemon=True)
    thread.start()
    thread.join(time_limit_s)
    if thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Timeout))
        thread.join(1.0)
        raise TemplateLimitError(f"the chat template ran longer than {time_limit_s:g} s")
    if "error" in result:
        error = result["error"]
        raise TemplateLimitError("the chat template ran past its time limit") if isinstance(error, _Timeout) \
            else error
    return result["text"]


class _Timeout(BaseException):
    """Raised inside a render thread that overran; BaseException so the template cannot catch it."""
