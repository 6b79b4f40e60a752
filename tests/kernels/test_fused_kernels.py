"""The fused Triton kernels (residual add + RMSNorm, SwiGLU, q/k norm + RoPE + K/V write, paged attention
with the output gate, MoE routing and combine) against the torch versions in the choosers
(kernels/<op>/ops.py), which are the exact CPU path.

Runs on CPU through Triton's interpreter, and on a CUDA GPU at real sizes in bf16."""
from __future__ import annotations

import importlib

import pytest
import torch

from hf2q.kernels.activation import ops as activation_ops
from hf2q.kernels.attention import ops as attention_ops
from hf2q.kernels.moe import ops as moe_ops
from hf2q.kernels.norm import ops as norm_ops
from hf2q.kernels.rotary import ops as rotary_ops
from hf2q.bench_shapes import random_model, tiny_config
from hf2q.kernels.choose import fast_path
from tests.support.triton_targets import (TARGETS, bf16_rounding_as_gpu, compile_for_hopper, interpreter_child, randn,
                                          rel, target, torch_only)

triton = pytest.importorskip("triton")

MODULES = {"norm_triton": "norm.add_rms_triton", "swiglu_triton": "activation.swiglu_triton",
           "qk_rope_triton": "rotary.qk_rope_triton", "paged_attention_triton": "attention.paged_triton",
           "moe_triton": "moe.route_triton", "gemv_triton": "linear.gemv_triton"}


@pytest.fixture(scope="module", params=TARGETS)
def env(request):
    """(device, dtype, tolerance, kernel modules, real sizes?)"""
    dev, dtype, real = target(request.param)
    mods = {name: importlib.import_module(f"hf2q.kernels.{path}") for name, path in MODULES.items()}
    return dev, dtype, (2e-2 if real else 1e-5), mods, real


test_kernels_under_the_interpreter = interpreter_child(__file__)


def test_add_rms_norm(env):
    dev, dtype, tol, k, real = env
    gen = torch.Generator().manual_seed(0)
    n = 4096 if real else 320
    x, y = randn(3, n, dev=dev, dtype=dtype, gen=gen), randn(3, n, dev=dev, dtype=dtype, gen=gen)
    w = randn(n, dev=dev, dtype=torch.float32, gen=gen)
    res, h = k["norm_triton"].add_rms_norm(x, y, w, 1e-6)
    with torch_only():
        ref_res, ref_h = norm_ops.add_rms_norm(x.cpu().float(), y.cpu().float(), w.cpu(), 1e-6)
        _, ref_h0 = norm_ops.add_rms_norm(x.cpu().float(), None, w.cpu(), 1e-6)
    assert rel(res, ref_res) <= tol and rel(h, ref_h) <= tol
    same, h0 = k["norm_triton"].add_rms_norm(x, None, w, 1e-6)
    assert same is x and rel(h0, ref_h0) <= tol
    for qtype in _int8_readers(n):
        _, hq = k["norm_triton"].add_rms_norm(x, y, w, 1e-6, int8_for=qtype)  # also writes the int8 rows
        assert torch.equal(hq, h)
        _check_int8_groups(hq, qtype)
    # The int8 rows written by programs of a slice each (the row's RMS in every one): the same outputs.
    n, width = (4096, 512) if real else (512, 128)
    x, y = randn(2, n, dev=dev, dtype=dtype, gen=gen), randn(2, n, dev=dev, dtype=dtype, gen=gen)
    w = randn(n, dev=dev, dtype=torch.float32, gen=gen)
    res, h = k["norm_triton"].add_rms_norm(x, y, w, 1e-6)
    for qtype in _int8_readers(n):
        res_q, hq = k["norm_triton"].add_rms_norm(x, y, w, 1e-6, int8_for=qtype, slice_width=width)
        assert torch.equal(res_q, res) and torch.equal(hq, h)
        _check_int8_groups(hq, qtype)


def _int8_readers(n):
    """Weight types whose int8 rows a producer of n-wide rows can write: plain order always, BLOCKED
    (K-quants) for whole 256-value blocks."""
    return ["Q8_0"] + (["Q4_K"] if n % 256 == 0 else [])


