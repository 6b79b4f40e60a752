"""The Qwen3.5 / 3.6 hybrid decoder: Gated DeltaNet layers with a gated full-attention layer every
`full_attention_interval`, dense SwiGLU or MoE feed-forward, final norm and LM head.

Model code is math only: it reads a `ForwardBatch` and the cache pools it is handed, nothing else.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf2q.config import ModelConfig
from hf2q.forward import ForwardBatch
from hf2q.kernels.linear import ops as linear_ops
from hf2q.kernels.norm import ops as norm_ops
from hf2q.kernels.quant.ops import int8_reader
from hf2q.layers.attention import GatedAttention
from hf2q.layers.gdn import GatedDeltaNet
from hf2q.layers.linear import Linear
from hf2q.layers.mlp import MLP
from hf2q.layers.moe import MoE
from hf2q.layers.norm import RMSNorm
from hf2q.layers.rotary import RotaryEmbedding


def make_ffn(cfg: ModelConfig) -> nn.Module:
    if cfg.is_moe:
        return MoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                   cfg.shared_expert_intermediate_size)
    return MLP(cfg.hidden_size, cfg.intermediate_size)


def head_logits(hidden: torch.Tensor, head: Linear) -> torch.Tensor:
    """fp32 logits of an LM head: a quantized one goes through its Linear; a dense one asks for fp32 out
    directly (the GEMV writes it, saving a cast kernel over the vocabulary)."""
    if head.quantized:
        return head(hidden).float()
    return linear_ops.linear(hidden, head.weight, torch.float32)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x += mixer(norm(x)); x += ffn(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.is_full_attention = cfg.is_full_attention(layer_id)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.is_full_attention:
            self.mixer = GatedAttention(cfg, layer_id, rotary)
        else:
            self.mixer = GatedDeltaNet(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = make_ffn(cfg)

    def forward(self, x: torch.Tensor, pending, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor):
        """x += pending; x += mixer(norm(x)); returns (x, ffn(norm(x))): each residual add is fused into the
        norm after it, so `pending` is the previous block's FFN output (or None) and this block's is added
        by the next block or the final norm. The same adds and norms as the plain pre-norm block."""
        int8_mixer, int8_ffn = self._int8_inputs()
        norm = self.attn_norm
        x, h = norm_ops.add_rms_norm(x, pending, norm.weight, norm.eps, int8_reader(x, int8_mixer))
        m = self.mixer(h, batch, cos, sin) if self.is_full_attention else self.mixer(h, batch)
        norm = self.ffn_norm
        x, h = norm_ops.add_rms_norm(x, m, norm.weight, norm.eps, int8_reader(x, int8_ffn))
        return x, self.ffn(h)

    def pack_weights(self) -> None:
        """Pack the mixer's and the FFN's projections of one input (linear_ops.pack) and note the types
        their inputs are read through: once, after load, so that the first forward does neither."""
        for group in self.mixer.packs + self.ffn.packs:
            linear_ops.pack(group)
        self._int8 = None
        self._int8_inputs()

    def _int8_inputs(self) -> tuple[str | None, str | None]:
        """The quantized type through which the mixer and the FFN read their input (then each norm also
        writes the int8 rows that type's mat-vec reads; a projection of another type quantizes the input
        itself), or None. Noted by pack_weights (here for a layer built by hand)."""
        if getattr(self, "_int8", None) is None:
            def first_qtype(module):
                for m in module.modules():
                    if isinstance(m, Linear) and m.quantized:
                        return m.qtype
                    if isinstance(m, MoE) and m.quantized:
                        return m.exps_qtype["gate_exps"]
                return None
            self._int8 = (first_qtype(self.mixer), first_qtype(self.ffn))
        return self._int8


class Qwen35Model(nn.Module):
    def __init__(self, cfg: ModelConfig, tie_embeddings: bool = False):
        super().__init__()
        self.config = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_sections)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tie_embeddings = tie_embeddings
        self.lm_head = None if tie_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.mtp = None  # set by the loader when the file carries an MTP layer

    def blocks(self) -> list:
        """Every decoder block, the MTP block's too."""
        return list(self.layers) + ([self.mtp.layer] if self.mtp is not None else [])

    def pack_weights(self) -> "Qwen35Model":
        """Pack every block's projections (DecoderLayer.pack_weights), the MTP block's too: call once the
        weights are loaded on their final device."""
        for layer in self.blocks():
            layer.pack_weights()
        return self

    def keep_dense_weights(self, dtype: torch.dtype) -> int:
        """Keep a dense copy (`dtype`) beside every quantized projection's blocks, a pack's once
        (linear_ops.keep_dense), for products of many rows; MoE experts stay blocks only. Returns the bytes
        kept; call after pack_weights."""
        kept = 0
        for layer in self.blocks():
            for group in layer.mixer.packs + layer.ffn.packs:
                kept += linear_ops.keep_dense(group, dtype)
        for module in self.modules():  # the projections outside packs (the LM head, output projections)
            if isinstance(module, Linear) and module.quantized and module.dense is None:
                kept += linear_ops.keep_dense([module], dtype)
        return kept

    def keep_column_weights(self) -> int:
        """Lay out every Q4_K projection by column beside its blocks, a pack's once (linear_ops.keep_columns),
        for products of 5-16 rows; MoE experts stay blocks only. Returns the bytes kept; call after
        pack_weights."""
        kept, packed = 0, set()
        for layer in self.blocks():
            for group in layer.mixer.packs + layer.ffn.packs:
                kept += linear_ops.keep_columns(group)
                packed.update(id(lin) for lin in group)
        for module in self.modules():  # the projections outside packs (the LM head, output projections)
            if isinstance(module, Linear) and module.qtype == "Q4_K" and id(module) not in packed:
                kept += linear_ops.keep_columns([module])
        return kept

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed)

    def forward(self, batch: ForwardBatch, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token: [T, hidden]."""
        x = self.embed_tokens(batch.input_ids) if input_embeds is None else input_embeds
        cos, sin = self.rotary.cos_sin(batch.positions)
        pending = None
        for layer in self.layers:
            x, pending = layer(x, pending, batch, cos, sin)
        head = int8_reader(x, self.lm_head.qtype if self.lm_head is not None else None)
        return norm_ops.add_rms_norm(x, pending, self.norm.weight, self.norm.eps, head)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab]. `lm_head` is a Linear, None (tied to the embedding), or a module that
        computes the logits itself (a tensor-parallel rank's vocab-parallel head)."""
        if self.lm_head is None:
            return linear_ops.linear(hidden, self.embed, torch.float32)
        if isinstance(self.lm_head, Linear):
            return head_logits(hidden, self.lm_head)
        return self.lm_head(hidden)

    @torch.inference_mode()
    def logits(self, token_ids) -> torch.Tensor:
        """Logits for every position of one sequence, without a cache: [n, vocab] fp32."""
        batch = ForwardBatch.single(token_ids, device=self.embed.device)
        return self.compute_logits(self.forward(batch))

    @torch.inference_mode()
    def mtp_logits(self, token_ids) -> torch.Tensor:
        """MTP draft logits for one sequence without a cache.

        Row t predicts token t+2 from the main model's hidden at t and the embedding of token t+1;
        returns [n - 1, vocab].
        """
        if self.mtp is None:
            raise ValueError("this model has no MTP layer")
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.embed.device)
        hidden = self.forward(ForwardBatch.single(ids, device=ids.device))
        batch = ForwardBatch.single(ids[1:], device=ids.device)
        return self.compute_logits(self.mtp(batch, hidden[:-1], self))
