"""ChatTemplate renders the Qwen3.5 template byte-identically to transformers' apply_chat_template."""
import json
from datetime import datetime

import pytest

from hf2q.text.chat_template import ChatTemplate, TemplateError
from tests.support.llama_cpp_sources import SourcesUnavailable, qwen35_chat_template
from tests.support.tokenizer_dir import cached_tokenizer_dir

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city — « quoted » and 日本",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Search <html> & stuff",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "filters": {"type": "object"}}}}}


def call(name, arguments, call_id="call_1"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


SYSTEM = {"role": "system", "content": "You are terse. Ünïcödé ✓"}
USER = {"role": "user", "content": "What's the weather in Paris?"}

CONVERSATIONS = {
    "single_user": ([{"role": "user", "content": "Hello!"}], {}),
    "system_user": ([SYSTEM, USER], {}),
    "multi_turn": ([SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "Thanks  \n"}], {}),
    "thinking_off": ([USER], {"enable_thinking": False}),
    "thinking_on": ([USER], {"enable_thinking": True}),
    "no_generation_prompt": ([USER, {"role": "assistant", "content": "Sunny."}], {"add_generation_prompt": False}),
    "tools_no_system": ([USER], {"tools": [WEATHER_TOOL, SEARCH_TOOL]}),
    "tools_with_system": ([SYSTEM, USER], {"tools": [WEATHER_TOOL]}),
    "tool_call_round": ([SYSTEM, USER,
                         {"role": "assistant", "content": None,
                          "tool_calls": [call("get_weather", {"city": "Paris", "days": 3})]},
                         {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'}],
                        {"tools": [WEATHER_TOOL]}),
    "typed_arguments": ([USER,
                         {"role": "assistant", "content": "Let me look.",
                          "tool_calls": [call("search", {"q": "ça va", "filters": {"lang": "fr", "n": 2},
                                                         "tags": ["a", "ü", 3], "exact": True, "limit": 2.5,
                                                         "none": None})]},
                         {"role": "tool", "content": "[]"}],
                        {"tools": [SEARCH_TOOL], "add_generation_prompt": False}),
    "several_tool_results": ([USER,
                              {"role": "assistant", "content": "",
                               "tool_calls": [call("get_weather", {"city": "Paris"}, "a"),
                                              call("get_weather", {"city": "Rome"}, "b"),
                                              call("search", {"q": "x"}, "c")]},
                              {"role": "tool", "tool_call_id": "a", "content": "sun"},
                              {"role": "tool", "tool_call_id": "b", "content": "rain"},
                              {"role": "tool", "tool_call_id": "c", "content": "nothing"},
                              {"role": "assistant", "content": "Paris sun, Rome rain."},
                              {"role": "user", "content": "ok"}],
                             {"tools": [WEATHER_TOOL, SEARCH_TOOL]}),
    "reasoning_history": ([USER, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Check it."},
                           {"role": "user", "content": "And tomorrow?"},
                           {"role": "assistant", "content": "Rain.", "reasoning_content": "\nForecast.\n"}],
                          {"add_generation_prompt": False}),
    "reasoning_after_last_query": ([USER, {"role": "assistant", "content": "",
                                           "reasoning_content": "I need a tool.",
                                           "tool_calls": [call("get_weather", {"city": "Paris"})]},
                                    {"role": "tool", "content": "sun"}], {"tools": [WEATHER_TOOL]}),
    "reasoning_alias": ([USER, {"role": "assistant", "content": "Yes.", "reasoning": "aliased"},
                         {"role": "tool", "content": "x"}], {}),
    "inline_think_in_content": ([USER, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nSunny."},
                                 {"role": "user", "content": "sure?"}], {}),
    "content_parts": ([{"role": "system", "content": [{"type": "text", "text": "Sys part."}]},
                       {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                                    {"type": "image_url", "image_url": {"url": "data:x"}},
                                                    {"type": "text", "text": " and say."}]}], {}),
    "vision_ids": ([{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "image"},
                                                 {"type": "text", "text": "compare"}]}], {"add_vision_id": True}),
}


