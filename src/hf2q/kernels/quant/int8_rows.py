"""Activation rows quantized to int8 for the dp4a mat-vec (dp4a_triton), and the Triton helpers with which
a kernel that produces a row (the norm, SwiGLU, the DeltaNet's output) writes its int8 form as it goes.

Each 32-value group is scaled by dx = max|x| / 127 (llama.cpp's q8_1); beside the int8 values every
16-value piece keeps the four floats the mat-vec's offset and min terms need (store_int8_groups). Pieces
are in the row's order, or BLOCKED (the order of the interleaved K-quant weight rows) for K-quant readers.
"""
from __future__ import annotations

import collections
import weakref
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hf2q.kernels.tuning import pdl
from hf2q.quant import KQUANTS


@triton.jit
def int8_groups(x, GROUPS: tl.constexpr):
    """x fp32 [GROUPS, 32] -> int8 values q (as fp32) with dx = max|x| / 127 per group [GROUPS, 1], dx·Σq
    per 16-value half [GROUPS, 2], and per group Σx - dx·Σq and Σx [GROUPS, 1]."""
    amax = tl.max(tl.abs(x), axis=1)
    inv = tl.where(amax > 0, 127.0 / amax, 0.0)
    v = x * inv[:, None]
    q = tl.minimum(tl.maximum(tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v)), -127.0), 127.0)
    dx = (amax / 127.0)[:, None]
    sq = dx * tl.sum(tl.reshape(q, (GROUPS, 2, 16)), axis=2)
    sx = tl.sum(x, axis=1)[:, None]
    fix = sx - tl.sum(sq, axis=1)[:, None]
    return q, dx, sq, fix, sx


