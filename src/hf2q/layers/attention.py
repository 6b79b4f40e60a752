"""Gated full attention of Qwen3.5: fused q+gate projection, per-head q/k RMSNorm, partial IMRoPE, GQA,
sigmoid output gate. K/V live in the paged pool of the hybrid cache."""
from __future__ import annotations

import torch
from torch import nn

from hf2q.config import ModelConfig
from hf2q.forward import ForwardBatch
from hf2q.kernels.attention import ops as attention_ops
from hf2q.kernels.linear import ops as linear_ops
from hf2q.kernels.rotary import ops as rotary_ops
from hf2q.layers.linear import Linear
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

    @property
    def packs(self) -> tuple[tuple[Linear, ...], ...]:
        """The projections the vectorised path multiplies as one pack (linear_ops.pack)."""
        return ((self.q, self.k, self.v),)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Projections, q/k norm + RoPE (the new K/V written into the pool), attention of every sequence over
        its prefix, output gate, o. Each step's chooser picks the kernels or the exact torch path."""
        t = x.shape[0]
        qg, k, v = linear_ops.projections(x, (self.q, self.k, self.v))
        qg = qg.reshape(t, self.nh, 2 * self.hd)
        q, gate = qg[..., : self.hd], qg[..., self.hd:]
        k, v = k.reshape(t, self.nkv, self.hd), v.reshape(t, self.nkv, self.hd)
        kv = attention_ops.layer_kv(batch, self.layer_id)
        q, k = rotary_ops.qk_norm_rope_store(q, k, v, self.q_norm, self.k_norm, cos, sin, self.eps,
                                             self.rotary.rotary_dim, batch, kv)
        return self.o(attention_ops.gated_causal_attention(q, k, v, gate, batch, kv, self.hd ** -0.5))
