"""The decode-step kernels: the Triton GEMV against F.linear, and the DeltaNet decode with the causal conv
folded in against the conv + DeltaNet pair it replaces (the choosers' torch versions, and on a GPU
the two Triton kernels too).

Runs on CPU through Triton's interpreter (small odd sizes, fp32), and on a CUDA GPU at 2B/9B sizes in bf16."""
from __future__ import annotations

import copy
import functools
import itertools

import pytest
import torch
import torch.nn.functional as F

from hf2q.kernels import choose
from hf2q.kernels.activation import ops as activation_ops
from hf2q.kernels.gdn import ops as gdn_ops
from hf2q.kernels.linear import ops as linear_ops
from hf2q.kernels.moe import ops as moe_ops
from tests.support.triton_targets import (INTERPRET, TARGETS, bf16_rounding_as_gpu, interpreter_child, randn, rel,
                                          target, torch_only)

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module", params=TARGETS)
def env(request):
    """(device, dtype, real sizes?)"""
    return target(request.param)


test_kernels_under_the_interpreter = interpreter_child(__file__, timeout=600)


# ---- GEMV ---------------------------------------------------------------------------------------------
def _gemv_cases(real: bool):
    """(N, K, config or None for the table/default)."""
    if not real:  # N not a multiple of BLOCK_N, K not a multiple of BLOCK_K, one- and many-tile K loops
        return [(37, 100, None), (37, 100, (8, 32, 4, 1)), (19, 300, (4, 64, 2, 3)), (5, 64, (16, 64, 4, 1)),
                (70, 520, (2, 128, 4, 2)), (70, 520, (32, 128, 4, 2)), (37, 100, (64, 64, 4, 1))]
    from hf2q.bench.gemv import decode_projections
    shapes = {(n, k) for s in ("2b", "9b") for _, n, k, _ in decode_projections(s)}
    return [(n, k, None) for n, k in sorted(shapes)] + [(8224, 2048, (4, 512, 4, 3)), (2048, 6144, (1, 4096, 8, 1)),
                                                        (8224, 2048, (64, 128, 4, 4)), (2048, 6144, (32, 256, 8, 3))]


def test_gemv_bench_refuses_unknown_projection(capsys):
    """`bench.gemv --only` names projections of the chosen shapes; a name none has is an error, not a
    sweep that times nothing."""
    from hf2q.bench import gemv as gemv_bench

    with pytest.raises(SystemExit) as exit_info:
        gemv_bench.main(["--shape", "2b", "--only", "lm_head", "nope"])
    assert exit_info.value.code == 2 and "nope" in capsys.readouterr().err


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv_matches_linear(env, m):
    """Configs are (BLOCK_N, BLOCK_K, warps, stages): the one-row kernel takes any, the 2..4-row kernel
    (tensor cores) needs BLOCK_N >= 16."""
    from hf2q.kernels.linear.gemv_triton import gemv

    dev, dtype, real = env
    gen = torch.Generator().manual_seed(m)
    for n, k, cfg in _gemv_cases(real):
        if cfg is not None and (m == 1) != (cfg[0] < 16):
            continue
        w = randn(n, k, dev=dev, dtype=dtype, gen=gen, scale=0.05)
        x = randn(m, k, dev=dev, dtype=dtype, gen=gen)
        y = gemv(x, w, config=cfg)
        assert y.shape == (m, n) and y.dtype == dtype
        ref = F.linear(x.float(), w.float())
        assert rel(y, ref) <= (1e-2 if real else 1e-5), (n, k, cfg)
        del w


def test_gemv_row_strided_input_and_3d(env):
    """A row-strided x (a slice of a wider buffer) and a [1, m, K] x give the same rows."""
    from hf2q.kernels.linear.gemv_triton import gemv

    dev, dtype, real = env
    gen = torch.Generator().manual_seed(7)
    n, k = (4096, 2048) if real else (33, 96)
    w = randn(n, k, dev=dev, dtype=dtype, gen=gen, scale=0.05)
    wide = randn(3, k + 40, dev=dev, dtype=dtype, gen=gen)
    x = wide[:, 40:]
    ref = F.linear(x.float(), w.float())
    assert rel(gemv(x, w), ref) <= (1e-2 if real else 1e-5)
    y3 = gemv(x.contiguous()[None], w)
    assert y3.shape == (1, 3, n) and rel(y3[0], ref) <= (1e-2 if real else 1e-5)


# ---- wiring: which kernels a fast-path FFN step launches -----------------------------------------------------
def _count_calls(monkeypatch, calls: dict, module, name: str, key: str | None = None) -> None:
    """Count calls of module.name in calls[key or name] (the call still runs)."""
    fn = getattr(module, name)
    key = key or name

    def wrapper(*args, **kwargs):
        calls[key] += 1
        return fn(*args, **kwargs)
    monkeypatch.setattr(module, name, wrapper)


