"""Triton Gated DeltaNet step of a graph-replayed small step: a few rows per sequence, on the slot pools in
place, keeping (for a speculative verify) the state after each of a sequence's first rows.

A prefill graph (hf2q.engine.prefill_graphs) feeds each sequence up to 127 new rows, a verify graph its last
decided token and up to 3 drafts; a partial accept settles the slot from the state after one of those rows
(hf2q.spec.states.KeptPositions). With no kept buffer (`prefixes` 0) nothing is kept. A prefill graph may
instead keep the state after one row of one sequence, named by a device pair the graph reads at each replay
(a prefix-cache checkpoint inside that sequence's chunk, hf2q.cache.state_at.GraphStateAt): `keep`.
Two kernels, as the decode step (gdn/decode_triton.py) is split:

The first runs one program per (sequence, value head, part of the head's columns): each column of the
delta rule needs only its own column of the state, so a sequence's 2 MB of 9B state is walked by 128
programs at batch 1. It walks the sequence's rows in order, the state in registers: the causal conv +
SiLU of the row (over a window of the last three inputs kept in registers, first the slot's conv state; the
next row's inputs are loaded before this row's arithmetic, so a row waits on no load), L2-normalised q/k (key head
h % n_k, the GGUF tiled order), decay and beta, the delta-rule update, the read-out; after each row but
the last (up to `prefixes`) it writes the state into the kept buffer, after the `keep` row into the keep
buffer (one scalar compare a row), and after the last into the pool. The arithmetic is fp32 whatever the pool
holds; a bf16 pool's state is rounded after each row, as the decode step a row would be rounds it, so the kept
states (in the pool's dtype) and the last are what plain decoding leaves.
The conv state is only read here: every program of a key head reads its q/k channels.

The second, one program per (sequence, block of channels), writes the conv windows after those rows into
the kept buffers and shifts the slot's conv state past the step's rows, now that every reader has
finished (a launch boundary is the only grid-wide barrier Triton has).

Sequences with no rows do nothing. Sequences from `live` on (a graph's padding, on a shared padding slot)
touch no state: their read-outs are zeros.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf2q import envs
from hf2q.kernels.gdn.decode_triton import SPLIT, _decay_beta_of
from hf2q.kernels.tuning import pdl


@triton.jit
def _mask(cond, shape):
    """A scalar condition as a mask of `shape` (the interpreter takes no scalar mask for a block of pointers)."""
    return tl.zeros(shape, tl.int1) | cond


@triton.jit
def _taps(conv, w_ptr, c, C):
    """Channels c's conv weights (4 taps) and the slot's conv state rows (inputs -3, -2, -1), fp32: the window
    a sequence's first row starts from."""
    w0 = tl.load(w_ptr + c * 4).to(tl.float32)
    w1 = tl.load(w_ptr + c * 4 + 1).to(tl.float32)
    w2 = tl.load(w_ptr + c * 4 + 2).to(tl.float32)
    w3 = tl.load(w_ptr + c * 4 + 3).to(tl.float32)
    p3 = tl.load(conv + c).to(tl.float32)
    p2 = tl.load(conv + C + c).to(tl.float32)
    p1 = tl.load(conv + 2 * C + c).to(tl.float32)
    return w0, w1, w2, w3, p3, p2, p1


@triton.jit
def _silu_conv(p3, p2, p1, new, w0, w1, w2, w3):
    """SiLU of the causal conv (width 4) over inputs t-3, t-2, t-1 and t, summed in that order."""
    acc = p3 * w0
    acc += p2 * w1
    acc += p1 * w2
    acc += new * w3
    return acc * tl.sigmoid(acc)


@triton.jit
def _row_inputs(x_ptr, a_ptr, b_ptr, row, cq, ck, cv, h, stride_x, stride_ab, stride_bb, ok):
    """Row `row`'s q, k and v inputs (before the conv) and its raw alpha and beta, fp32; zeros where not ok
    (past the sequence's last row)."""
    xs = x_ptr + row * stride_x
    xq = tl.load(xs + cq, mask=_mask(ok, cq.shape), other=0.0).to(tl.float32)
    xk = tl.load(xs + ck, mask=_mask(ok, ck.shape), other=0.0).to(tl.float32)
    xv = tl.load(xs + cv, mask=_mask(ok, cv.shape), other=0.0).to(tl.float32)
    a = tl.load(a_ptr + row * stride_ab + h, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_bb + h, mask=ok, other=0.0).to(tl.float32)
    return xq, xk, xv, a, b