def _check_int8_groups(out, qtype):
    """The int8 rows a kernel wrote with its output `out`, for weights of `qtype`, are remembered for the
    mat-vec and equal quantizing `out` afterwards."""
    from hf2q.kernels.quant import int8_rows as q8

    blocked = q8.blocked_for(qtype)
    assert q8._RECENT[0][0]() is out
    xq, act, _ = q8.quantize_rows(out, blocked=blocked)  # found, not recomputed
    assert xq is q8._RECENT[0][2].xq
    fresh_xq, fresh_act, _ = q8.quantize_rows(out.clone(), blocked=blocked)
    assert torch.equal(xq.cpu(), fresh_xq.cpu())
    assert torch.allclose(act.cpu(), fresh_act.cpu(), rtol=1e-5, atol=1e-6)


def test_silu_mul_writes_int8_groups(env):
    dev, dtype, tol, k, real = env
    n = 12288 if real else 160  # GPU: six programs per row; CPU: one, partly past N
    gu = randn(3, 2 * n, dev=dev, dtype=dtype, gen=torch.Generator().manual_seed(6))
    for qtype in _int8_readers(n):
        _check_int8_groups(k["swiglu_triton"].silu_mul(gu[:, :n], gu[:, n:], int8_for=qtype), qtype)


def test_silu_mul_on_packed_halves(env):
    dev, dtype, tol, k, real = env
    gen = torch.Generator().manual_seed(1)
    n = 12288 if real else 200
    packed = randn(2, 2 * n, dev=dev, dtype=dtype, gen=gen)
    gate, up = torch.split(packed, [n, n], dim=-1)
    out = k["swiglu_triton"].silu_mul(gate, up)
    with torch_only():
        ref = activation_ops.silu_mul(gate.cpu().float(), up.cpu().float())
    assert rel(out, ref) <= tol


@pytest.mark.parametrize("with_pool", [False, True])
def test_qk_norm_rope_and_kv_write(env, with_pool):
    dev, dtype, tol, k, real = env
    gen = torch.Generator().manual_seed(2)
    t, nh, nkv, hd, rd = (3, 16, 4, 256, 64) if real else (3, 4, 2, 32, 16)
    packed = randn(t, nh * 2 * hd + 2 * nkv * hd, dev=dev, dtype=dtype, gen=gen)  # as the fused GEMM
    qg, k_lin, v_lin = torch.split(packed, [nh * 2 * hd, nkv * hd, nkv * hd], dim=-1)
    qg = qg.reshape(t, nh, 2 * hd)
    q, kk, v = qg[..., :hd], k_lin.reshape(t, nkv, hd), v_lin.reshape(t, nkv, hd)
    qw, kw = randn(hd, dev=dev, dtype=torch.float32, gen=gen), randn(hd, dev=dev, dtype=torch.float32, gen=gen)
    pos = torch.tensor([5, 0, 1000])
    inv = 1.0 / (1e7 ** (torch.arange(0, rd, 2).float() / rd))
    emb = torch.cat([pos[:, None] * inv[None]] * 2, dim=-1)
    cos, sin = emb.cos().to(dev), emb.sin().to(dev)
    rows = 10
    mapping = torch.tensor([7, 2, 9], device=dev)
    pools = (torch.zeros(rows, nkv, hd, device=dev, dtype=dtype), torch.zeros(rows, nkv, hd, device=dev, dtype=dtype),
             mapping) if with_pool else None
    q_out, k_out = k["qk_rope_triton"].qk_norm_rope(q, kk, v, qw, kw, cos, sin, 1e-6, rd, pools)
    ref_pools = (torch.zeros(rows, nkv, hd), torch.zeros(rows, nkv, hd), mapping.cpu()) if with_pool else None
    with torch_only():
        ref_q, ref_k = rotary_ops.qk_norm_rope(q.cpu().float(), kk.cpu().float(), v.cpu().float(), qw.cpu(), kw.cpu(),
                                               cos.cpu(), sin.cpu(), 1e-6, rd, ref_pools)
    assert rel(q_out, ref_q) <= tol and rel(k_out, ref_k) <= tol
    if with_pool:
        assert rel(pools[0], ref_pools[0]) <= tol and torch.equal(pools[1].cpu().float(), ref_pools[1])


