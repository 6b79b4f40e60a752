"""On a CUDA GPU: bf16 fast-path logits against the exact fp32 CPU path of the same weights, each Triton
kernel against its torch version at real head sizes, and graph-replayed greedy decode against eager."""
from __future__ import annotations

import pytest
import torch

from hf2q.bench_shapes import random_model, tiny_config
from hf2q.cache.hybrid import HybridCache
from hf2q.config import CacheConfig
from hf2q.forward import ForwardBatch
from hf2q.kernels.gdn import ops as gdn_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def pair(request):
    cpu = random_model(tiny_config(request.param), device="cpu", dtype=torch.float32, std=0.08, seed=5)
    gpu = random_model(tiny_config(request.param), device="cpu", dtype=torch.float32, std=0.08, seed=5)
    for name, p in gpu.named_parameters():
        if p.dim() >= 2 and not name.endswith(".conv"):
            p.data = p.data.to(torch.bfloat16)
    return cpu, gpu.cuda()


def cache_for(cfg, slots=4):
    return HybridCache(cfg, CacheConfig(num_slots=slots, num_blocks=64, block_size=16, kv_dtype="bfloat16"),
                       device="cuda")


# fla's chunked delta rule keeps its intermediates (normalised q and k, beta, the WY factors, the chunk states)
# in the inputs' bf16 where the reference keeps fp32. The whole path with it, on the H200 (fourteenth session):
# dense 0.128 from fp32 against the bound's 0.077 (1.66x), MoE 0.200 against 0.185; every other kernel is
# held to the bound itself (the delta rule then on its reference), here and, rounding as a GPU, under Triton's
# interpreter (tests/kernels/test_fused_kernels.py).
FLA_BF16_ALLOWANCE = 2.0


def gpu_errors(gpu, ids, ref, cache) -> tuple[float, float]:
    """Relative errors from the fp32 logits of (a 40-token prefill, a 30-token prefill then 10 decode steps)."""
    prefill = rel(gpu.logits(ids).cpu(), ref)
    slot = cache.acquire()
    cache.reserve(slot, 30)
    rows = [gpu.compute_logits(gpu(ForwardBatch.single(ids[:30], slot=slot, cache=cache, device="cuda")))[-1]]
    cache.commit(slot, 30)
    for p in range(30, 40):
        cache.reserve(slot, p + 1)
        batch = ForwardBatch.single(ids[p:p + 1], start=p, slot=slot, cache=cache, device="cuda")
        rows.append(gpu.compute_logits(gpu(batch))[0])
        cache.commit(slot, p + 1)
    cache.release(slot)
    return prefill, rel(torch.stack(rows).cpu(), ref[29:40])


