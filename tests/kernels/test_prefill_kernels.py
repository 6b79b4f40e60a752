"""The prefill Triton kernels of the DeltaNet layer (varlen causal conv with in-place state update, gated
RMSNorm) against the choosers' torch versions, which are the exact CPU path.

Runs on CPU through Triton's interpreter, and on a CUDA GPU at real 9B sizes in bf16."""
from __future__ import annotations

import pytest
import torch

from hf2q.kernels import choose
from hf2q.kernels.activation import ops as activation_ops
from hf2q.kernels.attention import ops as attention_ops
from hf2q.kernels.conv import ops as conv_ops
from hf2q.kernels.gdn import ops as gdn_ops
from hf2q.kernels.linear import ops as linear_ops
from hf2q.kernels.moe import ops as moe_ops
from hf2q.kernels.norm import ops as norm_ops
from hf2q.kernels.rotary import ops as rotary_ops
from tests.support.triton_targets import TARGETS, interpreter_child, randn, rel, target, torch_only

# Every operation's chooser (kernels/<op>/ops.py) but the quantized products': each picks Triton or torch.
CHOOSERS = (activation_ops, attention_ops, conv_ops, gdn_ops, linear_ops, moe_ops, norm_ops, rotary_ops)

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module", params=TARGETS)
def env(request):
    """(device, dtype, tolerance, real sizes?)"""
    dev, dtype, real = target(request.param)
    return dev, dtype, (1e-2 if real else 1e-5), real


test_kernels_under_the_interpreter = interpreter_child(__file__)


@pytest.mark.parametrize("with_cache", [False, True])
def test_conv_varlen_and_state_update(env, with_cache):
    from hf2q.kernels.conv.varlen_triton import conv_varlen_
    dev, dtype, tol, real = env
    gen = torch.Generator().manual_seed(0)
    # real: 9B conv channels; else channels not a multiple of the block, sequences crossing token blocks
    lens, c = ([2, 1500, 1, 2593], 8192) if real else ([1, 37, 2, 0, 70, 3], 200)
    t, n, s = sum(lens), len(lens), 9
    packed = randn(t, c + 72, dev=dev, dtype=dtype, gen=gen)  # x is a column slice of the fused GEMM output
    x = packed[:, :c]
    w = randn(c, 4, dev=dev, dtype=torch.float32, gen=gen, scale=0.5)
    cu = torch.zeros(n + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    slots = torch.tensor([5, 0, 3, 8, 6, 2][:n])
    pool = ref_pool = None
    if with_cache:  # states rounded to x's dtype (they are past inputs); slot 0 holds a zero state
        pool = randn(s, 3, c, dev=dev, dtype=dtype, gen=gen).float()
        pool[0] = 0
        ref_pool = pool.cpu().clone()
    y = conv_varlen_(x, w, pool, slots.to(dev) if with_cache else None, cu.to(dev))
    with torch_only():
        ref = conv_ops.conv_varlen_(x.cpu().float(), w.cpu(), ref_pool, slots if with_cache else None, cu, lens)
    assert y.dtype == x.dtype and y.shape == (t, c)
    assert rel(y, ref) <= tol
    if with_cache:
        assert torch.equal(pool.cpu(), ref_pool)


@pytest.mark.parametrize("dv", [32, 24])
def test_gated_rms_norm(env, dv):
    from hf2q.kernels.norm.gated_triton import gated_rms_norm
    dev, dtype, tol, real = env
    gen = torch.Generator().manual_seed(1)
    t, nv, dv = (4096, 32, 128) if real else (37, 4, dv)  # rows = t * nv, not a multiple of the block
    o = randn(t, nv, dv, dev=dev, dtype=dtype, gen=gen)
    z = randn(t, nv * dv + 40, dev=dev, dtype=dtype, gen=gen)[:, :nv * dv]  # a slice of the fused GEMM output
    w = randn(dv, dev=dev, dtype=torch.float32, gen=gen)
    y = gated_rms_norm(o, z, w, 1e-6, dtype)
    with torch_only():
        ref = norm_ops.gated_rms_norm(o.cpu().float(), z.cpu().float(), w.cpu(), 1e-6, torch.float32)
    assert y.dtype == dtype and y.shape == (t, nv * dv)
    assert rel(y, ref) <= tol


@torch.inference_mode()
def test_prefill_over_cache_matches_torch_versions(env, monkeypatch):
    """The model's fast path with these kernels, prefill then short mixed chunks over cached states, equals the
    same path through the choosers' torch versions: logits at each step and the DeltaNet states after."""
    from hf2q.bench_shapes import random_model, tiny_config
    from hf2q.cache.hybrid import HybridCache
    from hf2q.config import CacheConfig
    from hf2q.forward import ForwardBatch
    dev, _, _, _ = env
    net = random_model(tiny_config(), device="cpu", dtype=torch.float32, std=0.08, seed=3).to(dev)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, net.config.vocab_size, (n,), generator=gen).tolist() for n in (9, 7)]

    def run():
        cache = HybridCache(net.config, CacheConfig(num_slots=3, num_blocks=16, block_size=4), device=dev)
        cache.acquire()  # slot 0 stays unused: the sequences' slots are not their batch rows
        slots, done, out = [cache.acquire() for _ in seqs], [0, 0], []
        for sizes in ([5, 2], [1, 3], [3, 2]):  # short chunks continue from nonzero states
            ids, pos = [], []
            for i, (slot, n) in enumerate(zip(slots, sizes)):
                ids += seqs[i][done[i]:done[i] + n]
                pos += range(done[i], done[i] + n)
                cache.reserve(slot, done[i] + n)
            batch = ForwardBatch(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), list(sizes),
                                 list(done), slots, cache)
            with choose.fast_path("force"):
                out.append(net.compute_logits(net(batch)).cpu())
            for i, n in enumerate(sizes):
                done[i] += n
                cache.commit(slots[i], done[i])
        return out, [s.cpu() for s in cache.conv_state + cache.recurrent_state]

    logits, states = run()
    with monkeypatch.context() as m:
        for chooser in CHOOSERS:
            m.setattr(chooser, "kernels_on" if hasattr(chooser, "kernels_on") else "triton_runs", lambda x: False)
        ref_logits, ref_states = run()
    tol = 1e-4 if dev == "cpu" else 1e-3
    for a, b in zip(logits, ref_logits):
        assert rel(a, b) <= tol
    for a, b in zip(states, ref_states):
        assert rel(a, b) <= tol


