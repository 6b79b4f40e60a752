"""Multi-token-prediction head: drafts token t+2 from the hidden at t and the embedding of token t+1.

h' = eh_proj([enorm(embed(t+1)); hnorm(hidden_t)]) -> one full-attention decoder layer (own K/V) ->
shared_head_norm -> the model's LM head. `hidden_t` is the main model's output after its final norm
(the convention of vLLM's Qwen3-Next MTP).
"""
from __future__ import annotations

import torch
from torch import nn

from hf2q.config import ModelConfig
from hf2q.forward import ForwardBatch
from hf2q.layers.linear import Linear
from hf2q.layers.norm import RMSNorm

MTP_NORM_EPS = 1e-6


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: nn.Module):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, MTP_NORM_EPS)
        self.hnorm = RMSNorm(cfg.hidden_size, MTP_NORM_EPS)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.layer = layer  # a DecoderLayer with full attention, layer id = num_layers
        self.shared_head_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embed = None  # dedicated embedding when the file has one, else the model's

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, model: nn.Module) -> torch.Tensor:
        """batch holds the *next* tokens (t+1) at positions t+1; hidden: [T, H] main-model rows at t."""
        emb = model.embed_tokens(batch.input_ids) if self.embed is None else nn.functional.embedding(
            batch.input_ids, self.embed)
        x = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(hidden)), dim=-1))
        cos, sin = model.rotary.cos_sin(batch.positions)
        x, ffn_out = self.layer(x, None, batch, cos, sin)
        return self.shared_head_norm(x + ffn_out)
