"""Causal depthwise conv1d + SiLU over a flat batch of variable-length sequences, as plain torch ops.

Each token's window is gathered from one buffer that holds every sequence's previous inputs (its conv
state) followed by all new tokens, so the whole batch is K gathers and K fused multiply-adds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _window_rows(seq_lens: torch.Tensor, cu: torch.Tensor, k: int, n_seqs: int):
    """Row of the combined buffer for each tap of each new token, and for each new-state row."""
    dev = seq_lens.device
    total = int(cu[-1])
    seq_id = torch.repeat_interleave(torch.arange(n_seqs, device=dev), seq_lens, output_size=total)
    local = torch.arange(total, device=dev) - cu[:-1][seq_id]  # position within its sequence

    def rows(seq: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        # p < 0 reads the state (row k-1+p of the sequence's state), else the new token
        from_state = seq * (k - 1) + (k - 1) + p
        from_new = n_seqs * (k - 1) + cu[:-1][seq] + p
        return torch.where(p < 0, from_state, from_new)

    taps = torch.arange(k, device=dev) - (k - 1)  # -(k-1) .. 0
    token_rows = rows(seq_id[:, None], local[:, None] + taps[None, :])  # [T, k]
    state_seq = torch.arange(n_seqs, device=dev)[:, None]
    state_rows = rows(state_seq, seq_lens[:, None] + taps[None, :-1])  # [N, k-1]: last k-1 inputs
    return token_rows, state_rows


def causal_conv1d_varlen(x: torch.Tensor, states: torch.Tensor | None, weight: torch.Tensor,
                         seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, C] new inputs of N sequences end to end; states: [N, K-1, C] previous raw inputs (None = zeros);
    weight: [C, K]. Returns (SiLU(conv) [T, C] fp32, new states [N, K-1, C]). The buffer takes the wider of
    the states' and x's dtypes, so fp32 states next to bf16 inputs are read (and carried) unrounded, as the
    kernels read them."""
    k, c = weight.shape[1], x.shape[1]
    n = len(seq_lens)
    if states is None:
        states = x.new_zeros(n, k - 1, c)
    dtype = torch.promote_types(states.dtype, x.dtype)
    lens = torch.tensor(seq_lens, dtype=torch.long, device=x.device)
    cu = torch.zeros(n + 1, dtype=torch.long, device=x.device)
    cu[1:] = torch.cumsum(lens, 0)
    buf = torch.cat((states.reshape(n * (k - 1), c).to(dtype), x.to(dtype)), dim=0)
    token_rows, state_rows = _window_rows(lens, cu, k, n)
    w = weight.float()
    acc = buf[token_rows[:, 0]].float() * w[:, 0]
    for j in range(1, k):
        acc.addcmul_(buf[token_rows[:, j]].float(), w[:, j])
    return F.silu(acc), buf[state_rows.reshape(-1)].reshape(n, k - 1, c)
