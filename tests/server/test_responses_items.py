"""/v1/responses without a server: input items -> chat messages, chat deltas -> output items and events,
and the bounded store."""
from __future__ import annotations

import pytest

from hf2q.server.errors import APIError
from hf2q.server.schemas import InputMessage, ResponsesRequest
from hf2q.server.response_store import ResponseStore, input_items
from hf2q.server.serving_responses import _Items, input_messages, to_chat


def _input(items):
    return ResponsesRequest.model_validate({"input": items}).input


def test_items_become_chat_messages():
    items = _input([
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{\"a\": 1}"},
        {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
    ])
    msgs = input_messages(items)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
    assert msgs[1]["reasoning_content"] == "Look." and [c["id"] for c in msgs[1]["tool_calls"]] == ["c1", "c2"]
    assert msgs[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert msgs[3]["content"] == "Sunny."


def test_to_chat_maps_options():
    req = ResponsesRequest.model_validate({
        "input": "hi", "instructions": "Be brief.", "max_output_tokens": 5, "reasoning": {"effort": "none"},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}})
    chat, conversation = to_chat(req, [{"role": "user", "content": "before"}])
    assert [m.role for m in chat.messages] == ["system", "user", "user"] and len(conversation) == 2
    assert chat.max_completion_tokens == 5 and chat.reasoning_effort == "none"
    assert chat.tools[0].function.name == "f" and chat.tool_choice.function.name == "f"
    assert chat.response_format.json_schema.json_schema == {"type": "object"}


def test_deltas_become_items_and_events():
    items = _Items()
    events = items.feed({"reasoning_content": "Hmm."}) + items.feed({"content": "Hi"})
    events += items.feed({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                          "function": {"name": "f", "arguments": "{\"a\""}}]})
    events += items.feed({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]})
    events += items.finish(incomplete=False)
    assert [i["type"] for i in items.items] == ["reasoning", "message", "function_call"]
    assert all(i["status"] == "completed" for i in items.items)
    assert items.items[2]["arguments"] == "{\"a\": 1}" and items.items[1]["content"][0]["text"] == "Hi"
    types = [e["type"] for e in events]
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 3
    assert types[-2:] == ["response.function_call_arguments.done", "response.output_item.done"]


def test_store_is_bounded_lru():
    store = ResponseStore(size=2)
    for rid in ("a", "b"):
        store.put({"id": rid}, [{"role": "user", "content": rid}], [])
    store.conversation("a")  # used: "b" is now the oldest
    store.put({"id": "c"}, [], [])
    assert store.conversation("a") and store.conversation("c") == []
    with pytest.raises(APIError) as err:
        store.conversation("b")
    assert err.value.status == 404 and err.value.param == "previous_response_id"
    with pytest.raises(APIError) as err:
        store.response("b")
    assert err.value.status == 404 and err.value.code == "response_not_found"


def test_input_items_pages_newest_first():
    store = ResponseStore()
    items = input_items([InputMessage(role="user", content="one"), InputMessage(role="assistant", content="two"),
                         InputMessage(role="user", content=[{"type": "input_text", "text": "three"}])])
    assert [i["content"][0]["type"] for i in items] == ["input_text", "output_text", "input_text"]
    assert all(i["id"].startswith("msg_") and i["status"] == "completed" for i in items)
    store.put({"id": "r"}, [], items)
    first = store.input_items("r", 2, None, None)
    assert [i["content"][0]["text"] for i in first["data"]] == ["three", "two"] and first["has_more"]
    rest = store.input_items("r", 2, None, first["last_id"])
    assert [i["content"][0]["text"] for i in rest["data"]] == ["one"] and not rest["has_more"]
    assert [i["content"][0]["text"] for i in store.input_items("r", None, "asc", None)["data"]] == \
        ["one", "two", "three"]
    with pytest.raises(APIError, match="limit"):
        store.input_items("r", 0, None, None)
    assert store.delete("r") == {"id": "r", "object": "response", "deleted": True}
    with pytest.raises(APIError):
        store.input_items("r", None, None, None)
