"""Sparse-MoE routing, experts and combine: picks the Triton kernels (routing, combine, the expert GEMV
for few pairs), grouped GEMMs for many pairs on CUDA, or the references."""
from __future__ import annotations

import torch

from hf2q.kernels.choose import kernels_on
from hf2q.kernels.linear.ops import gemv_serves, linear
from hf2q.kernels.moe import reference


MOE_GEMV_PAIRS = 32  # token-expert pairs up to which each pair's experts are read by a GEMV (decode)


def moe_pairs_by_gemv(x, experts, gate_exps, up_exps, down_exps) -> bool:
    """Whether the pairs' experts are read by the expert GEMV: few pairs (decode) where Triton runs."""
    return (kernels_on(x) and experts.numel() <= MOE_GEMV_PAIRS and x.stride(-1) == 1 and gate_exps.stride(-1) == 1
            and up_exps.stride() == gate_exps.stride() and down_exps.stride(-1) == 1)


def moe_pairs_swiglu(x, experts, gate_exps, up_exps) -> torch.Tensor:
    """silu(x·gate_e)·(x·up_e) of every pair [T·k, I] in one expert GEMV launch (where moe_pairs_by_gemv)."""
    from hf2q.kernels.linear.gemv_triton import expert_gemv
    return expert_gemv(x, gate_exps, experts.reshape(-1).to(torch.int32), experts.shape[1], second=up_exps)


def moe_expert_pairs(x, experts, gate_exps, up_exps, down_exps):
    """Every token-expert pair's expert output [T·k, H] (pair p: token p // k, its (p % k)-th expert): a few
    pairs through the expert GEMV (gate, up and the SwiGLU in one launch), many through grouped GEMMs where the device
    has them, else a loop over the chosen experts."""
    if moe_pairs_by_gemv(x, experts, gate_exps, up_exps, down_exps):
        from hf2q.kernels.linear.gemv_triton import expert_gemv
        h = moe_pairs_swiglu(x, experts, gate_exps, up_exps)
        return expert_gemv(h, down_exps, experts.reshape(-1).to(torch.int32))
    if x.is_cuda:
        from hf2q.kernels.moe.grouped import grouped_mm_available, moe_expert_pairs_grouped
        if grouped_mm_available(x):
            return moe_expert_pairs_grouped(x, experts, gate_exps, up_exps, down_exps)
    return reference.expert_pairs(x, experts, gate_exps, up_exps, down_exps)


def moe_route(logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] renormalised over the top k, in dtype; experts [T, k])."""
    if kernels_on(logits) and logits.stride(-1) == 1:
        from hf2q.kernels.moe.route_triton import route
        return route(logits, top_k, dtype)
    return reference.route(logits, top_k, dtype)


def moe_combine(pairs: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None,
                shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k weights · pairs (pair outputs [T·k, H]) plus sigmoid(shared_gate) · shared when given."""
    if kernels_on(pairs) and pairs.is_contiguous() and (shared is None or shared.stride(-1) == 1):
        from hf2q.kernels.moe.route_triton import combine
        return combine(pairs, weights.contiguous(), shared, shared_gate)
    return reference.combine(pairs, weights, shared, shared_gate)


def moe_down_combine(h_pairs: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, down_exps: torch.Tensor,
                     shared_act: torch.Tensor | None = None, shared_down_weight: torch.Tensor | None = None,
                     shared_gate_logit: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE output from the pairs' SwiGLU activations h_pairs [T·k, I] (moe_pairs_swiglu): each pair's down
    projection, Σ_k weights · pair, plus sigmoid(shared_gate_logit) · (shared_act W_sharedᵀ) when given (a dense
    shared down weight). One launch (gemv_triton.expert_down_combine, no rounding of the products in between)
    where the dense shared down would be a Triton GEMV too (or there is none); otherwise the down GEMV, the
    shared down by linear/ops.linear (cuBLAS or the GEMV) and moe_combine, as three launches."""
    shared = shared_act is not None
    if (kernels_on(h_pairs) and h_pairs.stride(-1) == 1 and down_exps.stride(-1) == 1
            and (not shared or gemv_serves(shared_act, shared_down_weight))):
        from hf2q.kernels.linear.gemv_triton import expert_down_combine
        return expert_down_combine(h_pairs, down_exps, experts, weights, shared_act, shared_down_weight,
                                   shared_gate_logit)
    from hf2q.kernels.linear.gemv_triton import expert_gemv
    pairs = expert_gemv(h_pairs, down_exps, experts.reshape(-1).to(torch.int32))
    if not shared:
        return moe_combine(pairs, weights)
    return moe_combine(pairs, weights, linear(shared_act, shared_down_weight), shared_gate_logit)
