"""The Gated DeltaNet's delta rule: one token per sequence (the fused Triton decode step, with the conv
folded in), a graph-replayed step's few rows per sequence on the pools in place (the Triton verify step,
conv folded in; a verify keeps the states after its first rows), or many (fla's chunked kernel), else the
reference.

A slot pool holds its recurrent states in fp32 or bf16 (STATE_DTYPES); the arithmetic is fp32 either way: a step
loads the state, widens it, updates it and rounds it once to the pool's dtype when it stores it. Graph-replayed
steps and the reference round after every token, as that many decode steps would; fla's chunked kernel rounds
once, at the end of its chunk (the caller's store)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hf2q.kernels.choose import kernels_on
from hf2q.kernels.conv.ops import conv_decode_
from hf2q.kernels.conv.reference import causal_conv1d_varlen
from hf2q.kernels.gdn.reference import gated_delta_rule_ref, l2_normalize
from hf2q.kernels.norm import reference as norm_ref

STATE_DTYPES = (torch.float32, torch.bfloat16)  # the recurrent state pools the Triton steps read and write


def gdn_conv_decode_(x, conv_w, conv_pool, a_raw, b_raw, A, dt_bias, z, norm_w, state_pool, slots, nk: int, dk: int,
                     eps: float, out_dtype: torch.dtype, int8_for: str | None = None) -> torch.Tensor:
    """conv_decode_ then gdn_decode_ of the qkv projection x [B, C], in one kernel where Triton runs (one
    launch per layer fewer); conv_pool and state_pool updated in place at `slots`. int8_for: the output
    feeds the int8 mat-vec of a weight of that type (quant_ops.int8_reader); the kernel also writes its
    int8 rows."""
    if (kernels_on(x) and conv_w.shape[1] == 4 and state_pool.dtype in STATE_DTYPES and x.stride(1) == 1
            and conv_pool.stride(2) == 1):
        from hf2q.kernels.gdn.decode_triton import gdn_conv_decode_ as kernel
        return kernel(x, conv_w, conv_pool, a_raw, b_raw, A, dt_bias, z, norm_w, state_pool, slots, nk, dk, eps,
                      out_dtype, int8_for)
    return gdn_decode_(conv_decode_(x, conv_w, conv_pool, slots), a_raw, b_raw, A, dt_bias, z, norm_w, state_pool,
                       slots, nk, dk, eps, out_dtype)


def gdn_decode_(qkv, a_raw, b_raw, A, dt_bias, z, norm_w, state_pool, slots, nk: int, dk: int, eps: float,
                out_dtype: torch.dtype) -> torch.Tensor:
    """Fused decode step of every sequence (see gdn_decode_triton); state_pool[slots] updated in place."""
    if kernels_on(qkv) and state_pool.dtype in STATE_DTYPES:
        from hf2q.kernels.gdn.decode_triton import gdn_decode_ as kernel
        return kernel(qkv, a_raw, b_raw, A, dt_bias, z, norm_w, state_pool, slots, nk, dk, eps, out_dtype)
    bsz, nv, dv = qkv.shape[0], state_pool.shape[1], state_pool.shape[3]
    rep = nv // nk
    q, k, v = torch.split(qkv.float(), [nk * dk, nk * dk, nv * dv], dim=-1)
    q, k = q.view(bsz, nk, dk), k.view(bsz, nk, dk)
    q = (l2_normalize(q, eps) * dk ** -0.5).repeat(1, rep, 1)
    k = l2_normalize(k, eps).repeat(1, rep, 1)
    g = A.float() * F.softplus(a_raw.float() + dt_bias.float())
    beta = torch.sigmoid(b_raw.float())
    heads = bsz * nv  # one token per sequence: the sequences ride the reference's head axis
    state = state_pool[slots].reshape(heads, dk, dv)
    o, s, _ = gated_delta_rule_ref(q.reshape(1, heads, dk), k.reshape(1, heads, dk), v.reshape(1, heads, dv),
                                   g.reshape(1, heads), beta.reshape(1, heads), state, store_dtype=state_pool.dtype)
    state_pool.index_copy_(0, slots, s.view(bsz, nv, dk, dv).to(state_pool.dtype))
    return norm_ref.gated_rms_norm(o.view(bsz, nv, dv), z, norm_w, eps, out_dtype)


def chunk_gdn(q, k, v, g, beta, initial_state, cu_seqlens, seq_lens: list[int], scale: float, eps: float,
              store_dtype: torch.dtype = torch.float32):
    """q, k: [T, nk, dk] raw; v: [T, nv, dv]; g, beta: [T, nv]; initial_state: [N, nv, dk, dv]; store_dtype: the
    slots' state dtype (the reference rounds to it after every token, fla's kernel leaves that to the caller's
    store). Returns (o [T, nv, dv] in v's dtype, final states [N, nv, dk, dv] fp32)."""
    if q.is_cuda:
        from hf2q.kernels.gdn.chunked_fla import chunk_gdn as kernel
        return kernel(q, k, v, g, beta, initial_state, cu_seqlens, scale, seq_lens)
    return chunk_gdn_reference(q, k, v, g, beta, initial_state, cu_seqlens, seq_lens, scale, eps, store_dtype)


def chunk_gdn_reference(q, k, v, g, beta, initial_state, cu_seqlens, seq_lens: list[int], scale: float, eps: float,
                        store_dtype: torch.dtype = torch.float32):
    """`chunk_gdn` by the reference recurrence, one sequence at a time, on any device (fp32 inside)."""
    rep = v.shape[1] // q.shape[1]
    qf = l2_normalize(q.float(), eps) * scale
    kf = l2_normalize(k.float(), eps)
    qf, kf = qf.repeat(1, rep, 1), kf.repeat(1, rep, 1)
    out, finals, row = torch.empty_like(v), [], 0
    for i, n in enumerate(seq_lens):
        r = slice(row, row + n)
        o, s, _ = gated_delta_rule_ref(qf[r], kf[r], v[r], g[r], beta[r], initial_state[i], store_dtype=store_dtype)
        out[r], row = o, row + n
        finals.append(s)
    return out, torch.stack(finals) if finals else initial_state.float()


def gdn_verify_(x, conv_w, conv_pool, a_raw, b_raw, A, dt_bias, state_pool, slots, cu_seqlens, live: int, kept_conv,
                kept_rec, nk: int, dk: int, eps: float, keep=None) -> torch.Tensor:
    """A graph-replayed step's conv and delta rule on the pools in place, keeping each sequence's states after
    its first rows where the kept buffers have room (a verify; empty buffers for a prefill graph's step), and
    with `keep` the states after one row of one sequence (a prefill graph's checkpoint inside a chunk), the
    contract of verify_triton.gdn_verify_; returns the read-outs o [T, nv, dv] fp32."""
    if (kernels_on(x) and conv_w.shape[1] == 4 and state_pool.dtype in STATE_DTYPES and x.stride(1) == 1
            and conv_pool.stride(2) == 1):
        from hf2q.kernels.gdn.verify_triton import gdn_verify_ as kernel
        return kernel(x, conv_w, conv_pool, a_raw, b_raw, A, dt_bias, state_pool, slots, cu_seqlens, live,
                      kept_conv, kept_rec, nk, dk, eps, keep)
    return gdn_verify_reference(x, conv_w, conv_pool, a_raw, b_raw, A, dt_bias, state_pool, slots, cu_seqlens,
                                live, kept_conv, kept_rec, nk, dk, eps, keep)


def gdn_verify_reference(x, conv_w, conv_pool, a_raw, b_raw, A, dt_bias, state_pool, slots, cu_seqlens, live: int,
                         kept_conv, kept_rec, nk: int, dk: int, eps: float, keep=None) -> torch.Tensor:
    """`gdn_verify_` by the reference conv and recurrence, one sequence at a time, on any device (fp32 inside;
    reads the row offsets on the host)."""
    nv, dv = state_pool.shape[1], state_pool.shape[3]
    prefixes, km1 = kept_rec.shape[0] // live, conv_pool.shape[1]
    out = torch.zeros(x.shape[0], nv, dv, dtype=torch.float32, device=x.device)
    cu = cu_seqlens.tolist()
    keep_i, keep_t = keep[0].tolist() if keep is not None else (-1, -1)
    for i, slot in enumerate(slots[:live].tolist()):
        start, end = cu[i], cu[i + 1]
        if start == end:
            continue
        n, old = end - start, conv_pool[slot:slot + 1]
        y, conv_new = causal_conv1d_varlen(x[start:end], old, conv_w, [n])
        q, k, v = torch.split(y, [nk * dk, nk * dk, nv * dv], dim=-1)
        q = (l2_normalize(q.view(n, nk, dk), eps) * dk ** -0.5).repeat(1, nv // nk, 1)
        k = l2_normalize(k.view(n, nk, dk), eps).repeat(1, nv // nk, 1)
        g = A.float() * F.softplus(a_raw[start:end].float() + dt_bias.float())
        o, final, states = gated_delta_rule_ref(q, k, v.view(n, nv, dv), g, torch.sigmoid(b_raw[start:end].float()),
                                                state_pool[slot], capture=True, store_dtype=state_pool.dtype)
        inputs = torch.cat((old[0], x[start:end].to(old.dtype)))  # the conv's inputs: old state, then the rows
        for t in range(min(n - 1, prefixes)):
            kept_rec[prefixes * i + t] = states[t]
            kept_conv[prefixes * i + t] = inputs[t + 1:t + 1 + km1]
        if i == keep_i and 0 <= keep_t < n:
            keep[1].copy_(inputs[keep_t + 1:keep_t + 1 + km1])
            keep[2].copy_(states[keep_t])
        out[start:end] = o
        state_pool[slot] = final.to(state_pool.dtype)
        conv_pool[slot] = conv_new[0].to(conv_pool.dtype)
    return out