def _exact_ffn(ffn, h):
    """The FFN by the torch references alone (the exact path): a float32 copy on the CPU with Triton off."""
    with torch_only():
        return copy.deepcopy(ffn).cpu().float()(h.cpu().float()).to(h.device, h.dtype)


def _fast_ffn(layer, h, gemv_rows, calls: dict):
    """The layer's FFN on the forced fast path with HF2Q_GEMV=gemv_rows -> (output, the counted calls)."""
    calls.update(dict.fromkeys(calls, 0))
    with choose.fast_path("force"), linear_ops.gemv_switch(gemv_rows):
        return layer.ffn(h), dict(calls)


# ---- the GEMV with the SwiGLU epilogue ----------------------------------------------------------------------
def _swiglu_ref(x, gate_w, up_w):
    """silu(x Wgᵀ) · (x Wuᵀ) in fp32 from the bf16 inputs."""
    x = x.float().cpu()
    return F.silu(x @ gate_w.float().cpu().T) * (x @ up_w.float().cpu().T)


def _assert_bf16_rounding_of(y, want):
    """The kernel rounds its fp32 result once to bf16: each value within one bf16 rounding of the fp32
    reference (2⁻⁸ relative when rounding to nearest as the GPU does, 2⁻⁷ under the interpreter, whose
    conversion truncates), plus 1e-5 · the largest value for fp32 summation-order differences."""
    y, want = y.float().cpu(), want.float()
    err = (y - want).abs()
    bound = (2 ** -7 if INTERPRET else 2 ** -8) * want.abs() + 1e-5 * want.abs().max()
    assert bool((err <= bound).all()), float((err - bound).max())


def _glu_cases(real: bool):
    """(n_first, I, K, config or None for the pack's table/default config)."""
    if not real:  # I not a multiple of BLOCK_N, K not a multiple of BLOCK_K, one- and many-tile K loops
        return [(0, 37, 100, None), (0, 37, 100, (8, 32, 4, 1)), (5, 19, 300, (4, 64, 2, 3)),
                (3, 21, 64, (16, 64, 4, 1)), (9, 6, 520, (2, 128, 4, 2))]
    return [(0, 6144, 2048, None), (257, 512, 2048, None), (0, 6144, 2048, (2, 512, 4, 3))]  # 2B mlp, 35B-A3B moe pack


def test_gemv_glu_matches_swiglu_of_products(env):
    """A pack [n_first rows of other projections; I gate rows; I up rows] at one row of x: the first n_first
    outputs are the plain products, the rest silu(gate)·up from the unrounded fp32 products, rounded
    once to bf16."""
    from hf2q.kernels.linear.gemv_triton import gemv_glu

    dev, _, real = env
    gen = torch.Generator().manual_seed(11)
    for n_first, inter, k, cfg in _glu_cases(real):
        w = randn(n_first + 2 * inter, k, dev=dev, dtype=torch.bfloat16, gen=gen, scale=0.05)
        x = randn(1, k, dev=dev, dtype=torch.bfloat16, gen=gen)
        y = gemv_glu(x, w, n_first, config=cfg)
        assert y.shape == (1, n_first + inter) and y.dtype == torch.bfloat16
        if n_first:
            _assert_bf16_rounding_of(y[:, :n_first], x.float().cpu() @ w[:n_first].float().cpu().T)
        _assert_bf16_rounding_of(y[:, n_first:], _swiglu_ref(x, w[n_first:n_first + inter], w[n_first + inter:]))


