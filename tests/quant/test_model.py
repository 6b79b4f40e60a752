"""A small random Qwen3.5 model whose projections are random Q8_0 / Q4_K_M-style blocks decodes the same
greedy tokens as its dequantized twin (CPU: exact reference; CUDA: the Triton kernels, bf16)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from hf2q.bench_shapes import random_model, tiny_config
from hf2q.kernels.dispatch import fast_path
from hf2q.layers.linear import Linear
from hf2q.quant import dequantize_ref, keep_blocks, random_blocks

DEVICES = ["cpu"] + [pytest.param("cuda", marks=pytest.mark.gpu)] * torch.cuda.is_available()
PROMPT = [1, 5, 9, 200, 17, 3, 88, 41]


def cfg():  # every projection's input a multiple of 256 (K-quant super-blocks)
    return dataclasses.replace(tiny_config(), hidden_size=256, intermediate_size=512, head_dim=64,
                               linear_v_head_dim=64, linear_k_head_dim=64)


def twins(mix: str, device: str, dtype):
    dense = random_model(cfg(), device="cpu", dtype=torch.float32, std=0.08, seed=2)
    kept = random_model(cfg(), device="cpu", dtype=torch.float32, std=0.08, seed=2)
    blocks = []
    for (name, d), (_, q) in zip(dense.named_modules(), kept.named_modules()):
        if not isinstance(d, Linear) or name == "lm_head" or d.out_features < 16:
            continue
        qtype = "Q8_0" if mix == "q8_0" else ("Q6_K" if name.endswith(("down", "mixer.v")) else "Q4_K")
        raw = random_blocks(qtype, d.out_features, d.in_features, std=0.08, seed=len(blocks))
        d.weight.data = dequantize_ref(raw, qtype, (d.out_features, d.in_features))
        blocks.append((q, raw, qtype))
    assert len(blocks) > 10
    for net in (dense, kept):
        for p in net.parameters():
            if p.dim() >= 2 and p.dtype == torch.float32 and dtype != torch.float32 and p.shape[-1] != 4:
                p.data = p.data.to(dtype)
    dense, kept = dense.to(device), kept.to(device)
    for q, raw, qtype in blocks:  # laid out for the device as a loaded model's are
        q.set_quantized(keep_blocks(raw, qtype, device), qtype)
    return dense, kept


def greedy(net, n: int):
    ids, margins = list(PROMPT), []
    for _ in range(n):
        last = net.logits(ids)[-1]
        top = last.topk(2).values
        ids.append(int(last.argmax()))
        margins.append(float(top[0] - top[1]))
    return ids[len(PROMPT):], margins


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix", ["q8_0", "q4_k_m"])
def test_quantized_model_greedy_matches_dequantized(mix, device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dense, kept = twins(mix, device, dtype)
    steps = 32 if device == "cuda" else 8
    with fast_path("off"):  # packed projections read dense weights; quantized Linears go one by one
        a, margins = greedy(dense, steps)
        b, _ = greedy(kept, steps)
        scale = float(dense.logits(PROMPT).float().abs().max())
    if a != b:
        first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        assert margins[first] < 0.02 * scale, (first, margins[first], scale)
