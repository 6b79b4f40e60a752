"""OpenAI request bodies, strict: an unknown or unsupported field is a 400, never silently ignored.

Types are checked here (pydantic, strict mode so `"5"` is not an integer); value ranges of sampling knobs
are checked once, by `SamplingParams`.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator
from pydantic_core import PydanticCustomError

Number = Union[StrictInt, StrictFloat]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class OtherPart(BaseModel):
    """Any non-text content part (image_url, input_audio, ...): accepted by the schema, refused by serving."""
    model_config = ConfigDict(extra="allow")
    type: StrictStr


Content = Union[StrictStr, list[Union[TextPart, OtherPart]]]


class FunctionCall(_Strict):
    name: StrictStr
    arguments: Union[StrictStr, dict[str, Any]]


class ToolCallIn(_Strict):
    id: Optional[StrictStr] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Content] = None
    name: Optional[StrictStr] = None
    reasoning_content: Optional[StrictStr] = None
    tool_calls: Optional[list[ToolCallIn]] = None
    tool_call_id: Optional[StrictStr] = None


class FunctionDef(_Strict):
    name: StrictStr = Field(min_length=1)
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: Optional[StrictBool] = None
    continuous_usage_stats: Optional[StrictBool] = None


class JSONSchemaSpec(BaseModel):
    """OpenAI's `response_format.json_schema`: the JSON schema is under `schema`."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: StrictStr
    description: Optional[StrictStr] = None
    json_schema: Union[dict[str, Any], StrictBool] = Field(default=True, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaSpec] = None


def _lone_surrogate(value: Any) -> Optional[str]:
    """Where a string (or key) holds a lone UTF-16 surrogate: JSON's "\\ud800" parses to a str that has no
    UTF-8 form, which the tokenizer and the grammar compiler cannot take."""
    stack = [("body", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str) and not _is_utf8(v):
            return path
        if isinstance(v, dict):
            for k, item in v.items():
                if isinstance(k, str) and not _is_utf8(k):
                    return path
                stack.append((str(k) if path == "body" else f"{path}.{k}", item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
    return None


def _is_utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


class _Sampling(_Strict):
    """Fields shared by chat and text completions."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = _lone_surrogate(data)
        if where is not None:
            message = f"invalid value for {where}: not valid Unicode (a lone UTF-16 surrogate such as \\ud800)"
            raise PydanticCustomError("unicode", "{message}", {"message": message})
        return data

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    top_k: Optional[StrictInt] = None
    min_p: Optional[Number] = None
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    logit_bias: Optional[dict[str, Number]] = None
    seed: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[StrictStr] = None  # accepted and not used: an end-user id for abuse tracking
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: Optional[list[StrictInt]] = None


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["auto", "none", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = None
    response_format: Optional[ResponseFormat] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    thinking_budget: Optional[StrictInt] = None  # extension: reasoning tokens before `</think>` is forced


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt]]
    logprobs: Optional[StrictInt] = None  # legacy API: the number of top logprobs
    echo: StrictBool = False
    suffix: Optional[StrictStr] = None
    best_of: Optional[StrictInt] = None
