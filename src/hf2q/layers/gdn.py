"""Gated DeltaNet (linear attention) layer of Qwen3.5.

GGUF files from llama.cpp's converter store value heads in *tiled* order: value head h uses key head
h % n_k (HF safetensors group them: h // (n_v / n_k)).
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from hf2q.config import ModelConfig
from hf2q.devices import upload
from hf2q.forward import ForwardBatch
from hf2q.kernels.conv import ops as conv_ops
from hf2q.kernels.gdn import ops as gdn_ops
from hf2q.kernels.linear import ops as linear_ops
from hf2q.kernels.meta import fast_meta
from hf2q.kernels.norm import ops as norm_ops
from hf2q.kernels.quant.ops import int8_reader
from hf2q.layers.linear import Linear


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

    @property
    def packs(self) -> tuple[tuple[Linear, ...], ...]:
        """The projections forward multiplies as one pack (linear_ops.pack)."""
        return ((self.qkv, self.z, self.alpha, self.beta),)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Every sequence at once: the fused decode step (conv, delta rule and gated norm) for decode, a
        graph-replayed small step's conv and delta rule on the pools in place (a verify graph's keeping the
        states after each sequence's first rows, a prefill graph's those after one row) then the gated norm,
        else the varlen conv, the chunked delta rule and the gated norm; each operation's chooser runs the kernel
        or its exact reference (kernels/<op>/ops.py)."""
        meta, cache = fast_meta(batch), batch.cache
        mixed, z, alpha, beta_raw = linear_ops.packed_linear(x, (self.qkv, self.z, self.alpha, self.beta))
        j = cache.linear_index(self.layer_id) if cache is not None else None
        if meta.decode and cache is not None:
            core = gdn_ops.gdn_conv_decode_(mixed, self.conv, cache.conv_state[j], alpha, beta_raw, self.a,
                                            self.dt_bias, z, self.norm, cache.recurrent_state[j], meta.slots,
                                            self.nk, self.dk, self.eps, x.dtype, int8_reader(x, self.out.qtype))
            return self.out(core)
        if meta.rows_paged and cache is not None:  # a graph-replayed step: a few rows a sequence, pools in place
            positions = meta.kept_positions  # a verify step keeps every sequence's states per position
            conv_pool, rec_pool = cache.conv_state[j], cache.recurrent_state[j]
            kept_conv, kept_rec = positions.layer(j) if positions is not None else \
                (conv_pool.new_empty(0, *conv_pool.shape[1:]), rec_pool.new_empty(0, *rec_pool.shape[1:]))
            keep = meta.state_inside.layer(j) if meta.state_inside is not None else None  # a checkpoint inside
            o = gdn_ops.gdn_verify_(mixed, self.conv, conv_pool, alpha, beta_raw, self.a, self.dt_bias, rec_pool,
                                    meta.slots, meta.cu_seqlens, meta.live_seqs, kept_conv, kept_rec, self.nk,
                                    self.dk, self.eps, keep)
            return self.out(norm_ops.gated_rms_norm(o, z, self.norm, self.eps, x.dtype))
        n = len(meta.seq_lens)
        conv_pool, slots = (cache.conv_state[j], meta.slots) if cache is not None else (None, None)
        kept = batch.extras.get("kept_states", {}) if cache is not None else {}  # seq -> whom to hand states
        conv_before = {i: conv_pool[batch.slots[i]].clone() for i in kept}  # the conv writes over them
        conv_out = conv_ops.conv_varlen_(mixed, self.conv, conv_pool, slots, meta.cu_seqlens, meta.seq_lens)
        if cache is not None:
            rec = cache.recurrent_state[j][meta.slots].float()
        else:
            rec = x.new_zeros(n, self.nv, self.dk, self.dv, dtype=torch.float32)
        q, k, v = torch.split(conv_out, [self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], dim=-1)
        t = x.shape[0]
        g = self.a.float() * F.softplus(alpha.float() + self.dt_bias.float())
        rule = (q.view(t, self.nk, self.dk), k.view(t, self.nk, self.dk), v.view(t, self.nv, self.dv), g,
                torch.sigmoid(beta_raw.float()), rec, meta.cu_seqlens, meta.seq_lens)
        prefixes = self._prefixes(batch, kept)
        if prefixes:
            rule = self._with_prefixes(batch, prefixes, *rule)
        store = cache.recurrent_state[j].dtype if cache is not None else torch.float32
        o, final = gdn_ops.chunk_gdn(*rule, self.dk ** -0.5, self.eps, store)
        states = dict(zip(prefixes, final[n:]))
        o, final = o[:t], final[:n]
        if kept:
            self._hand_states(batch, kept, states, final, j, conv_before, mixed)
        if cache is not None:
            cache.recurrent_state[j].index_copy_(0, meta.slots, final.to(cache.recurrent_state[j].dtype))
        return self.out(norm_ops.gated_rms_norm(o, z, self.norm, self.eps, x.dtype))

    @staticmethod
    def _prefixes(batch, kept) -> list[tuple[int, int, int]]:
        """(seq index, first row, length) of each proper chunk prefix whose final state is wanted: a kept
        checkpoint's (`hf2q.cache.state_at`), a verifying sequence's after each of its positions
        (`hf2q.spec.states.PositionStates`); a whole chunk's is the sequence's own final state."""
        return sorted({(i, row, m) for i, row, length, _, _ in batch.segments() for keeper in kept.get(i, ())
                       for m in keeper.lengths if m < length})

    @staticmethod
    def _with_prefixes(batch, prefixes, q, k, v, g, beta, rec, cu_seqlens, seq_lens):
        """The delta rule's arguments with each prefix appended as one more sequence: its chunk's first rows
        again, from its slot's state; the final states of the appended sequences are the states wanted. The
        row offsets are built once per forward and uploaded without waiting for the device."""
        lens = [*seq_lens, *(m for _, _, m in prefixes)]
        made = batch.extras.get("prefix_rows")
        if made is None:
            rows = torch.cat([torch.arange(row, row + m, device=q.device) for _, row, m in prefixes])
            cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=cu_seqlens.dtype)
            cu = upload(cu, cu_seqlens.device)
            made = batch.extras["prefix_rows"] = (rows, cu)
        rows, cu = made
        both = [torch.cat((x, x[rows])) for x in (q, k, v, g, beta)]
        return (*both, torch.cat([rec, *(rec[i:i + 1] for i, _, _ in prefixes)]), cu, lens)

    @staticmethod
    def _hand_states(batch, kept, states, final, j, conv_before, mixed) -> None:
        """Give layer j's states to whoever asked: the state after each prefix length it wants, stacked, and
        the conv inputs up to the longest (the slot's previous raw inputs, then the chunk's)."""
        for i, row, length, _, _ in batch.segments():
            for keeper in kept.get(i, ()):
                after = torch.stack([final[i] if m == length else states[(i, row, m)] for m in keeper.lengths])
                keeper(j, torch.cat((conv_before[i].to(mixed.dtype), mixed[row:row + max(keeper.lengths)])), after)
