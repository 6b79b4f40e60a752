"""Grammar constraints over the real Qwen3.5 vocabulary: what the formats accept, and that masked random
logits always decode to tool calls (or JSON) that hf2q's own parsers read back as valid."""
import json
import time

import pytest
import torch

pytest.importorskip("xgrammar")

from hf2q.engine import grammar  # noqa: E402
from hf2q.text.tokenizer import Tokenizer  # noqa: E402
from hf2q.text.tool_calls import ToolCallParser  # noqa: E402
from tests.support.tokenizer_dir import tokenizer_gguf_metadata  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer"}, "alerts": {"type": "boolean"}},
    "required": ["unit", "alerts"]}}}
# Only bounded values (enum, boolean): random logits must reach the end of every call.
BOUNDED = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {k: WEATHER["function"]["parameters"]["properties"][k] for k in ("unit", "alerts")},
    "required": ["unit"]}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
FREE = {"type": "function", "function": {"name": "free"}}
TOOLS = [WEATHER, PING, FREE]
WEATHER_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nLe Havre\nnord\n</parameter>\n"
                "<parameter=unit>\ncelsius\n</parameter>\n<parameter=alerts>\ntrue\n</parameter>\n"
                "</function>\n</tool_call>")
PING_CALL = "<tool_call>\n<function=ping>\n</function>\n</tool_call>"
FREE_CALL = "<tool_call>\n<function=free>\n<parameter=a.b>\nx < y\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture(scope="module")
def tok(request):
    return Tokenizer.from_gguf_metadata(tokenizer_gguf_metadata(request))


@pytest.fixture(scope="module")
def compiler(tok):
    return grammar.compiler_for(tok, tok.vocab_size)


def eos(tok) -> int:
    return tok.token_to_id("<|im_end|>")


def accepts(compiler, tok, fmt, text: str, end: bool = True) -> bool:
    """Whether the grammar takes `text` (as the tokenizer encodes it) and then, if `end`, stops."""
    c = compiler.compile(fmt).constraint()
    if not all(c.accept(t) for t in tok.encode(text)):
        return False
    return c.accept(eos(tok)) and c.is_terminated() if end else True


def sample(compiler, tok, fmt, seed: int, max_steps: int = 400) -> tuple[str, bool]:
    """Greedy decoding of random logits under the grammar: (text, terminated)."""
    c = compiler.compile(fmt).constraint()
    gen = torch.Generator().manual_seed(seed)
    ids = []
    for _ in range(max_steps):
        logits = torch.randn(tok.vocab_size, generator=gen) * 4
        c.mask(logits)
        token = int(logits.argmax())
        assert c.accept(token), f"the mask allowed {token}, which the matcher refuses"
        if c.is_terminated():
            assert token in tok.eos_token_ids
            return tok.decode(ids), True
        ids.append(token)
    return tok.decode(ids), False


def parse(text: str, tools=TOOLS):
    parser = ToolCallParser(tools)
    parser.push(text)
    parser.flush()
    return parser.finish()


def test_compiler_is_built_once_per_tokenizer(tok, compiler):
    assert grammar.compiler_for(tok, tok.vocab_size) is compiler


def test_prepare_leaves_the_request_independent_formats_compiled(tok, compiler):
    """What `prepare` compiles (before /health on CUDA: hf2q.server.first_use) is what a `response_format`
    json_object request asks for, with and without a reasoning prefix: that request compiles nothing more."""
    assert grammar.prepare(tok, tok.vocab_size) is compiler
    held = compiler._compiler.get_cache_size_bytes()
    for opens_reasoning in (False, True):
        compiler.compile(grammar.request_format(None, None, True, {"type": "json_object"}, opens_reasoning))
    assert compiler._compiler.get_cache_size_bytes() == held > 0
    grammar.mask_once(compiler, "cpu")  # what the server does on the device, then
    assert compiler._compiler.get_cache_size_bytes() == held


