"""Q8_0 and Q4_K_M GGUFs loaded with their projection weights kept as blocks give the dequantized model's
logits: on CPU through the exact reference, on CUDA through the Triton kernels (greedy tokens over 32
steps). The Q4_K_M files mix Q4_K, Q6_K, Q8_0 and F32 tensors (tests/support/requantize.py)."""
from __future__ import annotations

import pytest
import torch

from hf2q.checkpoint.gguf_file import GGUFFile
from hf2q.checkpoint.loader import build_model
from hf2q.config import ModelConfig
from hf2q.kernels.choose import fast_path
from hf2q.layers.linear import Linear
from tests.quant.test_model import PROMPT, assert_routed_divergence_explained, greedy


def load(path, keep_quantized, device="cpu", dtype=torch.float32):
    gguf = GGUFFile(path)
    cfg = ModelConfig.from_gguf_metadata(gguf.metadata)
    return build_model(gguf, cfg, device=device, dtype=dtype, with_mtp=False, keep_quantized=keep_quantized)


def quantized_linears(net) -> int:
    return sum(isinstance(m, Linear) and m.quantized for m in net.modules())


def test_cpu_default_path_stays_dense(gguf_dense_q8_0):
    assert quantized_linears(load(gguf_dense_q8_0, False)) == 0


@pytest.mark.parametrize("fixture", ["gguf_dense_q8_0", "gguf_dense_q4_k_m", "gguf_moe_q4_k_m"])
def test_cpu_kept_blocks_match_dequantized_logits(fixture, request):
    path = request.getfixturevalue(fixture)
    dense, kept = load(path, False), load(path, True)
    assert quantized_linears(kept) > 10
    if "q4_k_m" in fixture:
        kinds = {m.qtype for m in kept.modules() if isinstance(m, Linear) and m.quantized}
        assert {"Q4_K", "Q8_0"} <= kinds
    a, b = dense.logits(PROMPT), kept.logits(PROMPT)
    assert float((a - b).abs().max()) <= 1e-4 * float(a.abs().max())


def storages(net) -> dict[str, int]:
    """Where each weight (dense or kept blocks) lives: a pack made during a forward would move some."""
    tensors = list(net.named_parameters()) + [(n, t) for n, t in net.named_buffers() if n.endswith("qweight")]
    return {name: t.untyped_storage().data_ptr() for name, t in tensors}


@pytest.mark.parametrize("fixture,keep", [("gguf_dense_q4_k_m", True), ("gguf_moe_q4_k_m", True),
                                          ("gguf_moe_q4_k_m", False)])
def test_projections_are_packed_at_load_not_on_first_forward(fixture, keep, request):
    """Each block's projections of one input share one pack per weight type as soon as the model is
    loaded (a Q4_K_M DeltaNet: its Q5_K/Q6_K and Q4_K parts apart), and the forward packs nothing."""
    net = load(request.getfixturevalue(fixture), keep)
    multi = 0
    for layer in net.layers:
        for group in layer.mixer.packs + layer.ffn.packs:
            by_type: dict = {}
            for lin in group:
                w = lin.qweight if lin.quantized else lin.weight
                by_type.setdefault(lin.qtype if lin.quantized else None, set()).add(w.untyped_storage().data_ptr())
            assert all(len(ptrs) == 1 for ptrs in by_type.values()), by_type
            multi += sum(len(group) > 1 for _ in by_type)
    assert multi >= 2 * len(net.layers)
    before = storages(net)
    with fast_path("force"):
        net.logits(PROMPT)
    net.logits(PROMPT)
    assert storages(net) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fixture", ["gguf_dense_q8_0", "gguf_dense_q4_k_m", "gguf_moe_q4_k_m"])
def test_gpu_kept_blocks_greedy_match(fixture, request):
    """The served path (fast path, kernels on the blocks) against the same file dequantized on the eager
    path, both bf16 on the GPU: identical greedy tokens, or a first difference at a near-tie at the
    kernels' precision, in the logits or in an MoE router's choice (tests.quant.test_model.
    assert_routed_divergence_explained)."""
    path = request.getfixturevalue(fixture)
    dense = load(path, False, "cuda", torch.bfloat16)
    kept = load(path, True, "cuda", torch.bfloat16)
    assert quantized_linears(kept) > 10
    with fast_path("off"):
        a, _ = greedy(dense, 32)
    b, _ = greedy(kept, 32)
    if a != b:
        first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        assert_routed_divergence_explained(dense, kept, PROMPT + a[:first], (first, a, b))
