"""/v1/responses through the openai SDK: text, instructions, reasoning and function-call items, streaming
events, previous_response_id, retrieve / input_items / delete, and the 400s. Reuses the plain server and the scripted server of
test_scripted.py (whose reply i is generation i mod 3)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.test_request_fields import check, send
from tests.e2e.test_scripted import KEY, REPLIES, TOOLS, WEATHER_ARGS, ScriptedClient

FLAT_TOOLS = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
              for t in TOOLS]
NO_THINKING = {"effort": "none"}


@pytest.fixture(scope="module")
def scripted(server_factory):
    return ScriptedClient(server_factory("--api-key", KEY, "--served-model-name", "scripted", scripted=REPLIES))


def test_text_instructions_metadata_usage(client):
    plain = client.responses.create(model="tiny", input="Hello", reasoning=NO_THINKING, max_output_tokens=6)
    r = client.responses.create(model="tiny", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Hello"}]}], instructions="Answer briefly.", reasoning=NO_THINKING,
        max_output_tokens=6, metadata={"k": "v"}, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.metadata == {"k": "v"} and r.instructions == "Answer briefly."
    assert [o.type for o in r.output] == ["message"] and r.output_text == r.output[0].content[0].text
    assert r.usage.input_tokens > plain.usage.input_tokens  # the instructions are in the prompt
    assert r.usage.output_tokens <= 6 and r.usage.output_tokens_details.reasoning_tokens == 0
    if r.usage.output_tokens == 6:
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_reasoning_and_message_items(scripted):
    r = scripted.next(0).responses.create(model="scripted", input="Weather in Paris?")
    assert r.status == "completed" and [o.type for o in r.output] == ["reasoning", "message"]
    assert "Paris is in France." in r.output[0].content[0].text
    assert r.output_text == "It is sunny in Paris."
    assert r.usage.output_tokens_details.reasoning_tokens > 0


def test_function_calls_then_outputs(scripted):
    r = scripted.next(1).responses.create(model="scripted", input="Weather in Paris?", tools=FLAT_TOOLS)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == WEATHER_ARGS and calls[0].call_id
    # The stateless continuation: the output items sent back, with the function outputs.
    follow = [{"role": "user", "content": "Weather in Paris?"}, *(o.model_dump(exclude_none=True) for o in r.output),
              *({"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls)]
    r2 = scripted.next(0).responses.create(model="scripted", input=follow, tools=FLAT_TOOLS, store=False)
    assert r2.output_text == "It is sunny in Paris." and r2.usage.input_tokens > r.usage.input_tokens


def test_stream_events_and_final_response(scripted):
    with scripted.next(0).responses.stream(model="scripted", input="Weather in Paris?") as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for name in ("response.output_item.added", "response.reasoning_text.delta", "response.content_part.added",
                 "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                 "response.output_item.done"):
        assert name in types, name
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == "It is sunny in Paris."
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.usage.output_tokens > 0


def test_stream_function_calls(scripted):
    with scripted.next(1).responses.stream(model="scripted", input="Weather?", tools=FLAT_TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.name for e in done] == ["get_weather", "get_time"]
    assert json.loads(done[0].arguments) == WEATHER_ARGS
    calls = [o for o in final.output if o.type == "function_call"]
    assert [c.arguments for c in calls] == [e.arguments for e in done]


def test_previous_response_id(client):
    r1 = client.responses.create(model="tiny", input="My name is Ann.", reasoning=NO_THINKING, max_output_tokens=3)
    r2 = client.responses.create(model="tiny", input="My name?", reasoning=NO_THINKING, max_output_tokens=3,
                                 previous_response_id=r1.id)
    assert r2.previous_response_id == r1.id
    alone = client.responses.create(model="tiny", input="My name?", reasoning=NO_THINKING, max_output_tokens=3,
                                    store=False)
    assert r2.usage.input_tokens > alone.usage.input_tokens + r1.usage.output_tokens
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="tiny", input="x", previous_response_id=alone.id)  # not stored
    assert err.value.body["code"] == "previous_response_not_found"


def test_retrieve_input_items_delete(client):
    made = client.responses.create(model="tiny", input=[{"role": "user", "content": "Hi"},
                                                         {"role": "assistant", "content": "Hello."},
                                                         {"role": "user", "content": "Bye"}],
                                   reasoning=NO_THINKING, max_output_tokens=3)
    got = client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()
    page = client.responses.input_items.list(made.id, limit=2)
    assert [i.content[0].text for i in page.data] == ["Bye", "Hello."] and page.has_more
    assert [i.content[0].text for i in client.responses.input_items.list(made.id, order="asc")] == \
        ["Hi", "Hello.", "Bye"]  # the SDK pages on by `after`
    client.responses.delete(made.id)
    for call in (client.responses.retrieve, client.responses.delete, client.responses.input_items.list):
        with pytest.raises(openai.NotFoundError) as err:
            call(made.id)
        assert err.value.body["code"] == "response_not_found"


@pytest.mark.parametrize("kw, param", [
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
])
def test_refused(client, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**{"model": "tiny", "input": "x", **kw})
    assert err.value.body["param"] == param


# Each field of the installed SDK's responses.create, by what this server does with it: a value it honours
# (accepted), or one it refuses (a 400 naming the field). Fields tested elsewhere in this module: None.
RESPONSES_FIELDS = {
    "input": None, "model": None, "instructions": None, "metadata": None, "previous_response_id": None,
    "tools": None, "tool_choice": None, "parallel_tool_calls": None, "max_output_tokens": None,
    "temperature": None, "top_p": None, "reasoning": None, "text": None, "stream": None, "store": None,
    "user": None, "safety_identifier": None, "prompt_cache_key": None, "service_tier": None,
    "truncation": None, "background": None, "include": None,
    "max_tool_calls": ({"max_tool_calls": 2}, None),  # no built-in tools run here: the limit is never reached
    "prompt_cache_options": ({"prompt_cache_options": {"mode": "explicit", "ttl": "1h"}}, None),
    "prompt_cache_retention": ({"prompt_cache_retention": "24h"}, None),
    "top_logprobs": ({"top_logprobs": 3}, "top_logprobs"),
    "stream_options": ({"stream_options": {"include_obfuscation": False}}, "stream_options"),  # without stream
    "conversation": ({"conversation": "conv_1"}, "conversation"),
    "prompt": ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    "moderation": ({"moderation": {"mode": "auto"}}, "moderation"),
    "context_management": ({"context_management": [{"type": "compaction"}]}, "context_management"),
    "access_programs": ({"access_programs": {}}, "access_programs"),
    "background_options": ({"background_options": {}}, "background_options"),
    "image": ({"image": {}}, "image"),
}


def test_responses_table_covers_the_sdk():
    """A field the installed openai SDK can send to responses.create and this table does not know of fails
    here."""
    from openai.types.responses import response_create_params as params

    fields = params.ResponseCreateParamsStreaming
    assert set(fields.__required_keys__) | set(fields.__optional_keys__) <= set(RESPONSES_FIELDS)


@pytest.mark.parametrize("field", [f for f, case in RESPONSES_FIELDS.items() if case is not None])
def test_responses_field(plain_server, field):
    """Each field: its value accepted or refused by name (null: test_responses_null_is_absent)."""
    body, refused = RESPONSES_FIELDS[field]
    check(send(plain_server, "/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens": 2, **body}), refused)


def test_responses_null_is_absent(plain_server):
    """Every field but `input` (this server has no stored conversation or prompt to answer instead) may be null."""
    base = {"model": "tiny", "input": "x", "max_output_tokens": 2}
    for field in RESPONSES_FIELDS:
        if field in ("input", "max_output_tokens"):
            continue
        r = httpx.post(plain_server.url + "/v1/responses", json={**base, field: None}, timeout=60)
        assert r.status_code == 200, (field, r.text)
    r = httpx.post(plain_server.url + "/v1/responses", json={**base, "input": None}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def test_responses_stream_options(plain_server):
    base = {"model": "tiny", "input": "x", "max_output_tokens": 2, "stream": True}
    with httpx.stream("POST", plain_server.url + "/v1/responses", timeout=60,
                      json={**base, "stream_options": {"include_obfuscation": False}}) as r:
        text = r.read().decode()
        assert r.status_code == 200 and "response.incomplete" in text  # cut at max_output_tokens
    r = httpx.post(plain_server.url + "/v1/responses", timeout=60,
                   json={**base, "stream_options": {"include_obfuscation": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.include_obfuscation"
