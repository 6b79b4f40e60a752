"""The int8 mat-vec over MoE token-expert pairs in blocks of one expert: each chosen expert's blocks read once for up
to four of its pairs.

dp4a_triton's expert mat-vec reads a pair's expert for that pair alone, which at many pairs reads the experts over
and over (64 sequences of a 256-expert top-8 MoE: 512 pairs over about 220 experts). Here the pairs come in blocks
of BM slots of one expert (hf2q.kernels.moe.blocks_triton), and a program takes one block's pairs as the mat-vec's
shared rows (dp4a_blocks: each weight word unpacked once and dotted with every row), so an expert's bytes are read
once for up to four pairs. A pair's sums are its own (each row's in variables of their own): its result depends on
its expert, its activations and the configuration, never on the other pairs. On an H100 (BENCHMARKS.md) it reads
the chosen experts at 26-41% of the copy rate where the mat-vec of a pair at a time reaches 97% (L2 serving a pair's
expert to its neighbours): 0.59-0.82x that one's speed at 16-64 tokens of a 35B-A3B layer, 1.01-1.16x at 128. So it
is opt-in (HF2Q_MOE_BLOCKS).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf2q.kernels.quant.dequant_triton import QTYPE_ID, check_layout
from hf2q.kernels.quant.dp4a_blocks import below, row_products
from hf2q.kernels.quant.dp4a_triton import EMULATE, _row_units
from hf2q.kernels.quant.int8_rows import blocked_for
from hf2q.kernels.tuning import pdl
from hf2q.quant import KQUANTS, block_layout

BM = 4  # pairs a block: the shared rows' most


@triton.jit
def _piece(slot_ptr, s, M, rows_per_x, n_g16):
    """The first 16-value piece of the activation row of the pair in slot s (row M - 1's for an empty slot)."""
    return (tl.minimum(tl.load(slot_ptr + s), M - 1) // rows_per_x).to(tl.int64) * n_g16


@triton.jit
def _experts_dp4a_kernel(xq_ptr, act_ptr, w32, w32b, out_ptr, slot_ptr, block_e_ptr, M, N, n_first,
                         row_units: tl.constexpr, row_units_b: tl.constexpr, n_units: tl.constexpr, expert_units,
                         expert_units_b, n_g16: tl.constexpr, rows_per_x, out_stride, QTYPE: tl.constexpr,
                         QTYPE_B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr,
                         STAGES: tl.constexpr, TWO: tl.constexpr, EVEN: tl.constexpr, EMULATE: tl.constexpr,
                         PDL: tl.constexpr = False):
    """out[p, n] = Σ_k x[p // rows_per_x, k] · W_e[n, k] for the pairs p of block program_id(1) (slots of
    slot_ptr, M where empty) and its expert e (block_e_ptr; -1: a block past the last, every load masked), BN
    weight rows a program. TWO: output columns from n_first on come from a second stack (an MoE's up next to its
    gate). EVEN: N and the blocks a row are multiples of BN and SB."""
    pdl.wait_prior(PDL)  # the slots and the activations come from the previous kernels
    m0 = tl.program_id(1) * BM
    ms = tl.load(slot_ptr + m0 + tl.arange(0, BM))
    expert = tl.load(block_e_ptr + tl.program_id(1)).to(tl.int64)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    row_ok = below(cols, N, EVEN) & (cols * 0 + expert >= 0)  # [BN] (a scalar comparison would not broadcast)
    x_g16 = (_piece(slot_ptr, m0, M, rows_per_x, n_g16), _piece(slot_ptr, m0 + 1, M, rows_per_x, n_g16),
             _piece(slot_ptr, m0 + 2, M, rows_per_x, n_g16), _piece(slot_ptr, m0 + 3, M, rows_per_x, n_g16))
    e = tl.maximum(expert, 0)
    m_ok = ms < M
    if TWO and tl.program_id(0) * BN >= n_first:
        base = (cols - n_first).to(tl.int64) * row_units_b + e * expert_units_b
        acc = row_products(w32b, w32b, xq_ptr, act_ptr, x_g16, m_ok, base, row_ok, n_units, QTYPE_B, BM, BN, SB,
                           STAGES, True, EVEN, EMULATE)
    else:
        base = cols.to(tl.int64) * row_units + e * expert_units
        acc = row_products(w32, w32, xq_ptr, act_ptr, x_g16, m_ok, base, row_ok, n_units, QTYPE, BM, BN, SB,
                           STAGES, True, EVEN, EMULATE)
    pdl.release_next(PDL)
    out = out_ptr + ms.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out, tl.sum(acc, axis=2).to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & row_ok[None, :])


def serves(*qtypes: str) -> bool:
    """Whether these stacks' types have the shared rows (the K-quants) and read activations in one order."""
    return all(t in KQUANTS for t in qtypes) and len({blocked_for(t) for t in qtypes}) == 1


def config(qtype: str, n: int, k: int, second: bool) -> tuple:
    """(BLOCK_N, blocks a step, warps, stages, shared) for an [n, k] stack: one warp, each thread one (weight row,
    block) unit for the four rows, the step as many blocks as a row has (up to 16: an expert's 2,048-wide rows
    have 8, its 512-wide down rows 2), so that no thread holds a masked unit; the expert mat-vec's timing picked
    one-warp programs at these shapes on an H100 (BENCHMARKS.md). It depends on the stack alone."""
    blocks = k // 256
    sb = min(16, 1 << (blocks.bit_length() - 1))
    block_n = max(1, 32 // sb)
    if second and n % block_n:
        raise ValueError(f"two stacks in one launch need their rows ({n}) a multiple of {block_n}")
    return block_n, sb, 1, 1, True


def experts_matvec(xs, raw: torch.Tensor, qtype: str, n: int, slots: torch.Tensor, block_experts: torch.Tensor,
                   pairs: int, out_dtype: torch.dtype = torch.float32, second: tuple | None = None,
                   rows_per_x: int = 1) -> torch.Tensor:
    """Activations quantized by quantize_rows (xs) times the experts of a stacked quantized weight raw [E, n, ...]:
    output row p (of `pairs`) is activation row p // rows_per_x times pair p's expert, the pairs laid out by
    expert_blocks (slots, block_experts). `second` (raw2, n2[, qtype2]): a second stack of the same experts and
    rows (an MoE's up next to its gate), its products in the last n2 columns."""
    xq, act, blocked = xs
    qtype2 = second[2] if second and len(second) > 2 else qtype
    if not serves(qtype, qtype2) or blocked != blocked_for(qtype):
        raise ValueError(f"the blocked expert mat-vec takes K-quant stacks read in the activations' order, not "
                         f"{qtype}/{qtype2}")
    if second and second[1] != n:
        raise ValueError(f"two stacks in one launch need equal rows ({n} and {second[1]})")
    k = xq.shape[1] * 4
    check_layout(raw, qtype, k)
    if second:
        check_layout(second[0], qtype2, k)
    block_n, sb, warps, stages = config(qtype, n, k, second is not None)[:4]
    n_total = n * (2 if second else 1)
    row_units, row_units_b = _row_units(qtype, k), _row_units(qtype2, k)
    out = torch.empty(pairs, n_total, dtype=out_dtype, device=xq.device)
    w = raw.view(-1)
    wb = second[0].view(-1) if second else w
    n_units = k // block_layout(qtype)[0]
    grid = (triton.cdiv(n_total, block_n), block_experts.numel())
    _experts_dp4a_kernel[grid](xq, act, w, wb, out, slots, block_experts, pairs, n_total, n, row_units, row_units_b,
                               n_units, n * row_units, n * row_units_b, k // 16, rows_per_x, out.stride(0),
                               QTYPE=QTYPE_ID[qtype], QTYPE_B=QTYPE_ID[qtype2], BM=BM, BN=block_n, SB=sb,
                               STAGES=stages, TWO=second is not None,
                               EVEN=n_total % block_n == 0 and n_units % sb == 0, EMULATE=EMULATE, num_warps=warps,
                               **pdl.launch_options(xq.device))
    return out
