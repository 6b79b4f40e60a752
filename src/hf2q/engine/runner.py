"""Runs one scheduled batch through the model: builds the ForwardBatch, keeps the cache lengths."""
from __future__ import annotations

import torch

from hf2q.cache.hybrid import HybridCache
from hf2q.engine.request import Request
from hf2q.forward import ForwardBatch
from hf2q.models.qwen35 import Qwen35Model


class ModelRunner:
    def __init__(self, net: Qwen35Model, cache: HybridCache):
        self.net = net
        self.cache = cache
        self.device = net.embed.device

    def build_batch(self, scheduled: list[tuple[Request, int]]) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        for req, n in scheduled:
            ids += req.tokens(req.num_computed, req.num_computed + n)
            positions += range(req.num_computed, req.num_computed + n)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            seq_lens=[n for _, n in scheduled],
            start_lens=[req.num_computed for req, _ in scheduled],
            slots=[req.slot for req, _ in scheduled],
            cache=self.cache,
        )

    @torch.inference_mode()
    def run(self, scheduled: list[tuple[Request, int]]) -> tuple[list[Request], torch.Tensor]:
        """Advance every scheduled request; return the requests that now sample and their logits."""
        batch = self.build_batch(scheduled)
        for req, n in scheduled:
            self.cache.reserve(req.slot, req.num_computed + n)
        hidden = self.net(batch)
        rows, sampling = [], []
        row = 0
        for req, n in scheduled:
            row += n
            req.num_computed += n
            self.cache.commit(req.slot, req.num_computed)
            if req.num_computed == req.num_tokens:
                rows.append(row - 1)
                sampling.append(req)
        if not rows:
            return [], hidden.new_zeros(0, self.net.config.vocab_size, dtype=torch.float32)
        return sampling, self.net.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
