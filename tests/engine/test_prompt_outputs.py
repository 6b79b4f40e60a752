"""Prompt logprobs and embeddings through the engine equal a direct full-sequence forward, at every prefill
chunk size, and batching them with generation changes no generated token."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import hf2q
from hf2q.config import CacheConfig
from hf2q.engine.engine import Engine, EngineConfig
from hf2q.engine.request import RequestOptions
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.scheduler import SchedulerConfig
from hf2q.forward import ForwardBatch

PROMPTS = [[random.Random(i).randrange(100, 200000) for _ in range(n)] for i, n in enumerate((1, 7, 40))]


@pytest.fixture(scope="module")
def model(gguf_dense_f32):
    return hf2q.load(gguf_dense_f32)


def make_engine(model, chunk: int) -> Engine:
    return Engine(model, EngineConfig(
        max_model_len=128,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk=chunk),
        cache=CacheConfig(num_slots=8, num_blocks=128, block_size=8)))


def run(engine: Engine) -> dict:
    outs: dict = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def hidden(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model.net(ForwardBatch.single(ids))


@pytest.mark.parametrize("chunk", [3, 16, 64])
def test_prompt_logprobs_equal_full_forward(model, chunk):
    engine = make_engine(model, chunk)
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for i, ids in enumerate(PROMPTS):
        engine.add_request(ids, greedy, request_id=f"gen{i}", options=RequestOptions(prompt_logprobs=2))
        engine.add_request(ids, greedy, request_id=f"only{i}",
                           options=RequestOptions(prefill_only=True, prompt_logprobs=0))
    engine.add_request(PROMPTS[2], greedy, request_id="plain")
    outs = run(engine)
    for i, ids in enumerate(PROMPTS):
        ref = torch.log_softmax(model.logits(ids).float(), dim=-1)
        for rid in (f"gen{i}", f"only{i}"):
            lps = outs[rid][0].prompt_logprobs
            assert len(lps) == len(ids) and lps[0] is None
            got = torch.tensor([lp.logprob for lp in lps[1:]])
            want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:], dtype=torch.long)]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            assert all(o.prompt_logprobs is None for o in outs[rid][1:])
        top = [lp.top for lp in outs[f"gen{i}"][0].prompt_logprobs[1:]]
        assert [[t for t, _ in row] for row in top] == ref[:-1].topk(2).indices.tolist()
        only = outs[f"only{i}"]
        assert len(only) == 1 and only[0].finished and only[0].new_token_ids == []
    gen = [t for o in outs["gen2"] for t in o.new_token_ids]
    assert gen == [t for o in outs["plain"] for t in o.new_token_ids]  # prompt logprobs change no token
    assert not engine.requests and engine.cache.num_free_slots == 8


@pytest.mark.parametrize("chunk", [5, 64])
def test_embeddings_equal_full_forward_and_leave_generation_alone(model, chunk):
    engine = make_engine(model, chunk)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    solo = make_engine(model, chunk)
    alone = [t for o in solo.generate(PROMPTS[2], greedy) for t in o.new_token_ids]
    engine.add_request(PROMPTS[2], greedy, request_id="gen")
    for i, ids in enumerate(PROMPTS):
        engine.add_request(ids, SamplingParams(), request_id=f"last{i}", options=RequestOptions(pooling="last"))
        engine.add_request(ids, SamplingParams(), request_id=f"mean{i}", options=RequestOptions(pooling="mean"))
    outs = run(engine)
    assert [t for o in outs["gen"] for t in o.new_token_ids] == alone
    for i, ids in enumerate(PROMPTS):
        h = hidden(model, ids).float()
        last, mean = outs[f"last{i}"], outs[f"mean{i}"]
        assert len(last) == 1 and last[0].finished and last[0].num_prompt_tokens == len(ids)
        torch.testing.assert_close(last[0].embedding, F.normalize(h[-1], dim=0), atol=1e-5, rtol=0)
        torch.testing.assert_close(mean[0].embedding, F.normalize(h.mean(0), dim=0), atol=1e-5, rtol=0)
    assert not engine.requests and engine.cache.num_free_slots == 8


def test_embedding_request_checks(model):
    engine = make_engine(model, 16)
    with pytest.raises(ValueError, match="pooling"):
        engine.add_request([1, 2], SamplingParams(), options=RequestOptions(pooling="max"))
    # the whole context, no output room
    engine.add_request(list(range(100, 228)), SamplingParams(), options=RequestOptions(pooling="last"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.inference_mode()
def test_cuda_graph_runner_keeps_prompt_rows():
    """One-token prompts that keep their hidden rows, or only prefill, never go through a decode graph, even in
    a batch that otherwise would; their rows equal a cache-free forward's."""
    from hf2q.bench_shapes import random_model, tiny_config
    from hf2q.cache.hybrid import HybridCache
    from hf2q.engine.prompt_outputs import pool
    from hf2q.engine.request import Request
    from hf2q.engine.runner import ModelRunner

    net = random_model(tiny_config(False), device="cuda", dtype=torch.bfloat16, std=0.08, seed=7)
    cache = HybridCache(net.config, CacheConfig(num_slots=4, num_blocks=64, block_size=16, kv_dtype="bfloat16"),
                        device="cuda")
    runner = ModelRunner(net, cache)
    decode = Request("d", [5, 6, 7], SamplingParams())
    embed = Request("e", [9], SamplingParams(), prefill_only=True, pooling="last")
    scored = Request("s", [11], SamplingParams(), prompt_logprobs=1)
    for req in (decode, embed, scored):
        req.slot = cache.acquire()
    runner.run([(decode, 3)])
    decode.output_ids.append(1)
    sampling, logits = runner.run([(decode, 1), (embed, 1), (scored, 1)])
    assert sampling == [decode, scored] and logits.shape[0] == 2
    want = net(ForwardBatch.single([9], device="cuda"))
    torch.testing.assert_close(pool(torch.cat(embed.hidden), "last"), F.normalize(want[-1].float(), dim=0).cpu(),
                               atol=2e-2, rtol=0)
    assert len(scored.hidden) == 1 and not decode.hidden


def test_prompt_logprobs_never_resume_from_a_retained_prefix(model):
    """With the prefix cache on, a request whose prompt extends a retained one still computes (and reports)
    every prompt row: the same logprobs as with the cache off."""
    engine = Engine(model, EngineConfig(
        max_model_len=128, scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=64),
        cache=CacheConfig(num_slots=4, num_blocks=128, block_size=8, prefix_cache_bytes=1 << 30,
                          prefix_checkpoint_stride=8)))
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request(PROMPTS[2][:24], greedy, request_id="first")
    run(engine)
    assert engine.prefix.lookup(PROMPTS[2]) is not None  # the second prompt could resume from the first
    engine.add_request(PROMPTS[2], greedy, request_id="lp", options=RequestOptions(prompt_logprobs=0))
    lps = run(engine)["lp"][0].prompt_logprobs
    ref = torch.log_softmax(model.logits(PROMPTS[2]).float(), dim=-1)
    assert len(lps) == len(PROMPTS[2])
    got = torch.tensor([lp.logprob for lp in lps[1:]])
    want = ref[torch.arange(len(PROMPTS[2]) - 1), torch.tensor(PROMPTS[2][1:])]
    assert torch.allclose(got, want, atol=1e-5)
