"""Server pieces without a model: error envelopes, strict schemas, field mapping, chat output routing."""
from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from hf2q.engine.request import RequestOutput
from hf2q.server.chat_output import ChatOutput
from hf2q.server.errors import APIError, install_error_handlers
from hf2q.server.request_fields import thinking_budget, thinking_kwargs
from hf2q.server.sampling import build_params
from hf2q.server.schemas import ChatCompletionRequest, CompletionRequest
from hf2q.server.state import ServerConfig, ServerState


@pytest.fixture(scope="module")
def echo_app():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/chat")
    async def chat(body: ChatCompletionRequest):
        return {"ok": True}

    @app.get("/boom")
    async def boom():
        raise RuntimeError("kaput")

    @app.get("/teapot")
    async def teapot():
        raise APIError(429, "busy", code="queue_full", headers={"Retry-After": "1"})

    return TestClient(app, raise_server_exceptions=False)


def _error(r, status):
    assert r.status_code == status
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_envelopes(echo_app):
    assert _error(echo_app.post("/chat", content=b"{", headers={"content-type": "application/json"}), 400)[
        "message"].startswith("malformed JSON")
    assert _error(echo_app.post("/chat", json={"messages": [{"role": "user", "content": 3}]}), 400)["param"] == \
        "messages[0].content"
    assert _error(echo_app.post("/chat", json={"messages": [{"role": "user", "content": "x"}], "seed": 1.5}), 400)[
        "param"] == "seed"
    err = _error(echo_app.get("/boom"), 500)
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    r = echo_app.get("/teapot")
    assert _error(r, 429)["code"] == "queue_full" and r.headers["retry-after"] == "1"
    assert _error(echo_app.get("/nowhere"), 404)["type"] == "invalid_request_error"


def test_schema_is_strict():
    with pytest.raises(ValueError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "max_tokens": True})
    with pytest.raises(ValueError):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x", "extra": 1}]})
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}]}], "temperature": 1, "user": "u1"})
    assert req.temperature == 1


def test_build_params_maps_and_names_the_field():
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": 0.5, "top_k": 5, "seed": 3, "n": 2,
                                            "logit_bias": {"7": 2.5}, "stop": "END"})
    p = build_params(req, vocab_size=100, max_tokens=9, logprobs=True, top_logprobs=2)
    assert (p.temperature, p.top_k, p.seed, p.n, p.max_tokens, p.stop, p.logit_bias) == \
        (0.5, 5, 3, 2, 9, ("END",), {7: 2.5})
    assert p.for_choice(1).seed == 4
    for field, value in [("top_p", 1.5), ("min_p", -1), ("presence_penalty", 3), ("top_k", -5)]:
        bad = CompletionRequest.model_validate({"prompt": "x", field: value})
        with pytest.raises(APIError) as err:
            build_params(bad, 100, None, False, 0)
        assert err.value.status == 400 and err.value.param == field
    with pytest.raises(APIError) as err:
        build_params(CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"100": 1}}), 100, 5, False, 0)
    assert err.value.param == "logit_bias"


def test_model_recommended_sampling_fills_only_what_a_request_leaves_out(caplog):
    from hf2q.server.sampling import recommended_sampling

    meta = {"general.sampling.temp": np.float32(0.6).item(), "general.sampling.top_k": 20,
            "general.sampling.top_p": np.float32(0.95).item(), "general.sampling.min_p": 0.0,
            "general.sampling.penalty_repeat": 0.0, "general.name": "x"}  # a repeat penalty of 0: refused
    defaults = recommended_sampling(meta)
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0}
    assert "general.sampling.penalty_repeat" in caplog.text
    p = build_params(CompletionRequest.model_validate({"prompt": "x", "temperature": None}), 100, 4, False, 0, defaults)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (0.6, 20, 0.95, 1.0)
    p = build_params(CompletionRequest.model_validate({"prompt": "x", "temperature": 1, "top_k": -1}), 100, 4, False,
                     0, defaults)
    assert (p.temperature, p.top_k, p.top_p) == (1, -1, 0.95)  # the request's own values win (-1: no top-k)
    assert recommended_sampling({"general.name": "x"}) == {}


