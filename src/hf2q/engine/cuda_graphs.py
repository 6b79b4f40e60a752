"""Decode steps captured in CUDA graphs, one per batch-size bucket.

A decode step launches hundreds of small kernels; replaying a captured graph removes the launch gaps.
Each bucket's graph reads static buffers (token ids, positions, slots, K/V rows, block tables,
lengths), so one step is: fill the buffers from the host in one copy, replay, read the logits rows.
A batch smaller than its bucket is padded with a private scratch slot, so padding never touches a real
sequence's state. Off CUDA a "graph" runs its step again on replay (the same buffers, padding and metadata:
how the CPU tests check them).
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from hf2q.cache.hybrid import CacheError, HybridCache
from hf2q.engine.graph_tables import GraphTables
from hf2q.forward import ForwardBatch
from hf2q.kernels.meta import FastMeta
from hf2q.kernels.tuning.timing import SPENT
from hf2q.models.qwen35 import Qwen35Model

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def pack_decode_rows(b: int, ids, positions: list[int], slots: list[int], tables: list[list[int]], pad_slot: int,
                     pad_block: int, block_size: int, width: int, rope_positions: list[int] | None = None,
                     firsts: list[int] | None = None) -> tuple[list[int], list[int], list[int]]:
    """The host pack of one decode step of `len(positions)` sequences padded to `b` rows, as plain lists.

    Returns (fields, cells, values): fields is ids, rotary positions, slots, slot mapping and context
    lengths, b each; the block tables ([b, width], zero elsewhere) hold `values` at the flat indices `cells`.
    ids None (the ids come from a device tensor) packs zeros. `positions` place each new token in its
    sequence (slot mapping, context length); `rope_positions` rotate it where they differ (a request with
    images: index + delta), by default the same. `firsts` (each row's sequence's first row) leaves the tables of
    the rows that are not first empty: the attention kernel reads a sequence's first row's (`row_firsts`), and a
    follow-up's 41 rows over 8,000 tokens would otherwise write 20,000 cells where 500 serve.
    """
    n = len(positions)
    pad = b - n
    pos = list(positions) + [0] * pad
    rope = (list(positions) if rope_positions is None else list(rope_positions)) + [0] * pad
    rows = list(slots) + [pad_slot] * pad
    tabs = list(tables) + [[pad_block]] * pad
    cells: list[int] = []
    values: list[int] = []
    mapping = []
    for i, (p, table) in enumerate(zip(pos, tabs)):
        if len(table) > width:
            raise ValueError(f"sequence of {len(table)} blocks exceeds the graph's {width}")
        mapping.append(table[p // block_size] * block_size + p % block_size)
        if firsts is None or i >= n or firsts[i] == i:
            cells.extend(range(i * width, i * width + len(table)))
            values.extend(table)
    id_row = (list(ids) if ids is not None else [0] * n) + [0] * pad
    return id_row + rope + rows + mapping + [p + 1 for p in pos], cells, values


class DecodeGraphs:
    """Graph-replayed decode (one new token per sequence) for `net` over `cache`."""

    def __init__(self, net: Qwen35Model, cache: HybridCache, buckets=DEFAULT_BUCKETS, max_context: int = 4096):
        self.net, self.cache = net, cache
        self.buckets = tuple(sorted(buckets))
        self.block_size = cache.block_size
        self.width = -(-max_context // cache.block_size)  # block-table columns
        self.pad_slot = cache.acquire()
        try:
            cache.reserve(self.pad_slot, 1)
        except CacheError:
            cache.release(self.pad_slot)
            raise
        self.pad_block = cache.block_table(self.pad_slot)[0]
        dev = net.embed.device
        n = self.buckets[-1]
        # one int64 pack: ids, positions, slots, slot_mapping, context_lens, block tables
        self._fields = 5 * n + n * self.width
        self._host = torch.zeros(self._fields, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._dev = torch.zeros(self._fields, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # the final norm's rows (what the MTP head reads)
        self._pool = None
        self.on_cuda = dev.type == "cuda"
        self._copied = torch.cuda.Event() if self.on_cuda else None  # host pack free to rewrite
        self._tables = GraphTables(self._host, self._dev, 5 * n, n, self.width)

    def _views(self, pack: torch.Tensor, b: int):
        n = self.buckets[-1]
        ids, pos, slots, mapping, lens = (pack[i * n: i * n + b] for i in range(5))
        tables = pack[5 * n:].view(n, self.width)[:b]
        return ids, pos, slots, mapping, lens, tables

    def _fill_host(self, b: int, ids, positions: list[int], slots: list[int],
                   rope_positions: list[int] | None = None) -> None:
        """Pack the step's rows into the pinned buffer through a numpy view: per-row tensor writes (and even
        a few tensor operations a step) cost more host time than the replay itself at large batches. The
        block tables hold this step's cells alone (hf2q.engine.graph_tables)."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's upload has left the pinned buffer
        n = self.buckets[-1]
        tables = [self.cache.block_table(s) for s in slots]
        fields, cells, values = pack_decode_rows(b, None if torch.is_tensor(ids) else ids, positions, slots, tables,
                                                 self.pad_slot, self.pad_block, self.block_size, self.width,
                                                 rope_positions)
        host = self._host.numpy()
        host[:5 * n].reshape(5, n)[:, :b] = np.asarray(fields, dtype=np.int64).reshape(5, b)
        self._tables.write(cells, values)

    def _batch(self, b: int) -> ForwardBatch:
        ids, pos, slots, mapping, lens, tables = self._views(self._dev, b)
        meta = FastMeta(decode=True, seq_lens=[1] * b, start_lens=[0] * b,
                        cu_seqlens=torch.arange(b + 1, device=ids.device), slots=slots, slot_mapping=mapping,
                        block_tables=tables, context_lens=lens, block_size=self.block_size)
        return ForwardBatch(ids, pos, [1] * b, [0] * b, [self.pad_slot] * b, self.cache,
                            extras={"fast_meta": meta})

    def _step(self, b: int) -> torch.Tensor:
        self.hidden[b] = self.net(self._batch(b))
        return self.net.compute_logits(self.hidden[b])

    def hidden_rows(self, n: int) -> torch.Tensor:
        """A copy of the last step's hidden rows of its n sequences [n, hidden] (the graph's own rows are
        overwritten by the next replay)."""
        return self.hidden[self.bucket(n)][:n].clone()

    @torch.inference_mode()
    def capture(self, buckets=None) -> None:
        """Warm each bucket up (compiles Triton kernels) and capture its graph, largest first; all buckets
        by default. Graphs share one memory pool and never run concurrently."""
        stream = torch.cuda.Stream() if self.on_cuda else None
        for b in sorted(self.buckets if buckets is None else buckets, reverse=True):
            t0, spent = time.monotonic(), SPENT.snapshot()
            self._fill_host(b, [0] * b, [0] * b, [self.pad_slot] * b)
            self._dev.copy_(self._host)
            self._tables.synced()
            record(self, b, stream)
            if stream is not None:
                log.info("decode graph for %d sequences captured in %.1f s (%s)", b, time.monotonic() - t0,
                         SPENT.since(spent))

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"batch of {n} exceeds the largest graph bucket {self.buckets[-1]}")

    @torch.inference_mode()
    def step(self, ids, positions: list[int], slots: list[int],
             rope_positions: list[int] | None = None) -> torch.Tensor:
        """One decode token for each sequence: ids (host list or device tensor [n]), positions (of the new
        token), slots, and the tokens' rotary positions where they differ from `positions` (requests with
        images). The cache must already be reserved past each position. A bucket not yet captured is
        captured first. Returns logits [n, vocab] (a view into the graph's output, valid until the next step)."""
        n = len(positions)
        b = self.bucket(n)
        if b not in self.graphs:
            self.capture([b])
        self._fill_host(b, ids, positions, slots, rope_positions)
        fields = 5 * self.buckets[-1]
        self._dev[:fields].copy_(self._host[:fields], non_blocking=True)
        self._tables.upload()
        if self._copied is not None:
            self._copied.record()
        if torch.is_tensor(ids):
            self._views(self._dev, b)[0][:n].copy_(ids)
        self.graphs[b].replay()
        return self.logits[b][:n]


def record(graphs, b: int, stream) -> None:
    """Capture bucket b's step of `graphs` (a DecodeGraphs or PrefillGraphs: `_step`, `graphs`, `logits`, `_pool`)
    after two warm runs on a side stream (compiling and tuning), in the memory pool its other graphs share;
    with no stream (off CUDA), its stand-in."""
    if stream is None:
        graphs.graphs[b] = _StepAgain(graphs, b)
        graphs.logits[b] = graphs.graphs[b].replay()
        return
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            graphs._step(b)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=graphs._pool):
        graphs.logits[b] = graphs._step(b)
    graphs._pool = graph.pool()
    graphs.graphs[b] = graph
    torch.cuda.synchronize()


class _StepAgain:
    """Off CUDA, a decode graph's stand-in: replay runs the bucket's step again over the same buffers,
    writing its logits into the tensor the first run returned (as a graph's replay does)."""

    def __init__(self, graphs: DecodeGraphs, b: int):
        self.graphs, self.b, self.out = graphs, b, None

    def replay(self) -> torch.Tensor:
        logits = self.graphs._step(self.b)
        if self.out is None:
            self.out = logits
        else:
            self.out.copy_(logits)
        return self.out