@pytest.mark.parametrize("gated,one", [(False, False), (True, False), (True, True)])
def test_paged_attention_with_output_gate(env, gated, one):
    """Several sequences (the batched configuration), and one (its own: more splits, fewer keys a step)."""
    dev, dtype, tol, k, real = env
    gen = torch.Generator().manual_seed(3)
    b, nh, nkv, hd, bs, blocks = (4, 16, 4, 256, 16, 64) if real else (3, 4, 2, 32, 4, 12)
    rows_k = randn(blocks * bs, nkv, hd, dev=dev, dtype=dtype, gen=gen)
    rows_v = randn(blocks * bs, nkv, hd, dev=dev, dtype=dtype, gen=gen)
    lens = torch.tensor([1, 17, 40, 999][:b] if real else [1, 9, 30], dtype=torch.int32)
    if one:  # the longest context alone
        b, lens = 1, lens[-1:]
    tables = torch.randint(0, blocks, (b, blocks), generator=gen, dtype=torch.int32)
    q = randn(b, nh, hd, dev=dev, dtype=dtype, gen=gen)
    gate = randn(b, nh, 2 * hd, dev=dev, dtype=dtype, gen=gen)[..., hd:] if gated else None
    out = k["paged_attention_triton"].paged_decode_attention(q, rows_k, rows_v, tables.to(dev), lens.to(dev), bs,
                                                             hd ** -0.5, gate=gate)
    with torch_only():
        ref = attention_ops.paged_decode_attention(q.cpu().float(), rows_k.cpu().float(), rows_v.cpu().float(),
                                                   tables, lens, bs, hd ** -0.5,
                                                   gate=None if gate is None else gate.cpu().float())
    assert rel(out, ref) <= max(tol, 2e-5)


