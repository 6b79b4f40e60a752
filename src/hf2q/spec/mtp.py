"""The MTP proposer: the model's own multi-token-prediction head drafts the next tokens greedily.

MTP row p reads the target's hidden at position p and token p + 1 and predicts token p + 2; its K/V
lives at position p of the request's slot, in the MTP layer of the hybrid cache. The runner hands each
forward's hidden rows to the request (`extras["mtp_rows"]`); before the next step those rows, as far as
their tokens turned out right, are run through the head, which keeps its K/V equal to what a full
forward over the verified history would write. The last such row predicts the token after the
request's last one: draft 1. Draft i + 1 runs the head again on draft i and the head's own output, at
the next position; those K/V rows are provisional and are written over by the next catch-up, which
always starts at the first position the target recomputes.

Only drafts come out of here: the engine verifies them against the target, so a stale or missing K/V
row (a prefix resumed from the prefix cache, a slot that had no room) costs acceptance, never output.
"""
from __future__ import annotations

from typing import Optional

import torch

from hf2q.cache.hybrid import CacheFull, HybridCache
from hf2q.engine.request import Request
from hf2q.forward import ForwardBatch
from hf2q.models.qwen35 import Qwen35Model


class MTPProposer:
    def __init__(self, net: Qwen35Model, cache: HybridCache):
        if net.mtp is None:
            raise ValueError("--speculative mtp needs a model with an MTP head (this file has none, or it "
                             "was loaded without it)")
        self.net, self.cache = net, cache

    def propose(self, req: Request, k: int) -> list[int]:
        """Catch the head up on the request's last forward, then up to k greedy drafts (k may be 0)."""
        rows = req.extras.pop("mtp_rows", None)
        n = req.num_tokens
        if rows is not None:
            start, hidden = rows
            end = min(start + hidden.shape[0], n - 1)  # rows past the first wrong draft saw a wrong history
            if end > start:
                out = self._run(req.slot, req.tokens(start + 1, end + 1), start, hidden[:end - start])
                if out is not None:
                    req.extras["mtp_last"] = (end + 1, out[-1:])
        last = req.extras.get("mtp_last")
        if k <= 0 or last is None or last[0] != n:  # the head has not seen the row before the last token
            return []
        h, drafts = last[1], []
        for i in range(k):
            drafts.append(int(self.net.compute_logits(h).argmax(dim=-1)[0]))
            if i + 1 < k:
                h = self._run(req.slot, drafts[-1:], n - 1 + i, h)
                if h is None:
                    break
        return drafts

    def _run(self, slot: int, tokens: list[int], start: int, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """The head over rows [start, start + len(tokens)) of a slot, writing their K/V; None if no room."""
        try:
            self.cache.reserve(slot, start + len(tokens))
        except CacheFull:
            return None
        batch = ForwardBatch.single(tokens, start=start, slot=slot, cache=self.cache, device=hidden.device)
        return self.net.mtp(batch, hidden, self.net)
