"""Programmatic dependent launch (HF2Q_PDL, kernels/pdl.py) changes no token: batch-1 greedy decode through
captured graphs equals the plain launches' for the bf16 one-row GEMVs (dense and MoE) and for the int8
mat-vecs of a Q4_K_M-style model. Needs a GPU of compute capability 9.0 or later."""
from __future__ import annotations

import pytest
import torch

from hf2q.bench_shapes import random_model, tiny_config
from hf2q.cache.hybrid import HybridCache
from hf2q.config import CacheConfig
from hf2q.engine.request import Request
from hf2q.engine.runner import ModelRunner
from hf2q.engine.sampling_params import SamplingParams
from hf2q.kernels import pdl
from hf2q.kernels.dispatch import gemv_switch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a CUDA GPU, sm_90+")]
PROMPT = [1, 5, 9, 200, 17, 3, 88, 41]


def decode(net, steps: int) -> list[int]:
    cache = HybridCache(net.config, CacheConfig(num_slots=2, num_blocks=32, block_size=16, kv_dtype="bfloat16"),
                        device="cuda")
    runner = ModelRunner(net, cache, cuda_graphs=True)
    req = Request("r", list(PROMPT), SamplingParams())
    req.slot = cache.acquire()
    scheduled = [(req, len(PROMPT))]
    for _ in range(steps):
        _, logits = runner.run(scheduled)
        req.output_ids.append(int(logits[0].argmax()))
        scheduled = [(req, req.num_tokens - req.num_computed)]
    assert runner.graphs is not None and sorted(runner.graphs.graphs) == [1]
    return req.output_ids


def both_ways(net, monkeypatch, steps: int = 24) -> tuple[list[int], list[int]]:
    out = []
    for setting in ("0", "1"):
        monkeypatch.setattr(pdl, "_SETTING", setting)
        assert pdl.enabled(torch.device("cuda")) == (setting == "1")
        out.append(decode(net, steps))
    return out[0], out[1]


@torch.inference_mode()
@pytest.mark.parametrize("moe", [False, True])
def test_pdl_bf16_gemv_tokens(moe, monkeypatch):
    net = random_model(tiny_config(moe), device="cuda", dtype=torch.bfloat16, std=0.08, seed=7)
    with gemv_switch(1):  # every one-row product on the GEMV
        plain, overlapped = both_ways(net, monkeypatch)
    assert overlapped == plain


@torch.inference_mode()
def test_pdl_int8_matvec_tokens(monkeypatch):
    from tests.quant.test_model import twins

    _, kept = twins("q4_k_m", "cuda", torch.bfloat16)
    plain, overlapped = both_ways(kept, monkeypatch)
    assert overlapped == plain
