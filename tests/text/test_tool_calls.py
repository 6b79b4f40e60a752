"""ToolCallParser: Qwen3.5 XML tool calls, schema-typed values, malformed calls, streaming == whole."""
import json
import re

import pytest

from hf2q.text.tool_calls import (ToolCallArgs, ToolCallParser, ToolCallStart, convert_value,
                                  tool_schemas)
from tests.text.test_reasoning import chunkings

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "location": {"type": "string"}, "verbose": {"type": "boolean"}, "days": {"type": "integer"},
        "threshold": {"type": "number"}, "unit": {"type": ["string", "null"]},
        "filters": {"type": "object"}, "hours": {"type": "array", "items": {"type": "integer"}},
        "note": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}}}}},
]


def call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def parse(chunks, tools=TOOLS):
    """Run the parser as a streaming server would; check the deltas against the final result."""
    parser = ToolCallParser(tools)
    events = []
    for chunk in chunks:
        events += parser.push(chunk)
    events += parser.flush()
    result = parser.finish()
    assert "".join(e for e in events if isinstance(e, str)) == result.content
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [(s.index, s.id, s.name) for s in starts] == [(i, c.id, c.name) for i, c in enumerate(result.tool_calls)]
    for i, c in enumerate(result.tool_calls):
        assert re.fullmatch(r"call_[0-9a-f]{24}", c.id)
        streamed = "".join(e.json_fragment for e in events if isinstance(e, ToolCallArgs) and e.index == i)
        assert streamed == c.arguments
        assert isinstance(json.loads(c.arguments), dict) if c.complete else c.arguments.startswith("{")
        # no event of a call comes before its start
        first = next(k for k, e in enumerate(events) if isinstance(e, ToolCallStart) and e.index == i)
        assert all(k > first for k, e in enumerate(events) if isinstance(e, ToolCallArgs) and e.index == i)
    return result.content, [(c.name, json.loads(c.arguments) if c.complete else c.arguments, c.complete)
                            for c in result.tool_calls]


def check_all_chunkings(text, expected, tools=TOOLS):
    for i, chunks in enumerate(chunkings(text, seed=len(text))):
        assert parse(chunks, tools) == expected, f"chunking #{i}: {chunks!r}"


def test_every_schema_type():
    text = call("get_weather", location="  Paris, France ", verbose="True", days="3", threshold="2.5",
                unit="None", filters="{'max': 3, 'ok': True}", hours="[1, 2, 3]", note="null")
    check_all_chunkings(text, ("", [("get_weather", {
        "location": "  Paris, France ", "verbose": True, "days": 3, "threshold": 2.5, "unit": None,
        "filters": {"max": 3, "ok": True}, "hours": [1, 2, 3], "note": None}, True)]))


@pytest.mark.parametrize("raw, schema, value", [
    ("false", {"type": "boolean"}, False),
    ("False", {"type": "boolean"}, False),
    ("7", {"type": "number"}, 7),
    ("1e3", {"type": "number"}, 1000.0),
    ("4.0", {"type": "integer"}, 4),
    ("not a number", {"type": "integer"}, "not a number"),
    ("nan", {"type": "number"}, "nan"),
    ("None", {"type": "string"}, "None"),
    ("42", {"type": "string"}, "42"),
    ("42", {"type": ["integer", "string"]}, 42),
    ("x", {"type": ["integer", "string"]}, "x"),
    ('{"a": [1, null]}', {"type": "object"}, {"a": [1, None]}),
    ('"{\\"a\\": 1}"', {"type": "object"}, {"a": 1}),
    ("(1, 2)", {"type": "array"}, "(1, 2)"),
    ("['a', None]", {"type": "array"}, ["a", None]),
    ("red", {"enum": ["red", "green"]}, "red"),
    ("12", None, 12),
    ("true", None, True),
    ("True", None, "True"),
    ("hello world", None, "hello world"),
    ('{"k": 1}', {}, {"k": 1}),
])
def test_convert_value(raw, schema, value):
    assert convert_value(raw, schema) == value
    assert type(convert_value(raw, schema)) is type(value)


def test_string_values_keep_inner_newlines_and_lose_exactly_one_at_each_end():
    text = call("search", query="\nline one\n\nline two\n")
    check_all_chunkings(text, ("", [("search", {"query": "\nline one\n\nline two\n"}, True)]))


