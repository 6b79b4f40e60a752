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
from hf2q.forward import ForwardBatch
from hf2q.kernels.conv import ops as conv_ops
from hf2q.kernels.gdn import ops as gdn_ops
from hf2q.kernels.gdn.reference import gated_delta_rule_ref, l2_normalize
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
        """Every sequence at once: the fused decode step (conv, delta rule and gated norm) for decode, else
        the varlen conv, the chunked delta rule and the gated norm; each operation's chooser runs the
        kernel or its exact reference (kernels/<op>/ops.py)."""
        meta, cache = fast_meta(batch), batch.cache
        mixed, z, alpha, beta_raw = linear_ops.packed_linear(x, (self.qkv, self.z, self.alpha, self.beta))
        j = cache.linear_index(self.layer_id) if cache is not None else None
        if meta.decode and cache is not None:
            core = gdn_ops.gdn_conv_decode_(mixed, self.conv, cache.conv_state[j], alpha, beta_raw, self.a,
                                            self.dt_bias, z, self.norm, cache.recurrent_state[j], meta.slots,
                                            self.nk, self.dk, self.eps, x.dtype, int8_reader(x, self.out.qtype))
            return self.out(core)
        n = len(meta.seq_lens)
        conv_pool, slots = (cache.conv_state[j], meta.slots) if cache is not None else (None, None)
        keep = batch.extras.get("position_states", {}) if cache is not None else {}
        inner = batch.extras.get("states_at", {}) if cache is not None else {}
        conv_before = {i: conv_pool[batch.slots[i]].clone() for i in {*keep, *inner}}  # the conv writes over them
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
        if inner:
            rule, targets = self._with_prefixes(batch, inner, *rule)
        o, final = gdn_ops.chunk_gdn(*rule, self.dk ** -0.5, self.eps)
        if inner:
            for (i, row, at), state in zip(targets, final[n:]):
                at(j, torch.cat((conv_before[i].to(mixed.dtype), mixed[row:row + at.offset])), state)
            o, final = o[:t], final[:n]
        if cache is not None:
            cache.recurrent_state[j].index_copy_(0, meta.slots, final.to(cache.recurrent_state[j].dtype))
        self._keep_states(batch, keep, j, conv_before, mixed, q, k, v, g, beta_raw, rec)
        return self.out(norm_ops.gated_rms_norm(o, z, self.norm, self.eps, x.dtype))

    @staticmethod
    def _with_prefixes(batch, inner, q, k, v, g, beta, rec, cu_seqlens, seq_lens):
        """The delta rule's arguments with each kept prefix (`hf2q.cache.state_at`) appended as one more
        sequence: its chunk's first rows again, from its slot's state. Also (seq index, row, StateAt) each.
        The row offsets are built once per forward and uploaded without waiting for the device."""
        targets = [(i, row, at) for i, row, _, _, _ in batch.segments() for at in inner.get(i, ())]
        lens = [*seq_lens, *(at.offset for _, _, at in targets)]
        made = batch.extras.get("states_at_rows")
        if made is None:
            rows = torch.cat([torch.arange(row, row + at.offset, device=q.device) for _, row, at in targets])
            cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=cu_seqlens.dtype)
            cu = cu.pin_memory().to(cu_seqlens.device, non_blocking=True) if cu_seqlens.is_cuda else cu
            made = batch.extras["states_at_rows"] = (rows, cu)
        rows, cu = made
        both = [torch.cat((x, x[rows])) for x in (q, k, v, g, beta)]
        return (*both, torch.cat([rec, *(rec[i:i + 1] for i, _, _ in targets)]), cu, lens), targets

    def _keep_states(self, batch, keep, j, conv_before, mixed, q, k, v, g, beta_raw, rec) -> None:
        """Hand each verifying sequence its per-position states; sequences of one length step together."""
        groups: dict[int, list[tuple[int, int]]] = {}
        for i, row, length, _, _ in batch.segments():
            if i in keep:
                groups.setdefault(length, []).append((i, row))
        for length, members in groups.items():
            rows = torch.tensor([row + t for _, row in members for t in range(length)], device=q.device)
            seqs = torch.tensor([i for i, _ in members], device=q.device)
            states = self._states_after_each(q[rows], k[rows], v[rows], g[rows], beta_raw[rows], rec[seqs],
                                             len(members))
            for s, (i, row) in enumerate(members):
                keep[i](j, torch.cat((conv_before[i].to(mixed.dtype), mixed[row:row + length])), states[:, s])

    def _states_after_each(self, q, k, v, g, beta_raw, state, seqs: int) -> torch.Tensor:
        """The recurrent state after each token of `seqs` short sequences of one length (verify chunks, rows
        sequence-major), stepped token by token as plain decoding does; the chunked kernel keeps only the
        final one. The sequences ride along the head axis. Returns [n, seqs, h, dk, dv]."""
        n, rep = q.shape[0] // seqs, self.nv // self.nk

        def by_token(x, heads, dim):  # [seqs * n, heads * dim] -> [n, seqs, heads, dim]
            return x.reshape(seqs, n, heads, dim).transpose(0, 1)

        qf = l2_normalize(by_token(q, self.nk, self.dk).float(), self.eps) * self.dk ** -0.5
        kf = l2_normalize(by_token(k, self.nk, self.dk).float(), self.eps)
        heads = seqs * self.nv
        _, _, states = gated_delta_rule_ref(
            qf.repeat(1, 1, rep, 1).reshape(n, heads, self.dk), kf.repeat(1, 1, rep, 1).reshape(n, heads, self.dk),
            by_token(v, self.nv, self.dv).reshape(n, heads, self.dv),
            g.reshape(seqs, n, self.nv).transpose(0, 1).reshape(n, heads),
            torch.sigmoid(beta_raw.float()).reshape(seqs, n, self.nv).transpose(0, 1).reshape(n, heads),
            state.reshape(heads, self.dk, self.dv), capture=True)
        return states.view(n, seqs, self.nv, self.dk, self.dv)