def test_fla_short_delta_rule_matches_the_reference(env):
    """Our wrapper of fla's delta rule (kernels/gdn/chunked_fla.py: grouped value heads in GGUF's tiled order,
    raw q/k, unequal sequences end to end, initial and final states) on its short path, fla's fused recurrent
    kernel, against the reference recurrence: under the interpreter, the CPU's check of the arguments we hand
    fla (a positional mix-up gave NaN on the GPU). The chunked path needs a GPU driver even under the
    interpreter (its kernels autotune); tests/kernels/test_gpu.py covers both paths on CUDA."""
    pytest.importorskip("fla")
    from hf2q.kernels.gdn.chunked_fla import RECURRENT_MAX_LEN, chunk_gdn
    dev, dtype, tol, real = env
    lens = [37, 0, 1, 20, 0] if real else [5, 0, 1, 3, 0]  # empty sequences: the graphs pad with them
    assert max(lens) <= RECURRENT_MAX_LEN
    gen = torch.Generator().manual_seed(3)
    nk, nv, d = (2, 4, 128) if real else (2, 4, 16)
    t = sum(lens)
    q, k = randn(t, nk, d, dev=dev, dtype=dtype, gen=gen), randn(t, nk, d, dev=dev, dtype=dtype, gen=gen)
    v = randn(t, nv, d, dev=dev, dtype=dtype, gen=gen)
    g = (-torch.rand(t, nv, generator=gen) * 0.5).to(dev)
    beta = torch.rand(t, nv, generator=gen).to(dev)
    h0 = (torch.randn(len(lens), nv, d, d, generator=gen) * 0.05).to(dev)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev)
    o, final = chunk_gdn(q, k, v, g, beta, h0, cu, d ** -0.5, lens)
    o_ref, f_ref = gdn_ops.chunk_gdn_reference(*(x.cpu().float() for x in (q, k, v, g, beta, h0)), cu.cpu(), lens,
                                               d ** -0.5, 1e-6)
    assert rel(o, o_ref) <= (2e-2 if real else 1e-4) and rel(final, f_ref) <= (2e-2 if real else 1e-4)


def test_fla_imported_in_background():
    """`hf2q serve` on CUDA imports fla's delta-rule kernels on a thread while the weights load: the thread ends
    with the module imported, the same module the first prefill then finds."""
    pytest.importorskip("fla")
    import sys

    from hf2q.kernels.gdn.chunked_fla import import_in_background
    thread = import_in_background()
    thread.join(timeout=120)
    assert not thread.is_alive() and "fla.ops.gated_delta_rule" in sys.modules


def test_the_layers_of_a_forward_share_one_host_offsets_tensor():
    """fla keeps its chunk indices by argument identity: every layer of a forward (same `cu_seqlens`, same
    lengths) gets the same host offsets tensor; other lengths or another forward's `cu_seqlens` get new ones."""
    from hf2q.kernels.gdn.chunked_fla import _host_offsets

    cu = torch.tensor([0, 3, 5])
    first = _host_offsets(cu, [3, 2])
    assert _host_offsets(cu, [3, 2]) is first and first.tolist() == [0, 3, 5]
    assert _host_offsets(cu, [3, 3]).tolist() == [0, 3, 6]
    assert _host_offsets(torch.tensor([0, 3, 5]), [3, 2]) is not first
