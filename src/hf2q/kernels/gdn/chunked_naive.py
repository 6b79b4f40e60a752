"""Gated DeltaNet over many tokens through fla's PyTorch chunked form (`naive_chunk_gated_delta_rule`), for
training only: autograd differentiates it, so gradients need none of fla's Triton backward kernels, which
fla refuses to run on Hopper with Triton >= 3.4.0 and < 3.7.1 (wrong results there, fla issue 640).
Slower than the kernel and in fp32 throughout; serving never calls it.
"""
from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from hf2q.kernels.gdn.reference import l2_normalize


def fla_backward_refused() -> bool:
    """Whether fla's gated chunked backward raises on this machine, by fla's own flags (a Hopper GPU and
    Triton in [3.4.0, 3.7.1)); False where fla is not importable."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:
        return False
    return bool(IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)


def chunk_gdn_naive(q, k, v, g, beta, initial_state, cu_seqlens, seq_lens: list[int], scale: float, eps: float):
    """`ops.chunk_gdn`'s contract: q, k: [T, nk, dk] raw; v: [T, nv, dv]; g, beta: [T, nv]; initial_state:
    [N, nv, dk, dv]; sequences laid end to end (`seq_lens`, `cu_seqlens` their offsets). Returns (o [T, nv, dv]
    in v's dtype, final states [N, nv, dk, dv] fp32). q/k are L2-normalised and q scaled as the reference
    does; value heads tile the key heads (h % nk), as GGUF files order them."""
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule

    assert cu_seqlens.numel() == len(seq_lens) + 1 and sum(seq_lens) == q.shape[0], "seq_lens and cu_seqlens disagree"
    rep = v.shape[1] // q.shape[1]
    with torch.autocast(q.device.type, enabled=False):  # the state recurrence stays fp32 under bf16 autocast
        qn = l2_normalize(q.float(), eps).repeat(1, rep, 1)
        kn = l2_normalize(k.float(), eps).repeat(1, rep, 1)
        # [T, ...] -> [N, max len, ...]: the zero padding (g = 0, beta = 0, k = 0) leaves each state as it was
        q_, k_, v_, g_, b_ = (pad_sequence(x.split(seq_lens), batch_first=True)
                              for x in (qn, kn, v.float(), g.float(), beta.float()))
        o, final = naive_chunk_gated_delta_rule(q_, k_, v_, g_, b_, scale=scale,
                                                initial_state=initial_state.float(), output_final_state=True)
    out = torch.cat([o[i, :n] for i, n in enumerate(seq_lens)])  # [N, max len, nv, dv] -> [T, nv, dv]
    return out.to(v.dtype), final
