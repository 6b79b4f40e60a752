"""Gated full attention of Qwen3.5: fused q+gate projection, per-head q/k RMSNorm, partial IMRoPE, GQA,
sigmoid output gate. K/V live in the paged pool of the hybrid cache."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf2q.config import ModelConfig
from hf2q.forward import ForwardBatch
from hf2q.kernels import choose
from hf2q.kernels.attention import ops as attention_ops
from hf2q.kernels.linear import ops as linear_ops
from hf2q.kernels.meta import fast_meta
from hf2q.kernels.rotary import ops as rotary_ops
from hf2q.layers.linear import Linear
from hf2q.layers.norm import rms_norm
from hf2q.layers.rotary import RotaryEmbedding


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.layer_id = layer_id
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.q = Linear(cfg.hidden_size, 2 * self.nh * self.hd)  # per head: [q (hd), gate (hd)]
        self.k = Linear(cfg.hidden_size, self.nkv * self.hd)
        self.v = Linear(cfg.hidden_size, self.nkv * self.hd)
        self.o = Linear(self.nh * self.hd, cfg.hidden_size)
        self.q_norm = nn.Parameter(torch.ones(self.hd), requires_grad=False)
        self.k_norm = nn.Parameter(torch.ones(self.hd), requires_grad=False)
        self.rotary = rotary

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        if choose.use_fast_path(x):  # one GEMM for q+gate, k and v
            return self._forward_fast(*linear_ops.packed_linear(x, (self.q, self.k, self.v)), batch, cos, sin)
        qg = self.q(x).reshape(t, self.nh, 2 * self.hd)
        q, gate = qg[..., : self.hd], qg[..., self.hd:].reshape(t, self.nh * self.hd)
        q = self.rotary.apply(rms_norm(q, self.q_norm, self.eps), cos, sin)
        k = self.rotary.apply(rms_norm(self.k(x).reshape(t, self.nkv, self.hd), self.k_norm, self.eps), cos, sin)
        v = self.v(x).reshape(t, self.nkv, self.hd)
        out = torch.empty(t, self.nh, self.hd, dtype=x.dtype, device=x.device)
        cache = batch.cache
        for i, row, n, start, slot in batch.segments():
            rows = slice(row, row + n)
            if cache is None:
                keys, values = k[rows], v[rows]
            else:
                keys, values = self._update_cache(cache, slot, start, n, k[rows], v[rows])
            out[rows] = self._attend(q[rows], keys, values, start)
        return self.o((out.reshape(t, -1) * torch.sigmoid(gate)))

    def _update_cache(self, cache, slot: int, start: int, n: int, k: torch.Tensor, v: torch.Tensor):
        i = cache.kv_index(self.layer_id)
        cache.kv.store(i, cache.token_indices(slot, start, start + n), k, v)
        return cache.kv.gather(i, cache.token_indices(slot, 0, start + n), k.dtype)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """q: [n, nh, hd] at positions start.., k/v: [start + n, nkv, hd]. Causal, GQA."""
        n, total = q.shape[0], k.shape[0]
        rep = self.nh // self.nkv
        kh = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [nh, total, hd]
        vh = v.repeat_interleave(rep, dim=1).transpose(0, 1)
        qh = q.transpose(0, 1)  # [nh, n, hd]
        mask = torch.arange(total, device=q.device)[None, :] <= (start + torch.arange(n, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.hd ** -0.5)
        return o.transpose(0, 1)

    def _forward_fast(self, qg, k_lin, v_lin, batch: ForwardBatch, cos, sin) -> torch.Tensor:
        """q/k norm + RoPE + K/V write in one kernel (a compressed pool: the store kernel encodes the rows after
        it); decode reads the paged pool directly (the output gate in its epilogue), prefill uses SDPA, over the
        pool's decoded rows where the pool is compressed, as the plain path attends."""
        t, meta, cache = qg.shape[0], fast_meta(batch), batch.cache
        qg = qg.reshape(t, self.nh, 2 * self.hd)
        gate, v = qg[..., self.hd:], v_lin.reshape(t, self.nkv, self.hd)
        pools = None
        compressed = cache is not None and not cache.kv.is_dense
        if cache is not None:
            i = cache.kv_index(self.layer_id)
            k_rows, v_rows = cache.kv.rows(i)
            pools = None if compressed else (k_rows, v_rows, meta.slot_mapping)
        q, k = rotary_ops.qk_norm_rope(qg[..., : self.hd], k_lin.reshape(t, self.nkv, self.hd), v, self.q_norm,
                                       self.k_norm, cos, sin, self.eps, self.rotary.rotary_dim, pools)
        if compressed:
            attention_ops.store_compressed_kv(cache.kv, i, meta.slot_mapping, k, v)
        if cache is not None and meta.decode:
            out = attention_ops.paged_decode_attention(q, k_rows, v_rows, meta.block_tables, meta.context_lens,
                                                       meta.block_size, self.hd ** -0.5, gate=gate, pool=cache.kv)
            return self.o(out.reshape(t, -1))
        out = torch.empty_like(q)
        row = 0
        for n, start, slot in zip(meta.seq_lens, meta.start_lens, batch.slots):
            rows = slice(row, row + n)
            row += n
            if start == 0 and not compressed:  # the whole prefix is new: causal attention over these rows alone
                qh, kh, vh = (a[rows].transpose(0, 1)[None] for a in (q, k, v))  # [1, heads, n, hd]
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.hd ** -0.5, enable_gqa=True)
                out[rows] = o[0].transpose(0, 1)
                continue
            keys, values = cache.kv.gather(i, cache.token_indices(slot, 0, start + n), q.dtype)
            out[rows] = self._attend(q[rows], keys, values, start)
        return self.o(out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1)))
