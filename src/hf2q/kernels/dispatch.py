"""Picks the implementation of each vectorised op by device, importing Triton and fla only when used.

The layers call these functions on their fast path (CUDA by default). Each op has a plain torch
version with the same contract: it runs where Triton cannot (CPU), and it is what the Triton kernels
are tested against; `choose.triton_runs` decides between the two and `choose.fast_path` sets the
layers' vectorised path.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from hf2q import envs
from hf2q.kernels.choose import fast_path, triton_runs, use_fast_path  # noqa: F401 (fast_path, use_fast_path: re-exported)
from hf2q.kernels.conv.reference import causal_conv1d_varlen
from hf2q.kernels.gdn.reference import gated_delta_rule_ref, l2_normalize
from hf2q.kernels.moe import reference as moe_ref
from hf2q.kernels.norm import reference as norm_ref
from hf2q.kernels.norm.reference import rms_norm
from hf2q.kernels.rotary.reference import apply_rotary

# The Triton GEMV for few rows of x. By default ("measured") it serves the shapes its table records as
# faster than cuBLAS on the device (2B, one row: 20% faster); HF2Q_GEMV=N sends every product of at most
# N (0..4) rows to it, HF2Q_GEMV=0 none.
_GEMV = {"rows": envs.gemv_rows()}


@contextlib.contextmanager
def gemv_switch(rows):
    """Temporarily send products of at most `rows` rows (0: none; "measured": the table's faster shapes)
    to the Triton GEMV, as HF2Q_GEMV does."""
    old, _GEMV["rows"] = _GEMV["rows"], rows
    try:
        yield
    finally:
        _GEMV["rows"] = old


def _gemv_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x Wᵀ goes to the Triton GEMV: a few bf16 rows where Triton runs and the HF2Q_GEMV setting
    sends them."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (1 <= rows <= 4 and triton_runs(x) and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and x.stride(-1) == 1 and weight.stride(-1) == 1):
        return False
    from hf2q.kernels.linear import gemv_triton
    limit = _GEMV["rows"]
    if limit == "measured":
        return gemv_triton.measured_faster(weight.shape[0], x.shape[-1], rows)
    return rows <= limit


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x Wᵀ for a dense weight [N, K], in out_dtype (default x's): the Triton GEMV for a few bf16 rows on
    CUDA where the HF2Q_GEMV setting sends them (one kernel, no split-K reduce), cuBLAS otherwise."""
    if _gemv_serves(x, weight):
        from hf2q.kernels.linear.gemv_triton import gemv
        return gemv(x, weight, out_dtype)
    y = F.linear(x, weight)
    return y if out_dtype is None else y.to(out_dtype)


def packed_linear(x: torch.Tensor, linears) -> tuple[torch.Tensor, ...]:
    """Several projections of the same input as one GEMM. On first use their weights are concatenated
    once and each Linear's weight becomes a view of the packed matrix (no second copy). Quantized
    projections of one type pack their blocks the same way (rows are whole blocks); a pack mixing
    types packs each type's projections together (llama.cpp's Q4_K_M gives the DeltaNet qkv Q5_K and
    its z, alpha and beta Q4_K), and its dense projections together (a MoE's router and shared-expert
    gate, kept in float: one product instead of two)."""
    if any(lin.quantized for lin in linears):
        return _packed_by_type(x, linears)
    out = linear(x, _pack(x, linears))
    return torch.split(out, [lin.weight.shape[0] for lin in linears], dim=-1)


def packed_swiglu(x: torch.Tensor, linears, int8_for: str | None = None) -> tuple[torch.Tensor, ...]:
    """packed_linear of `linears` whose last two are a SwiGLU's gate and up -> the other projections'
    outputs, then silu(gate) * up. Where the GEMV serves the pack at one row, the SwiGLU is its epilogue
    (gemv_triton.gemv_glu): one launch, no activation launch after it. Elsewhere the pack's product and
    silu_mul run as two steps; with int8_for (the result feeds the int8 mat-vec of a weight of that type)
    too, since silu_mul also writes the int8 rows."""
    gate, up = linears[-2], linears[-1]
    if (int8_for is None and not any(lin.quantized for lin in linears) and x.numel() == x.shape[-1]
            and gate.weight.shape == up.weight.shape):
        packed = _pack(x, linears)
        if _gemv_serves(x, packed):
            from hf2q.kernels.linear.gemv_triton import gemv_glu
            sizes = [lin.weight.shape[0] for lin in linears[:-1]]
            return torch.split(gemv_glu(x, packed, sum(sizes[:-1])), sizes, dim=-1)
    *others, g, u = packed_linear(x, linears)
    return (*others, silu_mul(g, u, int8_for))


def _pack(x: torch.Tensor, linears) -> torch.Tensor:
    """The dense projections' weights concatenated (made on first use; each weight then a view of it)."""
    first = linears[0]
    packed = getattr(first, "_packed", None)
    if packed is None or packed.device != x.device or not _views_of(packed, [lin.weight for lin in linears]):
        packed = torch.cat([lin.weight.data for lin in linears])
        row = 0
        for lin in linears:
            n = lin.weight.shape[0]
            lin.weight = torch.nn.Parameter(packed[row:row + n], requires_grad=False)
            row += n
        first._packed = packed
    return packed


def _views_of(packed: torch.Tensor, parts) -> bool:
    """Whether `parts` are, in order, consecutive row blocks of `packed` (the pack made for exactly these
    projections: a projection shared by two packs, such as a router replicated across tensor-parallel
    shards, must not pick up another pack)."""
    row_bytes = packed.stride(0) * packed.element_size()
    ptr = packed.data_ptr()
    for part in parts:
        if part.data_ptr() != ptr:
            return False
        ptr += part.shape[0] * row_bytes
    return ptr == packed.data_ptr() + packed.shape[0] * row_bytes


def _packed_by_type(x: torch.Tensor, linears) -> tuple[torch.Tensor, ...]:
    groups: dict[str | None, list[int]] = {}
    for i, lin in enumerate(linears):
        groups.setdefault(lin.qtype if lin.quantized else None, []).append(i)
    if len(groups) == 1:
        return _packed_quant_linear(x, linears)
    out: list = [None] * len(linears)
    quant = [(qtype, idx) for qtype, idx in groups.items() if qtype is not None]
    if len(quant) == 2:  # two types (a DeltaNet's Q5_K qkv and Q4_K z/a/b): one launch where the mat-vec serves
        from hf2q.kernels.quant.ops import quant_linear_pair

        parts = [[linears[i] for i in idx] for _, idx in quant]
        sizes = [[lin.out_features for lin in part] for part in parts]
        weights = [(_packed_raw(part), qtype, sum(n)) for part, (qtype, _), n in zip(parts, quant, sizes)]
        y = quant_linear_pair(x, *weights)
        if y is not None:
            for i, r in zip(quant[0][1] + quant[1][1], torch.split(y, sizes[0] + sizes[1], dim=-1)):
                out[i] = r
            groups = {None: groups[None]} if None in groups else {}
    for qtype, idx in groups.items():
        if len(idx) == 1:
            results = [linears[idx[0]](x)]
        elif qtype is None:
            results = packed_linear(x, [linears[i] for i in idx])
        else:
            results = _packed_quant_linear(x, [linears[i] for i in idx])
        for i, r in zip(idx, results):
            out[i] = r
    return tuple(out)


def _packed_quant_linear(x: torch.Tensor, linears) -> tuple[torch.Tensor, ...]:
    """packed_linear for projections quantized as one type (see _packed_raw)."""
    from hf2q.kernels.quant.ops import quant_linear

    sizes = [lin.out_features for lin in linears]
    out = quant_linear(x, _packed_raw(linears), linears[0].qtype, sum(sizes))
    return torch.split(out, sizes, dim=-1)


def _packed_raw(linears) -> torch.Tensor:
    """The block rows of projections quantized as one type, concatenated once (made on first use; each
    Linear's qweight then a view of the packed blocks); a lone projection's own blocks."""
    first = linears[0]
    if len(linears) == 1:
        return first.qweight
    packed = getattr(first, "_qpacked", None)
    parts = [lin.qweight for lin in linears]
    if packed is None or packed.device != parts[0].device or not _views_of(packed, parts):
        packed = torch.cat(parts)
        row = 0
        for lin in linears:
            n = lin.out_features
            lin.qweight = packed[row:row + n]
            row += n
        first._qpacked = packed
    return packed


# ---- residual add + RMSNorm, activation -------------------------------------------------------------
def add_rms_norm(x: torch.Tensor, add, weight: torch.Tensor, eps: float,
                 int8_for: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + add, rms_norm(x + add)): the new residual and the block input; add None: (x, rms_norm(x)).
    int8_for: the block input feeds the int8 mat-vec of a weight of that type (quant_ops.int8_reader); the
    kernel also writes its int8 rows."""
    if triton_runs(x) and x.dim() == 2 and x.stride(1) == 1 and (add is None or add.stride(1) == 1):
        from hf2q.kernels.norm.add_rms_triton import add_rms_norm as kernel
        return kernel(x, add, weight, eps, int8_for)
    if add is not None:
        x = x + add
    return x, rms_norm(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, int8_for: str | None = None) -> torch.Tensor:
    """SwiGLU activation silu(gate) * up. int8_for: the result feeds the int8 mat-vec of a weight of that
    type; the kernel also writes its int8 rows."""
    if triton_runs(gate) and gate.stride(-1) == 1 and up.stride(-1) == 1:
        from hf2q.kernels.activation.swiglu_triton import silu_mul as kernel
        return kernel(gate, up, int8_for)
    return F.silu(gate) * up


# ---- attention q/k preparation ----------------------------------------------------------------------
def qk_norm_rope(q, k, v, q_w, k_w, cos, sin, eps: float, rotary_dim: int, pools=None):
    """Per-head RMSNorm and partial RoPE of q [T, nh, hd] and k [T, nkv, hd]; with pools (k_rows, v_rows,
    slot_mapping) also writes each token's K/V row into the paged pool. Returns (q, k)."""
    if triton_runs(q) and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1:
        from hf2q.kernels.rotary.qk_rope_triton import qk_norm_rope as kernel
        return kernel(q, k, v, q_w, k_w, cos, sin, eps, rotary_dim, pools)
    q = apply_rotary(rms_norm(q, q_w, eps), cos, sin, rotary_dim)
    k = apply_rotary(rms_norm(k, k_w, eps), cos, sin, rotary_dim)
    if pools is not None:
        k_rows, v_rows, mapping = pools
        k_rows.index_copy_(0, mapping, k.to(k_rows.dtype))
        v_rows.index_copy_(0, mapping, v.to(v_rows.dtype))
    return q, k


# ---- causal conv1d, one token per sequence ---------------------------------------------------------
def conv_decode_(x: torch.Tensor, weight: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """SiLU(causal conv) of one new input per sequence [B, C] -> fp32 [B, C]; updates state_pool[slots]."""
    if triton_runs(x) and weight.shape[1] == 4:
        from hf2q.kernels.conv.decode_triton import conv_decode_ as kernel
        return kernel(x, weight, state_pool, slots)
    return _conv_ref_(x, weight, state_pool, slots, [1] * x.shape[0])


# ---- causal conv1d, many tokens per sequence ------------------------------------------------------
def conv_varlen_(x: torch.Tensor, weight: torch.Tensor, state_pool, slots, cu_seqlens: torch.Tensor,
                 seq_lens: list[int]) -> torch.Tensor:
    """SiLU(causal conv) of N sequences end to end in x [T, C] -> [T, C] in x's dtype. Each sequence starts
    from state_pool[slots] ([S, K-1, C]) and its new state is written back there; state_pool None: zero
    states, nothing written."""
    if (triton_runs(x) and weight.shape[1] == 4 and x.stride(1) == 1
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


# ---- Gated DeltaNet, one token per sequence ---------------------------------------------------------
def gdn_conv_decode_(x, conv_w, conv_pool, a_raw, b_raw, A, dt_bias, z, norm_w, state_pool, slots, nk: int, dk: int,
                     eps: float, out_dtype: torch.dtype, int8_for: str | None = None) -> torch.Tensor:
    """conv_decode_ then gdn_decode_ of the qkv projection x [B, C], in one kernel where Triton runs (one
    launch per layer fewer); conv_pool and state_pool updated in place at `slots`. int8_for: the output
    feeds the int8 mat-vec of a weight of that type (quant_ops.int8_reader); the kernel also writes its
    int8 rows."""
    if (triton_runs(x) and conv_w.shape[1] == 4 and state_pool.dtype == torch.float32 and x.stride(1) == 1
            and conv_pool.stride(2) == 1):
        from hf2q.kernels.gdn.decode_triton import gdn_conv_decode_ as kernel
        return kernel(x, conv_w, conv_pool, a_raw, b_raw, A, dt_bias, z, norm_w, state_pool, slots, nk, dk, eps,
                      out_dtype, int8_for)
    return gdn_decode_(conv_decode_(x, conv_w, conv_pool, slots), a_raw, b_raw, A, dt_bias, z, norm_w, state_pool,
                       slots, nk, dk, eps, out_dtype)


def gdn_decode_(qkv, a_raw, b_raw, A, dt_bias, z, norm_w, state_pool, slots, nk: int, dk: int, eps: float,
                out_dtype: torch.dtype) -> torch.Tensor:
    """Fused decode step of every sequence (see gdn_decode_triton); state_pool[slots] updated in place."""
    if triton_runs(qkv) and state_pool.dtype == torch.float32:
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
    s = state_pool[slots].float() * g.exp()[..., None, None]
    delta = (v.view(bsz, nv, dv) - torch.einsum("bhkv,bhk->bhv", s, k)) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    state_pool.index_copy_(0, slots, s.to(state_pool.dtype))
    return norm_ref.gated_rms_norm(torch.einsum("bhkv,bhk->bhv", s, q), z, norm_w, eps, out_dtype)


# ---- Gated DeltaNet, many tokens per sequence -------------------------------------------------------
def chunk_gdn(q, k, v, g, beta, initial_state, cu_seqlens, seq_lens: list[int], scale: float, eps: float):
    """q, k: [T, nk, dk] raw; v: [T, nv, dv]; g, beta: [T, nv]; initial_state: [N, nv, dk, dv].
    Returns (o [T, nv, dv] in v's dtype, final states [N, nv, dk, dv] fp32)."""
    if q.is_cuda:
        from hf2q.kernels.gdn.chunked_fla import chunk_gdn as kernel
        return kernel(q, k, v, g, beta, initial_state, cu_seqlens, scale)
    rep = v.shape[1] // q.shape[1]
    qf = l2_normalize(q.float(), eps) * scale
    kf = l2_normalize(k.float(), eps)
    qf, kf = qf.repeat(1, rep, 1), kf.repeat(1, rep, 1)
    out, finals, row = torch.empty_like(v), [], 0
    for i, n in enumerate(seq_lens):
        r = slice(row, row + n)
        o, s, _ = gated_delta_rule_ref(qf[r], kf[r], v[r], g[r], beta[r], initial_state[i])
        out[r], row = o, row + n
        finals.append(s)
    return out, torch.stack(finals) if finals else initial_state.float()


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """Per-head rms_norm(o) * weight * silu(z) of the DeltaNet output: o [T, H, D], z [T, H * D]
    -> [T, H * D] in out_dtype."""
    if triton_runs(o) and o.stride(2) == 1 and z.stride(1) == 1:
        from hf2q.kernels.norm.gated_triton import gated_rms_norm as kernel
        return kernel(o, z, weight, eps, out_dtype)
    return norm_ref.gated_rms_norm(o, z, weight, eps, out_dtype)


# ---- paged attention, one query per sequence --------------------------------------------------------
def paged_decode_attention(q, k_rows, v_rows, block_tables, context_lens, block_size: int, scale: float,
                           gate=None):
    """q: [B, nh, hd]; k_rows/v_rows: flat pools [rows, nkv, hd]. Returns [B, nh, hd], times sigmoid(gate)
    ([B, nh, hd]) when given."""
    if triton_runs(q):
        from hf2q.kernels.attention.paged_triton import paged_decode_attention as kernel
        return kernel(q, k_rows, v_rows, block_tables, context_lens, block_size, scale, gate=gate)
    longest = block_tables.shape[1] * block_size
    pos = torch.arange(longest, device=q.device)
    rows = block_tables.long()[:, pos // block_size] * block_size + pos % block_size  # [B, L]
    keys, values = k_rows[rows].to(q.dtype), v_rows[rows].to(q.dtype)  # [B, L, nkv, hd]
    mask = (pos[None, :] < context_lens[:, None].long())[:, None, None, :]  # [B, 1, 1, L]
    o = F.scaled_dot_product_attention(q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
                                       attn_mask=mask, scale=scale, enable_gqa=True)[:, :, 0]
    return o if gate is None else o * torch.sigmoid(gate)


# ---- MoE experts -------------------------------------------------------------------------------------
MOE_GEMV_PAIRS = 32  # token-expert pairs up to which each pair's experts are read by a GEMV (decode)


def moe_pairs_by_gemv(x, experts, gate_exps, up_exps, down_exps) -> bool:
    """Whether the pairs' experts are read by the expert GEMV: few pairs (decode) where Triton runs."""
    return (triton_runs(x) and experts.numel() <= MOE_GEMV_PAIRS and x.stride(-1) == 1 and gate_exps.stride(-1) == 1
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
    return moe_ref.expert_pairs(x, experts, gate_exps, up_exps, down_exps)


def moe_route(logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] renormalised over the top k, in dtype; experts [T, k])."""
    if triton_runs(logits) and logits.stride(-1) == 1:
        from hf2q.kernels.moe.route_triton import route
        return route(logits, top_k, dtype)
    return moe_ref.route(logits, top_k, dtype)


def moe_combine(pairs: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None = None,
                shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k weights · pairs (pair outputs [T·k, H]) plus sigmoid(shared_gate) · shared when given."""
    if triton_runs(pairs) and pairs.is_contiguous() and (shared is None or shared.stride(-1) == 1):
        from hf2q.kernels.moe.route_triton import combine
        return combine(pairs, weights.contiguous(), shared, shared_gate)
    return moe_ref.combine(pairs, weights, shared, shared_gate)


def moe_down_combine(h_pairs: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, down_exps: torch.Tensor,
                     shared_act: torch.Tensor | None = None, shared_down_weight: torch.Tensor | None = None,
                     shared_gate_logit: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE output from the pairs' SwiGLU activations h_pairs [T·k, I] (moe_pairs_swiglu): each pair's down
    projection, Σ_k weights · pair, plus sigmoid(shared_gate_logit) · (shared_act W_sharedᵀ) when given (a dense
    shared down weight). One launch (gemv_triton.expert_down_combine, no rounding of the products in between)
    where the dense shared down would be a Triton GEMV too (or there is none); otherwise the down GEMV, the
    shared down by dispatch.linear (cuBLAS or the GEMV) and moe_combine, as three launches."""
    shared = shared_act is not None
    if (triton_runs(h_pairs) and h_pairs.stride(-1) == 1 and down_exps.stride(-1) == 1
            and (not shared or _gemv_serves(shared_act, shared_down_weight))):
        from hf2q.kernels.linear.gemv_triton import expert_down_combine
        return expert_down_combine(h_pairs, down_exps, experts, weights, shared_act, shared_down_weight,
                                   shared_gate_logit)
    from hf2q.kernels.linear.gemv_triton import expert_gemv
    pairs = expert_gemv(h_pairs, down_exps, experts.reshape(-1).to(torch.int32))
    if not shared:
        return moe_combine(pairs, weights)
    return moe_combine(pairs, weights, linear(shared_act, shared_down_weight), shared_gate_logit)
