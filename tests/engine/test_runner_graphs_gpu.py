"""On a CUDA GPU the runner replays captured decode graphs: greedy tokens through it equal the eager runner's,
with requests joining and leaving (buckets captured on first use, padded rows)."""
from __future__ import annotations

import pytest
import torch

from hf2q.bench_shapes import random_model, tiny_config
from hf2q.cache.hybrid import HybridCache
from hf2q.config import CacheConfig
from hf2q.engine.request import Request
from hf2q.engine.runner import ModelRunner
from hf2q.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def greedy(runner: ModelRunner, prompts: list[list[int]], steps: int, logits: list | None = None) -> list[list[int]]:
    """Prefill all prompts, decode `steps` tokens; the last request joins after two decode steps. Each step's
    logits, on the CPU in fp32, are appended to `logits` if given."""
    reqs = []
    for i, p in enumerate(prompts):
        req = Request(f"r{i}", list(p), SamplingParams())
        req.slot = runner.cache.acquire()
        reqs.append(req)
    active = reqs[:-1]
    scheduled = [(r, len(r.prompt_ids)) for r in active]
    for step in range(steps):
        sampling, step_logits = runner.run(scheduled)
        if logits is not None:
            logits.append(step_logits.float().cpu())
        for req, token in zip(sampling, step_logits.argmax(-1).tolist()):
            req.output_ids.append(token)
        if step == 2:
            active.append(reqs[-1])
        scheduled = [(r, r.num_tokens - r.num_computed) for r in active]
    return [r.output_ids for r in reqs]


@torch.inference_mode()
def test_graph_runner_matches_eager():
    net = random_model(tiny_config(False), device="cuda", dtype=torch.bfloat16, std=0.08, seed=7)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, net.config.vocab_size, (5 + 3 * i,), generator=gen).tolist() for i in range(4)]
    out = []
    for graphs in (False, True):
        cache = HybridCache(net.config, CacheConfig(num_slots=6, num_blocks=64, block_size=16, kv_dtype="bfloat16"),
                            device="cuda")
        runner = ModelRunner(net, cache, cuda_graphs=graphs)
        out.append(greedy(runner, prompts, 10))
        assert (runner.graphs is not None) == graphs
        if graphs:
            assert sorted(runner.graphs.graphs) == [4]  # 3 then 4 rows: both in the 4-bucket
    assert out[1] == out[0]
