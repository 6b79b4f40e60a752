"""Every token-expert pair's SwiGLU expert from quantized expert stacks, by device.

It composes the quantized products of quant/ops.py with the dense choosers (activation/ops.silu_mul, the
dense expert pairs of moe/ops.py), so it sits above them: quant/ops.py imports neither.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hf2q import envs
from hf2q.kernels.activation import ops as activation_ops
from hf2q.kernels.choose import triton_runs
from hf2q.kernels.moe import ops as moe_ops
from hf2q.kernels.quant.ops import MOE_PAIRS, dequantize, scratch
from hf2q.quant import dequantize_ref

MOE_BLOCKS = envs.moe_blocks()  # pairs from which the experts are read once a block of pairs (None: never)


def _expert_linear_ref(x: torch.Tensor, experts: torch.Tensor, raw: torch.Tensor, qtype: str,
                       out_features: int) -> torch.Tensor:
    """Row i of x [P, in] times expert experts[i] of a stacked quantized weight raw [E, out, row_bytes], by
    the exact reference (the kernels' path is quant_dp4a_triton.matvec with experts)."""
    w = dequantize_ref(raw, qtype, (raw.shape[0], out_features, x.shape[-1])).to(x.device)
    return torch.einsum("pk,pnk->pn", x.float(), w[experts]).to(x.dtype)


def moe_expert_pairs_quant(x: torch.Tensor, experts: torch.Tensor, gate: tuple, up: tuple,
                           down: tuple) -> torch.Tensor:
    """SwiGLU expert_k(x) of every token-expert pair [T·k, H] (pair p: token p // k, its (p % k)-th expert)
    with quantized stacked experts; gate/up/down: (raw, qtype).

    Few pairs read only the chosen experts' blocks (`_swiglu_pairs`: x quantized once, gate and up of every
    pair in one launch when their types read activations in the same order, then the down projection); from
    MOE_BLOCKS pairs each expert is read once for up to four of its pairs (`_pairs_in_blocks`); many
    pairs dequantize the stacks into scratch and run the dense path (grouped GEMMs).
    """
    t, top_k = experts.shape
    hidden, inter = x.shape[1], gate[0].shape[1]
    n_exp = gate[0].shape[0]
    flat = experts.reshape(-1)
    if not triton_runs(x):
        xs = x.repeat_interleave(top_k, dim=0)  # [T*k, H], pair p is token p // k
        h = F.silu(_expert_linear_ref(xs, flat, *gate, inter)) * _expert_linear_ref(xs, flat, *up, inter)
        return _expert_linear_ref(h, flat, *down, hidden)
    if t * top_k <= MOE_PAIRS:
        if _in_blocks(t * top_k, gate[1], up[1], down[1]):
            return _pairs_in_blocks(x, experts, gate, up, down)
        from hf2q.kernels.quant.dp4a_triton import matvec

        return _swiglu_pairs(x, top_k, gate, up, down, functools.partial(matvec, experts=flat.to(torch.int32)))
    stacks = []
    for slot, (raw, qtype), shape in (("gate_exps", gate, (n_exp, inter, hidden)), ("up_exps", up, (n_exp, inter, hidden)),
                                      ("down_exps", down, (n_exp, hidden, inter))):
        buf = scratch(slot, n_exp * shape[1] * shape[2], x.dtype, x.device)
        stacks.append(dequantize(raw, qtype, shape, x.dtype, out=buf))
    return moe_ops.moe_expert_pairs(x, experts, *stacks)


def _in_blocks(pairs: int, *qtypes: str) -> bool:
    """Whether the pairs' experts are read once a block of pairs (kernels/quant/dp4a_experts_triton.py): from
    MOE_BLOCKS pairs (HF2Q_MOE_BLOCKS), K-quant stacks. Fewer pairs than that spread over nearly as many experts,
    and a block's four shared rows cost more than one pair's row."""
    from hf2q.kernels.quant import dp4a_experts_triton

    return MOE_BLOCKS is not None and pairs >= MOE_BLOCKS and dp4a_experts_triton.serves(*qtypes)


def _pairs_in_blocks(x: torch.Tensor, experts: torch.Tensor, gate: tuple, up: tuple, down: tuple) -> torch.Tensor:
    """The pairs' SwiGLU experts with the pairs laid out by expert once (moe/blocks_triton.py) for the gate and up
    launch and the down launch."""
    from hf2q.kernels.moe.blocks_triton import expert_blocks
    from hf2q.kernels.quant.dp4a_experts_triton import BM, experts_matvec

    t, top_k = experts.shape
    slots, blocks = expert_blocks(experts, gate[0].shape[0], BM)
    product = functools.partial(experts_matvec, slots=slots, block_experts=blocks, pairs=t * top_k)
    return _swiglu_pairs(x, top_k, gate, up, down, product)


def _swiglu_pairs(x: torch.Tensor, top_k: int, gate: tuple, up: tuple, down: tuple, product) -> torch.Tensor:
    """The pairs' SwiGLU experts through `product(xs, raw, qtype, n, out_dtype=, second=, rows_per_x=)`, one pair
    layout's int8 mat-vec: x quantized once, gate and up in one launch when their types read activations in the
    same order (also for two types; else one launch each), the SwiGLU writing the down projection's int8 rows,
    then the down projection."""
    from hf2q.kernels.quant.int8_rows import blocked_for, quantize_rows

    hidden, inter = x.shape[1], gate[0].shape[1]
    xs = quantize_rows(x, blocked=blocked_for(gate[1]))
    if blocked_for(gate[1]) == blocked_for(up[1]):
        gu = product(xs, *gate, inter, out_dtype=x.dtype, second=(up[0], inter, up[1]), rows_per_x=top_k)
        h = activation_ops.silu_mul(gu[:, :inter], gu[:, inter:], int8_for=down[1])
    else:
        h = activation_ops.silu_mul(product(xs, *gate, inter, out_dtype=x.dtype, rows_per_x=top_k),
                                    product(quantize_rows(x, blocked=blocked_for(up[1])), *up, inter,
                                            out_dtype=x.dtype, rows_per_x=top_k), int8_for=down[1])
    return product(quantize_rows(h, blocked=blocked_for(down[1])), *down, hidden, out_dtype=x.dtype)
