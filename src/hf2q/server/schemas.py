"""OpenAI request bodies, strict: an unknown field is a 400, never silently ignored.

Every field of OpenAI's chat and completions request schemas is declared, and `null` means absent (the SDK
and other clients send `null` for unset fields). Types are checked here (pydantic, strict mode so `"5"` is
not an integer); whether a field's value can be honoured is decided in `request_fields`, value ranges of
sampling knobs once, by `SamplingParams`.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator
from pydantic_core import PydanticCustomError

Number = Union[StrictInt, StrictFloat]
Anything = Optional[Any]  # a field we accept in any shape and then honour or refuse by its value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """`"field": null` means the field is not set: its default applies."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class CacheBreakpoint(_Strict):
    """A prompt-cache hint on a content part; hf2q's prefix cache is automatic, so it changes nothing."""
    mode: Literal["explicit"]
    ttl: Optional[Literal["30m", "12h"]] = None


class CacheOptions(_Strict):
    mode: Optional[Literal["implicit", "explicit"]] = None
    ttl: Optional[StrictStr] = None


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr
    prompt_cache_breakpoint: Optional[CacheBreakpoint] = None


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
    """A message as clients send it, including what the SDK's own response message dumps to."""
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Content] = None
    name: Optional[StrictStr] = None
    reasoning_content: Optional[StrictStr] = None
    tool_calls: Optional[list[ToolCallIn]] = None
    tool_call_id: Optional[StrictStr] = None
    refusal: Optional[StrictStr] = None
    annotations: Optional[list[dict[str, Any]]] = None  # url citations of an earlier answer: not model input
    audio: Anything = None           # a reference to earlier audio output: refused unless null
    function_call: Anything = None   # the legacy form of tool_calls: refused unless null


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
    include_obfuscation: Optional[StrictBool] = None
    continuous_usage_stats: Optional[StrictBool] = None  # vLLM extension: usage so far on every chunk


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


class _Unicode(_Strict):
    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = _lone_surrogate(data)
        if where is not None:
            message = f"invalid value for {where}: not valid Unicode (a lone UTF-16 surrogate such as \\ud800)"
            raise PydanticCustomError("unicode", "{message}", {"message": message})
        return data


class _Sampling(_Unicode):
    """Fields shared by chat and text completions (vLLM's extensions among them: top_k ... stop_token_ids)."""

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
    user: Optional[StrictStr] = None  # an end-user id: logged
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
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None
    store: Optional[StrictBool] = None
    metadata: Optional[dict[StrictStr, StrictStr]] = None
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority", "fast"]] = None
    prompt_cache_key: Optional[StrictStr] = None
    prompt_cache_options: Optional[CacheOptions] = None
    prompt_cache_retention: Optional[Literal["in_memory", "24h"]] = None
    safety_identifier: Optional[StrictStr] = None
    modalities: Optional[list[Literal["text", "audio"]]] = None
    # Accepted in any shape, then refused unless null: honouring them would need what hf2q does not have.
    audio: Anything = None
    prediction: Anything = None
    web_search_options: Anything = None
    moderation: Anything = None
    functions: Anything = None
    function_call: Anything = None


# A string, a list of strings, a token-id list or a list of token-id lists (lm-evaluation-harness sends those).
Prompts = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_Sampling):
    prompt: Prompts
    logprobs: Optional[StrictInt] = None  # legacy API: the number of top logprobs
    echo: StrictBool = False
    suffix: Optional[StrictStr] = None
    best_of: Optional[StrictInt] = None


class EmbeddingRequest(_Unicode):
    """OpenAI's embeddings request; `pooling` is an extension ("last" token, the default, or "mean")."""
    input: Prompts
    model: Optional[StrictStr] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[StrictInt] = None
    user: Optional[StrictStr] = None
    pooling: Literal["last", "mean"] = "last"


class TokenizeRequest(_Strict):
    """vLLM's `/tokenize`: a `prompt`, or `messages` rendered by the chat template as chat requests are."""
    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[list[Message]] = None
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False  # BOS where the GGUF asks for it; off: the ids requests are built from
    tools: Optional[list[Tool]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Strict):
    model: Optional[StrictStr] = None
    tokens: list[StrictInt]


# /v1/responses: the Responses API's request, translated into a ChatCompletionRequest by serving_responses.

class InputText(_Strict):
    """A text part of an input message (`output_text` when an earlier answer is sent back)."""
    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: Optional[list[dict[str, Any]]] = None
    logprobs: Optional[list[dict[str, Any]]] = None


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[StrictStr, list[Union[InputText, OtherPart]]]
    id: Optional[StrictStr] = None
    status: Optional[StrictStr] = None
    phase: Optional[StrictStr] = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: Optional[StrictStr] = None
    status: Optional[StrictStr] = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: Union[StrictStr, list[InputText]]
    id: Optional[StrictStr] = None
    status: Optional[StrictStr] = None


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: StrictStr


class ReasoningItem(_Strict):
    """Earlier reasoning sent back: its text goes to the next assistant turn's `reasoning_content`."""
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: Optional[list[ReasoningText]] = None
    id: Optional[StrictStr] = None
    status: Optional[StrictStr] = None
    encrypted_content: Anything = None  # refused unless null: nothing here encrypts reasoning


InputItem = Union[InputMessage, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]


class ResponsesTool(_Strict):
    """A function tool in the Responses shape (flat: no `function` wrapper)."""
    type: Literal["function"]
    name: StrictStr = Field(min_length=1)
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class ResponsesNamedTool(_Strict):
    type: Literal["function"]
    name: StrictStr


class ResponsesTextFormat(BaseModel):
    """`text.format`: text, json_object, or json_schema with the schema's fields inline."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[StrictStr] = None
    description: Optional[StrictStr] = None
    json_schema: Optional[Union[dict[str, Any], StrictBool]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponsesText(_Strict):
    format: Optional[ResponsesTextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = None


class ResponsesReasoning(_Strict):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None


class ResponsesStreamOptions(_Strict):
    include_obfuscation: Optional[StrictBool] = None


class ResponsesRequest(_Unicode):
    model: Optional[StrictStr] = None
    input: Union[StrictStr, list[InputItem]]
    instructions: Optional[StrictStr] = None
    previous_response_id: Optional[StrictStr] = None
    tools: Optional[list[ResponsesTool]] = None
    tool_choice: Optional[Union[Literal["auto", "none", "required"], ResponsesNamedTool]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    max_output_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    reasoning: Optional[ResponsesReasoning] = None
    text: Optional[ResponsesText] = None
    stream: StrictBool = False
    metadata: Optional[dict[StrictStr, StrictStr]] = None
    store: Optional[StrictBool] = None
    user: Optional[StrictStr] = None
    safety_identifier: Optional[StrictStr] = None
    prompt_cache_key: Optional[StrictStr] = None
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority", "fast"]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    stream_options: Optional[ResponsesStreamOptions] = None
    max_tool_calls: Optional[StrictInt] = None
    top_logprobs: Optional[StrictInt] = None
    prompt_cache_options: Optional[CacheOptions] = None
    prompt_cache_retention: Optional[Literal["in_memory", "24h"]] = None
    # Accepted in any shape, then refused unless null (or empty): hf2q has no background jobs, no includes.
    background: Optional[StrictBool] = None
    include: Optional[list[StrictStr]] = None
    # Accepted in any shape, then refused unless null: honouring them would need what hf2q does not have.
    conversation: Anything = None
    prompt: Anything = None
    moderation: Anything = None
    context_management: Anything = None
    access_programs: Anything = None
    background_options: Anything = None
    image: Anything = None
