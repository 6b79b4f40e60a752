"""Partial, interleaved multi-section rotary embedding (Qwen3.5 "IMRoPE").

Only the first `rotary_dim` dims of each head rotate, pairing (p, p + rotary_dim/2) as HF's `rotate_half`
and llama.cpp do. Frequency j takes its position from axis T, H or W by `j % 3` within the sections; for
text all axes equal the token index, so this reduces to plain partial NeoX RoPE.
"""
from __future__ import annotations

import torch
from torch import nn

from hf2q.kernels.rotary.reference import apply_rotary


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float, sections: tuple[int, ...]):
        super().__init__()
        self.rotary_dim = rotary_dim
        # Tables are computed on the CPU, then moved: a model built on the meta device (the loader's) would
        # otherwise run these ops through torch's Python decompositions, whose first use imports torch._dynamo
        # (seconds of every start).
        cpu, target = torch.device("cpu"), torch.get_default_device()
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=cpu) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq.to(target), persistent=False)
        half = rotary_dim // 2
        axis = torch.zeros(half, dtype=torch.long, device=cpu)  # which position axis drives frequency j
        for a in (1, 2):
            if len(sections) > a:
                idx = torch.arange(a, min(sections[a] * 3, half), 3, device=cpu)
                axis[idx] = a
        self.register_buffer("axis", axis.to(target), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] (text) or [3, T] (T/H/W axes). Returns cos, sin of shape [T, rotary_dim]."""
        if positions.dim() == 1:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, half]
        else:
            pos = positions.float()[self.axis]  # [half, T]: each frequency's own axis
            freqs = pos.transpose(0, 1) * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; rotates x[..., :rotary_dim]."""
        return apply_rotary(x, cos, sin, self.rotary_dim)