def test_content_around_several_calls():
    text = ("I'll check both.\n\n" + call("get_weather", location="Paris") + "\n"
            + call("search", query="weather Paris") + "\n\nDone.")
    check_all_chunkings(text, ("I'll check both.Done.", [
        ("get_weather", {"location": "Paris"}, True), ("search", {"query": "weather Paris"}, True)]))


def test_call_without_parameters_and_tolerated_missing_tags():
    check_all_chunkings("<tool_call>\n<function=search>\n</function>\n</tool_call>",
                        ("", [("search", {}, True)]))
    # missing </parameter> (value ends at the next tag), missing </function>, missing </tool_call>
    text = ("<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n<parameter=location>\nRome\n"
            "</tool_call><tool_call><function=search><parameter=query>x</parameter></function> after")
    check_all_chunkings(text, ("after", [("get_weather", {"days": 2, "location": "Rome"}, True),
                                         ("search", {"query": "x"}, True)]))


@pytest.mark.parametrize("text", [
    "<tool_call>\n{\"name\": \"search\", \"arguments\": {}}\n</tool_call>",       # no <function=
    "<tool_call>\n<function=unknown_tool>\n</function>\n</tool_call>",            # not a known tool
    "<tool_call>\n<function=bad name>\n</function>\n</tool_call>",                # not a valid name
    "Calling now <tool_call>\n<function=sea",                                     # truncated header
    "just a <tool_call",
    "a literal </tool_call> and <function=search> outside a call",
])
def test_malformed_calls_come_back_as_content_verbatim(text):
    check_all_chunkings(text, (text, []))


def test_malformed_call_does_not_hide_a_later_good_one():
    text = "<tool_call>\n<function=nope>\n</function>\n</tool_call>\n" + call("search", query="q")
    check_all_chunkings(text, ("<tool_call>\n<function=nope>\n</function>\n</tool_call>",
                               [("search", {"query": "q"}, True)]))


@pytest.mark.parametrize("text, arguments", [
    ("<parameter=days>\n5\n</parameter>\n<parameter=location>\nPar", '{"days": 5, "location": "Par'),
    ("<parameter=location>\nsay \"hi\"\n</param", '{"location": "say \\"hi\\"'),
    ("<parameter=location>\n", '{"location": "'),
    ("<parameter=days>\n5\n</parameter>\n<parameter=hours>\n[1, 2", '{"days": 5, "hours": [1, 2'),
    ("<parameter=days>\n1", '{"days": 1'),
    ("<parameter=days>\n5\n</parameter>\n<parameter=loc", '{"days": 5'),
    ("", "{"),
])
def test_call_cut_by_end_of_generation_keeps_its_raw_partial_arguments(text, arguments):
    """Nothing invented to close it: the complete parameters' JSON, then the cut value as produced."""
    text = "Sure.\n<tool_call>\n<function=get_weather>\n" + text
    check_all_chunkings(text, ("Sure.", [("get_weather", arguments, False)]))


def test_without_tools_any_valid_name_is_parsed_with_json_fallback():
    text = call("anything", n="5", flag="true", s="text")
    check_all_chunkings(text, ("", [("anything", {"n": 5, "flag": True, "s": "text"}, True)]), tools=None)


def test_arguments_stream_per_parameter():
    parser = ToolCallParser(TOOLS)
    assert parser.push("Sure.\n\n<tool_call>\n<function=get_we") == ["Sure."]
    start = parser.push("ather>\n<parameter=days>\n1")
    assert len(start) == 1 and isinstance(start[0], ToolCallStart) and start[0].name == "get_weather"
    assert parser.push("2\n</parameter>\n") == [ToolCallArgs(0, '{"days": 12')]
    assert parser.push("</function>\n</tool_call>") == [ToolCallArgs(0, "}")]
    assert parser.flush() == []
    assert parser.finish().tool_calls[0].arguments == '{"days": 12}'


def test_ids_are_unique_and_tool_schemas_accept_bare_functions():
    text = call("search", query="a") + call("search", query="b")
    parser = ToolCallParser(TOOLS)
    parser.push(text)
    ids = [c.id for c in parser.finish().tool_calls]
    assert len(ids) == 2 and ids[0] != ids[1]
    assert tool_schemas([{"name": "f", "parameters": {"type": "object"}}]) == {"f": {"type": "object"}}
    assert parser.finish().tool_calls[0].to_openai()["function"] == {"name": "search", "arguments": '{"query": "a"}'}