@triton.jit
def _verify_columns_kernel(x_ptr, cw_ptr, conv_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, state_ptr, slot_ptr, cu_ptr,
                           o_ptr, kept_ptr, keep_ptr, keep_rec_ptr, stride_x, stride_conv, stride_ab, stride_bb, C,
                           NK, NV, LIVE, scale, eps,
                           DK: tl.constexpr, DV: tl.constexpr, SPLIT: tl.constexpr, PREFIXES: tl.constexpr,
                           KEEP: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (i, h, j): columns j·DV/SPLIT .. of value head h over sequence i's rows."""
    pdl.enter(PDL)
    i = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2)
    BDV: tl.constexpr = DV // SPLIT
    dv = j * BDV + tl.arange(0, BDV)
    start = tl.load(cu_ptr + i).to(tl.int64)
    n = tl.load(cu_ptr + i + 1).to(tl.int64) - start
    if i >= LIVE:
        for t in range(0, n):
            tl.store(o_ptr + ((start + t) * NV + h) * DV + dv, tl.zeros([BDV], tl.float32))
    elif n > 0:
        kh = h % NK  # tiled order: value head h reads key head h % n_k
        dk = tl.arange(0, DK)
        slot = tl.load(slot_ptr + i).to(tl.int64)
        conv = conv_ptr + slot * stride_conv
        cols = dk[:, None] * DV + dv[None, :]
        sp = state_ptr + (slot * NV + h) * (DK * DV) + cols
        s = tl.load(sp).to(tl.float32)
        if KEEP:  # the row of this sequence whose state is kept (-1: none)
            keep_t = tl.where(tl.load(keep_ptr) == i, tl.load(keep_ptr + 1), -1)
        cq, ck, cv = kh * DK + dk, NK * DK + kh * DK + dk, 2 * NK * DK + h * DV + dv
        qw0, qw1, qw2, qw3, q3, q2, q1 = _taps(conv, cw_ptr, cq, C)
        kw0, kw1, kw2, kw3, k3, k2, k1 = _taps(conv, cw_ptr, ck, C)
        vw0, vw1, vw2, vw3, v3, v2, v1 = _taps(conv, cw_ptr, cv, C)
        dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
        A = tl.load(A_ptr + h).to(tl.float32)
        xq, xk, xv, ra, rb = _row_inputs(x_ptr, a_ptr, b_ptr, start, cq, ck, cv, h, stride_x, stride_ab, stride_bb,
                                         n > 0)
        for t in range(0, n):
            # the next row's inputs are loaded before this row's arithmetic, which hides their latency
            nxq, nxk, nxv, na, nb = _row_inputs(x_ptr, a_ptr, b_ptr, start + t + 1, cq, ck, cv, h, stride_x, stride_ab,
                                             stride_bb, t + 1 < n)
            q = _silu_conv(q3, q2, q1, xq, qw0, qw1, qw2, qw3)
            k = _silu_conv(k3, k2, k1, xk, kw0, kw1, kw2, kw3)
            v = _silu_conv(v3, v2, v1, xv, vw0, vw1, vw2, vw3)
            q3, q2, q1, k3, k2, k1, v3, v2, v1 = q2, q1, xq, k2, k1, xk, v2, v1, xv
            decay, beta = _decay_beta_of(ra, rb, A, dt_bias)
            xq, xk, xv, ra, rb = nxq, nxk, nxv, na, nb
            q = q * tl.rsqrt(tl.sum(q * q, 0) + eps) * scale
            k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
            s = s * decay
            delta = (v - tl.sum(s * k[:, None], 0)) * beta
            s = s + k[:, None] * delta[None, :]
            tl.store(o_ptr + ((start + t) * NV + h) * DV + dv, tl.sum(s * q[:, None], 0))
            s = s.to(sp.dtype.element_ty).to(tl.float32)  # what the slot would hold (fp32: unchanged)
            kept = _mask((t < PREFIXES) & (t < n - 1), cols.shape)
            tl.store(kept_ptr + ((PREFIXES * i + t) * NV + h) * (DK * DV) + cols, s.to(sp.dtype.element_ty),
                     mask=kept)
            if KEEP:
                if t == keep_t:
                    tl.store(keep_rec_ptr + h * (DK * DV) + cols, s.to(sp.dtype.element_ty))
        tl.store(sp, s.to(sp.dtype.element_ty))


