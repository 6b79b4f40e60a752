"""Sharding in one process: each rank's slice of every block sums (or concatenates) to the full block."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from hf2q.distributed.plan import ShardingError, deltanet_heads, plan_rank
from hf2q.distributed.sharding import shard_ffn, shard_linear, shard_net, shard_vocab, slice_blocks
from hf2q.distributed.tp_layers import VocabParallelHead
from hf2q.forward import ForwardBatch
from hf2q.kernels import choose
from hf2q.layers.linear import Linear
from hf2q.layers.moe import EXPERT_STACKS, MoE
from hf2q.models.qwen35 import Qwen35Model


def test_deltanet_heads_keep_tiled_order():
    # 4 key heads, 8 value heads: key head k owns value heads k and k + 4
    assert deltanet_heads(4, 8, 2, 0) == ([0, 1], [0, 1, 4, 5])
    assert deltanet_heads(4, 8, 2, 1) == ([2, 3], [2, 3, 6, 7])
    for rank in range(2):
        keys, values = deltanet_heads(4, 8, 2, rank)
        assert all(v % 4 == keys[i % len(keys)] for i, v in enumerate(values))


def test_deltanet_key_heads_replicate_when_fewer_than_ranks():
    plans = [deltanet_heads(2, 4, 4, r) for r in range(4)]
    assert plans == [([0], [0]), ([0], [2]), ([1], [1]), ([1], [3])]
    assert sorted(v for _, values in plans for v in values) == [0, 1, 2, 3]  # every value head exactly once
    with pytest.raises(ShardingError, match="cannot be split over 4 ranks"):
        deltanet_heads(1, 2, 4, 0)


@pytest.fixture(params=["dense", "moe"])
def model(request, tp_models):
    return tp_models[request.param]


def test_uneven_heads_fail_clearly(model):
    with pytest.raises(ShardingError, match="attention heads is 4, which must be divisible by 3"):
        plan_rank(model.config, 0, 3)
    with pytest.raises(ShardingError, match="attention heads is 4"):
        plan_rank(model.config, 0, 8)


def test_kv_heads_replicate_at_four_ranks(model):
    plans = [plan_rank(model.config, r, 4) for r in range(4)]
    assert [p.attn_heads for p in plans] == [[0], [1], [2], [3]]
    assert [p.kv_heads for p in plans] == [[0], [0], [1], [1]]  # q head h reads K/V head h // 2
    assert all(p.local.num_kv_heads == 1 and p.local.conv_channels == 2 * 32 + 32 for p in plans)


def test_a_shard_is_built_from_the_single_device_classes(model):
    """No tensor-parallel twins: the only module a rank adds is its vocab-parallel head."""
    net = shard_net(model.net, plan_rank(model.config, 1, 2))
    assert {type(m) for m in net.modules()} - {type(m) for m in model.net.modules()} == {VocabParallelHead}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("mode", ["off", "force"])  # reference and vectorised (fast-path) layer code
@pytest.mark.parametrize("world", [2, 4])
@torch.inference_mode()
def test_rank_partials_sum_to_full_blocks(model, world, mode):
    with choose.fast_path(mode):
        _check_partials(model, world)


def _check_partials(model, world):
    nets = [shard_net(model.net, plan_rank(model.config, r, world)) for r in range(world)]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, model.config.hidden_size, generator=gen)
    batch = ForwardBatch.single(list(range(7)))
    cos, sin = model.net.rotary.cos_sin(batch.positions)
    full_layers = list(model.net.layers) + [model.net.mtp.layer]
    for i, full in enumerate(full_layers):
        parts = [n.layers[i] if i < len(n.layers) else n.mtp.layer for n in nets]
        args = (x, batch, cos, sin) if full.is_full_attention else (x, batch)
        assert _rel(sum(p.mixer(*args) for p in parts), full.mixer(*args)) < 1e-5, i
        assert _rel(sum(p.ffn(x) for p in parts), full.ffn(x)) < 1e-5, i
    h = torch.randn(3, model.config.hidden_size, generator=gen)
    logits = torch.cat([n.compute_logits(h) for n in nets], dim=-1)[:, : model.config.vocab_size]
    assert torch.equal(logits, model.net.compute_logits(h))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_quantized_linear_splits_by_whole_blocks(qtype):
    from hf2q.quant import block_layout, dequantize_ref, random_blocks

    elems = block_layout(qtype)[0]
    full = Linear(2 * elems, 6)
    full.set_quantized(random_blocks(qtype, 6, 2 * elems, seed=1), qtype)
    dense = dequantize_ref(full.qweight, qtype, (6, 2 * elems))
    rows = shard_linear(full, 0, torch.tensor([3, 4, 5]))
    cols = shard_linear(full, 1, torch.arange(elems, 2 * elems))
    assert torch.equal(dequantize_ref(rows.qweight, qtype, (3, 2 * elems)), dense[3:])
    assert torch.equal(dequantize_ref(cols.qweight, qtype, (6, elems)), dense[:, elems:])
    with pytest.raises(ShardingError, match="block"):
        shard_linear(full, 1, torch.arange(elems // 2, elems // 2 + elems))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_interleaved_k_quants_split_by_whole_blocks(qtype):
    """K-quants kept as interleaved rows (the GPU's layout) split like ggml's blocks: rows stay rows, a
    column slice holds the chosen blocks, interleaved (and padded) as a row of its own width."""
    from hf2q.quant import block_layout, from_gpu_rows, random_blocks, to_gpu_rows

    size = block_layout(qtype)[1]
    raw = random_blocks(qtype, 6, 3 * 256, seed=2)  # 3 blocks a row, 2 after the cut (Q6_K: both padded)
    full = Linear(3 * 256, 6)
    full.set_quantized(to_gpu_rows(raw, qtype), qtype)
    rows = shard_linear(full, 0, torch.tensor([1, 4]))
    cols = shard_linear(full, 1, torch.arange(256, 3 * 256))
    assert torch.equal(from_gpu_rows(rows.qweight, qtype, 3 * 256), raw[[1, 4]])
    assert torch.equal(from_gpu_rows(cols.qweight, qtype, 2 * 256), raw[:, size:])


@pytest.mark.parametrize("head", ["tied", "Q8_0"])
def test_vocab_parallel_head_pads_the_last_slice_and_trims_it(tp_models, head):
    """10 rows over 4 ranks: 3 each, the last rank's 1 row padded to 3; the gathered logits, trimmed to
    the vocabulary, are the single-device head's (to fp32 rounding). A tied head without padding stays a
    view of the embedding; a quantized one is cut by whole rows of blocks."""
    from hf2q.quant import random_blocks

    cfg = dataclasses.replace(tp_models["dense"].config, vocab_size=10)
    gen = torch.Generator().manual_seed(3)
    full = Qwen35Model(cfg, tie_embeddings=head == "tied")
    full.embed.copy_(torch.randn(10, cfg.hidden_size, generator=gen))
    if head != "tied":
        full.lm_head.set_quantized(random_blocks(head, 10, cfg.hidden_size, seed=4), head)
    heads = [VocabParallelHead(shard_vocab(full, plan_rank(cfg, r, 4)), 10, None) for r in range(4)]
    qtype = None if full.lm_head is None else full.lm_head.qtype
    assert all(h.shard.out_features == 3 and h.qtype == qtype for h in heads)
    h = torch.randn(2, cfg.hidden_size, generator=gen)
    got = torch.cat([p(h) for p in heads], dim=-1)[:, :10]
    assert _rel(got, full.compute_logits(h)) < 1e-6  # fp32 rounding: a 3-row GEMM sums in another order
    if head == "tied":
        assert heads[0].shard.weight.data_ptr() == full.embed.data_ptr()


@pytest.mark.parametrize("qtype, hidden, width", [("Q8_0", 32, 64), ("Q4_K", 256, 512)])
@torch.inference_mode()
def test_kept_expert_stacks_split_by_whole_blocks(tp_models, qtype, hidden, width):
    """A MoE whose experts and shared expert are kept as blocks: each rank keeps blocks (gate/up by rows,
    down by whole input blocks) and the ranks' outputs sum to the full MoE's; interleaved stacks cut alike."""
    from hf2q.quant import block_layout, from_gpu_rows, random_blocks, to_gpu_rows

    full = MoE(hidden, 4, 2, width, width)
    gen = torch.Generator().manual_seed(5)
    for lin in (full.router, full.shared_gate):
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen))
    for seed, lin in enumerate((full.shared.gate, full.shared.up, full.shared.down)):
        lin.set_quantized(random_blocks(qtype, lin.out_features, lin.in_features, seed=seed), qtype)
    for seed, name in enumerate(EXPERT_STACKS, start=3):
        experts, rows, cols = full.stack_shape(name)
        full.set_quantized(name, random_blocks(qtype, experts * rows, cols, seed=seed).view(experts, rows, -1), qtype)
    parts = [shard_ffn(full, plan_rank(tp_models["moe"].config, r, 2)) for r in range(2)]
    assert all(p.quantized and p.shared.down.quantized and p.expert_dim == width // 2 for p in parts)
    x = torch.randn(5, hidden, generator=gen)
    assert _rel(sum(p(x) for p in parts), full(x)) < 1e-5
    if qtype == "Q4_K":  # 512 columns are two blocks: rank 1 keeps the second
        raw = full.down_qexps
        cut = slice_blocks(to_gpu_rows(raw, qtype), qtype, width, 2, torch.arange(256, 512))
        assert torch.equal(from_gpu_rows(cut, qtype, 256), raw[..., block_layout(qtype)[1]:])
