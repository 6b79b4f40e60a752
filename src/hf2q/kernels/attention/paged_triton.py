"""Triton paged attention for decode: one query token per sequence against its K/V in the block pool.

Grid (sequence, KV head, split): each program takes the GQA group of query heads that share one KV head
(padded to 16 rows for the tensor cores), walks its share of the sequence's blocks through the block
table with an online softmax, and writes a partial output and log-sum-exp; the splits are merged with
a weighted sum by a second small kernel, which also applies the gated attention's sigmoid output gate.
Splitting keeps the GPU busy at batch 1 with long contexts.

The rows of a small prefill step replayed in a graph are decode rows too, several of one sequence (each a query
at its own position over the same block table). With `row_firsts` (each row's sequence's first row) a program
takes up to GROUPED_TILE // GQA-group consecutive rows of one sequence in the tensor-core rows a lone decode row
leaves as padding, each row masked at its own length: the sequence's keys are read once for them instead of once a
row (a chat follow-up's 40 rows over an 8,000-token history read it 10 times instead of 40 on the 9B's heads), and
every row reads the block table of its sequence's first row, the only one a graph step's host pack writes.

A compressed pool (fp8, tq8/tq6/tq5) takes the same kernel with its rows decoded in registers (compressed_triton):
the codes are read 16 bytes at a time from their own rows, the side values (fp8's scale exponent, TurboQuant's norm)
from their plane (so Triton's pipeline prefetches them like model-dtype rows), each tile's unit values go through
the tensor cores in fp16 (which holds every e4m3 value and the hardware converts two an instruction; fp8's tiles as
four planes of channels, whose products with q's matching planes add up), and its per-row factors scale the scores
and the probabilities; q and the probabilities times the value rows' factors enter fp16 as unit rows with a
power-of-two factor, so no range is lost. TurboQuant attends in the rotated domain: the kernel rotates q (signs and
Walsh–Hadamard butterflies, as the store rotates K/V), and the merge rotates the output back before the gate, so no
other launch is needed.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from hf2q import envs
from hf2q.kernels.attention.compressed_triton import (centroid_table, decoded_tile, device_tables, e4m3_planes,
                                                       fwht, quarters, unit_rows)
from hf2q.kernels.tuning import pdl

_INTERPRETED = envs.triton_interpret()  # the interpreter runs no PTX (the fp8 tiles' hardware conversion)
# how the pool stores a row: the kernel's CODED
VALUES, FP8, TURBOQUANT = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


# the table width varies with the batch's longest sequence: specialised (width 1, a multiple of 16), a sequence
# crossing 16 or 32 blocks compiled a variant mid-request (an eager MTP head's catch-up, 0.45 s on an H100)
@triton.jit(do_not_specialize=["stride_bt", "num_rows"])
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, kside_ptr, vside_ptr, cb_ptr, sign_ptr, bt_ptr, len_ptr, first_ptr,
                         o_ptr, lse_ptr, scale, num_rows, stride_qb, stride_qh, stride_kr, stride_kh, stride_bt,
                         stride_ob, stride_oh, stride_os, stride_lb, stride_lh, REP: tl.constexpr,
                         REP_PAD: tl.constexpr, HD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         NSPLIT: tl.constexpr, CODED: tl.constexpr = 0, DOT: tl.constexpr = tl.float16,
                         LOG2_HD: tl.constexpr = 0, INV_SQRT_HD: tl.constexpr = 1.0, PLANES: tl.constexpr = False,
                         CVT: tl.constexpr = False, GROUPED: tl.constexpr = False, SHARED_TABLES: tl.constexpr = False,
                         PDL: tl.constexpr = False):
    pdl.enter(PDL)
    b = tl.program_id(0)
    g = tl.program_id(1)
    sp = tl.program_id(2)
    r = tl.arange(0, REP_PAD)
    d = tl.arange(0, HD)
    if GROUPED:  # tile row r is query head r % REP of row b + r // REP, while that row is of b's sequence
        ROWS: tl.constexpr = REP_PAD // REP
        first = tl.load(first_ptr + b)
        step = r // REP
        in_tile = r < ROWS * REP
        mates = tl.load(first_ptr + b + step, mask=in_tile & (r % REP == 0) & (b + step < num_rows), other=-1)
        lead = (b - first) % ROWS == 0  # the group's program; the others write nothing (their rows are its)
        count = tl.where(lead, tl.sum((mates == first).to(tl.int32), 0), 0)
        rmask = in_tile & (step < count)
        row = b + tl.where(rmask, step, 0)
        heads = g * REP + r % REP
        lens = tl.load(len_ptr + row, mask=rmask, other=0)
        length = tl.max(lens, 0)
    else:
        row = b + r * 0
        rmask = r < REP
        heads = g * REP + r
        length = tl.max(tl.load(len_ptr + b + tl.arange(0, 1)), 0)  # a 0-d scalar (also under the interpreter)
    if SHARED_TABLES:  # each row reads its sequence's first row's block table (the host writes no other)
        table_row = tl.load(first_ptr + b)
    else:
        table_row = b
    per_split = tl.cdiv(tl.cdiv(length, BLOCK_N), NSPLIT) * BLOCK_N
    start = sp * per_split
    end = tl.minimum(start + per_split, length)
    q = tl.load(q_ptr + row[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=rmask[:, None],
                other=0.0)
    if CODED == VALUES:
        q = (q.to(tl.float32) * scale).to(k_ptr.dtype.element_ty)
    else:  # decoded tiles go through the tensor cores in DOT, each row of q as unit values and a factor
        q = q.to(tl.float32) * scale
        if CODED == TURBOQUANT:  # the keys' orthogonal map, kv_codec.rotate: ⟨Rq, Rk⟩ = ⟨q, k⟩
            q = fwht(q * tl.load(sign_ptr + d)[None, :], INV_SQRT_HD, REP_PAD, HD, LOG2_HD)
        q, q_factor = unit_rows(q, DOT)
    if PLANES:  # fp8 tiles as four planes of channels (e4m3_planes): q and the output likewise
        q0, q1, q2, q3 = quarters(q, REP_PAD, HD)
        acc0 = tl.zeros([REP_PAD, HD // 4], tl.float32)
        acc1 = tl.zeros([REP_PAD, HD // 4], tl.float32)
        acc2 = tl.zeros([REP_PAD, HD // 4], tl.float32)
        acc3 = tl.zeros([REP_PAD, HD // 4], tl.float32)
    else:
        acc = tl.zeros([REP_PAD, HD], tl.float32)
    m_i = tl.full([REP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([REP_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + n
        valid = toks < end
        blk = tl.load(bt_ptr + table_row * stride_bt + toks // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = blk * BLOCK_SIZE + toks % BLOCK_SIZE
        # a compressed pool's rows give unit values and a factor per row (scale, or norm/√D); its strides are in
        # vectors (payload rows of HD bytes)
        if CODED == VALUES:
            off = rows[:, None] * stride_kr + g * stride_kh + d[None, :]
            k = tl.load(k_ptr + off, mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k))  # [REP_PAD, BLOCK_N]
        elif PLANES:
            off = rows * stride_kr + g * stride_kh
            k0, k1, k2, k3, k_factor = e4m3_planes(k_ptr, kside_ptr, off, valid, HD, DOT, CVT)
            s = tl.dot(q0, tl.trans(k0))
            s = tl.dot(q1, tl.trans(k1), s)
            s = tl.dot(q2, tl.trans(k2), s)
            s = tl.dot(q3, tl.trans(k3), s) * q_factor[:, None] * k_factor[None, :]
        else:
            off = rows * stride_kr + g * stride_kh
            k, k_factor = decoded_tile(k_ptr, kside_ptr, off, valid, cb_ptr, HD, CODED == TURBOQUANT, DOT)
            s = tl.dot(q, tl.trans(k)) * q_factor[:, None] * k_factor[None, :]
        if GROUPED:  # each row at its own length; a row with no key in the tile yet keeps m -inf, p and alpha 0
            s = tl.where(valid[None, :] & (toks[None, :] < lens[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_use[:, None])
            alpha = tl.exp(m_i - m_use)
        else:
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if CODED == VALUES:
            v = tl.load(v_ptr + off, mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        elif PLANES:
            v0, v1, v2, v3, v_factor = e4m3_planes(v_ptr, vside_ptr, off, valid, HD, DOT, CVT)
            w, w_factor = unit_rows(p * v_factor[None, :], DOT)  # the value rows' factors go on p's columns
            acc0 = acc0 * alpha[:, None] + tl.dot(w, v0) * w_factor[:, None]
            acc1 = acc1 * alpha[:, None] + tl.dot(w, v1) * w_factor[:, None]
            acc2 = acc2 * alpha[:, None] + tl.dot(w, v2) * w_factor[:, None]
            acc3 = acc3 * alpha[:, None] + tl.dot(w, v3) * w_factor[:, None]
        else:
            v, v_factor = decoded_tile(v_ptr, vside_ptr, off, valid, cb_ptr, HD, CODED == TURBOQUANT, DOT)
            w, w_factor = unit_rows(p * v_factor[None, :], DOT)
            acc = acc * alpha[:, None] + tl.dot(w, v) * w_factor[:, None]
        m_i = m_new
    if PLANES:  # the planes back in channel order: [r, c, m, t] is channel 4c + 2m + t (quarters)
        acc = tl.reshape(tl.join(tl.join(acc0, acc2), tl.join(acc1, acc3)), [REP_PAD, HD])
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(safe_l), float("-inf"))
    tl.store(o_ptr + row[:, None] * stride_ob + heads[:, None] * stride_oh + sp * stride_os + d[None, :], out,
             mask=rmask[:, None])
    tl.store(lse_ptr + row * stride_lb + heads * stride_lh + sp, lse, mask=rmask)


@triton.jit
def _merge_kernel(parts_ptr, lse_ptr, gate_ptr, o_ptr, sign_ptr, stride_pb, stride_ph, stride_ps, stride_lb,
                  stride_lh, stride_gb, stride_gh, NH, HD: tl.constexpr, NSPLIT: tl.constexpr, HAS_GATE: tl.constexpr,
                  UNROTATE: tl.constexpr = False, LOG2_HD: tl.constexpr = 0, INV_SQRT_HD: tl.constexpr = 1.0,
                  PDL: tl.constexpr = False):
    pdl.enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, NSPLIT)
    d = tl.arange(0, HD)
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + sp)
    w = tl.exp(lse - tl.max(lse, 0))  # empty splits have lse -inf and weight 0
    w = w / tl.sum(w, 0)
    parts = tl.load(parts_ptr + b * stride_pb + h * stride_ph + sp[:, None] * stride_ps + d[None, :])
    o = tl.sum(parts * w[:, None], 0)
    if UNROTATE:  # TurboQuant's rotated output back to the heads' own basis: s ⊙ (H o / √D), kv_codec.unrotate
        o = tl.reshape(fwht(tl.reshape(o, [1, HD]), INV_SQRT_HD, 1, HD, LOG2_HD), [HD]) * tl.load(sign_ptr + d)
    o = o.to(o_ptr.dtype.element_ty)
    if HAS_GATE:
        g = tl.load(gate_ptr + b * stride_gb + h * stride_gh + d).to(tl.float32)
        o = (o.to(tl.float32) * tl.sigmoid(g)).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + (b * NH + h) * HD + d, o)


# (splits, keys a step, warps), from bench.attention's sweep on an H200 for the 9B's heads (16 query, 4 KV, 256
# wide) at 4,096- and 32,768-token contexts (BENCHMARKS.md, eighteenth session). One sequence: 32 splits of 64
# keys a step on 8 warps was the fastest for bf16, fp8 and TurboQuant pools alike (bf16: 12.7 µs at 4,096 and
# 51 µs at 32,768, against 18.7 and 113 for the (16, 32, 4) chosen at a 512-token context before). 64
# sequences: 4 splits; 32 keys on 4 warps for bf16 (248 and 1,902 µs, against 267 and 1,968 for (8, 64, 4)),
# 64 keys on 4 warps for a compressed pool (fp8: 367 and 2,720 µs, against 639 and 4,797 for (8, 32, 8)).
ONE_SEQUENCE = (32, 64, 8)
BATCHED = (4, 32, 4)
CODED_ONE_SEQUENCE = (32, 64, 8)
CODED_BATCHED = (4, 64, 4)
# A grouped step (row_firsts): a program's tensor-core rows, filled with the GQA groups of as many consecutive rows
# of one sequence as they hold (bench.attention --rows times wider tiles, which read a sequence's keys fewer times:
# on an H100, 41 rows over 8,000 keys on the 9B's heads took 80 µs with 16 rows, 91-99 with 32 or 64), and its
# splits keep about GROUPED_PROGRAMS programs (groups of rows x KV heads x splits), as the fastest did there: 8
# splits for those 41 rows (11 groups x 4 KV heads; 80 µs, against 134 at the batched decode's 4 and 88 at 16), and
# for the 35B-A3B's heads (21 groups x 2; 71 µs against 129 at 4).
GROUPED_TILE = 16
GROUPED_PROGRAMS = 384


def _config_setting() -> tuple[int, int, int] | None:
    """(splits, keys a step, warps) of the first kernel at every batch size: HF2Q_PAGED_DECODE="S,N,W" (powers
    of two; N at least 16, the tensor cores' width), or None (ONE_SEQUENCE for one sequence, else BATCHED)."""
    return envs.paged_decode()


CONFIG = _config_setting()


def config_for(batch: int, coded: bool = False) -> tuple[int, int, int]:
    """The first kernel's (splits, keys a step, warps) at `batch` sequences (over a compressed pool: coded)."""
    if CONFIG:
        return CONFIG
    if batch == 1:
        return CODED_ONE_SEQUENCE if coded else ONE_SEQUENCE
    # Between the two measured ends, splits keep about as many programs as one sequence has (untimed there).
    splits, keys, warps = CODED_BATCHED if coded else BATCHED
    return max(splits, ONE_SEQUENCE[0] >> (batch - 1).bit_length()), keys, warps  # powers of two


def grouped_config_for(rows: int, rep: int, nkv: int, coded: bool = False) -> tuple[int, int, int]:
    """A grouped step's (splits, keys a step, warps) over `rows` rows, taken as one sequence's (a chat follow-up's
    rows; a step of shorter sequences has more groups and is then over-split, its partial outputs more but no key
    read twice): splits a power of two from 4 to 32 for about GROUPED_PROGRAMS programs."""
    if CONFIG:
        return CONFIG
    groups = -(-rows // max(1, GROUPED_TILE // rep))
    wanted = max(1, GROUPED_PROGRAMS // (groups * nkv))
    splits = min(32, max(4, 1 << (wanted.bit_length() - 1)))
    return (splits, *(CODED_BATCHED if coded else BATCHED)[1:])


def paged_decode_attention(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           scale: float, num_splits: int | None = None, gate: Optional[torch.Tensor] = None,
                           block_n: int | None = None, num_warps: int | None = None,
                           kv_format: str | None = None, k_side: torch.Tensor | None = None,
                           v_side: torch.Tensor | None = None, row_firsts: torch.Tensor | None = None,
                           group_tile: int | None = None) -> torch.Tensor:
    """q: [B, nh, hd]; k_rows/v_rows: [num_blocks * block_size, nkv, hd] (the flat pool), or with kv_format (fp8,
    tq8, tq6, tq5) a compressed pool's u8 payload rows and k_side/v_side its side values [.., nkv] (fp8: u8
    exponents, TurboQuant: fp32 norms);
    block_tables: [B, max_blocks] int32;
    context_lens: [B] int32 (>= 1); gate: [B, nh, hd] or None; row_firsts: [B] integers, each row's sequence's
    first row (rows of one sequence consecutive), whose block table serves them all (the others' rows are not
    read), or None: each row alone with its own.
    Returns [B, nh, hd] in q's dtype, times sigmoid(gate) when given. num_splits, block_n (keys a
    step) and num_warps shape the first kernel (default: config_for(B, coded), grouped_config_for with row_firsts;
    bench.attention times them); group_tile: with row_firsts, a program's tile rows (a power of two, default
    GROUPED_TILE), filled with the GQA groups of consecutive rows of one sequence."""
    bsz, nh, hd = q.shape
    coded = VALUES if kv_format is None else FP8 if kv_format == "fp8" else TURBOQUANT
    nkv = k_rows.shape[1]
    rep = nh // nkv
    tile = max(16, triton.next_power_of_2(rep), group_tile or GROUPED_TILE)  # a grouped program's tile rows
    grouped = row_firsts is not None and tile // rep > 1
    config = grouped_config_for(bsz, rep, nkv, coded != VALUES) if grouped else config_for(bsz, coded != VALUES)
    num_splits = num_splits or config[0]
    block_n = block_n or config[1]
    num_warps = num_warps or config[2]
    assert k_rows.stride(2) == 1 and q.stride(2) == 1 and k_rows.stride() == v_rows.stride()
    # a compressed pool's tiles go through the tensor cores in fp16, which holds every e4m3 value exactly (fp32 for
    # an fp32 model)
    dot = torch.float32 if q.dtype == torch.float32 else torch.float16
    rotated = coded == TURBOQUANT  # q is rotated in the kernel, the output back in the merge
    planes = coded == FP8 and hd >= 64  # fp8 tiles as planes of channels, each at least the tensor cores' 16 wide
    codebook = centroid_table(kv_format, dot, str(q.device)) if rotated else k_rows  # unread unless rotated
    signs = device_tables(kv_format, hd, str(q.device))[0] if rotated else k_rows
    log2_hd, inv_sqrt_hd = hd.bit_length() - 1, 1.0 / math.sqrt(hd)
    unit = 1
    if coded != VALUES:  # payload rows of hd bytes, hd a power of two ≥ 16: the kernel takes strides in vectors
        assert k_rows.dtype == torch.uint8 and k_rows.is_contiguous() and v_rows.is_contiguous() and hd % 16 == 0
        assert k_side.is_contiguous() and v_side.is_contiguous() and k_side.shape == k_rows.shape[:2]
        assert k_side.dtype == v_side.dtype == (torch.uint8 if coded == FP8 else torch.float32)
        unit = hd
    else:
        k_side = v_side = k_rows  # unread
    parts = torch.empty(bsz, nh, num_splits, hd, dtype=torch.float32, device=q.device)
    lse = torch.empty(bsz, nh, num_splits, dtype=torch.float32, device=q.device)
    # a grouped program's tile, or a decode row's group padded to the tensor cores' 16 rows
    rep_pad = tile if grouped else max(16, triton.next_power_of_2(rep))
    _paged_decode_kernel[(bsz, nkv, num_splits)](
        q, k_rows, v_rows, k_side, v_side, codebook, signs, block_tables, context_lens,
        context_lens if row_firsts is None else row_firsts, parts, lse, scale, bsz,
        q.stride(0), q.stride(1), k_rows.stride(0) // unit, k_rows.stride(1) // unit, block_tables.stride(0),
        parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1),
        REP=rep, REP_PAD=rep_pad, HD=hd, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        NSPLIT=num_splits, CODED=coded, DOT=tl.float32 if dot == torch.float32 else tl.float16, LOG2_HD=log2_hd,
        INV_SQRT_HD=inv_sqrt_hd, PLANES=planes, CVT=planes and dot == torch.float16 and not _INTERPRETED,
        GROUPED=grouped, SHARED_TABLES=row_firsts is not None, num_warps=num_warps, **pdl.launch_options(q.device))
    out = torch.empty(bsz, nh, hd, dtype=q.dtype, device=q.device)
    if gate is not None:
        assert gate.shape == q.shape and gate.stride(2) == 1
    g = gate if gate is not None else q
    _merge_kernel[(bsz, nh)](parts, lse, g, out, signs, parts.stride(0), parts.stride(1), parts.stride(2),
                             lse.stride(0), lse.stride(1), g.stride(0), g.stride(1), nh, HD=hd, NSPLIT=num_splits,
                             HAS_GATE=gate is not None, UNROTATE=rotated, LOG2_HD=log2_hd, INV_SQRT_HD=inv_sqrt_hd,
                             num_warps=2, **pdl.launch_options(q.device))
    return out
