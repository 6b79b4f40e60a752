"""Per-step metadata for one model forward over a flat, variable-length token batch.

The runner builds a `ForwardBatch`; only the attention layer, the DeltaNet layer and the head read it.
Prefill, chunked prefill, decode and speculative verify all use the same shape: sequences laid end to
end in `input_ids`, no padding.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from hf2q.cache.hybrid import HybridCache


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, the new tokens of every sequence, end to end
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    seq_lens: list[int]  # new tokens per sequence; sum == T
    start_lens: list[int]  # tokens already in the cache per sequence (its position of the first new token)
    slots: list[int]  # cache slot of each sequence
    cache: Optional["HybridCache"] = None  # None: stateless one-shot forward (tests, embeddings)
    logits_indices: Optional[torch.Tensor] = None  # rows whose logits are wanted; None = every row
    extras: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def segments(self):
        """(seq index, start row, new tokens, cached tokens, slot) for each sequence."""
        row = 0
        for i, (n, start, slot) in enumerate(zip(self.seq_lens, self.start_lens, self.slots)):
            yield i, row, n, start, slot
            row += n

    @classmethod
    def single(cls, token_ids: list[int] | torch.Tensor, start: int = 0, slot: int = 0,
               cache: Optional["HybridCache"] = None, device: str | torch.device = "cpu") -> "ForwardBatch":
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=device)
        n = int(ids.shape[0])
        pos = torch.arange(start, start + n, dtype=torch.long, device=device)
        return cls(ids, pos, [n], [start], [slot], cache)
