"""The DeltaNet's causal conv1d + SiLU over paged conv states, one token or many per sequence: picks the
Triton kernel or the reference."""
from __future__ import annotations

import torch

from hf2q.kernels.choose import kernels_on
from hf2q.kernels.conv.reference import causal_conv1d_varlen


def conv_decode_(x: torch.Tensor, weight: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """SiLU(causal conv) of one new input per sequence [B, C] -> fp32 [B, C]; updates state_pool[slots]."""
    if kernels_on(x) and weight.shape[1] == 4:
        from hf2q.kernels.conv.decode_triton import conv_decode_ as kernel
        return kernel(x, weight, state_pool, slots)
    return _conv_ref_(x, weight, state_pool, slots, [1] * x.shape[0])


def conv_varlen_(x: torch.Tensor, weight: torch.Tensor, state_pool, slots, cu_seqlens: torch.Tensor,
                 seq_lens: list[int]) -> torch.Tensor:
    """SiLU(causal conv) of N sequences end to end in x [T, C] -> [T, C] in x's dtype. Each sequence starts
    from state_pool[slots] ([S, K-1, C]) and its new state is written back there; state_pool None: zero
    states, nothing written."""
    if (kernels_on(x) and weight.shape[1] == 4 and x.stride(1) == 1
            and (state_pool is None or state_pool.stride(2) == 1)):
        from hf2q.kernels.conv.varlen_triton import conv_varlen_ as kernel
        return kernel(x, weight, state_pool, slots, cu_seqlens)
    return _conv_ref_(x, weight, state_pool, slots, seq_lens).to(x.dtype)


def _conv_ref_(x, weight, state_pool, slots, seq_lens: list[int]) -> torch.Tensor:
    """The reference conv of conv_decode_ and conv_varlen_: fp32 [T, C]; new states written to state_pool."""
    states = state_pool[slots] if state_pool is not None else None
    y, new = causal_conv1d_varlen(x, states, weight, seq_lens)
    if state_pool is not None:
        state_pool.index_copy_(0, slots, new.to(state_pool.dtype))
    return y
