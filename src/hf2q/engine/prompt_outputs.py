"""What a request can get from its prompt's hidden rows instead of (or before) sampling: the prompt tokens'
log-probabilities (log-likelihood evaluation) and a pooled embedding."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from hf2q.engine.request import TokenLogprob

# Rows per log_softmax pass: each row is a vocabulary-wide fp32 vector (248k entries, ~1 MB on Qwen3.5).
LOGPROB_ROWS = 128
POOLINGS = ("last", "mean")


def prompt_logprobs(net, hidden: torch.Tensor, prompt_ids: list[int], top: int) -> list[Optional[TokenLogprob]]:
    """Log-probability of each prompt token given the ones before it, with the `top` most likely tokens at
    each position; None for the first token, which nothing predicts. hidden: [len(prompt_ids), H] or more."""
    out: list[Optional[TokenLogprob]] = [None]
    n = len(prompt_ids)
    targets = torch.tensor(prompt_ids[1:], dtype=torch.long, device=hidden.device)
    for start in range(0, n - 1, LOGPROB_ROWS):
        end = min(start + LOGPROB_ROWS, n - 1)
        logp = torch.log_softmax(net.compute_logits(hidden[start:end]).float(), dim=-1)  # [rows, vocab]
        chosen = logp.gather(1, targets[start:end, None])[:, 0].tolist()
        if top > 0:
            values, ids = logp.topk(top, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        else:
            tops = [[] for _ in chosen]
        out += [TokenLogprob(t, lp, tp) for t, lp, tp in zip(prompt_ids[start + 1:end + 1], chosen, tops)]
    return out


def pool(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    """The L2-normalised fp32 embedding of one sequence's final hidden rows [n, H], on the CPU."""
    if pooling == "last":
        vector = hidden[-1].float()
    elif pooling == "mean":
        vector = hidden.float().mean(dim=0)
    else:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    return F.normalize(vector, dim=0).cpu()