@triton.jit
def store_int8_groups(xq_ptr, act_ptr, row, n_groups, g, ok, q, dx, sq, fix, sx, GROUPS: tl.constexpr,
                      BLOCKED: tl.constexpr):
    """Write int8_groups' results for groups g [GROUPS] of activation row `row` (n_groups groups a row
    apart: row is the row's first group index): the int8 values, and per 16-value piece the quad
    (dx, dx·Σxq of the piece, Σx - dx·Σxq of the group, Σx of the group). Pieces go in the row's
    order, or BLOCKED (for the K-quant kernels, n_groups a multiple of 8): piece j of 256-value block u
    at j·B + u of B blocks, the order of interleaved weight rows (hf2q.quant.to_gpu_rows)."""
    h = tl.arange(0, 2)
    piece = 2 * g[:, None] + h[None, :]  # [GROUPS, 2]
    if BLOCKED:
        piece = (piece % 16) * (n_groups // 8) + piece // 16
    quad = 2 * row + piece
    l = tl.arange(0, 16)
    tl.store(xq_ptr + quad[:, :, None] * 16 + l[None, None, :], tl.reshape(q, (GROUPS, 2, 16)).to(tl.int8),
             mask=ok[:, None, None])
    base = act_ptr + quad * 4
    hok = ok[:, None] & (h < 2)[None, :]
    tl.store(base, tl.broadcast_to(dx, (GROUPS, 2)), mask=hok)
    tl.store(base + 1, sq, mask=hok)
    tl.store(base + 2, tl.broadcast_to(fix, (GROUPS, 2)), mask=hok)
    tl.store(base + 3, tl.broadcast_to(sx, (GROUPS, 2)), mask=hok)


@triton.jit
def quantize_and_store(xq_ptr, act_ptr, y, row, first, n_groups, BLOCK: tl.constexpr, BLOCKED: tl.constexpr):
    """For a kernel that has just produced y [BLOCK], values first·32 .. of activation row `row` (of
    n_groups groups): write their int8 groups as quantize_rows would (groups past n_groups skipped)."""
    G: tl.constexpr = BLOCK // 32
    g = first + tl.arange(0, G)
    q, dx, sq, fix, sx = int8_groups(tl.reshape(y.to(tl.float32), (G, 32)), G)
    store_int8_groups(xq_ptr, act_ptr, row * n_groups, n_groups, g, g < n_groups, q, dx, sq, fix, sx, G, BLOCKED)


# Columns of a row one program quantizes where a kernel writes int8 rows beside its output (the norm,
# SwiGLU): quantizing a 4096-wide row in one program (one SM) took longer than the norm itself.
QUANT_SLICE = 512


@triton.jit
def _quantize_kernel(x_ptr, xq_ptr, act_ptr, n_groups, x_stride, GROUPS: tl.constexpr, BLOCKED: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Row m, 32-value groups g: xq = round(x / dx) in int8 with dx = max|x| / 127, and per 16-value half
    the four floats (store_int8_groups) that the mat-vec's offset and min terms need."""
    pdl.enter(PDL)
    m = tl.program_id(0)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    l = tl.arange(0, 32)
    ok = g < n_groups
    x = tl.load(x_ptr + m * x_stride + g[:, None] * 32 + l[None, :], mask=ok[:, None], other=0).to(tl.float32)
    q, dx, sq, fix, sx = int8_groups(x, GROUPS)
    store_int8_groups(xq_ptr, act_ptr, m.to(tl.int64) * n_groups, n_groups, g, ok, q, dx, sq, fix, sx, GROUPS,
                      BLOCKED)


class Int8Rows(NamedTuple):
    """Activation rows as the mat-vec reads them: int8 values as int32 words [M, K/4], float32 [M, K/16, 4]
    per 16-value piece (dx, dx·Σxq of the piece, Σx - dx·Σxq and Σx of its 32-value group), and whether
    the pieces are in BLOCKED order (store_int8_groups) for K-quant weights, or in the row's order."""
    xq: torch.Tensor
    act: torch.Tensor
    blocked: bool


def blocked_for(qtype: str) -> bool:
    """Whether weights of `qtype` read activations in BLOCKED order (the interleaved K-quant rows)."""
    return qtype in KQUANTS


def int8_writes(int8_for: str | None, width: int) -> tuple[bool, bool]:
    """(write, BLOCKED) for a kernel whose width-wide rows feed the int8 mat-vec of a weight of type
    `int8_for` (None: no such reader): it writes int8 rows only in whole 32-value groups, and BLOCKED
    ones only in whole 256-value blocks."""
    blocked = int8_for is not None and blocked_for(int8_for)
    return int8_for is not None and width % (256 if blocked else 32) == 0, blocked


def quantize_rows(x: torch.Tensor, key: torch.Tensor | None = None, blocked: bool = False) -> Int8Rows:
    """x [M, K] (K a multiple of 32; of 256 when blocked) -> its Int8Rows, in BLOCKED order if `blocked`.

    The last few inputs' results are kept: projections of one input in several packs (a DeltaNet's Q5_K
    qkv and Q4_K z/a/b; an MoE's shared expert and routed experts, whose SwiGLU outputs are quantized in
    between) quantize it once. The same tensor object (`key`, the tensor x is a reshaped view of, else x),
    unmodified since (its version counter), is the only hit (see _stamp for tensors made under inference
    mode)."""
    key = x if key is None else key
    for ref, stamp, out in _RECENT:
        if ref() is key and stamp == _stamp(key) and out.xq.shape[0] == x.shape[0] and out.blocked == blocked:
            return out
    xc = x.contiguous()
    m, k = xc.shape
    groups = k // 32
    if blocked and k % 256:
        raise ValueError(f"BLOCKED int8 rows need a multiple of 256 values, not {k}")
    xq, act = int8_buffers(m, k, x.device)
    _quantize_kernel[(m, triton.cdiv(groups, 16))](xc, xq, act, groups, xc.stride(0), GROUPS=16, BLOCKED=blocked,
                                                   **pdl.launch_options(x.device))
    out = Int8Rows(xq.view(torch.int32), act, blocked)
    _RECENT.appendleft((weakref.ref(key), _stamp(key), out))
    return out


_RECENT: collections.deque = collections.deque(maxlen=4)  # (weakref to the input, its stamp, Int8Rows)


def _stamp(t: torch.Tensor):
    """What tells a cached quantization of t from a stale one: t's version counter, bumped by every
    in-place write. Tensors made under inference mode have none (torch does not track them); for those
    the object's identity is the whole key, which holds because a projection's input is never written in
    place after it is produced (norm, SwiGLU and mixer outputs are fresh tensors each step)."""
    return None if t.is_inference() else t._version


def int8_buffers(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (xq int8 [M, K], act float32 [M, K/16, 4]) for a kernel that quantizes rows as it writes them."""
    return (torch.empty(m, k, dtype=torch.int8, device=device),
            torch.empty(m, k // 16, 4, dtype=torch.float32, device=device))


def remember(x: torch.Tensor, xq: torch.Tensor, act: torch.Tensor, blocked: bool) -> None:
    """Record (xq, act) as x's quantization (written by a kernel that produced x), for quantize_rows."""
    _RECENT.appendleft((weakref.ref(x), _stamp(x), Int8Rows(xq.view(torch.int32), act, blocked)))
