"""/v1/embeddings through a real server and the `openai` client: equal to HF transformers' final normed hidden
state of the checkpoint the served GGUF was converted from (last token or mean, L2-normalised), and harmless to
a generation running beside."""
from __future__ import annotations

import threading

import httpx
import pytest
import torch
import torch.nn.functional as F

MODEL = "tiny"
TEXTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog."]
TOLERANCE = 1e-5  # fp32 on both sides (tests/models/test_parity.py holds the logits to 1e-5 relative)


@pytest.fixture(scope="module")
def reference(served_model_path, gguf_dense_f32, hf_model_dense):
    """HF transformers' model of the served GGUF (the fixture GGUF is its conversion)."""
    if served_model_path != gguf_dense_f32:
        pytest.skip("the server runs the demo model, which has no HF checkpoint")
    return hf_model_dense


def hidden(hf_model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model.model(torch.tensor([ids])).last_hidden_state[0].float()  # after the final norm


def token_ids(server, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]


def test_embeddings_equal_hf_hidden_states(client, plain_server, reference):
    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    ids = [token_ids(plain_server, t) for t in TEXTS]
    assert [d.index for d in r.data] == [0, 1] and r.model == MODEL
    for d, tokens in zip(r.data, ids):
        want = F.normalize(hidden(reference, tokens)[-1], dim=0)
        torch.testing.assert_close(torch.tensor(d.embedding), want, atol=TOLERANCE, rtol=0)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))


def test_base64_token_ids_mean_pooling_and_dimensions(client, reference):
    ids = [[101, 2000, 3000], [7, 8, 9, 10, 11]]
    # No encoding_format: the SDK asks for base64 and decodes the little-endian float32 itself.
    decoded = client.embeddings.create(model=MODEL, input=ids)
    floats = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    for a, b in zip(decoded.data, floats.data):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-7)
    one = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float").data[0].embedding
    assert one == pytest.approx(floats.data[1].embedding, abs=1e-5)  # alone or batched: same within rounding
    mean = client.embeddings.create(model=MODEL, input=ids, dimensions=16, encoding_format="float",
                                    extra_body={"pooling": "mean"})
    for d, tokens in zip(mean.data, ids):
        want = F.normalize(hidden(reference, tokens).mean(0)[:16], dim=0)
        assert len(d.embedding) == 16
        torch.testing.assert_close(torch.tensor(d.embedding), want, atol=TOLERANCE, rtol=0)


def test_bad_embedding_requests(plain_server):
    for body, param in [({"input": "x", "dimensions": 0}, "dimensions"), ({"input": ""}, "input"),
                        ({"input": ["a", ""]}, "input"), ({"input": "x", "pooling": "max"}, "pooling"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": [999999999]}, "input"), ({"input": "x", "max_tokens": 3}, "max_tokens")]:
        r = httpx.post(plain_server.url + "/v1/embeddings", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_embeddings_leave_generation_alone(client):
    kw = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 24, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    alone = client.completions.create(**kw).choices[0].text
    stop = threading.Event()

    def embed() -> None:
        while not stop.is_set():
            client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")

    worker = threading.Thread(target=embed)
    worker.start()
    try:
        beside = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    finally:
        stop.set()
        worker.join()
    assert beside == alone


def test_every_sdk_field_is_accepted():
    from openai.types import embedding_create_params

    from hf2q.server.schemas import EmbeddingRequest

    params = embedding_create_params.EmbeddingCreateParams
    assert set(params.__required_keys__) | set(params.__optional_keys__) <= set(EmbeddingRequest.model_fields)