def test_grammar_ahead_builds_on_a_thread_and_never_fails_the_start(tok, compiler, caplog):
    """The server's build beside the warm-up (on CUDA; here on the CPU): the tokenizer's one compiler, and a
    model whose compiler cannot be built is a log line, not a failed start."""
    from types import SimpleNamespace

    from hf2q.server.first_use import GrammarAhead

    model = SimpleNamespace(tokenizer=tok, config=SimpleNamespace(vocab_size=tok.vocab_size))
    ahead = GrammarAhead(model, torch.device("cpu"))
    ahead.finish()
    assert ahead.compiler is compiler
    broken = GrammarAhead(SimpleNamespace(tokenizer=None, config=model.config), torch.device("cpu"))
    broken.finish()
    assert broken.compiler is None and "grammar compiler not built ahead" in caplog.text
    nowhere = GrammarAhead(model, torch.device("cuda", 99))  # a device the mask cannot run on
    nowhere.finish()
    assert nowhere.compiler is compiler and "grammar mask not run ahead" in caplog.text


def test_required_accepts_template_calls_only(compiler, tok):
    fmt = grammar.request_format(TOOLS, "required", True, None, False)
    assert accepts(compiler, tok, fmt, WEATHER_CALL)
    assert accepts(compiler, tok, fmt, WEATHER_CALL + "\n" + PING_CALL + "\n" + FREE_CALL)
    assert not accepts(compiler, tok, fmt, "", end=True)                     # at least one call
    assert not accepts(compiler, tok, fmt, "Sure. " + WEATHER_CALL, end=False)  # no text before
    assert not accepts(compiler, tok, fmt, WEATHER_CALL + "\nok", end=False)   # nor between / after
    assert not accepts(compiler, tok, fmt, WEATHER_CALL.replace("get_weather", "get_news"), end=False)
    assert not accepts(compiler, tok, fmt, WEATHER_CALL.replace("celsius", "kelvin"), end=False)  # enum
    assert not accepts(compiler, tok, fmt, WEATHER_CALL.replace("true", "yes"), end=False)  # boolean
    missing = WEATHER_CALL.replace("<parameter=unit>\ncelsius\n</parameter>\n", "")
    assert not accepts(compiler, tok, fmt, missing, end=False)  # required parameter
    assert not accepts(compiler, tok, fmt, PING_CALL.replace("</function>", "<parameter=x>\n1\n</parameter>\n"
                                                             "</function>"), end=False)


def test_markers_are_their_special_tokens(compiler, tok):
    """`<tool_call>` must be the single special token, as the template tokenizes it."""
    fmt = grammar.request_format(TOOLS, "required", True, None, False)
    c = compiler.compile(fmt).constraint()
    spelled = tok.encode("<")  # the first piece of `<tool_call>` written as plain text
    assert not c.accept(spelled[0])
    assert c.accept(tok.token_to_id("<tool_call>"))


def test_named_choice_and_single_call(compiler, tok):
    named = grammar.request_format(TOOLS, {"type": "function", "function": {"name": "ping"}}, True, None, False)
    assert accepts(compiler, tok, named, PING_CALL)
    assert not accepts(compiler, tok, named, WEATHER_CALL, end=False)
    assert not accepts(compiler, tok, named, PING_CALL + "\n" + PING_CALL, end=False)
    single = grammar.request_format(TOOLS, "required", False, None, False)
    assert accepts(compiler, tok, single, PING_CALL)
    assert not accepts(compiler, tok, single, PING_CALL + "\n" + PING_CALL, end=False)


def test_reasoning_comes_first_when_the_prompt_opens_it(compiler, tok):
    fmt = grammar.request_format(TOOLS, "required", True, None, True)
    assert accepts(compiler, tok, fmt, "Paris, so celsius.\n</think>\n\n" + WEATHER_CALL)
    assert not accepts(compiler, tok, fmt, WEATHER_CALL)  # a call inside the reasoning is not the answer
    assert not accepts(compiler, tok, fmt, "a</think>\n\nSure. " + WEATHER_CALL, end=False)


@pytest.mark.parametrize("seed", range(4))
def test_random_logits_give_parseable_calls(compiler, tok, seed):
    fmt = grammar.request_format([BOUNDED, PING], "required", seed % 2 == 0, None, False)
    text, done = sample(compiler, tok, fmt, seed)
    assert done, text
    result = parse(text, [BOUNDED, PING])
    assert result.content == "" and result.tool_calls and all(c.complete for c in result.tool_calls)
    for call in result.tool_calls:
        args = json.loads(call.arguments)
        if call.name == "get_weather":
            assert args["unit"] in ("celsius", "fahrenheit") and isinstance(args.get("alerts", False), bool)
        else:
            assert call.name == "ping" and args == {}