@triton.jit
def _window_row(x_ptr, conv, start, p, c, stride_x, C, mask):
    """Channels c of input p of a sequence (p < 0: row 3 + p of the slot's conv state), in the state's dtype."""
    fresh = _mask(p >= 0, c.shape)
    new = tl.load(x_ptr + (start + p) * stride_x + c, mask=mask & fresh, other=0.0).to(conv.dtype.element_ty)
    old = tl.load(conv + (3 + p) * C + c, mask=mask & ~fresh, other=0.0)
    return tl.where(fresh, new, old)


@triton.jit
def _verify_conv_kernel(x_ptr, conv_ptr, slot_ptr, cu_ptr, kept_ptr, keep_ptr, keep_conv_ptr, stride_x, stride_conv,
                        C, PREFIXES: tl.constexpr, BLOCK: tl.constexpr, KEEP: tl.constexpr = False,
                        PDL: tl.constexpr = False):
    """Program (i, b): channels b·BLOCK .. of sequence i: its conv windows after each kept row (and the `keep`
    row), then the slot's conv state after its last row (the last 3 of: the old state, the step's rows)."""
    pdl.enter(PDL)
    i = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    start = tl.load(cu_ptr + i).to(tl.int64)
    n = tl.load(cu_ptr + i + 1).to(tl.int64) - start
    if n > 0:
        conv = conv_ptr + tl.load(slot_ptr + i).to(tl.int64) * stride_conv
        for t in tl.static_range(PREFIXES):  # the window after row t: inputs t-2 .. t
            kept = m & _mask(t < n - 1, c.shape)
            for r in tl.static_range(3):
                w = _window_row(x_ptr, conv, start, t - 2 + r, c, stride_x, C, kept)
                tl.store(kept_ptr + ((PREFIXES * i + t) * 3 + r) * C + c, w, mask=kept)
        if KEEP:
            kt = tl.load(keep_ptr + 1)
            kept = m & _mask((tl.load(keep_ptr) == i) & (kt >= 0) & (kt < n), c.shape)
            for r in tl.static_range(3):
                w = _window_row(x_ptr, conv, start, kt - 2 + r, c, stride_x, C, kept)
                tl.store(keep_conv_ptr + r * C + c, w, mask=kept)
        r0 = _window_row(x_ptr, conv, start, n - 3, c, stride_x, C, m)
        r1 = _window_row(x_ptr, conv, start, n - 2, c, stride_x, C, m)
        r2 = _window_row(x_ptr, conv, start, n - 1, c, stride_x, C, m)
        # Threads may hold copies of the same channel: all reads of the old rows finish before any is overwritten.
        tl.debug_barrier()
        tl.store(conv + c, r0, mask=m)
        tl.store(conv + C + c, r1, mask=m)
        tl.store(conv + 2 * C + c, r2, mask=m)