# 16 tile rows: 4 rows a program; 5 (3 heads a group, 15 of 16 tile rows); 32: 8 and 10 rows
@pytest.mark.parametrize("nh,nkv,tile", [(4, 1, None), (6, 2, None), (4, 1, 32), (6, 2, 32)])
def test_paged_attention_groups_a_sequences_rows(env, nh, nkv, tile):
    """A prefill graph's rows (several of one sequence, each at its own position) taken a group a program with
    row_firsts: the reference's output for every row, with a sequence longer than a group, one shorter than a
    key step, a lone row and padding rows; splits left without keys for the shorter rows of a group. Each row reads
    its sequence's first row's block table: the other rows' tables (which a graph step leaves empty) are garbage."""
    dev, dtype, tol, k, real = env
    gen = torch.Generator().manual_seed(5)
    if real:
        nh, nkv = 16, 4
    hd, bs, blocks = (256, 16, 64) if real else (32, 4, 16)
    rows_k = randn(blocks * bs, nkv, hd, dev=dev, dtype=dtype, gen=gen)
    rows_v = randn(blocks * bs, nkv, hd, dev=dev, dtype=dtype, gen=gen)
    seqs = [(20, 11), (8, 1), (2, 3), (0, 1), (0, 1)]  # (cached tokens, rows); the last two: padding rows
    lens, firsts, tables = [], [], []
    for cached, n in seqs:
        table = torch.randperm(blocks, generator=gen)[:blocks // 2].to(torch.int32)
        firsts += [len(lens)] * n
        lens += [cached + i + 1 for i in range(n)]
        tables += [table] * n
    tables, lens = torch.stack(tables), torch.tensor(lens, dtype=torch.int32)
    q = randn(len(lens), nh, hd, dev=dev, dtype=dtype, gen=gen)
    gate = randn(len(lens), nh, hd, dev=dev, dtype=dtype, gen=gen)
    kernel = k["paged_attention_triton"].paged_decode_attention
    args = (q, rows_k, rows_v, tables.to(dev), lens.to(dev), bs, hd ** -0.5)
    unread = torch.tensor([r != f for r, f in enumerate(firsts)])
    garbage = tables.clone()
    garbage[unread] = torch.randint(0, blocks, (int(unread.sum()), garbage.shape[1]), generator=gen, dtype=torch.int32)
    grouped = (q, rows_k, rows_v, garbage.to(dev), *args[4:])
    out = kernel(*grouped, gate=gate, num_splits=4, block_n=16, row_firsts=torch.tensor(firsts, device=dev),
                 group_tile=tile)
    alone = kernel(*args, gate=gate, num_splits=4, block_n=16)
    with torch_only():
        ref = attention_ops.paged_decode_attention(q.cpu().float(), rows_k.cpu().float(), rows_v.cpu().float(),
                                                   tables, lens, bs, hd ** -0.5, gate=gate.cpu().float())
        shared = attention_ops.paged_decode_attention(q.cpu().float(), rows_k.cpu().float(), rows_v.cpu().float(),
                                                      garbage, lens, bs, hd ** -0.5, gate=gate.cpu().float(),
                                                      row_firsts=torch.tensor(firsts))
    assert rel(out, ref) <= max(tol, 2e-5) and rel(alone, ref) <= max(tol, 2e-5)
    assert torch.equal(shared, ref)


@pytest.mark.parametrize("n_exp,top_k", [(256, 8), (10, 3)])  # real routing; non-power-of-two counts
def test_moe_route(env, n_exp, top_k):
    dev, dtype, tol, k, real = env
    logits = randn(5, n_exp, dev=dev, dtype=dtype, gen=torch.Generator().manual_seed(n_exp), scale=3.0)
    weights, experts = k["moe_triton"].route(logits, top_k, dtype)
    with torch_only():
        ref_w, ref_e = moe_ops.moe_route(logits.cpu(), top_k, torch.float32)
    # bf16 logits tie (the 256-expert case twice: inside the top 8 and at the 8th): the kernel takes the first
    # index of a tie and torch.topk may not, so compare the chosen logits, in order, and their distinctness
    chosen = logits.cpu().float().gather(1, experts.cpu().long())
    assert torch.equal(chosen, logits.cpu().float().gather(1, ref_e))
    assert all(len(set(row)) == top_k for row in experts.cpu().tolist())
    assert weights.dtype == dtype and rel(weights, ref_w) < (1e-2 if real else 1e-6)


@pytest.mark.parametrize("shared", [False, True])
def test_moe_combine(env, shared):
    dev, dtype, tol, k, real = env
    gen = torch.Generator().manual_seed(2)
    t, top_k, h = 3, (8 if real else 3), (2048 if real else 96)
    pairs = randn(t * top_k, h, dev=dev, dtype=dtype, gen=gen)
    weights = torch.softmax(torch.randn(t, top_k, generator=gen), -1).to(dev, dtype)
    packed = randn(t, 1 + h, dev=dev, dtype=dtype, gen=gen)  # shared-expert gate logit and output side by side
    gate, out = (packed[:, :1], packed[:, 1:]) if shared else (None, None)
    got = k["moe_triton"].combine(pairs, weights, out, gate)
    with torch_only():
        want = moe_ops.moe_combine(pairs.cpu().float(), weights.cpu().float(), out.cpu().float() if shared else None,
                                   gate.cpu().float() if shared else None)
    assert got.dtype == dtype and rel(got, want) < tol


def test_moe_expert_pairs_by_gemv(env):
    """Few pairs: gate and up of each pair's expert in one GEMV launch, SwiGLU, down, against the loop."""
    dev, dtype, tol, k, real = env
    gen = torch.Generator().manual_seed(3)
    n_exp, hidden, inter, t, top_k = (16, 2048, 512, 2, 8) if real else (4, 64, 32, 2, 2)
    stacks = [randn(n_exp, *shape, dev=dev, dtype=dtype, gen=gen, scale=0.05)
              for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]
    x = randn(t, hidden, dev=dev, dtype=dtype, gen=gen)
    experts = torch.stack([torch.randperm(n_exp, generator=gen)[:top_k] for _ in range(t)]).to(dev)
    got = moe_ops.moe_expert_pairs(x, experts, *stacks)
    g, u, d = (s.cpu().float() for s in stacks)
    want = torch.stack([d[e] @ (torch.nn.functional.silu(g[e] @ x[i].cpu().float()) * (u[e] @ x[i].cpu().float()))
                        for i in range(t) for e in experts[i].tolist()])
    assert got.shape == (t * top_k, hidden) and rel(got, want) < tol


@torch.inference_mode()
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_bf16_model_within_the_exact_paths_bf16_error(env, moe):
    """A whole bf16 model through the kernels (the interpreter rounding as a GPU does) against its fp32 twin:
    within 1.5x the error of the exact path given the same bf16 weights. The chunked delta rule is fla's on
    CUDA only, so its reference runs here; on CUDA, tests/kernels/test_gpu.py checks both."""
    dev, dtype, tol, k, real = env
    if real:
        pytest.skip("on CUDA: tests/kernels/test_gpu.py::test_bf16_gpu_logits_match_fp32_cpu")
    ref_net = random_model(tiny_config(moe), device="cpu", dtype=torch.float32, std=0.08, seed=5)
    net = random_model(tiny_config(moe), device="cpu", dtype=torch.float32, std=0.08, seed=5)
    for name, p in net.named_parameters():
        if p.dim() >= 2 and not name.endswith(".conv"):
            p.data = p.data.to(torch.bfloat16)
    ids = torch.randint(0, ref_net.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = ref_net.logits(ids)
    with torch_only():
        bound = 1.5 * rel(net.logits(ids), ref) + 1e-3
    with bf16_rounding_as_gpu(), fast_path("force"):
        assert rel(net.logits(ids), ref) <= bound


@pytest.mark.parametrize("kernel", ["route", "combine", "gemv", "gemv_glu", "gemv_glu_pipelined", "expert_gemv",
                                    "down_combine", "down_combine_pipelined", "norm_int8", "norm_int8_blocked",
                                    "swiglu_int8", "swiglu_int8_blocked", "gdn_columns", "gdn_columns_bf16_state",
                                    "gdn_finish", "gdn_finish_int8_blocked", "gdn_verify_columns",
                                    "gdn_verify_columns_bf16_state", "gdn_verify_conv", "gdn_verify_columns_keep",
                                    "gdn_verify_conv_keep"])
def test_new_kernels_compile_for_hopper(kernel):
    """The MoE kernels, the one-row GEMV (plain, with the SwiGLU epilogue, for MoE pairs, for the pairs' down
    projections with the combine), the int8-writing norm and SwiGLU (rows in either order) and the two-launch
    DeltaNet decode step, and the two of the DeltaNet verify step (keeping a verify's rows, or a prefill
    graph's one row), the DeltaNet steps' first kernels also on a bf16 state pool, compile to sm_90 (the
    interpreter never runs the compiler). Needs Triton's bundled ptxas, not a GPU."""
    from hf2q.kernels.gdn import decode_triton as gdn_decode_triton
    from hf2q.kernels.gdn import verify_triton as gdn_verify_triton
    from hf2q.kernels.linear import gemv_triton
    from hf2q.kernels.moe import route_triton as moe_triton
    from hf2q.kernels.norm import add_rms_triton as norm_triton
    from hf2q.kernels.activation import swiglu_triton

    ptr, i32 = "*bf16", "i32"
    gemv_sig = dict(x_ptr=ptr, w_ptr=ptr, w2_ptr=ptr, y_ptr=ptr, experts_ptr="*i32", N=i32, n_first=i32, K=i32,
                    rows_per_x=i32, stride_xm=i32, stride_we=i32, stride_wn=i32, stride_ym=i32)
    down_sig = dict(h_ptr=ptr, w_ptr=ptr, experts_ptr="*i32", route_ptr=ptr, hs_ptr=ptr, ws_ptr=ptr, g_ptr=ptr,
                    y_ptr=ptr, N=i32, K=i32, KS=i32, stride_hp=i32, stride_we=i32, stride_wn=i32, stride_hs=i32,
                    stride_wsn=i32, stride_g=i32, stride_ym=i32)
    one_tile = dict(BLOCK_N=1, BLOCK_K=2048, K_TILES=1, STAGES=1, EVEN_K=True)
    fn, sig, const = {
        "route": (moe_triton._route_kernel, dict(logit_ptr=ptr, w_ptr=ptr, e_ptr="*i32", E=i32, stride=i32),
                  dict(TOPK=8, TOPK_P2=8, BLOCK_E=256)),
        "combine": (moe_triton._combine_kernel, dict(y_ptr=ptr, w_ptr=ptr, s_ptr=ptr, g_ptr=ptr, out_ptr=ptr, H=i32,
                                                     s_stride=i32, g_stride=i32), dict(TOPK=8, HAS_SHARED=True, BLOCK=2048)),
        "gemv": (gemv_triton._gemv_kernel, gemv_sig, dict(one_tile, HAS_EXPERTS=False, GLU=False)),
        "gemv_glu": (gemv_triton._gemv_kernel, gemv_sig, dict(one_tile, HAS_EXPERTS=False, GLU=True)),
        "gemv_glu_pipelined": (gemv_triton._gemv_kernel, gemv_sig,
                               dict(BLOCK_N=2, BLOCK_K=256, K_TILES=3, STAGES=3, EVEN_K=False, HAS_EXPERTS=False,
                                    GLU=True)),
        "expert_gemv": (gemv_triton._gemv_kernel, gemv_sig, dict(one_tile, HAS_EXPERTS=True, GLU=True)),
        "down_combine": (gemv_triton._down_combine_kernel, down_sig,
                         dict(one_tile, TOPK=8, KS_TILES=1, EVEN_KS=True, HAS_SHARED=True)),
        "down_combine_pipelined": (gemv_triton._down_combine_kernel, down_sig,
                                   dict(BLOCK_N=2, BLOCK_K=256, K_TILES=2, KS_TILES=3, STAGES=2, EVEN_K=True,
                                        EVEN_KS=False, TOPK=8, HAS_SHARED=True)),
        **{f"norm_int8{suffix}": (norm_triton._add_rms_norm_kernel,
                                  dict(x_ptr=ptr, r_ptr=ptr, w_ptr="*fp32", res_ptr=ptr, y_ptr=ptr, xq_ptr="*i8",
                                       act_ptr="*fp32", N=i32, stride_x=i32, stride_r=i32, stride_res=i32,
                                       stride_y=i32, eps="fp32"),
                                  dict(HAS_R=True, BLOCK=4096, SLICE=512, QUANT=True, BLOCKED=blocked))
           for suffix, blocked in (("", False), ("_blocked", True))},
        **{f"swiglu_int8{suffix}": (swiglu_triton._silu_mul_kernel,
                                    dict(g_ptr=ptr, u_ptr=ptr, o_ptr=ptr, xq_ptr="*i8", act_ptr="*fp32", N=i32,
                                         stride_g=i32, stride_u=i32, stride_o=i32),
                                    dict(BLOCK=2048, QUANT=True, BLOCKED=blocked))
           for suffix, blocked in (("", False), ("_blocked", True))},
        **{f"gdn_columns{suffix}": (
            gdn_decode_triton._gdn_conv_columns_kernel,
            dict(x_ptr=ptr, cw_ptr="*fp32", conv_ptr=ptr, a_ptr=ptr, b_ptr=ptr, A_ptr="*fp32", dtb_ptr="*fp32",
                 state_ptr=state, slot_ptr="*i64", o_ptr="*fp32", ss_ptr="*fp32", stride_x=i32, stride_conv=i32,
                 stride_ab=i32, stride_bb=i32, C=i32, NK=i32, NV=i32, scale="fp32", eps="fp32"),
            dict(DK=128, DV=128, SPLIT=4))
           for suffix, state in (("", "*fp32"), ("_bf16_state", "*bf16"))},
        **{name: (gdn_decode_triton._gdn_conv_finish_kernel,
                  dict(x_ptr=ptr, conv_ptr=ptr, z_ptr=ptr, nw_ptr="*fp32", slot_ptr="*i64", o_ptr="*fp32",
                       ss_ptr="*fp32", out_ptr=ptr, xq_ptr="*i8", act_ptr="*fp32", stride_x=i32, stride_conv=i32,
                       stride_z=i32, stride_out=i32, C=i32, NK=i32, NV=i32, eps="fp32"),
                  dict(DK=128, DV=128, SPLIT=4, QUANT=quant, BLOCKED=quant))
           for name, quant in (("gdn_finish", False), ("gdn_finish_int8_blocked", True))},
        **{f"gdn_verify_columns{suffix}": (
            gdn_verify_triton._verify_columns_kernel,
            dict(x_ptr=ptr, cw_ptr="*fp32", conv_ptr="*fp32", a_ptr=ptr, b_ptr=ptr, A_ptr="*fp32", dtb_ptr="*fp32",
                 state_ptr=state, slot_ptr="*i64", cu_ptr="*i64", o_ptr="*fp32", kept_ptr=state, keep_ptr="*i64",
                 keep_rec_ptr=state, stride_x=i32, stride_conv=i32, stride_ab=i32, stride_bb=i32, C=i32, NK=i32,
                 NV=i32, LIVE=i32, scale="fp32", eps="fp32"), dict(DK=128, DV=128, SPLIT=4, **modes))
           for suffix, modes, state in (("", dict(PREFIXES=3), "*fp32"),
                                        ("_keep", dict(PREFIXES=0, KEEP=True), "*fp32"),
                                        ("_bf16_state", dict(PREFIXES=3, KEEP=True), "*bf16"))},
        **{f"gdn_verify_conv{suffix}": (
            gdn_verify_triton._verify_conv_kernel,
            dict(x_ptr=ptr, conv_ptr="*fp32", slot_ptr="*i64", cu_ptr="*i64", kept_ptr="*fp32", keep_ptr="*i64",
                 keep_conv_ptr="*fp32", stride_x=i32, stride_conv=i32, C=i32), dict(BLOCK=1024, **modes))
           for suffix, modes in (("", dict(PREFIXES=3)), ("_keep", dict(PREFIXES=0, KEEP=True)))},
    }[kernel]
    compile_for_hopper(fn, sig, const, warps=4)


def test_paged_decode_does_not_specialise_the_table_width():
    """The block tables' width (the batch's longest sequence in blocks) is an integer Triton would specialise when it
    is 1 or a multiple of 16; it is not, so a sequence growing past 16 or 32 blocks compiles nothing mid-request (an
    MTP head's eager catch-up did: 0.45 s on an H100). Nor is the row count (1 at batch 1). The GPU test below counts
    the compiled variants."""
    from hf2q.kernels.attention import paged_triton
    assert [p.name for p in paged_triton._paged_decode_kernel.params if p.do_not_specialize] == ["num_rows",
                                                                                                 "stride_bt"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paged_decode_compiles_once_for_every_table_width():
    """Widths 1, 5, 16 and 32 at one configuration leave one compiled variant of the kernel."""
    from hf2q.kernels.attention import paged_triton
    gen = torch.Generator().manual_seed(4)
    nh, nkv, hd, bs, blocks = 16, 4, 256, 16, 40
    rows = [randn(blocks * bs, nkv, hd, dev="cuda", dtype=torch.bfloat16, gen=gen) for _ in range(2)]
    q = randn(1, nh, hd, dev="cuda", dtype=torch.bfloat16, gen=gen)
    variants = []
    for width in (1, 5, 16, 32):
        tables = torch.randperm(blocks, generator=gen)[:width].to(torch.int32).view(1, width).cuda()
        lens = torch.tensor([width * bs - 3], dtype=torch.int32, device="cuda")
        paged_triton.paged_decode_attention(q, *rows, tables, lens, bs, hd ** -0.5, num_splits=32, block_n=64,
                                            num_warps=8)
        variants.append(len(paged_triton._paged_decode_kernel.device_caches[q.device.index][0]))
    assert variants[1:] == variants[:1] * 3, variants


def test_paged_decode_config_setting(monkeypatch):
    """The paged decode kernel's (splits, keys a step, warps): one sequence's measured configuration, the
    batched one for 64, fewer splits the more sequences between, each with its own for a compressed pool; HF2Q_PAGED_DECODE sets one for every batch
    and pool, and malformed values fail loudly at import instead of being ignored."""
    from hf2q.kernels.attention import paged_triton as paged

    monkeypatch.delenv("HF2Q_PAGED_DECODE", raising=False)
    assert paged._config_setting() is None
    monkeypatch.setattr(paged, "CONFIG", None)
    assert paged.config_for(1) == paged.ONE_SEQUENCE and paged.config_for(64) == paged.BATCHED
    assert paged.config_for(1, coded=True) == paged.CODED_ONE_SEQUENCE
    assert paged.config_for(64, coded=True) == paged.CODED_BATCHED
    assert [paged.config_for(b)[0] for b in (2, 3, 4, 5, 8, 16)] == [16, 8, 8, 4, 4, 4]  # about as many programs as one
    monkeypatch.setenv("HF2Q_PAGED_DECODE", "16,64,4")
    assert paged._config_setting() == (16, 64, 4)
    monkeypatch.setattr(paged, "CONFIG", paged._config_setting())
    assert paged.config_for(1) == paged.config_for(64) == paged.config_for(64, coded=True) == (16, 64, 4)
    for bad in ("16,32", "a,b,c", "12,32,4", "8,8,4"):
        monkeypatch.setenv("HF2Q_PAGED_DECODE", bad)
        with pytest.raises(ValueError, match="HF2Q_PAGED_DECODE"):
            paged._config_setting()


def test_grouped_step_splits(monkeypatch):
    """A grouped step's splits keep about GROUPED_PROGRAMS programs (row groups x KV heads x splits), powers of two
    from 4 to 32: a follow-up's 41 rows on the 9B's heads (11 groups of 4 rows, 4 KV heads) and the 35B-A3B's (21
    of 2, 2 KV heads) take 8, 64 verifying sequences of 4 rows the batched decode's 4, a 4-row step 32."""
    from hf2q.kernels.attention import paged_triton as paged

    monkeypatch.setattr(paged, "CONFIG", None)
    assert paged.grouped_config_for(41, rep=4, nkv=4) == (8, *paged.BATCHED[1:])
    assert paged.grouped_config_for(41, rep=8, nkv=2)[0] == 8
    assert paged.grouped_config_for(256, rep=4, nkv=4)[0] == 4 and paged.grouped_config_for(4, rep=4, nkv=4)[0] == 32
    assert paged.grouped_config_for(41, rep=4, nkv=4, coded=True) == (8, *paged.CODED_BATCHED[1:])
    monkeypatch.setattr(paged, "CONFIG", (16, 64, 4))
    assert paged.grouped_config_for(41, rep=4, nkv=4) == (16, 64, 4)


def test_gdn_verify_setting(monkeypatch):
    """HF2Q_GDN_VERIFY sets the verify walk's (column parts, warps); malformed values fail loudly."""
    from hf2q import envs

    monkeypatch.delenv("HF2Q_GDN_VERIFY", raising=False)
    assert envs.gdn_verify() is None
    monkeypatch.setenv("HF2Q_GDN_VERIFY", "8,1")
    assert envs.gdn_verify() == (8, 1)
    for bad in ("8", "a,b", "6,1", "8,0"):
        monkeypatch.setenv("HF2Q_GDN_VERIFY", bad)
        with pytest.raises(ValueError, match="HF2Q_GDN_VERIFY"):
            envs.gdn_verify()