def _deltas(text: str, size: int) -> list[RequestOutput]:
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    return [RequestOutput("r", [i], p, finished=i == len(pieces) - 1, finish_reason="stop" if i == len(pieces) - 1
                          else None) for i, p in enumerate(pieces)]


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}]
TEXT = ("why\n<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=f>\n<parameter=x>\n2\n</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_chat_output_same_message_for_any_chunking(size):
    out = ChatOutput(starts_in_reasoning=True, tools=TOOLS, tool_choice="auto")
    streamed: dict[int, dict] = {}
    for d in _deltas(TEXT, size):
        for tc in out.feed(d).get("tool_calls", []):
            call = streamed.setdefault(tc["index"], {"name": None, "arguments": ""})
            if "id" in tc:
                call["name"] = tc["function"]["name"]
            call["arguments"] += tc["function"]["arguments"]
    msg = out.message()
    assert msg["reasoning_content"] == "why" and msg["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [{"x": 1}, {"x": 2}]
    assert [c["arguments"] for _, c in sorted(streamed.items())] == [c["function"]["arguments"]
                                                                       for c in msg["tool_calls"]]
    assert out.finish_reason("stop") == "tool_calls"
    assert out.reasoning_tokens > 0


def test_chat_output_parallel_false_cuts_after_first_call():
    out = ChatOutput(True, TOOLS, "auto", parallel_tool_calls=False)
    for d in _deltas(TEXT, 5):
        out.feed(d)
        if out.cut:
            break
    assert out.cut and len(out.message()["tool_calls"]) == 1 and out.finish_reason(None) == "tool_calls"


def test_state_model_check_and_scripts():
    state = ServerState(model=None, engine=None, config=ServerConfig(model_name="m"), scripted_replies=[[1], [2, 3]])
    state.check_model(None)
    state.check_model("m")
    with pytest.raises(APIError) as err:
        state.check_model("other")
    assert err.value.status == 404 and err.value.code == "model_not_found"
    assert [state.next_script() for _ in range(3)] == [[1], [2, 3], [1]]


@pytest.mark.parametrize("effort,thinking,budget", [
    ("none", False, None), ("minimal", False, None), ("low", True, 1024), ("medium", True, 4096),
    ("high", True, None), ("xhigh", True, None), ("max", True, None), (None, None, None),
])
def test_reasoning_effort_maps_to_thinking_and_budget(effort, thinking, budget):
    """README.md's mapping: the template's enable_thinking and the reasoning budget each effort sets;
    thinking_budget overrides the budget."""
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                "reasoning_effort": effort})
    assert thinking_kwargs(req) == ({} if thinking is None else {"enable_thinking": thinking})
    assert thinking_budget(req) == budget
    assert thinking_budget(req.model_copy(update={"thinking_budget": 7})) == 7


def test_async_scheduling_is_on_for_cuda_unless_said_or_impossible():
    """Default (None): on for CUDA alone, with or without speculation, off where other ranks need each step's
    ids; asking for it there is refused by name; --no-async-scheduling turns it off."""
    import argparse

    import torch

    from hf2q.server.launch import add_serve_args, resolve_async_scheduling
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_async_scheduling(None, cuda, 1) is True
    assert resolve_async_scheduling(None, cpu, 1) is False
    assert resolve_async_scheduling(None, cuda, 2) is False
    assert resolve_async_scheduling(False, cuda, 1) is False
    assert resolve_async_scheduling(True, cpu, 1) is True
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        resolve_async_scheduling(True, cuda, 2)
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert [p.parse_args(a).async_scheduling for a in ([], ["--async-scheduling"], ["--no-async-scheduling"])] == \
        [None, True, False]


def test_short_prefill_graphs_default_on_cuda_and_are_refused_where_no_graph_would_run():
    """--short-prefill-graphs: on by default for CUDA with one rank, off elsewhere; `--no-...` turns it off;
    asked on a CPU or with other ranks, refused by name."""
    import argparse

    import torch

    from hf2q.server.launch import add_serve_args, resolve_short_prefill_graphs
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert [p.parse_args(a).short_prefill_graphs for a in ([], ["--short-prefill-graphs"],
                                                           ["--no-short-prefill-graphs"])] == [None, True, False]
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [resolve_short_prefill_graphs(None, d, tp) for d, tp in ((cuda, 1), (cuda, 2), (cpu, 1))] == \
        [True, False, False]
    assert resolve_short_prefill_graphs(True, cuda, 1) and not resolve_short_prefill_graphs(False, cuda, 1)
    assert not resolve_short_prefill_graphs(False, cpu, 2)
    for device, tp, why in ((cpu, 1, "needs a CUDA device"), (cuda, 2, "--tensor-parallel-size")):
        with pytest.raises(ValueError, match=why):
            resolve_short_prefill_graphs(True, device, tp)


