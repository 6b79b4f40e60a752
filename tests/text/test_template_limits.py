"""A hostile chat template (in a GGUF or a --chat-template file) reaches no Python internals, and cannot loop
for ever or build values without bound: each attempt is a clean TemplateError, at load or per request."""
from __future__ import annotations

import time

import pytest

from hf2q.text.chat_template import ChatTemplate, TemplateError

BASE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
HI = [{"role": "user", "content": "hi"}]

INTERNALS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__['os'] }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ self._TemplateReference__context }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{{ dict.__call__.__globals__ }}",
    "{% set ns = namespace(__class__=1) %}",
]

UNBOUNDED = [
    "{{ 'x' * 10**10 }}",
    "{{ range(10**10)|list }}",
    "{{ 'x'|center(10**10) }}",
    "{{ 'x'.ljust(10**10) }}",
    "{{ '%999999999s' % 'x' }}",
    "{{ '{:>999999999}'.format('x') }}",
    "{% set a = 'xxxxxxxxxxxxxxxx' %}" + "{% set a = a ~ a %}" * 30 + "{{ a }}",
    "{% set a = ['x'] %}" + "{% set a = a + a %}" * 30 + "{{ a|length }}",
    "{{ [1]|batch(100000, 'x' * 1000000)|first|join }}",
    "{% for i in range(100000) %}{% for j in range(1000) %}xxxxxxxxxxxxxxxxxxxx{% endfor %}{% endfor %}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
]

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def attacked(payload: str, time_limit_s: float = 5.0) -> ChatTemplate:
    """A template that is harmless unless the request sets `attack` (so it loads, as a trap would)."""
    return ChatTemplate("{% if attack %}" + payload + "{% endif %}" + BASE, time_limit_s=time_limit_s)


@pytest.mark.parametrize("payload", INTERNALS)
def test_no_python_internals(payload):
    template = attacked(payload)
    try:
        out = template.render(HI, attack=True)
    except TemplateError as exc:
        assert "unsafe" in str(exc) or "not allowed" in str(exc), exc
    else:  # the sandbox may also print an unsafe attribute as nothing
        assert "class" not in out and "function" not in out and "module" not in out, out


@pytest.mark.parametrize("payload", UNBOUNDED)
def test_no_unbounded_values(payload):
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match="limit|recursion|too big"):
        attacked(payload).render(HI, attack=True)
    assert time.monotonic() - t0 < 3


def test_endless_loop_is_stopped():
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match="ran longer than 0.5 s"):
        attacked(LOOP, time_limit_s=0.5).render(HI, attack=True)
    assert time.monotonic() - t0 < 2
    assert attacked(LOOP, time_limit_s=0.5).render(HI) == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize("payload", [LOOP, "{{ 'x' * 10**10 }}"])
def test_refused_at_load_when_every_request_would_break_it(payload):
    with pytest.raises(TemplateError, match="chat template refused"):
        ChatTemplate(payload + BASE, time_limit_s=0.5)


def test_ordinary_operations_still_work():
    out = ChatTemplate("{{ '{:>5}'.format('x') }}|{{ '%5d' % 3 }}|{{ 'ab' * 3 }}|{{ [1] + [2] }}|{{ 2 ** 8 }}|"
                       "{{ 'a' ~ 'b' }}|{{ ['a', 'b']|join(',') }}|{{ 'a-b'.replace('-', '+') }}").render([])
    assert out == "    x|    3|ababab|[1, 2]|256|ab|a,b|a+b"
