"""The MTP proposer: the model's own multi-token-prediction head drafts the next tokens greedily.

MTP row p reads the target's hidden at position p and token p + 1 and predicts token p + 2; its K/V
lives at position p of the request's slot, in the MTP layer of the hybrid cache. The runner hands each
forward's hidden rows to the request (`extras["mtp_rows"]`, from graph replays too); before the next step
those rows, as far as their tokens turned out right, are run through the head, every request's in one
forward (`catch_up`: a step of 64 decoding requests is one head forward, not 64), which keeps its K/V equal
to what a full forward over the verified history would write. The last such row predicts the token after
the request's last one: draft 1. Draft i + 1 runs the head again on draft i and the head's own output, at
the next position (every drafting request's in one forward); those K/V rows are provisional and are written
over by the next catch-up, which always starts at the first position the target recomputes.

Only drafts come out of here: the engine verifies them against the target, so a stale or missing K/V
row (a prefix resumed from the prefix cache, a slot that had no room) costs acceptance, never output.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from hf2q.cache.hybrid import CacheFull, HybridCache
from hf2q.devices import upload
from hf2q.engine.request import Request
from hf2q.forward import ForwardBatch
from hf2q.models.qwen35 import Qwen35Model

if TYPE_CHECKING:
    from hf2q.spec.mtp_graphs import MTPGraphs


class MTPProposer:
    def __init__(self, net: Qwen35Model, cache: HybridCache):
        if net.mtp is None:
            raise ValueError("--speculative mtp needs a model with an MTP head (this file has none, or it "
                             "was loaded without it)")
        self.net, self.cache = net, cache
        self.graphs: Optional[Callable[[], Optional[MTPGraphs]]] = None  # the runner's, where graphs run

    def catch_up(self, reqs: list[Request]) -> None:
        """Run the head once over every request's rows of its last forward whose tokens turned out right,
        writing their K/V; each request keeps the head's output at its last row (what draft 1 reads)."""
        self._catch_up(self._pending(reqs))

    def catch_up_and_draft(self, reqs: list[Request], wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """`catch_up(reqs)` then `draft(wanted)`: in one graph replay where the runner's MTP graphs serve the
        step (`graphs`, set by the engine: every drafting request brought its rows, at most 4 each)."""
        graphs = self.graphs() if self.graphs is not None and wanted else None
        if graphs is None:
            self.catch_up(reqs)
            return self.draft(wanted)
        pending = self._pending(reqs)
        ks = {id(req): k for req, k in wanted}
        caught_up = {id(req) for req, _, end, _ in pending if end == req.num_tokens - 1}  # rows up to the last token
        if not graphs.serves([end - start for _, start, end, _ in pending]) or not ks.keys() <= caught_up:
            self._catch_up(pending)
            return self.draft(wanted)
        depths = []  # each further draft's row per request: (position, slot), or None (the padding slot)
        going = [ks.get(id(req), 0) for req, *_ in pending]
        for d in range(1, graphs.k):
            row = []
            for i, (req, _, end, _) in enumerate(pending):
                if d < going[i] and not self._room(req.slot, end + d):
                    going[i] = d  # no block free: its drafts end here
                row.append((end - 1 + d, req.slot) if d < going[i] else None)
            depths.append(row)
        out = graphs.step([(req.tokens(start + 1, end + 1), list(range(start, end)), req.slot)
                           for req, start, end, _ in pending], [hidden for *_, hidden in pending], depths)
        drafts = {req.request_id: [] for req, _ in wanted}
        for (req, *_), k, tokens in zip(pending, going, out):
            if id(req) in ks:
                drafts[req.request_id] = tokens[:k]
            req.extras.pop("mtp_last", None)  # the head's output stayed in the graph
        return drafts

    def _pending(self, reqs: list[Request]) -> list[tuple[Request, int, int, torch.Tensor]]:
        """(request, start, end, hidden rows) of each request's rows to catch up on: its last forward's rows
        whose tokens turned out right, with room in the cache."""
        pending = []
        for req in reqs:
            rows = req.extras.pop("mtp_rows", None)
            if rows is None:
                continue
            start, hidden = rows
            end = min(start + hidden.shape[0], req.num_tokens - 1)  # rows past a wrong draft saw a wrong history
            if end <= start or not self._room(req.slot, end):
                continue
            pending.append((req, start, end, hidden[:end - start]))
        return pending

    def _catch_up(self, pending: list[tuple[Request, int, int, torch.Tensor]]) -> None:
        if pending:
            ids = [t for req, start, end, _ in pending for t in req.tokens(start + 1, end + 1)]
            self._forward(pending, torch.tensor(ids, dtype=torch.long, device=pending[0][3].device))

    def catch_up_queued(self, reqs: list[Request], next_ids: torch.Tensor) -> None:
        """`catch_up` for a step whose sampled tokens the host has not read yet (async scheduling): `next_ids`
        [len(reqs)] on the device, row i reqs[i]'s token after its last row. The step carried no drafts, so
        every row is right; the head's forward is queued behind the step without waiting for the device."""
        pending, last_rows, picked, total = [], [], [], 0
        for i, req in enumerate(reqs):
            rows = req.extras.pop("mtp_rows", None)
            if rows is None:
                continue
            start, hidden = rows
            end = start + hidden.shape[0]
            if not self._room(req.slot, end):
                continue
            pending.append((req, start, end, hidden))
            total += end - start
            last_rows.append(total - 1)
            picked.append(i)
        if not pending:
            return
        device = next_ids.device
        if len(picked) < len(reqs):
            next_ids = next_ids.index_select(0, upload(torch.tensor(picked, dtype=torch.long), device))
        if len(last_rows) == last_rows[-1] + 1:  # one row each: the ids are the step's tokens
            ids = next_ids
        else:  # rows before a request's last are prompt tokens the host has; the last is the sampled one
            known = [t for req, start, end, _ in pending for t in req.tokens(start + 1, end) + [0]]
            ids = upload(torch.tensor(known, dtype=torch.long), device)
            ids.index_copy_(0, upload(torch.tensor(last_rows, dtype=torch.long), device), next_ids)
        self._forward(pending, ids)

    def _forward(self, pending: list[tuple[Request, int, int, torch.Tensor]], ids: torch.Tensor) -> None:
        """One head forward over (request, start, end, hidden rows) with the tokens after those rows."""
        device = ids.device
        positions = [p for _, start, end, _ in pending for p in range(start, end)]
        batch = ForwardBatch(ids, upload(torch.tensor(positions, dtype=torch.long), device),
                             [end - start for _, start, end, _ in pending], [start for _, start, _, _ in pending],
                             [req.slot for req, *_ in pending], self.cache)
        out = self.net.mtp(batch, torch.cat([hidden for *_, hidden in pending]), self.net)
        row = 0
        for req, start, end, _ in pending:
            row += end - start
            req.extras["mtp_last"] = (end + 1, out[row - 1:row])

    def draft(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Up to k greedy drafts for each (request, k) by request id, from the head's output after `catch_up`:
        draft i + 1 of every request from one LM-head product, and the head's next step one forward for all."""
        drafts: dict[str, list[int]] = {req.request_id: [] for req, _ in wanted}
        active = []
        for req, k in wanted:
            last = req.extras.get("mtp_last")
            if k > 0 and last is not None and last[0] == req.num_tokens:  # the head saw the row before the last token
                active.append((req, k, last[1]))
        if not active:
            return drafts
        h = torch.cat([row for *_, row in active])
        for i in range(max(k for _, k, _ in active)):
            tokens = self.net.compute_logits(h).argmax(dim=-1).tolist()
            going = []
            for j, ((req, k, _), token) in enumerate(zip(active, tokens)):
                drafts[req.request_id].append(token)
                if i + 1 < k and self._room(req.slot, req.num_tokens + i):
                    going.append(j)
            if not going:
                break
            active = [active[j] for j in going]
            batch = ForwardBatch(torch.tensor([tokens[j] for j in going], dtype=torch.long, device=h.device),
                                 torch.tensor([req.num_tokens - 1 + i for req, *_ in active], device=h.device),
                                 [1] * len(active), [req.num_tokens - 1 + i for req, *_ in active],
                                 [req.slot for req, *_ in active], self.cache)
            h = self.net.mtp(batch, h[going], self.net)
        return drafts

    def _room(self, slot: int, end: int) -> bool:
        """Reserve the slot's cache up to `end` tokens for a head step; False if no block is free."""
        try:
            self.cache.reserve(slot, end)
        except CacheFull:
            return False
        return True