def test_named_random_logits_call_that_function(compiler, tok):
    fmt = grammar.request_format([BOUNDED, PING], {"type": "function", "function": {"name": "get_weather"}}, True,
                                 None, False)
    text, done = sample(compiler, tok, fmt, seed=7)
    calls = parse(text, [BOUNDED, PING]).tool_calls
    assert done and [c.name for c in calls] == ["get_weather"]


def test_json_schema_response_format(compiler, tok):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "mood": {"enum": ["calm", "busy"]}}, "required": ["ok", "mood"]}
    fmt = grammar.request_format(None, None, True, {"type": "json_schema", "json_schema": {"schema": schema}},
                                 False)
    for seed in range(3):
        text, done = sample(compiler, tok, fmt, seed)
        value = json.loads(text)
        assert done and isinstance(value["ok"], bool) and value["mood"] in ("calm", "busy")
    assert accepts(compiler, tok, grammar.request_format(None, None, True, {"type": "json_object"}, False),
                   '{"a": [1, "x"]}')
    assert not accepts(compiler, tok, grammar.request_format(None, None, True, {"type": "json_object"}, False),
                       '[1]', end=False)


def test_refusals_are_value_errors(compiler):
    with pytest.raises(ValueError):
        grammar.request_format(TOOLS, "required", True, {"type": "json_object"}, False)
    with pytest.raises(ValueError):
        grammar.json_format({"type": "json_schema"})
    with pytest.raises(ValueError):
        compiler.compile({"type": "token", "token": "<no_such_token>"})


def test_compile_per_request_is_fast(compiler):
    """Building the vocabulary index is per model; a request's tool grammar compiles in well under a second."""
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": WEATHER["function"]["parameters"]}}
             for i in range(8)]
    fmt = grammar.request_format(tools, "required", True, None, True)
    start = time.perf_counter()
    compiler.compile(fmt)
    assert time.perf_counter() - start < 1.0


# Every keyword json_schema mode enforces, on tool parameters: string length, pattern, format, const,
# numeric bounds.
KEYWORDS = {"type": "function", "function": {"name": "label", "parameters": {
    "type": "object",
    "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 8},
                   "tag": {"type": "string", "pattern": "^[a-z]+$"},
                   "day": {"type": "string", "format": "date"}, "kind": {"const": "box"},
                   "n": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["code", "tag", "kind", "n"]}}}


def label_call(code="ABC", tag="abc", n="3", day=None, kind="box") -> str:
    day_param = f"<parameter=day>\n{day}\n</parameter>\n" if day is not None else ""
    return (f"<tool_call>\n<function=label>\n<parameter=code>\n{code}\n</parameter>\n<parameter=tag>\n{tag}\n"
            f"</parameter>\n{day_param}<parameter=kind>\n{kind}\n</parameter>\n<parameter=n>\n{n}\n</parameter>\n"
            f"</function>\n</tool_call>")


@pytest.mark.parametrize("fields, ok", [
    ({}, True), ({"code": "12345678"}, True), ({"day": "2024-02-29"}, True),
    ({"code": "123456789"}, False), ({"code": "x" * 992}, False),  # maxLength
    ({"code": "AB"}, False), ({"tag": "Abc"}, False),               # minLength, pattern
    ({"day": "soon"}, False), ({"kind": "bag"}, False),             # format, const
    ({"n": "0"}, False), ({"n": "6"}, False),                       # minimum, maximum
])
def test_tool_arguments_honour_json_schema_keywords(compiler, tok, fields, ok):
    fmt = grammar.request_format([KEYWORDS], {"type": "function", "function": {"name": "label"}}, True, None, False)
    assert accepts(compiler, tok, fmt, label_call(**fields), end=ok) is ok


def test_random_logits_keep_a_bounded_string_bounded(compiler, tok):
    """Unconstrained, random logits write strings of hundreds of characters; here they must stop at 8."""
    props = KEYWORDS["function"]["parameters"]["properties"]
    short = {"type": "function", "function": {"name": "label", "parameters": {
        "type": "object", "properties": {k: props[k] for k in ("code", "n")}, "required": ["code", "n"]}}}
    fmt = grammar.request_format([short], "required", False, None, False)
    for seed in range(2):
        text, done = sample(compiler, tok, fmt, seed=seed, max_steps=100)
        args = json.loads(parse(text, [short]).tool_calls[0].arguments)
        assert done and 3 <= len(args["code"]) <= 8 and 1 <= args["n"] <= 5, text
