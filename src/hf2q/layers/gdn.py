"""Gated DeltaNet (linear attention) layer of Qwen3.5.

GGUF files from llama.cpp's converter store value heads in *tiled* order: value head h uses key head
h % n_k (HF safetensors group them: h // (n_v / n_k)).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf2q.config import ModelConfig
from hf2q.forward import ForwardBatch
from hf2q.kernels import dispatch
from hf2q.kernels.gdn.reference import causal_conv1d_ref, gated_delta_rule_ref
from hf2q.kernels.meta import fast_meta
from hf2q.kernels.quant.ops import int8_reader
from hf2q.layers.linear import Linear


def l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.nk, self.nv = cfg.linear_num_k_heads, cfg.linear_num_v_heads
        self.dk, self.dv = cfg.linear_k_head_dim, cfg.linear_v_head_dim
        self.eps = cfg.rms_norm_eps
        channels = cfg.conv_channels
        self.qkv = Linear(cfg.hidden_size, channels)
        self.z = Linear(cfg.hidden_size, self.nv * self.dv)
        self.alpha = Linear(cfg.hidden_size, self.nv)
        self.beta = Linear(cfg.hidden_size, self.nv)
        self.dt_bias = nn.Parameter(torch.zeros(self.nv), requires_grad=False)
        self.a = nn.Parameter(torch.zeros(self.nv), requires_grad=False)  # -exp(A_log)
        self.conv = nn.Parameter(torch.zeros(channels, cfg.conv_kernel), requires_grad=False)
        self.norm = nn.Parameter(torch.ones(self.dv), requires_grad=False)  # shared by all heads
        self.out = Linear(self.nv * self.dv, cfg.hidden_size)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if dispatch.use_fast_path(x):
            return self._forward_fast(x, batch)
        mixed = self.qkv(x)  # [T, C]
        z = self.z(x).view(-1, self.nv, self.dv)
        g = self.a.float() * F.softplus(self.alpha(x).float() + self.dt_bias.float())  # [T, nv] log-decay
        beta = torch.sigmoid(self.beta(x).float())
        core = torch.empty(x.shape[0], self.nv, self.dv, dtype=x.dtype, device=x.device)
        cache = batch.cache
        for i, row, n, start, slot in batch.segments():
            rows = slice(row, row + n)
            if cache is None:
                conv_state = mixed.new_zeros(self.conv.shape[1] - 1, mixed.shape[1])
                rec_state = x.new_zeros(self.nv, self.dk, self.dv, dtype=torch.float32)
            else:
                j = cache.linear_index(self.layer_id)
                conv_state, rec_state = cache.conv_state[j][slot], cache.recurrent_state[j][slot]
            conv_out, new_conv = causal_conv1d_ref(mixed[rows], conv_state, self.conv)
            q, k, v = torch.split(conv_out, [self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], dim=-1)
            q = l2_normalize(q.reshape(n, self.nk, self.dk).float(), self.eps) * self.dk ** -0.5
            k = l2_normalize(k.reshape(n, self.nk, self.dk).float(), self.eps)
            rep = self.nv // self.nk
            q, k = q.repeat(1, rep, 1), k.repeat(1, rep, 1)  # tiled: value head h -> key head h % nk
            o, new_state, _ = gated_delta_rule_ref(q, k, v.reshape(n, self.nv, self.dv), g[rows], beta[rows],
                                                   rec_state)
            core[rows] = o.to(x.dtype)
            if cache is not None:
                cache.conv_state[j][slot].copy_(new_conv)
                cache.recurrent_state[j][slot].copy_(new_state)
        # Gated RMSNorm per head: norm(o) * w * silu(z)
        of = core.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm.float()
        of = of * F.silu(z.float())
        return self.out(of.to(x.dtype).reshape(x.shape[0], -1))

    def _forward_fast(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Every sequence at once: fused Triton step for decode, fla's chunked kernel otherwise."""
        meta, cache = fast_meta(batch), batch.cache
        mixed, z, alpha, beta_raw = dispatch.packed_linear(x, (self.qkv, self.z, self.alpha, self.beta))
        j = cache.linear_index(self.layer_id) if cache is not None else None
        if meta.decode and cache is not None:
            core = dispatch.gdn_conv_decode_(mixed, self.conv, cache.conv_state[j], alpha, beta_raw, self.a,
                                             self.dt_bias, z, self.norm, cache.recurrent_state[j], meta.slots,
                                             self.nk, self.dk, self.eps, x.dtype, int8_reader(x, self.out.qtype))
            return self.out(core)
        n = len(meta.seq_lens)
        conv_pool, slots = (cache.conv_state[j], meta.slots) if cache is not None else (None, None)
        conv_out = dispatch.conv_varlen_(mixed, self.conv, conv_pool, slots, meta.cu_seqlens, meta.seq_lens)
        if cache is not None:
            rec = cache.recurrent_state[j][meta.slots].float()
        else:
            rec = x.new_zeros(n, self.nv, self.dk, self.dv, dtype=torch.float32)
        q, k, v = torch.split(conv_out, [self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], dim=-1)
        t = x.shape[0]
        g = self.a.float() * F.softplus(alpha.float() + self.dt_bias.float())
        o, final = dispatch.chunk_gdn(q.view(t, self.nk, self.dk), k.view(t, self.nk, self.dk),
                                      v.view(t, self.nv, self.dv), g, torch.sigmoid(beta_raw.float()), rec,
                                      meta.cu_seqlens, meta.seq_lens, self.dk ** -0.5, self.eps)
        if cache is not None:
            cache.recurrent_state[j].index_copy_(0, meta.slots, final.to(cache.recurrent_state[j].dtype))
        return self.out(dispatch.gated_rms_norm(o, z, self.norm, self.eps, x.dtype))