def gdn_verify_(x: torch.Tensor, conv_w: torch.Tensor, conv_pool: torch.Tensor, a_raw: torch.Tensor,
                b_raw: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor, state_pool: torch.Tensor,
                slots: torch.Tensor, cu_seqlens: torch.Tensor, live: int, kept_conv: torch.Tensor,
                kept_rec: torch.Tensor, nk: int, dk: int, eps: float, keep=None,
                config: tuple[int, int] | None = None) -> torch.Tensor:
    """x [T, C]: the qkv projection before the conv, sequences' rows end to end at cu_seqlens [N + 1] (read
    on the device only); conv_w [C, 4]; conv_pool [S, 3, C] and state_pool [S, nv, dk, dv] (fp32 or bf16),
    updated in place at slots [N]; sequences i >= live are padding. kept_conv [P * live, 3, C] and kept_rec
    [P * live, nv, dk, dv] (the pools' dtypes): row P * i + t gets sequence i's states after its row t, for
    t < min(rows - 1, P). keep: None, or (at [2] int on the device: sequence i, row t, -1 for none; conv [3, C];
    recurrent [nv, dk, dv] in the pool's dtype) which get sequence i's states after its row t (left alone where no
    such row is in the step).
    config: (column parts a value head, warps) of the columns kernel (default COLUMNS_CONFIG; bench.gdn
    --verify-rows times others). Returns the read-outs o [T, nv, dv] fp32 (before the gated RMSNorm)."""
    t, c = x.shape
    nv, dv = state_pool.shape[1], state_pool.shape[3]
    prefixes = kept_rec.shape[0] // live
    assert state_pool.dtype in (torch.float32, torch.bfloat16) and state_pool.is_contiguous()
    assert state_pool.shape[2] == dk
    assert nv % nk == 0 and c == 2 * nk * dk + nv * dv and x.stride(1) == 1
    assert conv_w.shape == (c, 4) and conv_pool.shape[1:] == (3, c) and conv_pool.stride(2) == 1
    assert conv_pool.stride(1) == c and a_raw.stride(1) == 1 and b_raw.stride(1) == 1
    assert kept_rec.shape == (prefixes * live, nv, dk, dv) and kept_rec.is_contiguous()
    assert kept_rec.dtype == state_pool.dtype
    assert kept_conv.shape == (prefixes * live, 3, c) and kept_conv.is_contiguous()
    if keep is not None:
        at, keep_conv, keep_rec = keep
        assert at.shape == (2,) and keep_conv.shape == (3, c) and keep_conv.is_contiguous()
        assert keep_rec.shape == (nv, dk, dv) and keep_rec.dtype == state_pool.dtype and keep_rec.is_contiguous()
        assert keep_conv.dtype == conv_pool.dtype
    else:
        at, keep_conv, keep_rec = cu_seqlens, kept_conv, kept_rec  # never read
    o = torch.empty(t, nv, dv, dtype=torch.float32, device=x.device)
    split, warps = config or COLUMNS_CONFIG
    split = split if dv % split == 0 else 1
    launch = pdl.launch_options(x.device)
    _verify_columns_kernel[(slots.shape[0], nv, split)](
        x, conv_w.contiguous(), conv_pool, a_raw, b_raw, A, dt_bias, state_pool, slots, cu_seqlens, o, kept_rec, at,
        keep_rec, x.stride(0), conv_pool.stride(0), a_raw.stride(0), b_raw.stride(0), c, nk, nv, live, dk ** -0.5, eps,
        DK=dk, DV=dv, SPLIT=split, PREFIXES=prefixes, KEEP=keep is not None, num_warps=warps, **launch)
    _verify_conv_kernel[(live, triton.cdiv(c, CONV_BLOCK))](
        x, conv_pool, slots, cu_seqlens, kept_conv, at, keep_conv, x.stride(0), conv_pool.stride(0), c,
        PREFIXES=prefixes, BLOCK=CONV_BLOCK, KEEP=keep is not None, num_warps=4, **launch)
    return o


CONV_BLOCK = 1024  # channels a program of the conv kernel writes (a 9B layer's 8192: 8 programs a sequence)
# (column parts a value head, warps) of the columns kernel: a row's reductions over the key dimension cross the
# program's warps (barriers) where it has several; bench.gdn --verify-rows times the alternatives. Two warps were
# never slower than four on an H100 (9B heads, fp32 state; µs a step, (4, 4) -> (4, 2)): one sequence of 4 / 41 / 127
# rows 10.2 -> 8.8 / 57.0 -> 47.0 / 169.5 -> 135.9, 4 of 41 rows 74.9 -> 69.9, 16 and 64 of 4 rows 46.1 -> 41.8 and
# 154.3 -> 136.4. (8, 1) was fastest for few sequences (one of 41 rows: 32.6) and slowest for many (64 of 4: 195.3),
# and a graph's kernel serves both (a prefill graph's step is a hit's rows or a prompt beside others' decode rows).
COLUMNS_CONFIG = envs.gdn_verify() or (SPLIT, 2)
COLUMNS_CONFIGS = ((4, 4), (4, 2), (4, 1), (8, 1), (8, 2), (16, 1))
