"""The vectorised fast path (forced on CPU with its torch kernels) computes what the exact path computes:
varlen prefill, chunked prefill and batched decode over several slots, dense and MoE."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf2q.bench_shapes import random_model, tiny_config
from hf2q.cache.hybrid import HybridCache
from hf2q.config import CacheConfig
from hf2q.forward import ForwardBatch
from hf2q.kernels.conv.reference import causal_conv1d_varlen
from hf2q.kernels.choose import fast_path


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def net(request):
    return random_model(tiny_config(request.param), device="cpu", dtype=torch.float32, std=0.08, seed=3)


def test_one_shot_logits_match_reference(net):
    ids = torch.randint(0, net.config.vocab_size, (19,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = net.logits(ids)
    with fast_path("force"):
        assert rel(net.logits(ids), ref) <= 1e-5


@torch.inference_mode()
def test_batched_prefill_and_decode_over_slots_match_reference(net):
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, net.config.vocab_size, (n,), generator=g).tolist() for n in (15, 12, 9)]
    refs = [net.logits(s) for s in seqs]
    cache = HybridCache(net.config, CacheConfig(num_slots=4, num_blocks=32, block_size=4))
    slots = [cache.acquire() for _ in seqs]
    done = [0, 0, 0]

    def step(sizes):
        ids, pos = [], []
        for s, seq, n in zip(slots, seqs, sizes):
            ids += seq[done[s]:done[s] + n]
            pos += range(done[s], done[s] + n)
            cache.reserve(s, done[s] + n)
        batch = ForwardBatch(torch.tensor(ids), torch.tensor(pos), list(sizes), [done[s] for s in slots], slots, cache)
        with fast_path("force"):
            logits = net.compute_logits(net(batch))
        row = 0
        for i, (s, n) in enumerate(zip(slots, sizes)):
            want = refs[i][done[s]:done[s] + n]
            assert rel(logits[row:row + n], want) <= 5e-5, (i, done[s], n)
            row += n
            done[s] += n
            cache.commit(s, done[s])

    step([6, 5, 3])  # prefill, several sequences end to end
    step([4, 1, 2])  # chunked prefill mixed with a decode row
    for _ in range(4):
        step([1, 1, 1])  # decode


def test_varlen_conv_matches_torch_conv1d():
    """The one causal-conv reference (the exact path, and the CPU fallback of the decode and prefill conv
    kernels) against torch's depthwise conv1d, each sequence run from its state; sequences shorter than
    the state included."""
    g = torch.Generator().manual_seed(2)
    lens, c, k = [1, 5, 2, 7], 6, 4
    x = torch.randn(sum(lens), c, generator=g)
    states = torch.randn(len(lens), k - 1, c, generator=g)
    w = torch.randn(c, k, generator=g)
    y, new = causal_conv1d_varlen(x, states, w, lens)
    row = 0
    for i, n in enumerate(lens):
        seq = torch.cat((states[i], x[row:row + n]))  # [K-1+n, C]: the state, then the new inputs
        want = F.silu(F.conv1d(seq.t()[None], w[:, None, :], groups=c)[0].t())  # [n, C]
        assert torch.allclose(y[row:row + n], want, atol=1e-5)
        assert torch.equal(new[i], seq[-(k - 1):])
        row += n


def test_grouped_gemm_moe_matches_expert_loop():
    from hf2q.kernels.moe.ops import moe_combine
    from hf2q.kernels.moe.grouped import moe_expert_pairs_grouped
    torch.manual_seed(4)
    net = random_model(tiny_config(True), device="cpu", dtype=torch.bfloat16, std=0.08, seed=4)
    moe = net.layers[0].ffn
    x = torch.randn(11, net.config.hidden_size, dtype=torch.bfloat16)
    weights, experts = moe.route(x)
    ref = moe(x) - torch.sigmoid(moe.shared_gate(x)) * moe.shared(x)
    for ids in (experts, experts.int()):  # torch's top-k gives int64, the routing kernel int32
        got = moe_combine(moe_expert_pairs_grouped(x, ids, moe.gate_exps, moe.up_exps, moe.down_exps), weights)
        assert rel(got.float(), ref.float()) <= 2e-2


def test_fast_path_off_keeps_the_dense_choosers_on_their_references(monkeypatch):
    """Where Triton runs, fast_path("off") still gives the torch references of the dense operations (what the
    exactness tests compare against on CUDA and training differentiates): the kernel module is never reached."""
    import sys
    import types

    from hf2q.kernels import choose
    from hf2q.kernels.norm import ops as norm_ops

    monkeypatch.setattr(choose, "triton_runs", lambda x: True)
    kernel_module = types.ModuleType("hf2q.kernels.norm.add_rms_triton")

    def kernel(*args):
        raise AssertionError("the Triton kernel ran under fast_path('off')")

    kernel_module.add_rms_norm = kernel
    monkeypatch.setitem(sys.modules, "hf2q.kernels.norm.add_rms_triton", kernel_module)
    x, w = torch.randn(3, 8), torch.ones(8)
    with fast_path("off"):
        assert not choose.kernels_on(x)
        new_x, h = norm_ops.add_rms_norm(x, x, w, 1e-6)
    assert torch.equal(new_x, x + x) and torch.allclose(h, F.rms_norm(x + x, (8,), w, 1e-6), atol=1e-6)
    assert choose.kernels_on(x)  # auto: the kernel where Triton runs
    with pytest.raises(AssertionError, match="Triton kernel ran"):
        norm_ops.add_rms_norm(x, x, w, 1e-6)


@pytest.mark.parametrize("fmt", ["float32", "fp8", "tq8"])
def test_attention_ops_vectorised_path_matches_exact_path(fmt):
    """The attention layer's q/k + K/V-write and gated causal attention operations: the vectorised path (writes
    by slot mapping, paged decode, SDPA's causal kernel for a fresh prompt) against the exact per-sequence path,
    each over its own pool in `fmt`: prefill, chunked prefill beside two decode rows (which the vectorised path
    takes in one paged call), then decode over three slots."""
    from hf2q.kernels.attention import ops as attention_ops
    from hf2q.kernels.rotary import ops as rotary_ops
    from hf2q.layers.rotary import RotaryEmbedding

    cfg = tiny_config()
    layer = next(i for i in range(cfg.num_layers) if cfg.is_full_attention(i))
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_sections)
    q_w, k_w = 1 + 0.1 * torch.randn(hd), 1 + 0.1 * torch.randn(hd)
    caches = {mode: HybridCache(cfg, CacheConfig(num_slots=3, num_blocks=16, block_size=4, kv_dtype=fmt))
              for mode in ("off", "force")}
    slots = {mode: [cache.acquire() for _ in range(3)] for mode, cache in caches.items()}
    g, done = torch.Generator().manual_seed(5), [0, 0, 0]
    for sizes in ([5, 3, 4], [2, 1, 1], [1, 1, 1], [1, 1, 1]):
        t = sum(sizes)
        q, gate = torch.randn(t, nh, hd, generator=g), torch.randn(t, nh, hd, generator=g)
        k, v = torch.randn(t, nkv, hd, generator=g), torch.randn(t, nkv, hd, generator=g)
        pos = torch.cat([torch.arange(d, d + n) for d, n in zip(done, sizes)])
        cos, sin = rotary.cos_sin(pos)
        outs = {}
        for mode, cache in caches.items():
            for s, d, n in zip(slots[mode], done, sizes):
                cache.reserve(s, d + n)
            batch = ForwardBatch(torch.zeros(t, dtype=torch.long), pos, list(sizes), list(done), slots[mode], cache)
            kv = attention_ops.layer_kv(batch, layer)
            with fast_path(mode):
                qr, kr = rotary_ops.qk_norm_rope_store(q, k, v, q_w, k_w, cos, sin, cfg.rms_norm_eps,
                                                       cfg.rotary_dim, batch, kv)
                outs[mode] = attention_ops.gated_causal_attention(qr, kr, v, gate, batch, kv, hd ** -0.5)
            for s, d, n in zip(slots[mode], done, sizes):
                cache.commit(s, d + n)
        assert outs["off"].shape == (t, nh * hd)
        assert rel(outs["force"], outs["off"]) <= 1e-5, (fmt, sizes)
        done = [d + n for d, n in zip(done, sizes)]


def test_prefill_attention_leaves_cudnn_out(monkeypatch):
    """A prefill's SDPA calls run with cuDNN's backend off (it plans every new shape again: half a served
    engine's time on an H100) and the flash and memory-efficient ones on; the result is the exact path's. The
    backends are read in the two functions that call SDPA (a stand-in for SDPA itself would hide it from the
    causal bias the fused one passes, which dispatches on SDPA's identity)."""
    from hf2q.kernels.attention import ops as attention_ops

    cfg = tiny_config()
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = torch.Generator().manual_seed(6)
    q, gate = torch.randn(7, nh, hd, generator=g), torch.randn(7, nh, hd, generator=g)
    k, v = torch.randn(7, nkv, hd, generator=g), torch.randn(7, nkv, hd, generator=g)
    batch = ForwardBatch(torch.zeros(7, dtype=torch.long), torch.cat([torch.arange(4), torch.arange(3)]), [4, 3],
                         [0, 0], [0, 1], None)
    backends = []

    def spy(attend):
        def attend_noting_backends(*args):
            backends.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
                             torch.backends.cuda.mem_efficient_sdp_enabled()))
            return attend(*args)
        return attend_noting_backends

    for name in ("_over_prefix_fused", "prefix_attention"):
        monkeypatch.setattr(attention_ops, name, spy(getattr(attention_ops, name)))
    outs = {}
    for mode in ("off", "force"):
        with fast_path(mode):
            outs[mode] = attention_ops.gated_causal_attention(q, k, v, gate, batch, None, hd ** -0.5)
    assert backends == [(False, True, True)] * 4 and torch.backends.cuda.cudnn_sdp_enabled()  # 2 sequences, 2 paths
    assert rel(outs["force"], outs["off"]) <= 1e-5
