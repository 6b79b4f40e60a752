"""Prompt log-probabilities on /v1/completions (`echo` + `logprobs`), as log-likelihood evaluation uses them,
through a real server and the `openai` client; equal to a direct full-sequence forward of the same model."""
from __future__ import annotations

import random

import pytest
import torch

import hf2q

MODEL = "tiny"
IDS = [random.Random(1).randrange(100, 200000) for _ in range(24)]


@pytest.fixture(scope="module")
def local(served_model_path):
    return hf2q.load(served_model_path)


def reference(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, from one forward over the whole sequence (fp32 CPU)."""
    logp = torch.log_softmax(model.logits(ids).float(), dim=-1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def test_echo_prompt_logprobs_equal_full_forward(client, local):
    r = client.completions.create(model=MODEL, prompt=IDS, echo=True, logprobs=3, max_tokens=0)
    (c,) = r.choices
    lp = c.logprobs
    assert c.finish_reason == "length" and c.text == local.tokenizer.decode(IDS)
    assert len(lp.tokens) == len(IDS) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(reference(local, IDS), abs=1e-5)
    assert all(len(top) == 3 and max(top.values()) >= v for top, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(IDS), 0)


def test_lm_eval_loglikelihood_request_shape(client, local):
    """What lm-evaluation-harness `local-completions` sends for loglikelihood: token-id lists, echo, logprobs 1,
    one token generated; it sums token_logprobs[ctxlen:-1] and checks greediness against top_logprobs."""
    ctxlen = 10
    batch = [IDS, IDS[:16]]
    r = client.completions.create(model=MODEL, prompt=batch, echo=True, logprobs=1, max_tokens=1, temperature=0,
                                  seed=1234)
    assert [c.index for c in r.choices] == [0, 1]
    for c, ids in zip(r.choices, batch):
        assert len(c.logprobs.token_logprobs) == len(ids) + 1
        assert sum(c.logprobs.token_logprobs[ctxlen:-1]) == pytest.approx(sum(reference(local, ids)[ctxlen - 1:]),
                                                                          abs=1e-4)
        generated, top = c.logprobs.tokens[-1], c.logprobs.top_logprobs[-1]
        assert generated == max(top, key=top.get)  # greedy
    assert r.usage.prompt_tokens == len(IDS) + 16 and r.usage.completion_tokens == 2


def test_list_prompts_n_and_echo(client):
    prompts = ["The capital of France is", "One, two,"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=3, temperature=0, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]  # prompt i, choice j -> i * n + j
    for c in r.choices:
        assert c.text.startswith(prompts[c.index // 2])
    assert r.choices[0].text == r.choices[1].text  # greedy choices of one prompt agree
    plain = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=3, temperature=0)
    assert r.choices[2].text == prompts[1] + plain.choices[0].text


def test_stream_echo(client):
    chunks = list(client.completions.create(model=MODEL, prompt=IDS[:8], echo=True, logprobs=1, max_tokens=2,
                                            temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.logprobs.token_logprobs[0] is None and len(first.logprobs.tokens) == 9
    full = client.completions.create(model=MODEL, prompt=IDS[:8], echo=True, logprobs=1, max_tokens=2, temperature=0)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
