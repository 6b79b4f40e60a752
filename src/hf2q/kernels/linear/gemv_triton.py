"""Triton bf16 GEMV / skinny GEMM y = x Wᵀ for at most 4 rows of x (decode at batch ≤ 4).

At M = 1 cuBLAS picks split-K tiles for most projections and adds a reduce kernel after them. Here each
program owns BLOCK_N rows of W and walks all of K in BLOCK_K-wide tiles (16-byte loads along the
contiguous rows of W), accumulating in fp32, so one launch writes the output and nothing is reduced
afterwards. One row of x runs on the CUDA cores; 2..4 rows on the tensor cores (x padded to 16 rows),
since the CUDA cores' multiply-adds per W element grow with the rows and a 4-row CUDA-core version
measured twice as slow as cuBLAS. The configuration of an (N, K) comes from `TABLE` (filled from
`python -m hf2q.bench.gemv`), else from `default_config`. STAGES > 1 software-pipelines the K
loop (asynchronous copies into shared memory), which pays only when a program walks many K tiles. The
K loop's trip count is a compile-time constant: one compilation per K of the model, a handful.

At one row the SwiGLU after a gate+up product can run as the kernel's epilogue (GLU: `gemv_glu` for a
dense pack, `expert_gemv` with two stacks for MoE pairs): each program multiplies BLOCK_N gate rows and
the matching BLOCK_N up rows over the same x tiles and writes silu(gate)·up, so neither product is
stored and no activation kernel is launched after it.

A MoE block's end at few pairs is one launch too (`expert_down_combine`): a program takes BLOCK_N output
columns of one token and walks its k pairs' down rows (and the shared expert's), weighting each product
in fp32, so neither the pair outputs nor the shared output are stored and no combine kernel follows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf2q.kernels.tuning import pdl

MAX_ROWS = 4

Config = tuple[int, int, int, int]  # (BLOCK_N, BLOCK_K, num_warps, STAGES)

# (N, K, 1 for one row of x or MAX_ROWS for 2..MAX_ROWS rows) -> (Config, GEMV µs, cuBLAS µs), from
# `bench.gemv` on an H200 (2B: full sweep; 35B-A3B: `--quick`, its LM head shares the 2B entries). By default the GEMV serves exactly the entries where it measured faster.
TABLE: dict[tuple[int, int, int], tuple[Config, float, float]] = {
    (8224, 2048, 1): ((2, 2048, 8, 1), 9.7, 11.3),  # 2b gdn.qkv+z+a+b
    (2048, 2048, 1): ((1, 2048, 4, 1), 4.1, 6.1),  # 2b gdn.out, attn.o
    (5120, 2048, 1): ((2, 2048, 8, 1), 6.9, 8.1),  # 2b attn.q+g+k+v
    (12288, 2048, 1): ((1, 2048, 4, 1), 13.6, 15.4),  # 2b mlp.gate+up
    (2048, 6144, 1): ((1, 2048, 4, 1), 7.8, 11.4),  # 2b mlp.down
    (248320, 2048, 1): ((2, 1024, 4, 1), 224.0, 254.8),  # 2b lm_head
    (8224, 2048, 4): ((64, 256, 4, 3), 11.5, 11.1),  # 2b gdn.qkv+z+a+b
    (2048, 2048, 4): ((64, 128, 4, 5), 6.1, 6.1),  # 2b gdn.out, attn.o
    (5120, 2048, 4): ((64, 128, 4, 5), 8.8, 8.1),  # 2b attn.q+g+k+v
    (12288, 2048, 4): ((64, 128, 4, 5), 16.7, 15.8),  # 2b mlp.gate+up
    (2048, 6144, 4): ((64, 128, 4, 5), 13.6, 11.5),  # 2b mlp.down
    (248320, 2048, 4): ((64, 128, 4, 5), 239.6, 250.2),  # 2b lm_head
    (12352, 2048, 1): ((1, 2048, 4, 1), 13.6, 16.1),  # 35b-a3b gdn.qkv+z+a+b
    (12352, 2048, 4): ((64, 128, 4, 5), 17.4, 16.2),  # 35b-a3b gdn.qkv+z+a+b
    (2048, 4096, 1): ((2, 2048, 4, 1), 6.0, 9.2),  # 35b-a3b gdn.out
    (2048, 4096, 4): ((64, 128, 4, 5), 10.3, 9.3),  # 35b-a3b gdn.out
    (9216, 2048, 1): ((1, 2048, 4, 1), 10.7, 11.9),  # 35b-a3b attn.q+g+k+v
    (9216, 2048, 4): ((64, 128, 4, 5), 14.3, 12.0),  # 35b-a3b attn.q+g+k+v
    (1281, 2048, 1): ((1, 2048, 4, 1), 3.3, 4.4),  # 35b-a3b moe.router+shared
    (1281, 2048, 4): ((64, 128, 4, 5), 5.9, 11.8),  # 35b-a3b moe.router+shared
    (2048, 512, 1): ((2, 1024, 4, 1), 2.6, 3.7),  # 35b-a3b moe.shared.down
    (2048, 512, 4): ((64, 128, 4, 5), 3.2, 3.7),  # 35b-a3b moe.shared.down
}


# The MoE kernels at one token: (kind, N, K) -> (Config, µs at that configuration, µs at the default), from
# `bench.gemv --moe` on an H200. "glu": the pairs' gate and up rows (expert_gemv with two stacks: N the
# expert width, K the hidden size); "down": the pairs' down rows with the shared expert's and the combine
# (expert_down_combine: N the hidden size, K the expert width).
EXPERT_TABLE: dict[tuple[str, int, int], tuple[Config, float, float]] = {
    ("glu", 512, 2048): ((1, 2048, 1, 1), 9.83, 10.29),  # 35b-a3b
    ("down", 2048, 512): ((4, 256, 2, 1), 6.76, 8.42),  # 35b-a3b
}


@triton.jit
def _load(ptrs, k_ok, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=k_ok, other=0.0)


@triton.jit
def _dot_rows(w_ptrs, x_ptrs, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
              STAGES: tl.constexpr, EVEN_K: tl.constexpr):
    """BLOCK_N rows of W times x, both as [BLOCK_N, BLOCK_K] pointer tiles at K offset 0 -> fp32 [BLOCK_N]."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for t in tl.range(0, K_TILES, num_stages=STAGES):
        k_ok = (t * BLOCK_K + ks < K)[None, :]
        w_tile = _load(w_ptrs, k_ok, EVEN_K).to(tl.float32)
        acc += tl.sum(w_tile * _load(x_ptrs, k_ok, EVEN_K).to(tl.float32), 1)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def _dot_tiles(w_ptrs, x_ptrs, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
               STAGES: tl.constexpr, EVEN_K: tl.constexpr):
    """_dot_rows before its reduction: the fp32 products of every K tile summed elementwise [BLOCK_N, BLOCK_K].
    A caller that adds several such products reduces once, so no cross-warp reduction (and its barrier)
    stands between one product's loads and the next's."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for t in tl.range(0, K_TILES, num_stages=STAGES):
        k_ok = (t * BLOCK_K + ks < K)[None, :]
        acc += _load(w_ptrs, k_ok, EVEN_K).to(tl.float32) * _load(x_ptrs, k_ok, EVEN_K).to(tl.float32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def _dot_row_pairs(g_ptrs, u_ptrs, x_ptrs, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
                   STAGES: tl.constexpr, EVEN_K: tl.constexpr):
    """_dot_rows of two weights' rows over the same x tiles (each x tile loaded once) -> (fp32, fp32)."""
    ks = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for t in tl.range(0, K_TILES, num_stages=STAGES):
        k_ok = (t * BLOCK_K + ks < K)[None, :]
        x_tile = _load(x_ptrs, k_ok, EVEN_K).to(tl.float32)
        acc_g += tl.sum(_load(g_ptrs, k_ok, EVEN_K).to(tl.float32) * x_tile, 1)
        acc_u += tl.sum(_load(u_ptrs, k_ok, EVEN_K).to(tl.float32) * x_tile, 1)
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc_g, acc_u


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, w2_ptr, y_ptr, experts_ptr, N, n_first, K, rows_per_x, stride_xm, stride_we, stride_wn,
                 stride_ym, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, STAGES: tl.constexpr,
                 EVEN_K: tl.constexpr, HAS_EXPERTS: tl.constexpr, GLU: tl.constexpr, PDL: tl.constexpr = False):
    """One row of x: multiply-adds on the CUDA cores, one reduction over K per tile.

    HAS_EXPERTS (MoE token-expert pairs): program column p multiplies x row p // rows_per_x by expert
    experts[p] of stacked weights [E, rows, K] into output row p.
    GLU (SwiGLU in the epilogue, so gate and up never reach memory and no activation kernel follows):
    output columns n_first + j (j < N - n_first) are silu(g)·u with g from row n_first + j of w and u
    from row j of w2; the first cdiv(n_first, BLOCK_N) programs write columns 0..n_first from the
    first rows of w as usual (a pack's other projections). PDL (kernels/tuning/pdl.py): wait for the previous
    kernel before the first read; the next may start once the products are done."""
    pdl.wait_prior(PDL)
    x_row = x_ptr
    y_row = y_ptr
    w = w_ptr
    w2 = w2_ptr
    if HAS_EXPERTS:
        p = tl.program_id(1)
        expert = tl.load(experts_ptr + p).to(tl.int64) * stride_we
        w += expert
        w2 += expert
        x_row += (p // rows_per_x).to(tl.int64) * stride_xm
        y_row += p.to(tl.int64) * stride_ym
    lanes = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # x is re-read in W's own layout (from L1): no shuffle of x through shared memory every tile.
    x_ptrs = x_row + (lanes * 0)[:, None] + ks[None, :]
    n_plain = N
    glu_program = False
    if GLU:
        n_plain = n_first
        glu_program = tl.program_id(0) >= tl.cdiv(n_first, BLOCK_N)
    if glu_program:
        j = (tl.program_id(0) - tl.cdiv(n_first, BLOCK_N)) * BLOCK_N + lanes
        n_glu = N - n_first
        j_ok = tl.minimum(j, n_glu - 1)  # as below: rows past the last re-read it, only the store is masked
        g_ptrs = w + (n_first + j_ok).to(tl.int64)[:, None] * stride_wn + ks[None, :]
        u_ptrs = w2 + j_ok.to(tl.int64)[:, None] * stride_wn + ks[None, :]
        g, u = _dot_row_pairs(g_ptrs, u_ptrs, x_ptrs, K, BLOCK_N, BLOCK_K, K_TILES, STAGES, EVEN_K)
        pdl.release_next(PDL)
        tl.store(y_row + n_first + j, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=j < n_glu)
    else:
        cols = tl.program_id(0) * BLOCK_N + lanes
        # Rows past the weight's last re-read that row so W's loads need no row mask; only the stores are masked.
        w_ptrs = w + tl.minimum(cols, n_plain - 1).to(tl.int64)[:, None] * stride_wn + ks[None, :]
        acc = _dot_rows(w_ptrs, x_ptrs, K, BLOCK_N, BLOCK_K, K_TILES, STAGES, EVEN_K)
        pdl.release_next(PDL)
        tl.store(y_row + cols, acc.to(y_ptr.dtype.element_ty), mask=cols < n_plain)


@triton.jit
def _down_combine_kernel(h_ptr, w_ptr, experts_ptr, route_ptr, hs_ptr, ws_ptr, g_ptr, y_ptr, N, K, KS, stride_hp,
                         stride_we, stride_wn, stride_hs, stride_wsn, stride_g, stride_ym, TOPK: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
                         KS_TILES: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr, EVEN_KS: tl.constexpr,
                         HAS_SHARED: tl.constexpr, PDL: tl.constexpr = False):
    """Program (BLOCK_N output columns, token t): the MoE block's last step at once, in fp32,
    Σ_j route[t, j] · (down_exps[experts[t, j]] · h[t·TOPK + j]) + sigmoid(g[t]) · (W_shared · hs[t]),
    stored once. Neither the pair outputs nor the shared output reach memory, and no combine kernel follows.
    The weighted products are summed elementwise and reduced once at the end (_dot_tiles), so every
    expert's weight loads can be in flight together."""
    pdl.wait_prior(PDL)
    t = tl.program_id(1)
    lanes = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    cols = tl.program_id(0) * BLOCK_N + lanes
    rows = tl.minimum(cols, N - 1).to(tl.int64)[:, None]  # rows past the last re-read it; only the store is masked
    x_cols = (lanes * 0)[:, None] + ks[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        p = t * TOPK + j
        expert = tl.load(experts_ptr + p).to(tl.int64)
        route = tl.load(route_ptr + p).to(tl.float32)
        w_ptrs = w_ptr + expert * stride_we + rows * stride_wn + ks[None, :]
        x_ptrs = h_ptr + p.to(tl.int64) * stride_hp + x_cols
        acc += route * _dot_tiles(w_ptrs, x_ptrs, K, BLOCK_N, BLOCK_K, K_TILES, STAGES, EVEN_K)
    if HAS_SHARED:
        gate = tl.sigmoid(tl.load(g_ptr + t.to(tl.int64) * stride_g).to(tl.float32))
        w_ptrs = ws_ptr + rows * stride_wsn + ks[None, :]
        x_ptrs = hs_ptr + t.to(tl.int64) * stride_hs + x_cols
        acc += gate * _dot_tiles(w_ptrs, x_ptrs, KS, BLOCK_N, BLOCK_K, KS_TILES, STAGES, EVEN_KS)
    pdl.release_next(PDL)
    out = tl.sum(acc, 1)
    tl.store(y_ptr + t.to(tl.int64) * stride_ym + cols, out.to(y_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr,
                   PDL: tl.constexpr = False):
    """2..16 rows of x: W tile [BLOCK_N, BLOCK_K] times xᵀ [BLOCK_K, 16] on the tensor cores, so each W
    element costs no CUDA-core work per row of x."""
    pdl.wait_prior(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    ms = tl.arange(0, 16)
    w_ptrs = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn + cols[None, :]
    # Rows of x past M repeat row M-1 (their outputs are never stored), so x's loads need no row mask either.
    x_ptrs = x_ptr + tl.minimum(ms, M - 1)[None, :] * stride_xm + cols[:, None]  # xᵀ [BLOCK_K, 16]
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for t in tl.range(0, K_TILES, num_stages=STAGES):
        k_ok = t * BLOCK_K + cols < K
        acc = tl.dot(_load(w_ptrs, k_ok[None, :], EVEN_K), _load(x_ptrs, k_ok[:, None], EVEN_K), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    pdl.release_next(PDL)
    y_ptrs = y_ptr + ms[None, :] * stride_ym + rows[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows < N)[:, None] & (ms < M)[None, :])


def default_config(n: int, k: int, m: int) -> Config:
    """The configuration of a shape the table lacks. One row: one or two rows of W per program over K
    tiles of up to 2048 (the 2B sweep's winners: many small programs, each loading its whole strip at
    once). Several rows: 64 rows of W per program over 5-stage pipelined K tiles of 128 (the 2B sweep's
    winner at 2 and 4 rows on every shape but one)."""
    if m == 1:
        return (2 if n >= 65536 else 1), min(2048, triton.next_power_of_2(k)), 4, 1
    return 64, min(128, triton.next_power_of_2(k)), 4, 5


def _entry(n: int, k: int, m: int):
    return TABLE.get((n, k, 1 if m == 1 else MAX_ROWS))


def pick_config(n: int, k: int, m: int) -> Config:
    entry = _entry(n, k, m)
    return entry[0] if entry else default_config(n, k, m)


def measured_faster(n: int, k: int, m: int) -> bool:
    """Whether the table holds this shape with the GEMV faster than cuBLAS on the device."""
    entry = _entry(n, k, m)
    return entry is not None and entry[1] < entry[2]


def expert_config(kind: str, n: int, k: int) -> Config:
    """The measured configuration of a MoE kernel at one token (EXPERT_TABLE), else the one-row default."""
    entry = EXPERT_TABLE.get((kind, n, k))
    return entry[0] if entry else default_config(n, k, 1)


def _meta(k: int, config: Config) -> dict:
    block_n, block_k, num_warps, stages = config
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, K_TILES=triton.cdiv(k, block_k), STAGES=stages,
                EVEN_K=k % block_k == 0, num_warps=num_warps)


def gemv(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None,
         config: Config | None = None) -> torch.Tensor:
    """x [..., K] with 1..4 rows in all, weight [N, K] with contiguous rows -> x Wᵀ [..., N] in out_dtype
    (default x's dtype). `config` overrides the table (the bench sweeps it)."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    assert 1 <= m <= MAX_ROWS, f"gemv takes 1..{MAX_ROWS} rows, got {m}"
    assert weight.shape[1] == k and weight.stride(1) == 1 and x2.stride(1) == 1
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    meta = _meta(k, config or pick_config(n, k, m))
    grid = (triton.cdiv(n, meta["BLOCK_N"]),)
    if m == 1:
        _gemv_kernel[grid](x2, weight, weight, y, weight, n, n, k, 1, 0, 0, weight.stride(0), 0, HAS_EXPERTS=False,
                           GLU=False, **meta, **pdl.launch_options(x.device))
    else:
        _skinny_kernel[grid](x2, weight, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0), **meta,
                             **pdl.launch_options(x.device))
    return y.view(*x.shape[:-1], n)


def gemv_glu(x: torch.Tensor, weight: torch.Tensor, n_first: int = 0, config: Config | None = None) -> torch.Tensor:
    """One row x [..., K] times a pack weight [n_first + 2I, K] (n_first rows of other projections, then
    I gate rows, then I up rows) -> [..., n_first + I] in x's dtype: the first n_first products, then
    silu(gate)·up computed in fp32 from unrounded products (the SwiGLU as the GEMV's epilogue). The
    configuration is the whole pack's (table or default): a program covers BLOCK_N gate and BLOCK_N up rows."""
    k = x.shape[-1]
    rows = weight.shape[0]
    inter = (rows - n_first) // 2
    x2 = x.reshape(-1, k)
    assert x2.shape[0] == 1 and inter > 0 and n_first + 2 * inter == rows
    assert weight.shape[1] == k and weight.stride(1) == 1 and x2.stride(1) == 1
    y = torch.empty(1, n_first + inter, dtype=x.dtype, device=x.device)
    meta = _meta(k, config or pick_config(rows, k, 1))
    grid = (triton.cdiv(n_first, meta["BLOCK_N"]) + triton.cdiv(inter, meta["BLOCK_N"]),)
    _gemv_kernel[grid](x2, weight, weight[n_first + inter:], y, weight, n_first + inter, n_first, k, 1, 0, 0,
                       weight.stride(0), 0, HAS_EXPERTS=False, GLU=True, **meta, **pdl.launch_options(x.device))
    return y.view(*x.shape[:-1], n_first + inter)


def expert_gemv(x: torch.Tensor, stack: torch.Tensor, experts: torch.Tensor, rows_per_x: int = 1,
                second: torch.Tensor | None = None, config: Config | None = None) -> torch.Tensor:
    """MoE pairs: row p of the result is x[p // rows_per_x] times expert experts[p] of stack [E, N, K]
    -> [P, N]. With `second` (the up stack, same shape; `stack` is the gate stack) row p is the pair's
    SwiGLU silu(x·gate)·(x·up) instead, in one launch (a program covers BLOCK_N rows of each)."""
    _, n, k = stack.shape
    p = experts.numel()
    assert stack.stride(2) == 1 and x.stride(1) == 1 and x.shape[1] == k
    assert second is None or (second.shape == stack.shape and second.stride() == stack.stride())
    meta = _meta(k, config or (expert_config("glu", n, k) if second is not None else default_config(n, k, 1)))
    y = torch.empty(p, n, dtype=x.dtype, device=x.device)
    if p:
        _gemv_kernel[(triton.cdiv(n, meta["BLOCK_N"]), p)](
            x, stack, second if second is not None else stack, y, experts, n, 0 if second is not None else n, k,
            rows_per_x, x.stride(0), stack.stride(0), stack.stride(1), y.stride(0), HAS_EXPERTS=True,
            GLU=second is not None, **meta, **pdl.launch_options(x.device))
    return y


def expert_down_combine(h: torch.Tensor, down: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                        shared_act: torch.Tensor | None = None, shared_down: torch.Tensor | None = None,
                        shared_gate: torch.Tensor | None = None, config: Config | None = None) -> torch.Tensor:
    """The MoE output [T, H] from the pairs' SwiGLU activations h [T·k, I] in one launch: Σ_k weights[t, k] ·
    (down[experts[t, k]] · h[t·k + k]) (+ sigmoid(shared_gate[t]) · (shared_down · shared_act[t])), summed in
    fp32 from unrounded products and rounded once to h's dtype (expert_gemv + the shared down + moe_triton.combine
    round each product first). down [E, H, I]; experts and weights [T, k]; shared_act [T, I_s] and shared_gate
    [T, 1] may be row-strided views; shared_down [H, I_s]. A program covers BLOCK_N outputs of one token."""
    t, top_k = weights.shape
    _, n, k = down.shape
    has_shared = shared_act is not None
    assert h.shape == (t * top_k, k) and h.stride(1) == 1 and down.stride(2) == 1 and experts.shape == (t, top_k)
    ks = k
    if has_shared:
        ks = shared_act.shape[1]
        assert shared_down.shape == (n, ks) and shared_down.stride(1) == 1 and shared_act.stride(1) == 1
        assert shared_act.shape[0] == t and shared_gate.shape[0] == t
    meta = _meta(k, config or expert_config("down", n, max(k, ks)))
    block_k = meta["BLOCK_K"]
    flat = experts.reshape(-1).to(torch.int32)
    route = weights.contiguous()
    hs = shared_act if has_shared else h
    ws = shared_down if has_shared else down
    g = shared_gate if has_shared else h
    y = torch.empty(t, n, dtype=h.dtype, device=h.device)
    if t:
        _down_combine_kernel[(triton.cdiv(n, meta["BLOCK_N"]), t)](
            h, down, flat, route, hs, ws, g, y, n, k, ks, h.stride(0), down.stride(0), down.stride(1), hs.stride(0),
            ws.stride(0), g.stride(0), y.stride(0), TOPK=top_k, KS_TILES=triton.cdiv(ks, block_k),
            EVEN_KS=ks % block_k == 0, HAS_SHARED=has_shared, **meta, **pdl.launch_options(h.device))
    return y