@pytest.fixture(scope="module")
def template_source():
    try:
        return qwen35_chat_template()
    except SourcesUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def hf_tokenizer(template_source):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(cached_tokenizer_dir()))


@pytest.fixture(scope="module")
def template(template_source):
    return ChatTemplate(template_source, eos_token="<|im_end|>")


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_identical_to_transformers(template, hf_tokenizer, name):
    messages, kwargs = CONVERSATIONS[name]
    kwargs = {"add_generation_prompt": True, **kwargs}
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert template.render(messages, **kwargs) == expected


def test_qwen35_generation_prompt(template):
    assert template.render([USER]).endswith("<|im_start|>assistant\n<think>\n")
    assert template.render([USER], enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    assert not template.render([USER], add_generation_prompt=False).endswith("assistant\n")


def test_template_errors_carry_the_message(template):
    with pytest.raises(TemplateError, match="No user query found"):
        template.render([{"role": "system", "content": "only a system message"}])
    with pytest.raises(TemplateError, match="Unexpected message role"):
        template.render([USER, {"role": "narrator", "content": "x"}])
    with pytest.raises(TemplateError, match="System message must be at the beginning"):
        template.render([USER, SYSTEM])


def test_syntax_error_is_a_template_error():
    with pytest.raises(TemplateError, match="parse"):
        ChatTemplate("{% if %}")


def test_environment_features():
    source = ("{{ bos_token }}|{{ eos_token }}|{{ {'k': 'é<&>'} | tojson }}|{{ [1, 2] | tojson(indent=1) }}|"
              "{{ {'a': 1} | tojson(separators=(',', ':')) }}|"
              "{% for m in messages %}{% if loop.index0 == 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}|"
              "{{ strftime_now('%Y') }}|{{ custom }}|{{ messages[0].keys() | list | sort | join(',') }}")
    out = ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(
        [{"role": "user", "content": "a", "name": None}, {"role": "user", "content": "b"}], custom=7)
    assert out == "|".join(["<s>", "</s>", json.dumps({"k": "é<&>"}, ensure_ascii=False),
                            json.dumps([1, 2], indent=1), '{"a":1}', "a", str(datetime.now().year), "7",
                            "content,role"])


def test_trim_and_lstrip_blocks():
    source = "  {% if true %}\nx\n  {% endif %}\ny"
    assert ChatTemplate(source).render([]) == "x\ny"


def test_raise_exception_and_sandbox():
    with pytest.raises(TemplateError, match="^boom$"):
        ChatTemplate("{{ raise_exception('boom') }}").render([])
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])
    with pytest.raises(TemplateError):
        ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}").render([])
    with pytest.raises(TemplateError):  # immutable sandbox: no mutating the caller's data
        ChatTemplate("{{ messages.append(1) }}").render([])


def test_from_gguf_metadata_and_file(template_source, tmp_path):
    meta = {"tokenizer.chat_template": template_source, "tokenizer.ggml.tokens": ["a", "<s>", "<|im_end|>"],
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.bos_token_id": 1}
    from_meta = ChatTemplate.from_gguf_metadata(meta)
    assert (from_meta.bos_token, from_meta.eos_token) == ("<s>", "<|im_end|>")
    path = tmp_path / "override.jinja"
    path.write_text("{{ messages | length }}{{ eos_token }}")
    assert ChatTemplate.from_file(path, eos_token="E").render([USER, USER]) == "2E"
    with pytest.raises(TemplateError, match="chat_template"):
        ChatTemplate.from_gguf_metadata({"tokenizer.ggml.tokens": ["a"]})


def test_messages_are_not_modified(template):
    messages = [USER, {"role": "assistant", "content": None, "reasoning": "r",
                       "tool_calls": [call("get_weather", {"city": "Paris"})]},
                {"role": "tool", "content": "x"}]
    snapshot = json.dumps(messages)
    template.render(messages)
    assert json.dumps(messages) == snapshot
