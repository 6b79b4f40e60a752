"""The MTP head's work of a step in one CUDA graph: its catch-up over the rows of the last forward, then its
k drafts, for up to 8 requests (speculation runs on small batches).

Eagerly that is k + 1 head forwards and k LM-head products, each a few dozen kernel launches, and a host read
of the argmax after each draft: at batch 1 more host time than a graph-replayed decode step of the whole
model. In the graph the catch-up rows are laid out as paged decode rows (each reads its request's block table
up to its own position, so a row attends to the rows before it written by the same forward), the last row of
each request gives draft 1, and each further draft is one row per request at the next position, fed the
previous draft from the device; the drafts come back in one read. Rows past a request's drafts, or with no
cache room reserved, write the decode graphs' padding slot. Off CUDA a "graph" runs its step again on replay
(`hf2q.engine.cuda_graphs._StepAgain`), which is how the CPU tests check the buffers and the layout.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from hf2q.engine.cuda_graphs import DecodeGraphs, pack_decode_rows, record
from hf2q.engine.graph_tables import GraphTables
from hf2q.engine.prefill_graphs import capturable_buckets
from hf2q.forward import ForwardBatch
from hf2q.kernels.meta import FastMeta

log = logging.getLogger(__name__)

MTP_BUCKETS = (1, 2, 4, 8)
ROWS = 4  # catch-up rows a request may bring: a verify chunk's (the last decided token and up to 3 drafts)


class MTPGraphs:
    """Graph-replayed catch-up + drafts of the MTP head for `k` drafts, sharing the decode graphs' padding slot
    and block-table width. `step` takes (request, first row's position, rows, hidden rows, drafts wanted)."""

    def __init__(self, decode: DecodeGraphs, k: int, buckets=MTP_BUCKETS):
        self.net, self.cache = decode.net, decode.cache
        self.k = k
        self.buckets, self.usable = capturable_buckets(decode.net, buckets, ROWS)
        self.pad_slot, self.pad_block, self.width = decode.pad_slot, decode.pad_block, decode.width
        self.block_size = decode.block_size
        dev = self.net.embed.device
        n = self.buckets[-1]
        r = ROWS * n
        # one int64 pack: the catch-up rows' ids, positions, (unused) slots, slot mapping and context lengths,
        # their block tables, each request's last catch-up row, then for each further draft its rows' positions,
        # (unused) slots, slot mapping and context lengths, and the requests' block tables
        self._depth_fields = 4 * n + n * self.width
        self._fields = 5 * r + r * self.width + n + (k - 1) * 4 * n + n * self.width
        self._host = torch.zeros(self._fields, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._dev = torch.zeros(self._fields, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(r, self.net.config.hidden_size, dtype=self.net.embed.dtype, device=dev)
        self._cu = torch.arange(r + 1, device=dev)
        self.graphs: dict = {}
        self.logits: dict[int, torch.Tensor] = {}  # each bucket's drafts [b, k] (the name `record` writes)
        self._pool = None
        self.on_cuda = dev.type == "cuda"
        self._copied = torch.cuda.Event() if self.on_cuda else None
        # the block tables (hf2q.engine.graph_tables): the catch-up rows', then the further drafts' at the pack's end
        self._middle = (5 * r + r * self.width, self._fields - n * self.width)  # what lies between them
        self._tables = GraphTables(self._host, self._dev, 5 * r, r, self.width)
        self._depth_tables = GraphTables(self._host, self._dev, self._middle[1], n, self.width)

    def serves(self, rows: list[int]) -> bool:
        """Whether a step whose requests bring these catch-up rows fits a graph."""
        return self.usable and 1 <= len(rows) <= self.buckets[-1] and all(1 <= n <= ROWS for n in rows)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _views(self, pack: torch.Tensor, b: int):
        """The catch-up rows' fields and tables (ROWS * b rows), the last rows (b), and per further draft its
        fields (b rows each), then the requests' tables (b rows)."""
        n, r = self.buckets[-1], ROWS * self.buckets[-1]
        rows = ROWS * b
        ids, pos, _, mapping, lens = (pack[i * r: i * r + rows] for i in range(5))
        at = 5 * r
        tables = pack[at:at + r * self.width].view(r, self.width)[:rows]
        at += r * self.width
        last = pack[at:at + b]
        at += n
        depths = []
        for _ in range(self.k - 1):
            pos_d, _, map_d, lens_d = (pack[at + i * n: at + i * n + b] for i in range(4))
            depths.append((pos_d, map_d, lens_d))
            at += 4 * n
        depth_tables = pack[at:at + n * self.width].view(n, self.width)[:b]
        return ids, pos, mapping, lens, tables, last, depths, depth_tables

    def _fill_host(self, b: int, catch_up: list[tuple[list[int], list[int], int]],
                   depths: list[list[tuple[int, int] | None]]) -> None:
        """Pack the step: `catch_up` (token ids, positions, slot) per request; `depths[d]` the position and slot
        of each request's row for draft d + 2, or None where it writes the padding slot."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's upload has left the pinned buffer
        n, r = self.buckets[-1], ROWS * self.buckets[-1]
        host = self._host.numpy()
        ids = [t for toks, _, _ in catch_up for t in toks]
        positions = [p for _, ps, _ in catch_up for p in ps]
        slots = [slot for _, ps, slot in catch_up for _ in ps]
        tables = [self.cache.block_table(slot) for slot in slots]
        fields, cells, values = pack_decode_rows(ROWS * b, ids, positions, slots, tables, self.pad_slot,
                                                 self.pad_block, self.block_size, self.width)
        host[:5 * r].reshape(5, r)[:, :ROWS * b] = np.asarray(fields, dtype=np.int64).reshape(5, ROWS * b)
        self._tables.write(cells, values)
        at = 5 * r + r * self.width
        ends = np.cumsum([len(ps) for _, ps, _ in catch_up]) - 1
        host[at:at + b] = np.concatenate([ends, np.full(b - len(catch_up), ROWS * b - 1)])
        at += n
        for depth in depths:
            pos = [row[0] if row is not None else 0 for row in depth]
            row_slots = [row[1] if row is not None else self.pad_slot for row in depth]
            tabs = [self.cache.block_table(s) if row is not None else [self.pad_block]
                    for s, row in zip(row_slots, depth)]
            fields, _, _ = pack_decode_rows(b, None, pos, row_slots, tabs, self.pad_slot, self.pad_block,
                                            self.block_size, self.width)
            host[at:at + 4 * n].reshape(4, n)[:, :b] = np.asarray(fields[b:], dtype=np.int64).reshape(4, b)
            at += 4 * n
        # the further drafts' block tables: each request's (pack_decode_rows for its table cells alone)
        tables = [self.cache.block_table(slot) for _, _, slot in catch_up]
        _, cells, values = pack_decode_rows(b, None, [0] * len(tables), [0] * len(tables), tables, self.pad_slot,
                                            self.pad_block, self.block_size, self.width)
        self._depth_tables.write(cells, values)

    def _step(self, b: int) -> torch.Tensor:
        ids, pos, mapping, lens, tables, last, depths, depth_tables = self._views(self._dev, b)
        rows = ROWS * b
        meta = FastMeta(decode=False, seq_lens=[1] * rows, start_lens=[0] * rows, cu_seqlens=self._cu[:rows + 1],
                        slot_mapping=mapping, block_tables=tables, context_lens=lens, block_size=self.block_size,
                        rows_paged=True)
        batch = ForwardBatch(ids, pos, [1] * rows, [0] * rows, [self.pad_slot] * rows, self.cache,
                             extras={"fast_meta": meta})
        h = self.net.mtp(batch, self.hidden[:rows], self.net).index_select(0, last)
        drafts = []
        for d in range(self.k):
            token = self.net.compute_logits(h).argmax(dim=-1)
            drafts.append(token)
            if d + 1 < self.k:
                pos_d, map_d, lens_d = depths[d]
                meta = FastMeta(decode=True, seq_lens=[1] * b, start_lens=[0] * b, cu_seqlens=self._cu[:b + 1],
                                slot_mapping=map_d, block_tables=depth_tables, context_lens=lens_d,
                                block_size=self.block_size)
                batch = ForwardBatch(token, pos_d, [1] * b, [0] * b, [self.pad_slot] * b, self.cache,
                                     extras={"fast_meta": meta})
                h = self.net.mtp(batch, h, self.net)
        return torch.stack(drafts, dim=1)

    @torch.inference_mode()
    def capture(self, buckets=None) -> None:
        """Warm each bucket up and capture its graph, largest first; all by default (on the padding slot)."""
        stream = torch.cuda.Stream() if self.on_cuda else None
        for b in sorted(self.buckets if buckets is None else buckets, reverse=True):
            t0 = time.monotonic()
            self._fill_host(b, [([0], [0], self.pad_slot)], [[None] * b] * (self.k - 1))
            self._dev.copy_(self._host)
            self._tables.synced()
            self._depth_tables.synced()
            record(self, b, stream)
            if stream is not None:
                log.info("MTP draft graph for %d requests captured in %.1f s", b, time.monotonic() - t0)

    @torch.inference_mode()
    def step(self, catch_up: list[tuple[list[int], list[int], int]], hidden: list[torch.Tensor],
             depths: list[list[tuple[int, int] | None]]) -> list[list[int]]:
        """One replay: `catch_up` (token ids, positions, slot) and `hidden` (the target's rows at those
        positions) per request, `depths` as `_fill_host` takes them. Returns each request's k drafts (those
        past its own count are noise)."""
        b = self.bucket(len(catch_up))
        if b not in self.graphs:
            self.capture([b])
        self._fill_host(b, catch_up, [row + [None] * (b - len(row)) for row in depths])
        fields, (mid, end) = 5 * ROWS * self.buckets[-1], self._middle
        self._dev[:fields].copy_(self._host[:fields], non_blocking=True)
        self._dev[mid:end].copy_(self._host[mid:end], non_blocking=True)
        self._tables.upload()
        self._depth_tables.upload()
        if self._copied is not None:
            self._copied.record()
        rows = torch.cat(hidden)
        self.hidden[:rows.shape[0]].copy_(rows)
        self.graphs[b].replay()
        return self.logits[b][:len(catch_up)].tolist()