@torch.inference_mode()
def test_bf16_gpu_logits_match_fp32_cpu(pair, monkeypatch):
    cpu, gpu = pair
    ids = torch.randint(0, cpu.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = cpu.logits(ids)
    # bf16 weights move this small random model's logits a lot: the bound is the exact CPU path run
    # with the same bf16 weights (same rounding of weights, fp32 activations would be kinder)
    bf16_cpu = gpu.to("cpu").logits(ids)
    gpu.to("cuda")
    tol = 1.5 * rel(bf16_cpu, ref) + 1e-3
    cache = cache_for(gpu.config)
    with monkeypatch.context() as m:
        # the reference is exact at any length
        m.setattr(gdn_ops, "chunk_gdn", gdn_ops.chunk_gdn_reference)
        ours = gpu_errors(gpu, ids, ref, cache)
    with_fla = gpu_errors(gpu, ids, ref, cache)
    assert max(ours) <= tol, dict(ours=ours, with_fla=with_fla, bound=tol)
    assert max(with_fla) <= FLA_BF16_ALLOWANCE * tol, dict(ours=ours, with_fla=with_fla, bound=tol)


@torch.inference_mode()
def test_triton_kernels_match_torch_versions():
    from hf2q.kernels.conv import decode_triton as conv_triton
    from hf2q.kernels.gdn import decode_triton as gdn_decode_triton
    from hf2q.kernels.attention import paged_triton as paged_attention_triton
    from hf2q.kernels import choose
    from hf2q.kernels.attention import ops as attention_ops
    from hf2q.kernels.conv import ops as conv_ops
    from hf2q.kernels.gdn import ops as gdn_ops
    torch.manual_seed(0)
    b, nk, nv, dk, c, s = 5, 4, 8, 128, 2 * 4 * 128 + 8 * 128, 7
    slots = torch.tensor([3, 0, 6, 2, 5], device="cuda")
    x = torch.randn(b, c, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(c, 4, device="cuda")
    pool = torch.randn(s, 3, c, device="cuda")
    pool2 = pool.clone()
    y = conv_triton.conv_decode_(x, w, pool, slots)
    with choose.fast_path("force"):
        y_ref = conv_ops.conv_decode_(x.cpu(), w.cpu(), pool2.cpu(), slots.cpu())  # torch version on CPU
    assert rel(y.cpu(), y_ref) <= 1e-5
    qkv = torch.randn(b, c, device="cuda")
    a, bb, z = torch.randn(b, nv, device="cuda"), torch.randn(b, nv, device="cuda"), torch.randn(b, nv * dk, device="cuda")
    A, dtb, nw = -torch.rand(nv, device="cuda") * 8, torch.randn(nv, device="cuda"), torch.randn(dk, device="cuda")
    st = torch.randn(s, nv, dk, dk, device="cuda") * 0.1
    st_cpu = st.cpu()
    o = gdn_decode_triton.gdn_decode_(qkv, a, bb, A, dtb, z, nw, st, slots, nk, dk, 1e-6, torch.float32)
    o_ref = gdn_ops.gdn_decode_(qkv.cpu(), a.cpu(), bb.cpu(), A.cpu(), dtb.cpu(), z.cpu(), nw.cpu(), st_cpu,
                                slots.cpu(), nk, dk, 1e-6, torch.float32)
    assert rel(o.cpu(), o_ref) <= 1e-4 and rel(st.cpu(), st_cpu) <= 1e-5
    nh, nkv, hd, bs = 16, 4, 256, 16
    rows = torch.randn(64 * bs, nkv, hd, device="cuda", dtype=torch.bfloat16)
    vals = torch.randn(64 * bs, nkv, hd, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([1, 17, 300, 64, 999], device="cuda", dtype=torch.int32)
    tables = torch.randint(0, 64, (5, 63), device="cuda", dtype=torch.int32)
    q = torch.randn(b, nh, hd, device="cuda", dtype=torch.bfloat16)
    out = paged_attention_triton.paged_decode_attention(q, rows, vals, tables, lens, bs, hd ** -0.5)
    ref = attention_ops.paged_decode_attention(q.cpu().float(), rows.cpu().float(), vals.cpu().float(), tables.cpu(),
                                               lens.cpu(), bs, hd ** -0.5)
    assert rel(out.cpu(), ref) <= 2e-2


@torch.inference_mode()
@pytest.mark.parametrize("lens", [[37, 1, 100], [37, 1, 20]], ids=["chunked", "short-recurrent"])
def test_fla_prefill_matches_reference(lens):
    from hf2q.kernels.gdn import ops as gdn_ops
    torch.manual_seed(1)
    nk, nv, d = 2, 4, 128
    t = sum(lens)
    q, k = torch.randn(t, nk, d, device="cuda", dtype=torch.bfloat16), torch.randn(t, nk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, nv, d, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(t, nv, device="cuda") * 0.5
    beta = torch.rand(t, nv, device="cuda")
    h0 = torch.randn(len(lens), nv, d, d, device="cuda") * 0.05
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    o, final = gdn_ops.chunk_gdn(q, k, v, g, beta, h0, cu, lens, d ** -0.5, 1e-6)
    o_ref, f_ref = gdn_ops.chunk_gdn(*(x.cpu().float() for x in (q, k, v, g, beta, h0)), cu.cpu(), lens, d ** -0.5,
                                     1e-6)
    assert rel(o.cpu(), o_ref) <= 2e-2 and rel(final.cpu(), f_ref) <= 2e-2


@torch.inference_mode()
@pytest.mark.parametrize("n", [1, 4, 3])
def test_graph_greedy_tokens_equal_eager(pair, n):
    from hf2q.engine.cuda_graphs import DecodeGraphs
    gpu = pair[1]
    cache = cache_for(gpu.config, slots=2 * n + 2)
    gen = torch.Generator().manual_seed(n)
    prompts = [torch.randint(0, gpu.config.vocab_size, (9 + i,), generator=gen).tolist() for i in range(n)]
    eager_slots, graph_slots = [cache.acquire() for _ in range(n)], [cache.acquire() for _ in range(n)]
    first = []
    for p, a, b in zip(prompts, eager_slots, graph_slots):
        cache.reserve(a, len(p))
        first.append(gpu.compute_logits(gpu(ForwardBatch.single(p, slot=a, cache=cache, device="cuda")))[-1].argmax())
        cache.commit(a, len(p))
        cache.fork(a, b)
    graphs = DecodeGraphs(gpu, cache, buckets=(1, 4), max_context=64)
    graphs.capture()
    steps, pos = 12, [len(p) for p in prompts]
    ids_e = ids_g = torch.stack(first)
    out_e, out_g = [], []
    for _ in range(steps):
        for s, p in zip(eager_slots + graph_slots, pos + pos):
            cache.reserve(s, p + 1)
        batch = ForwardBatch(ids_e, torch.tensor(pos, device="cuda"), [1] * n, list(pos), eager_slots, cache)
        ids_e = gpu.compute_logits(gpu(batch)).argmax(-1)
        ids_g = graphs.step(ids_g, pos, graph_slots).argmax(-1)
        out_e.append(ids_e.tolist())
        out_g.append(ids_g.tolist())
        pos = [p + 1 for p in pos]
    assert out_g == out_e
