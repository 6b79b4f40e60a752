"""Child process of test_pdl.py's GPU test (HF2Q_PDL is read at import): the logits of a few decode steps,
through the graph runner (a bf16 dense and an MoE model) and through the paged cache (a Q4_K_M-style model
on its int8 mat-vecs), saved to the file named by argv[1] with whether PDL was on."""
from __future__ import annotations

import sys

import torch

from hf2q.bench_shapes import random_model, tiny_config
from hf2q.cache.hybrid import HybridCache
from hf2q.config import CacheConfig
from hf2q.engine.runner import ModelRunner
from hf2q.kernels.tuning import pdl
from hf2q.kernels.choose import fast_path
from tests.engine.test_runner_graphs import greedy
from tests.quant.test_model import twins
from tests.quant.test_wiring import greedy_cached


def runner_logits(moe: bool) -> list[torch.Tensor]:
    """Eight graph-replayed decode steps of three prompts (the last joining after two)."""
    net = random_model(tiny_config(moe), device="cuda", dtype=torch.bfloat16, std=0.08, seed=7)
    cache = HybridCache(net.config, CacheConfig(num_slots=4, num_blocks=64, block_size=16, kv_dtype="bfloat16"),
                        device="cuda")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, net.config.vocab_size, (5 + 3 * i,), generator=gen).tolist() for i in range(3)]
    out: list[torch.Tensor] = []
    greedy(ModelRunner(net, cache, cuda_graphs=True), prompts, 8, logits=out)
    return out


def kept_logits() -> list[torch.Tensor]:
    """Eight decode steps of the Q4_K_M-style model through the paged cache, every fused kernel on."""
    _, kept = twins("q4_k_m", "cuda", torch.bfloat16)
    out: list[torch.Tensor] = []
    with fast_path("force"):
        greedy_cached(kept, 8, logits=out)
    return out


if __name__ == "__main__":
    with torch.inference_mode():
        torch.save({"pdl": pdl.enabled(torch.device("cuda")), "dense": runner_logits(False),
                    "moe": runner_logits(True), "kept": kept_logits()}, sys.argv[1])
