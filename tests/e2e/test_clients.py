"""The clients people point at a local server, unmodified, against one shared `hf2q serve`: the openai SDK's
typed paths (`chat.completions.parse` with a pydantic response_format, `responses.create` and
`responses.stream`, `embeddings.create`) and langchain-openai's `bind_tools` and `with_structured_output`.
The model has random weights: what is checked is that each client gets, and parses, the shape it asks for
(the grammar guarantees the content)."""
from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel

MODEL = "tiny"  # conftest's plain server


class Verdict(BaseModel):
    ok: bool
    color: Literal["red", "blue"]


def test_openai_sdk_typed_paths(client):
    parsed = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Judge."}],
                                           response_format=Verdict, reasoning_effort="none", max_tokens=48,
                                           temperature=0)
    assert parsed.choices[0].finish_reason == "stop"
    assert isinstance(parsed.choices[0].message.parsed, Verdict)
    made = client.responses.create(model=MODEL, input="Hi", reasoning={"effort": "none"}, max_output_tokens=4)
    with client.responses.stream(model=MODEL, input="Hi", reasoning={"effort": "none"},
                                 max_output_tokens=4) as stream:
        events = list(stream)  # (get_final_response() wants response.completed; a cut answer ends incomplete)
    assert made.id.startswith("resp_") and made.usage.output_tokens >= 1
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete") and last.response.id.startswith("resp_")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert last.response.output_text == deltas and last.response.usage.output_tokens >= 1
    vectors = client.embeddings.create(model=MODEL, input=["a", "b c"], encoding_format="float")
    assert [d.index for d in vectors.data] == [0, 1] and len(vectors.data[0].embedding) > 0


@pytest.fixture(scope="module")
def chat_model(plain_server):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=plain_server.url + "/v1", api_key="unused", model=MODEL,
                                       max_tokens=48, temperature=0, reasoning_effort="none", max_retries=0,
                                       timeout=120)


def test_langchain_bind_tools(chat_model):
    def paint(color: Literal["red", "blue"]) -> str:
        """Paint the wall."""
        return color

    reply = chat_model.bind_tools([paint], tool_choice="paint").invoke("Paint it.")
    assert [call["name"] for call in reply.tool_calls] == ["paint"]
    assert reply.tool_calls[0]["args"]["color"] in ("red", "blue")


def test_langchain_with_structured_output(chat_model):
    structured = chat_model.with_structured_output(Verdict, include_raw=True).invoke("Judge.")
    assert structured["raw"].response_metadata.get("finish_reason") == "stop"
    assert isinstance(structured["parsed"], Verdict) and structured["parsing_error"] is None