def test_batched_weights_dense_is_refused_by_name_where_nothing_would_be_copied():
    """--batched-weights: `auto` unless said; `dense` on a model that keeps no quantized projection (the CPU
    dequantizes by default) is refused by name, not accepted and ignored; `auto` there keeps nothing."""
    import argparse

    import torch

    from hf2q.layers.linear import Linear
    from hf2q.server.dense_copies import keep_dense_weights
    from hf2q.server.launch import add_serve_args
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert [p.parse_args(a).batched_weights for a in ([], ["--batched-weights", "dense"])] == ["auto", "dense"]
    with pytest.raises(ValueError, match="--batched-weights dense: this model keeps no quantized projection"):
        keep_dense_weights(torch.nn.Sequential(Linear(8, 8)), torch.device("cpu"), torch.float32)
    keep_dense_weights(torch.nn.Sequential(Linear(8, 8)), torch.device("cpu"), torch.float32, asked=False)


def test_batched_weights_columns_is_refused_by_name_without_q4_k_projections(gguf_dense_q8_0):
    """--batched-weights columns lays out Q4_K projections only: a model that keeps none (this one's are Q8_0) is
    refused by name, not served as if the layout were there."""
    import torch

    from hf2q.checkpoint.gguf_file import GGUFFile
    from hf2q.checkpoint.loader import build_model
    from hf2q.config import ModelConfig
    from hf2q.server.dense_copies import keep_column_weights
    gguf = GGUFFile(gguf_dense_q8_0)
    net = build_model(gguf, ModelConfig.from_gguf_metadata(gguf.metadata), device="cpu", dtype=torch.float32,
                      with_mtp=False, keep_quantized=True)
    with pytest.raises(ValueError, match="--batched-weights columns: this model keeps no Q4_K projection"):
        keep_column_weights(net)


def test_batched_weights_dense_checks_the_room_for_its_copies(gguf_dense_q8_0, monkeypatch):
    """On CUDA the copies must fit in the free memory beyond the serving reserve: refused by name with the sizes
    where they do not, made (every quantized projection, before the K/V pool is sized) where they do. `auto`
    makes them only on CUDA and only within a quarter of that room, and never refuses. The device's free memory
    is stood in for; the net stays on the CPU."""
    import torch

    from hf2q.checkpoint.gguf_file import GGUFFile
    from hf2q.checkpoint.loader import build_model
    from hf2q.config import ModelConfig
    from hf2q.layers.linear import Linear
    from hf2q.server.dense_copies import keep_dense_weights
    gguf = GGUFFile(gguf_dense_q8_0)
    net = build_model(gguf, ModelConfig.from_gguf_metadata(gguf.metadata), device="cpu", dtype=torch.float32,
                      with_mtp=False, keep_quantized=True)
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 << 30, 80 << 30))  # under the 8-GiB reserve
    with pytest.raises(ValueError, match=r"--batched-weights dense needs 0\.\d GiB .* 0\.0 GiB is free"):
        keep_dense_weights(net, cuda, torch.float32)
    keep_dense_weights(net, cuda, torch.float32, asked=False)
    keep_dense_weights(net, torch.device("cpu"), torch.float32, asked=False)
    assert all(m.dense is None for m in net.modules() if isinstance(m, Linear))
    need = sum(m.out_features * m.in_features for m in net.modules() if isinstance(m, Linear) and m.quantized) * 4
    reserve = 8 << 30  # the 8-GiB reserve of an 80-GiB device
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (reserve + 4 * need - 1, 80 << 30))
    keep_dense_weights(net, cuda, torch.float32, asked=False)  # just over a quarter of the room: auto declines
    assert all(m.dense is None for m in net.modules() if isinstance(m, Linear))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (reserve + 4 * need, 80 << 30))
    keep_dense_weights(net, cuda, torch.float32, asked=False)
    quantized = [m for m in net.modules() if isinstance(m, Linear) and m.quantized]
    assert quantized and all(m.dense is not None for m in quantized)


def test_event_json_holds_no_character_a_line_reader_splits_on():
    from hf2q.server.sse import event, json_data

    payload = {"text": "a\u2028b\u2029c\x85d \u00e9\u4e2d", "n": 1}
    frame = event(payload)
    assert frame.startswith("data: ") and frame.endswith("\n\n")
    assert len(frame[:-2].splitlines()) == 1  # str.splitlines also ends lines at U+2028, U+2029, U+0085
    assert json.loads(frame[len("data: "):]) == payload
    assert "\u00e9\u4e2d" in json_data(payload)  # other text stays UTF-8, not escaped
