"""/v1/embeddings through a real server and the `openai` client: equal to a direct forward of the same model
(final normed hidden state, last token or mean, L2-normalised), and harmless to a generation running beside."""
from __future__ import annotations

import threading

import httpx
import pytest
import torch
import torch.nn.functional as F

import hf2q
from hf2q.forward import ForwardBatch

MODEL = "tiny"
TEXTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="module")
def local(served_model_path):
    return hf2q.load(served_model_path)


def hidden(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model.net(ForwardBatch.single(ids)).float()


def test_embeddings_equal_direct_forward(client, local):
    r = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    ids = [local.tokenizer.encode(t) for t in TEXTS]
    assert [d.index for d in r.data] == [0, 1] and r.model == MODEL
    for d, tokens in zip(r.data, ids):
        want = F.normalize(hidden(local, tokens)[-1], dim=0)
        torch.testing.assert_close(torch.tensor(d.embedding), want, atol=1e-5, rtol=0)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))


def test_base64_token_ids_mean_pooling_and_dimensions(client, local):
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
        want = F.normalize(hidden(local, tokens).mean(0)[:16], dim=0)
        assert len(d.embedding) == 16
        torch.testing.assert_close(torch.tensor(d.embedding), want, atol=1e-5, rtol=0)


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
