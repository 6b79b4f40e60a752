"""Child process of test_pdl.py's GPU test (HF2Q_PDL is read at import): the logits of a few decode steps,
through the graph runner (a bf16 dense and an MoE model) and through the paged cache (a Q4_K_M-style model
on its int8 mat-vecs), saved to the file named by argv[1] with whether PDL was on."""
from __future__ import annotations

import sys

import torch

from hf2q.bench_shapes import random_model, tiny_config
from hf2q.cache.hybrid import HybridCache
from hf2q.config import CacheConfig
from hf2q.engine.request import Request
from hf2q.engine.runner import ModelRunner
from hf2q.engine.sampling_params import SamplingParams
from hf2q.forward import ForwardBatch
from hf2q.kernels import pdl
from hf2q.kernels.dispatch import fast_path
from tests.quant.test_model import PROMPT, twins


def runner_logits(moe: bool) -> list[torch.Tensor]:
    """Eight graph-replayed decode steps of three prompts."""
    net = random_model(tiny_config(moe), device="cuda", dtype=torch.bfloat16, std=0.08, seed=7)
    cache = HybridCache(net.config, CacheConfig(num_slots=4, num_blocks=64, block_size=16, kv_dtype="bfloat16"),
                        device="cuda")
    runner = ModelRunner(net, cache, cuda_graphs=True)
    gen = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(3):
        req = Request(f"r{i}", torch.randint(0, net.config.vocab_size, (5 + 3 * i,), generator=gen).tolist(),
                      SamplingParams())
        req.slot = cache.acquire()
        reqs.append(req)
    scheduled, out = [(r, len(r.prompt_ids)) for r in reqs], []
    for _ in range(8):
        sampling, logits = runner.run(scheduled)
        out.append(logits.float().cpu())
        for req, token in zip(sampling, logits.argmax(-1).tolist()):
            req.output_ids.append(token)
        scheduled = [(r, r.num_tokens - r.num_computed) for r in reqs]
    return out


def kept_logits() -> list[torch.Tensor]:
    """Eight decode steps of the Q4_K_M-style model through the paged cache, every fused kernel on."""
    _, kept = twins("q4_k_m", "cuda", torch.bfloat16)
    cache = HybridCache(kept.config, CacheConfig(num_slots=1, num_blocks=16, block_size=4), device="cuda")
    slot = cache.acquire()
    ids, done, out = list(PROMPT), 0, []
    with fast_path("force"):
        for _ in range(8):
            cache.reserve(slot, len(ids))
            batch = ForwardBatch.single(ids[done:], start=done, slot=slot, cache=cache, device="cuda")
            logits = kept.compute_logits(kept(batch)[-1:])
            cache.commit(slot, len(ids))
            done = len(ids)
            ids.append(int(logits.argmax()))
            out.append(logits.float().cpu())
    return out


if __name__ == "__main__":
    with torch.inference_mode():
        torch.save({"pdl": pdl.enabled(torch.device("cuda")), "dense": runner_logits(False),
                    "moe": runner_logits(True), "kept": kept_logits()}, sys.argv[1])
