"""Sparse MoE: softmax router, top-k with renormalised probabilities, SwiGLU experts, gated shared expert."""
from __future__ import annotations

import torch
from torch import nn

from hf2q.kernels.linear import ops as linear_ops
from hf2q.kernels.moe import ops as moe_ops
from hf2q.kernels.moe import reference as moe_ref
from hf2q.kernels.quant.ops import int8_reader
from hf2q.layers.linear import Linear
from hf2q.layers.mlp import MLP

EXPERT_STACKS = ("gate_exps", "up_exps", "down_exps")


class MoE(nn.Module):
    """Expert stacks are dense parameters [experts, out, in], or GGUF blocks kept as bytes (buffers
    `gate_qexps` ..., uint8 [experts, out, row_bytes], types in `exps_qtype`) multiplied without
    dequantizing the whole stack."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, expert_dim: int, shared_dim: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden, self.expert_dim = hidden, expert_dim
        self.router = Linear(hidden, num_experts)
        # Stacked expert weights: [experts, out, in]
        self.gate_exps = nn.Parameter(torch.empty(num_experts, expert_dim, hidden), requires_grad=False)
        self.up_exps = nn.Parameter(torch.empty(num_experts, expert_dim, hidden), requires_grad=False)
        self.down_exps = nn.Parameter(torch.empty(num_experts, hidden, expert_dim), requires_grad=False)
        for name in EXPERT_STACKS:
            self.register_buffer(name.replace("_exps", "_qexps"), None)
        self.exps_qtype: dict[str, str] = {}
        self.shared = MLP(hidden, shared_dim) if shared_dim else None
        self.shared_gate = Linear(hidden, 1) if shared_dim else None

    def stack_shape(self, name: str) -> tuple[int, int, int]:
        if name == "down_exps":
            return self.num_experts, self.hidden, self.expert_dim
        return self.num_experts, self.expert_dim, self.hidden

    @property
    def quantized(self) -> bool:
        """Every expert stack is held as blocks (the quantized expert kernels need all three)."""
        return len(self.exps_qtype) == len(EXPERT_STACKS)

    def set_quantized(self, name: str, raw: torch.Tensor, qtype: str) -> None:
        """Hold expert stack `name` as `raw` blocks of `qtype` (its dense parameter is dropped)."""
        from hf2q.kernels.quant.ops import check_raw

        check_raw(raw, qtype, self.stack_shape(name))
        delattr(self, name)
        self.register_parameter(name, None)
        setattr(self, name.replace("_exps", "_qexps"), raw)
        self.exps_qtype[name] = qtype

    def quant_stack(self, name: str) -> tuple[torch.Tensor, str]:
        return getattr(self, name.replace("_exps", "_qexps")), self.exps_qtype[name]

    def dense_stack(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Stack `name` as values: the parameter, or its blocks dequantized (a file mixing kept and dense
        expert stacks; slow, but exact)."""
        if name not in self.exps_qtype:
            return getattr(self, name)
        from hf2q.kernels.quant.ops import dequantize

        return dequantize(*self.quant_stack(name), self.stack_shape(name), dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return moe_ref.route(self.router(x), self.top_k, x.dtype)

    def expert_pairs_quant(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """expert_k(x) of every token-expert pair [T·k, H] from the quantized stacks."""
        from hf2q.kernels.quant.moe import moe_expert_pairs_quant

        return moe_expert_pairs_quant(x, experts, *(self.quant_stack(n) for n in EXPERT_STACKS))

    @property
    def packs(self) -> tuple[tuple[Linear, ...], ...]:
        """The projections forward multiplies as one pack (linear_ops.pack): the router, with a shared
        expert its gate and the shared SwiGLU's gate and up (the shared MLP's own pack is not used)."""
        if self.shared is None:
            return ((self.router,),)
        return ((self.router, self.shared_gate, self.shared.gate, self.shared.up),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Router, shared-expert gate and shared gate+up in one packed GEMM, then routing, every token-expert
        pair's expert (straight from quantized blocks, through the expert GEMV for few pairs, grouped GEMMs
        for many, else the reference loop) and the weighted combine with the gated shared expert; each step's
        chooser runs its kernel or its exact reference (kernels/moe/ops.py)."""
        shared = self.shared
        if shared is None:
            outs = linear_ops.packed_linear(x, (self.router,))
        else:  # router, shared-expert gate and the shared expert's SwiGLU
            outs = linear_ops.packed_swiglu(x, (self.router, self.shared_gate, shared.gate, shared.up),
                                            int8_reader(x, shared.down.qtype))
        weights, experts = moe_ops.moe_route(outs[0], self.top_k, x.dtype)
        if self.quantized:
            pairs = self.expert_pairs_quant(x, experts)
        else:  # a stack kept as blocks next to dense ones is dequantized (slow, but exact)
            gate, up, down = (self.dense_stack(n, x.dtype) for n in EXPERT_STACKS)
            if (shared is None or not shared.down.quantized) and moe_ops.moe_pairs_by_gemv(x, experts, gate, up, down):
                # Few pairs, dense shared down: the pairs' down projections, the shared down and the combine
                # can be one launch.
                act = moe_ops.moe_pairs_swiglu(x, experts, gate, up)
                if shared is None:
                    return moe_ops.moe_down_combine(act, experts, weights, down)
                return moe_ops.moe_down_combine(act, experts, weights, down, outs[2], shared.down.weight, outs[1])
            pairs = moe_ops.moe_expert_pairs(x, experts, gate, up, down)
        if shared is None:
            return moe_ops.moe_combine(pairs, weights)
        return moe_ops.moe_combine(pairs, weights, shared.down(outs[2]), outs[1])