def test_expert_gemv_glu_matches_swiglu_of_products(env):
    """MoE pairs with gate and up as separate stacks [E, I, K]: pair p (token p // rows_per_x, expert
    experts[p]) gets silu(x·gate_e)·(x·up_e); several experts, some picked twice, odd I and K."""
    from hf2q.kernels.linear.gemv_triton import expert_gemv

    dev, _, real = env
    gen = torch.Generator().manual_seed(12)
    cases = [(16, 512, 2048, 2, 8, None)] if real else [(5, 37, 100, 3, 2, None), (5, 19, 300, 2, 3, (4, 64, 2, 3)),
                                                         (4, 21, 64, 1, 4, (16, 64, 4, 1))]
    for n_exp, inter, k, t, top_k, cfg in cases:
        gate, up = (randn(n_exp, inter, k, dev=dev, dtype=torch.bfloat16, gen=gen, scale=0.05) for _ in range(2))
        x = randn(t, k, dev=dev, dtype=torch.bfloat16, gen=gen)
        experts = torch.randint(0, n_exp, (t * top_k,), generator=gen, dtype=torch.int32)
        experts[-1] = experts[0]
        y = expert_gemv(x, gate, experts.to(dev), top_k, second=up, config=cfg)
        assert y.shape == (t * top_k, inter) and y.dtype == torch.bfloat16
        want = torch.cat([_swiglu_ref(x[p // top_k][None], gate[e], up[e]) for p, e in enumerate(experts.tolist())])
        _assert_bf16_rounding_of(y, want)


# ---- the experts' down projections, the shared down and the combine in one launch ----------------------------
def _down_combine_ref(h, down, experts, weights, shared_act=None, shared_down=None, shared_gate=None):
    """Σ_k w · (W_e h_pair) (+ sigmoid(g) · (W_s h_s)) in fp32 from the bf16 inputs, on CPU."""
    t, top_k = weights.shape
    h, down, w = h.float().cpu(), down.float().cpu(), weights.float().cpu()
    out = torch.stack([sum(w[i, j] * (down[e] @ h[i * top_k + j]) for j, e in enumerate(experts[i].tolist()))
                       for i in range(t)])
    if shared_act is not None:
        gate = torch.sigmoid(shared_gate.float().cpu())
        out = out + gate * (shared_act.float().cpu() @ shared_down.float().cpu().T)
    return out


def test_expert_down_combine_matches_fp32_sum(env):
    """One launch for the MoE block's end: each pair's down projection weighted by its route weight, plus the
    gated shared expert's down, summed in fp32 and rounded once. Tolerance: one bf16 rounding of the fp32
    reference (_assert_bf16_rounding_of). Tokens 1..3, top-k > 1 with an expert picked twice by one token,
    H (N) not a multiple of BLOCK_N, expert and shared widths (K) not multiples of BLOCK_K and unequal."""
    from hf2q.kernels.linear.gemv_triton import expert_down_combine

    dev, _, real = env
    gen = torch.Generator().manual_seed(13)
    bf = dict(dev=dev, dtype=torch.bfloat16, gen=gen)
    # (experts, H, I, I_shared, top_k, config or None for the default)
    cases = ([(16, 2048, 512, 512, 8, None), (16, 2048, 512, 384, 8, (2, 256, 4, 2))] if real else
             [(5, 37, 100, 70, 3, (8, 32, 4, 1)), (4, 21, 64, 48, 2, (16, 64, 4, 1)), (5, 19, 40, 40, 2, (32, 64, 4, 1)),
              (3, 13, 300, 130, 2, (4, 64, 2, 3))])
    for n_exp, hidden, inter, inter_s, top_k, cfg in cases:
        down = randn(n_exp, hidden, inter, **bf, scale=0.05)
        w_shared = randn(hidden, inter_s, **bf, scale=0.05)
        for t in (1, 2, 3):
            h = randn(t * top_k, inter, **bf)
            experts = torch.stack([torch.randperm(n_exp, generator=gen)[:top_k] for _ in range(t)]).to(torch.int32)
            experts[-1, -1] = experts[-1, 0]
            weights = torch.softmax(torch.randn(t, top_k, generator=gen), -1).to(dev, torch.bfloat16)
            packed = randn(t, 1 + inter_s + 5, **bf)  # gate logit and shared activations as row-strided views
            gate, act = packed[:, :1], packed[:, 1:1 + inter_s]
            experts = experts.to(dev)
            y = expert_down_combine(h, down, experts, weights, config=cfg)
            assert y.shape == (t, hidden) and y.dtype == torch.bfloat16
            _assert_bf16_rounding_of(y, _down_combine_ref(h, down, experts, weights))
            y = expert_down_combine(h, down, experts, weights, act, w_shared, gate, config=cfg)
            _assert_bf16_rounding_of(y, _down_combine_ref(h, down, experts, weights, act, w_shared, gate))


@torch.inference_mode()
def test_moe_down_combine_wiring_at_one_token(env, monkeypatch):
    """On the fast path a bf16 MoE layer at one token whose pairs go through the expert GEMV ends in one
    expert_down_combine launch (no down GEMV, no shared down, no combine kernel) and matches the unfused
    three launches (within 1e-2 relative: those round each pair's and the shared output to bf16 first) and
    the exact path. The unfused path stays where the shared down is not a Triton GEMV, the experts are
    quantized, or there are too many pairs for the GEMV."""
    import dataclasses

    from hf2q.bench_shapes import random_model, tiny_config
    from hf2q.kernels.linear import gemv_triton
    from hf2q.kernels.moe import route_triton as moe_triton
    from hf2q.quant import random_blocks

    dev = env[0]
    calls = dict(expert_down_combine=0, expert_gemv=0, combine=0)
    _count_calls(monkeypatch, calls, gemv_triton, "expert_down_combine")
    _count_calls(monkeypatch, calls, gemv_triton, "expert_gemv")
    _count_calls(monkeypatch, calls, moe_triton, "combine")
    fast_ffn = functools.partial(_fast_ffn, calls=calls)

    fused = {"expert_down_combine": 1, "expert_gemv": 1, "combine": 0}  # expert_gemv: gate+up of the pairs
    unfused = {"expert_down_combine": 0, "expert_gemv": 2, "combine": 1}
    gen = torch.Generator().manual_seed(9)
    cfg = tiny_config(True)
    for shared in (True, False):
        net = random_model(cfg if shared else dataclasses.replace(cfg, shared_expert_intermediate_size=0),
                           device=dev, dtype=torch.bfloat16, std=0.08, seed=5)
        layer = net.layers[0]
        assert (layer.ffn.shared is not None) == shared
        h = randn(1, cfg.hidden_size, dev=dev, dtype=torch.bfloat16, gen=gen)
        exact = _exact_ffn(layer.ffn, h)
        got, n = fast_ffn(layer, h, 1)
        assert n == fused, (shared, n)
        assert rel(got, exact) <= 2e-2, shared
        if shared:  # the shared down by torch/cuBLAS: the three launches
            ref, n0 = fast_ffn(layer, h, 0)
            assert n0 == unfused, n0
            assert rel(got, ref) <= 1e-2
        monkeypatch.setattr(moe_ops, "MOE_GEMV_PAIRS", 1)  # 2 pairs: too many for the GEMV
        many, n = fast_ffn(layer, h, 1)
        monkeypatch.setattr(moe_ops, "MOE_GEMV_PAIRS", 32)
        assert n["expert_down_combine"] == 0 and n["combine"] == 1, n
        assert rel(many, exact) <= 2e-2
    moe = layer.ffn  # quantized experts (Q8_0 blocks, dequantized for the exact path): the int8 mat-vec
    for i, name in enumerate(("gate_exps", "up_exps", "down_exps")):
        e, rows, k = moe.stack_shape(name)
        moe.set_quantized(name, random_blocks("Q8_0", e * rows, k, std=0.05, seed=i).view(e, rows, -1).to(dev), "Q8_0")
    exact = _exact_ffn(moe, h)
    got, n = fast_ffn(layer, h, 1)
    assert n == {"expert_down_combine": 0, "expert_gemv": 0, "combine": 1}, n
    assert rel(got, exact) <= 3e-2


# ---- DeltaNet decode with the causal conv folded in ----------------------------------------------------
def _decode_inputs(dev, dtype, real: bool, nk: int, nv: int, seed: int, d: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    d = d or (128 if real else 16)
    b, s = (4, 9) if real else (3, 6)
    c = 2 * nk * d + nv * d
    slots = torch.tensor([5, 0, 8, 2][:b] if real else [4, 0, 2])
    mixed = randn(b, c, dev=dev, dtype=dtype, gen=gen)
    conv_w = randn(c, 4, dev=dev, dtype=torch.float32, gen=gen, scale=0.5)
    conv_pool = randn(s, 3, c, dev=dev, dtype=torch.float32, gen=gen)
    a_raw, b_raw = randn(b, nv, dev=dev, dtype=dtype, gen=gen), randn(b, nv, dev=dev, dtype=dtype, gen=gen)
    z = randn(b, nv * d, dev=dev, dtype=dtype, gen=gen)
    A = -torch.rand(nv, generator=gen).to(dev) * 8
    dt_bias, norm_w = randn(nv, dev=dev, dtype=torch.float32, gen=gen), randn(d, dev=dev, dtype=torch.float32, gen=gen)
    state = randn(s, nv, d, d, dev=dev, dtype=torch.float32, gen=gen, scale=0.1)
    return dict(x=mixed, conv_w=conv_w, conv_pool=conv_pool, a_raw=a_raw, b_raw=b_raw, A=A, dt_bias=dt_bias, z=z,
                norm_w=norm_w, state_pool=state, slots=slots.to(dev), nk=nk, dk=d, eps=1e-6, out_dtype=torch.float32)


def _on_cpu(args: dict) -> dict:
    """fp32 CPU copies (never views: the pools are updated in place)."""
    return {k: (v.cpu().float().clone() if isinstance(v, torch.Tensor) and v.is_floating_point() else
                v.cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


@pytest.mark.parametrize("heads,config", [((2, 4), None), ((2, 2), None), ((2, 4), (8, 2, 1))] if INTERPRET else
                         [((16, 16), None), ((16, 32), None), ((16, 32), (8, 2, 1))],
                         ids=["nv=2nk", "nv=nk", "nv=2nk-8parts"] if INTERPRET else ["2b", "9b", "9b-8parts"])
def test_fused_conv_gdn_decode_matches_two_step(env, heads, config):
    """Two decode steps in a row (the second reads the conv state the first shifted), over several slots;
    the slots no sequence owns are left alone. Also with another split of each head's columns and other
    warp counts (bench.gdn's configurations)."""
    from hf2q.kernels.gdn.decode_triton import gdn_conv_decode_

    dev, dtype, real = env
    nk, nv = heads
    args = _decode_inputs(dev, dtype, real, nk, nv, seed=nv)
    ref = _on_cpu(args)
    for step in range(2):
        out = gdn_conv_decode_(**args, config=config)
        with torch_only(), choose.fast_path("off"):
            ref_out = gdn_ops.gdn_conv_decode_(**ref)
        tol = 2e-3 if real else 1e-5
        assert rel(out, ref_out) <= tol, step
        assert rel(args["conv_pool"], ref["conv_pool"]) <= 1e-6, step
        assert rel(args["state_pool"], ref["state_pool"]) <= tol, step
        nxt = torch.randn(args["x"].shape, generator=torch.Generator().manual_seed(step))
        args["x"], ref["x"] = nxt.to(dev, dtype), nxt.to(dtype).float()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_fused_conv_gdn_decode_writes_int8_rows(env, qtype):
    """With int8_for, the folded step's second kernel also writes its output's int8 rows (in the row's
    order, or BLOCKED for a K-quant output projection), equal to quantizing the output afterwards: the
    quantized output projection then needs no quantizing launch of its own."""
    from hf2q.kernels.quant import int8_rows as q8
    from hf2q.kernels.gdn.decode_triton import gdn_conv_decode_

    dev, dtype, real = env
    args = _decode_inputs(dev, dtype, real, 2, 8, seed=7, d=None if real else 32)  # 8 heads of 32: 256 wide
    args["out_dtype"] = dtype
    out = gdn_conv_decode_(**args, int8_for=qtype)
    blocked = q8.blocked_for(qtype)
    assert q8._RECENT[0][0]() is out and q8._RECENT[0][2].blocked == blocked
    kept = q8.quantize_rows(out, blocked=blocked)  # found, not recomputed
    assert kept is q8._RECENT[0][2]
    fresh = q8.quantize_rows(out.clone(), blocked=blocked)
    assert torch.equal(kept.xq.cpu(), fresh.xq.cpu())
    assert torch.allclose(kept.act.cpu(), fresh.act.cpu(), rtol=1e-5, atol=1e-6)


needs_cuda = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("heads", [(16, 16), (16, 32)], ids=["2b", "9b"])
@pytest.mark.gpu
@needs_cuda
def test_fused_conv_gdn_decode_matches_two_triton_kernels(heads):
    """The folded kernel against conv_decode_ + gdn_decode_ (the kernels it replaces), same inputs."""
    from hf2q.kernels.conv.decode_triton import conv_decode_
    from hf2q.kernels.gdn.decode_triton import gdn_conv_decode_, gdn_decode_

    nk, nv = heads
    args = _decode_inputs("cuda", torch.bfloat16, True, nk, nv, seed=3)
    conv2, state2 = args["conv_pool"].clone(), args["state_pool"].clone()
    out = gdn_conv_decode_(**args)
    y = conv_decode_(args["x"], args["conv_w"], conv2, args["slots"])
    out2 = gdn_decode_(y, args["a_raw"], args["b_raw"], args["A"], args["dt_bias"], args["z"], args["norm_w"], state2,
                       args["slots"], nk, args["dk"], args["eps"], torch.float32)
    assert torch.equal(args["conv_pool"], conv2)
    assert rel(out, out2) <= 1e-5 and rel(args["state_pool"], state2) <= 1e-6


# ---- DeltaNet verify step: a few rows per sequence on the pools in place -------------------------------
VERIFY_ROWS = [4, 0, 1, 3, 2, 6]  # each live sequence's rows (0: an empty one on the padding slot; 6: a prefill)
VERIFY_SLOTS = [3, 8, 0, 5, 1, 7]
PADDING_ROWS = [3]  # the padding sequence's, last, on the padding slot (8)


def _verify_inputs(dev, dtype, real: bool, seed: int = 0, keep: bool = True,
                   state_dtype: torch.dtype = torch.float32) -> dict:
    """A verify step's arguments; the kept buffers hold 7.0, so rows the step must not write stay so (none
    without `keep`: a prefill graph's step). state_dtype: the recurrent state pool's and its kept buffer's."""
    gen = torch.Generator().manual_seed(seed)
    nk, nv, d = (16, 32, 128) if real else (2, 4, 16)
    c, lens, live = 2 * nk * d + nv * d, VERIFY_ROWS + PADDING_ROWS, len(VERIFY_ROWS)
    t, cu = sum(lens), torch.tensor([0, *itertools.accumulate(lens)])
    slots = torch.tensor(VERIFY_SLOTS + [8] * len(PADDING_ROWS))

    def rand(*shape, dtype=torch.float32, scale=1.0):
        return randn(*shape, dev=dev, dtype=dtype, gen=gen, scale=scale)

    return dict(x=rand(t, c, dtype=dtype), conv_w=rand(c, 4, scale=0.5), conv_pool=rand(9, 3, c),
                a_raw=rand(t, nv, dtype=dtype), b_raw=rand(t, nv, dtype=dtype),
                A=-torch.rand(nv, generator=gen).to(dev) * 8, dt_bias=rand(nv),
                state_pool=rand(9, nv, d, d, scale=0.1).to(state_dtype), slots=slots.to(dev), cu_seqlens=cu.to(dev),
                live=live, kept_conv=torch.full((3 * live * keep, 3, c), 7.0, device=dev),
                kept_rec=torch.full((3 * live * keep, nv, d, d), 7.0, device=dev, dtype=state_dtype), nk=nk, dk=d,
                eps=1e-6)


@pytest.mark.parametrize("keep,config", [(True, None), (False, None), (True, (8, 1))],
                         ids=["verify", "prefill", "verify-one-warp"])
def test_gdn_verify_matches_reference(env, keep, config):
    """The verify kernel against its reference, mixed row counts (0..6) and padding: the read-outs (zeros on
    padding rows), every slot's recurrent and conv state after the step, and every row of the kept buffers
    (the states after each kept position; the rest untouched); also with another split of the columns on one
    warp (bench.gdn's alternatives)."""
    from hf2q.kernels.gdn.verify_triton import gdn_verify_

    dev, dtype, real = env
    args = _verify_inputs(dev, dtype, real, keep=keep)
    ref = _on_cpu(args)
    o = gdn_verify_(**args, config=config)
    ref_o = gdn_ops.gdn_verify_reference(**ref)
    tol = 2e-3 if real else 1e-5
    assert rel(o, ref_o) <= tol and not o[sum(VERIFY_ROWS):].any()
    assert torch.equal(args["conv_pool"].cpu(), ref["conv_pool"])
    assert torch.equal(args["kept_conv"].cpu(), ref["kept_conv"])
    assert rel(args["state_pool"], ref["state_pool"]) <= tol
    assert rel(args["kept_rec"], ref["kept_rec"]) <= tol if keep else args["kept_rec"].numel() == 0


@pytest.mark.parametrize("at", [(3, 1), (5, 5), (1, 0)], ids=["inner-row", "last-row", "empty-sequence"])
def test_gdn_verify_keeps_one_row_as_reference(env, at):
    """The keep mode (a prefill graph's checkpoint inside a chunk) against the reference: the keep buffers get
    the states after row t of sequence i (untouched where that sequence has no such row), and everything else
    the step writes is bitwise what it writes without a keep."""
    from hf2q.kernels.gdn.verify_triton import gdn_verify_

    dev, dtype, real = env
    args = _verify_inputs(dev, dtype, real, keep=at[0] == 3)  # with the verify buffers too, and without
    plain, ref = copy.deepcopy(args), _on_cpu(args)
    nv, d, c = args["state_pool"].shape[1], args["dk"], args["x"].shape[1]
    keep = (torch.tensor(at, device=dev), torch.full((3, c), 7.0, device=dev), torch.full((nv, d, d), 7.0, device=dev))
    ref_keep = tuple(x.cpu().clone() for x in keep)
    o, o_plain = gdn_verify_(**args, keep=keep), gdn_verify_(**plain)
    ref_o = gdn_ops.gdn_verify_reference(**ref, keep=ref_keep)
    assert torch.equal(o, o_plain)
    for name in ("conv_pool", "state_pool", "kept_conv", "kept_rec"):
        assert torch.equal(args[name], plain[name]), name
    tol = 2e-3 if real else 1e-5
    assert rel(o, ref_o) <= tol and torch.equal(keep[1].cpu(), ref_keep[1]) and rel(keep[2], ref_keep[2]) <= tol
    written = VERIFY_ROWS[at[0]] > at[1]
    assert (ref_keep[2] != 7.0).all() == written and (ref_keep[1] != 7.0).any() == written


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gdn_verify_reference_is_plain_decoding(state_dtype):
    """The verify reference against one-row decode steps (the decode step's torch version) of each sequence:
    each row's gated-normed read-out, the state kept after each row but the last (up to 3), the slot's
    states after the last; the padding slot and the kept rows no position fills are left alone. On a bf16
    pool too, where each decode step rounds the state it stores: the verify rounds after every row."""
    from hf2q.kernels.norm import reference as norm_ref

    args = _verify_inputs("cpu", torch.float32, False, seed=1, state_dtype=state_dtype)
    nv, d = args["state_pool"].shape[1], args["dk"]
    gen = torch.Generator().manual_seed(2)
    z, norm_w = torch.randn(args["x"].shape[0], nv * d, generator=gen), torch.randn(d, generator=gen)
    plain = copy.deepcopy(args)
    with torch_only(), choose.fast_path("off"):
        o = gdn_ops.gdn_verify_(**args)
        got = norm_ref.gated_rms_norm(o, z, norm_w, args["eps"], torch.float32)
        kept_conv, kept_rec = torch.full_like(args["kept_conv"], 7.0), torch.full_like(args["kept_rec"], 7.0)
        cu = args["cu_seqlens"].tolist()
        for i, slot in enumerate(VERIFY_SLOTS):
            for t, row in enumerate(range(cu[i], cu[i + 1])):
                one = slice(row, row + 1)
                want = gdn_ops.gdn_conv_decode_(plain["x"][one], plain["conv_w"], plain["conv_pool"],
                                                plain["a_raw"][one], plain["b_raw"][one], plain["A"], plain["dt_bias"],
                                                z[one], norm_w, plain["state_pool"], torch.tensor([slot]),
                                                plain["nk"], d, plain["eps"], torch.float32)
                assert rel(got[one], want) <= 1e-5, (i, t)
                if t < min(VERIFY_ROWS[i] - 1, 3):
                    kept_conv[3 * i + t], kept_rec[3 * i + t] = plain["conv_pool"][slot], plain["state_pool"][slot]
    assert torch.equal(args["conv_pool"], plain["conv_pool"]) and torch.equal(args["kept_conv"], kept_conv)
    if state_dtype == torch.float32:
        assert rel(args["state_pool"], plain["state_pool"]) <= 1e-6 and rel(args["kept_rec"], kept_rec) <= 1e-6
    else:
        _rounded_alike(args["state_pool"], plain["state_pool"])
        _rounded_alike(args["kept_rec"], kept_rec)
    assert not o[sum(VERIFY_ROWS):].any()


# ---- a bf16 state pool: fp32 arithmetic, the state rounded once as it is stored --------------------------------
def _rounded_alike(got: torch.Tensor, want: torch.Tensor) -> None:
    """Two bf16 states from the same fp32 arithmetic in another summation order: equal, but for rare one-unit
    flips of values the order moved across a rounding boundary (at most 1 in 100 values, none by more)."""
    assert got.dtype == want.dtype == torch.bfloat16
    got, want = got.cpu().float(), want.cpu().float()
    assert bool(((got - want).abs() <= 2 ** -7 * want.abs() + 1e-30).all()), float((got - want).abs().max())
    assert (got == want).float().mean().item() >= 0.99, (got == want).float().mean().item()


@pytest.mark.parametrize("heads", [(2, 4)] if INTERPRET else [(16, 32)], ids=["nv=2nk"] if INTERPRET else ["9b"])
def test_gdn_steps_on_a_bf16_state_round_once(env, heads):
    """On a bf16 state pool the fused decode step loads the state, updates it in fp32 and rounds it once to bf16
    as it stores it: its states are the fp32 reference's from the same bf16 states, rounded (to nearest even, as
    torch and the GPU round), its read-outs the reference's. The verify step's slot and kept states are those of
    its reference on bf16 pools, which rounds after every row as bf16 decode steps do
    (test_gdn_verify_reference_is_plain_decoding); its kept buffers are bf16 too."""
    from hf2q.kernels.gdn.decode_triton import gdn_conv_decode_
    from hf2q.kernels.gdn.verify_triton import gdn_verify_

    dev, dtype, real = env
    tol = 2e-3 if real else 1e-5
    args = _decode_inputs(dev, dtype, real, *heads, seed=5)
    args["state_pool"] = args["state_pool"].to(torch.bfloat16)
    ref = _on_cpu(args)  # fp32 copies of the bf16 states (exact)
    with bf16_rounding_as_gpu():
        out = gdn_conv_decode_(**args)
    with torch_only(), choose.fast_path("off"):
        ref_out = gdn_ops.gdn_conv_decode_(**ref)
    assert rel(out, ref_out) <= tol and torch.equal(args["conv_pool"].cpu(), ref["conv_pool"])
    _rounded_alike(args["state_pool"], ref["state_pool"].to(torch.bfloat16))

    args = _verify_inputs(dev, dtype, real, seed=6, state_dtype=torch.bfloat16)
    ref = {**_on_cpu(args), "state_pool": args["state_pool"].cpu().clone(), "kept_rec": args["kept_rec"].cpu().clone()}
    with bf16_rounding_as_gpu():
        o = gdn_verify_(**args)
    ref_o = gdn_ops.gdn_verify_reference(**ref)
    assert rel(o, ref_o) <= tol and torch.equal(args["kept_conv"].cpu(), ref["kept_conv"])
    _rounded_alike(args["state_pool"], ref["state_pool"])
    _rounded_alike(args["kept_rec"], ref["kept_rec"])


# ---- the GEMV in the model -------------------------------------------------------------------------------
def test_default_gemv_serves_only_shapes_measured_faster():
    from hf2q.kernels.linear import gemv_triton

    faster = [key for key, (_, ours, cublas) in gemv_triton.TABLE.items() if ours < cublas]
    slower = [key for key, (_, ours, cublas) in gemv_triton.TABLE.items() if ours >= cublas]
    assert faster and slower
    assert all(gemv_triton.measured_faster(*key) for key in faster)
    assert not any(gemv_triton.measured_faster(*key) for key in slower)
    assert gemv_triton.measured_faster(2048, 2048, 1) and not gemv_triton.measured_faster(2048, 2048, 3)
    assert not gemv_triton.measured_faster(4096, 4096, 1)  # a 9B shape: never measured, cuBLAS



@pytest.mark.gpu
@needs_cuda
@torch.inference_mode()
def test_dispatch_linear_and_model_logits_with_gemv():
    """HF2Q_GEMV's path: linear_ops.linear takes the GEMV for bf16 products of at most the switch's rows, and
    a bf16 model's logits for 1 and 3 tokens (every projection and the tied head through the GEMV) match
    the cuBLAS ones."""
    from hf2q.bench_shapes import random_model, tiny_config
    from hf2q.kernels.linear.gemv_triton import gemv

    w = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)
    for m in (1, 3, 5):
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        with linear_ops.gemv_switch(4):
            assert torch.equal(linear_ops.linear(x, w), gemv(x, w) if m <= 4 else F.linear(x, w))
            logits = linear_ops.linear(x, w, torch.float32)
            assert logits.dtype == torch.float32 and rel(logits, F.linear(x.float(), w.float())) <= 1e-2
        with linear_ops.gemv_switch(1):
            assert torch.equal(linear_ops.linear(x, w), gemv(x, w) if m == 1 else F.linear(x, w))
        with linear_ops.gemv_switch(0):
            assert torch.equal(linear_ops.linear(x, w), F.linear(x, w))
        with linear_ops.gemv_switch("measured"):  # the default: only shapes the table has as faster
            assert torch.equal(linear_ops.linear(x, w), F.linear(x, w))
    w2b = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)  # 2B gdn.out: GEMV measured faster
    x1 = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    with linear_ops.gemv_switch("measured"):
        assert torch.equal(linear_ops.linear(x1, w2b), gemv(x1, w2b))
    net = random_model(tiny_config(), tie=True, device="cuda", dtype=torch.bfloat16, std=0.05, seed=1)
    for ids in ([5], [5, 17, 300]):
        with linear_ops.gemv_switch(0):
            ref = net.logits(ids)
        with linear_ops.gemv_switch(4):
            got = net.logits(ids)
        assert got.dtype == torch.float32 and rel(got, ref) <= 2e-2


@torch.inference_mode()
def test_swiglu_epilogue_wiring_at_one_row(env, monkeypatch):
    """On the fast path, a one-row gate+up product that the GEMV serves ends in its SwiGLU epilogue: the
    dense MLP and the MoE layer (the shared expert's gate+up in the router's pack, the experts through
    the pairs GEMV) match the exact path and the unfused one, with no separate SiLU-mul launch. Two rows,
    a pack the table has cuBLAS faster for, and an int8-reading down projection keep product + silu_mul."""
    from hf2q.bench_shapes import random_model, tiny_config
    from hf2q.kernels.linear import gemv_triton

    dev = env[0]
    calls = dict(glu=0, silu_mul=0)
    _count_calls(monkeypatch, calls, gemv_triton, "gemv_glu", "glu")
    _count_calls(monkeypatch, calls, activation_ops, "silu_mul")
    fast_ffn = functools.partial(_fast_ffn, calls=calls)
    if INTERPRET:  # 16 rows per program instead of 1: a sixteenth of the programs to interpret
        one_row = gemv_triton.default_config
        monkeypatch.setattr(gemv_triton, "default_config", lambda n, k, m: (16, *one_row(n, k, m)[1:]) if m == 1
                            else one_row(n, k, m))

    gen = torch.Generator().manual_seed(6)
    for moe in (False, True):
        net = random_model(tiny_config(moe), device=dev, dtype=torch.bfloat16, std=0.08, seed=5)
        layer, hidden = net.layers[0], net.config.hidden_size
        for rows in (1, 2):
            h = randn(rows, hidden, dev=dev, dtype=torch.bfloat16, gen=gen)
            exact = _exact_ffn(layer.ffn, h)
            got, n = fast_ffn(layer, h, 1)
            unfused, n0 = fast_ffn(layer, h, 0)  # every product by torch/cuBLAS: product, then silu_mul
            assert rel(got, exact) <= 2e-2 and rel(got, unfused) <= 2e-2, (moe, rows)
            assert n0 == {"glu": 0, "silu_mul": 1}
            assert n == ({"glu": 1, "silu_mul": 0} if rows == 1 else {"glu": 0, "silu_mul": 1}), (moe, rows)
        # The default: only packs the table has as faster go to the GEMV, and with it to the epilogue.
        pack = (8 + 1 + 2 * 48) if moe else 2 * 96
        for gemv_us, cublas_us, fused in ((1.0, 2.0, True), (2.0, 1.0, False)):
            monkeypatch.setitem(gemv_triton.TABLE, (pack, hidden, 1), ((16, 64, 4, 1), gemv_us, cublas_us))
            _, n = fast_ffn(layer, h[:1], "measured")
            assert n == ({"glu": 1, "silu_mul": 0} if fused else {"glu": 0, "silu_mul": 1}), (moe, fused)
    mlp = random_model(tiny_config(), device=dev, dtype=torch.bfloat16, std=0.08, seed=5).layers[0].ffn
    calls.update(glu=0, silu_mul=0)
    with linear_ops.gemv_switch(1):  # the down projection reads int8 groups that only silu_mul writes
        (act,) = linear_ops.packed_swiglu(h[:1], (mlp.gate, mlp.up), int8_for="Q8_0")
    assert calls == {"glu": 0, "silu_mul": 1} and act.shape == (1, 96)
