"""Short prefills of one sequence (2 to 63 new tokens) captured in CUDA graphs, one per row bucket.

An eager prefill step is host-bound at these lengths (about 40 ms for 40 tokens on the H200, its GPU work
under half of that), and such steps are what a follow-up turn after a prefix-cache hit and a speculative
verify take. The graph's rows are laid out as decode rows: each row's attention reads its sequence's block
table up to its own position (the paged decode kernel, causal by the context lengths), so the K/V written
by the step is read back within it; the DeltaNet layers see two sequences, the real rows and the padding
rows, the latter on the decode graphs' private padding slot, so padding never touches a real state. The
logits are the last real row's. Off CUDA a "graph" runs its step again on replay (`_StepAgain`), which is
how the CPU tests check the buffers and the metadata.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from hf2q.engine.cuda_graphs import DecodeGraphs, _StepAgain, pack_decode_rows
from hf2q.forward import ForwardBatch
from hf2q.kernels.meta import FastMeta

log = logging.getLogger(__name__)

PREFILL_BUCKETS = (8, 16, 32, 64)
MAX_ROWS = PREFILL_BUCKETS[-1] - 1  # a bucket keeps at least one padding row: the padding sequence is never empty


class PrefillGraphs:
    """Graph-replayed short prefills of one sequence, sharing the decode graphs' padding slot and width."""

    def __init__(self, decode: DecodeGraphs, buckets=PREFILL_BUCKETS):
        self.net, self.cache = decode.net, decode.cache
        self.buckets = tuple(sorted(buckets))
        self.pad_slot, self.pad_block, self.width = decode.pad_slot, decode.pad_block, decode.width
        self.block_size = decode.block_size
        dev = self.net.embed.device
        n = self.buckets[-1]
        # one int64 pack: ids, positions, (unused) row slots, slot mapping, context lengths, block tables, then
        # the two sequences' slots, their row offsets and the last real row
        self._fields = 5 * n + n * self.width + 2 + 3 + 1
        self._host = torch.zeros(self._fields, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._dev = torch.zeros(self._fields, dtype=torch.long, device=dev)
        self.graphs: dict = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        # The two sequences' lengths on the host: a capture fixes only that both are short (fla's recurrent
        # kernel); the CPU stand-in reads the real ones at every replay.
        self._lens = {b: [1, b - 1] for b in self.buckets}
        self._pool = None
        self.on_cuda = dev.type == "cuda"
        self._copied = torch.cuda.Event() if self.on_cuda else None
        self._written = None

    def serves(self, rows: int, blocks: int) -> bool:
        """Whether a prefill of `rows` new tokens, its sequence then `blocks` blocks long, fits a graph."""
        return 2 <= rows <= MAX_ROWS and blocks <= self.width

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b > rows)

    def _views(self, pack: torch.Tensor, b: int):
        n = self.buckets[-1]
        ids, pos, _, mapping, lens = (pack[i * n: i * n + b] for i in range(5))
        tail = 5 * n + n * self.width
        tables = pack[5 * n:tail].view(n, self.width)[:b]
        return ids, pos, mapping, lens, tables, pack[tail:tail + 2], pack[tail + 2:tail + 5], pack[tail + 5:tail + 6]

    def _fill_host(self, b: int, ids: list[int], start: int, slot: int) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's upload has left the pinned buffer
        rows = len(ids)
        table = self.cache.block_table(slot)
        fields, cells, values = pack_decode_rows(b, ids, list(range(start, start + rows)), [slot] * rows,
                                                 [table] * rows, self.pad_slot, self.pad_block, self.block_size,
                                                 self.width)
        n = self.buckets[-1]
        host = self._host.numpy()
        host[:5 * n].reshape(5, n)[:, :b] = np.asarray(fields, dtype=np.int64).reshape(5, b)
        tab = host[5 * n:5 * n + n * self.width]
        if self._written is not None:
            tab[self._written] = 0
        self._written = np.asarray(cells, dtype=np.int64)
        tab[self._written] = values
        host[5 * n + n * self.width:] = [slot, self.pad_slot, 0, rows, b, rows - 1]
        self._lens[b] = [rows, b - rows]

    def _batch(self, b: int) -> ForwardBatch:
        ids, pos, mapping, lens, tables, slots, cu, _ = self._views(self._dev, b)
        seq_lens = list(self._lens[b])
        meta = FastMeta(decode=False, seq_lens=seq_lens, start_lens=[0, 0], cu_seqlens=cu, slots=slots,
                        slot_mapping=mapping, block_tables=tables, context_lens=lens, block_size=self.block_size,
                        rows_paged=True)
        return ForwardBatch(ids, pos, seq_lens, [0, 0], [self.pad_slot] * 2, self.cache,
                            extras={"fast_meta": meta})

    def _step(self, b: int) -> torch.Tensor:
        self.hidden[b] = self.net(self._batch(b))
        last = self._views(self._dev, b)[7]
        return self.net.compute_logits(self.hidden[b].index_select(0, last))

    @torch.inference_mode()
    def capture(self, buckets=None) -> None:
        """Warm each bucket up (compiles its kernels) and capture its graph, largest first; all by default. The
        capture runs on the padding slot alone: one row at its first position, the rest padding."""
        stream = torch.cuda.Stream() if self.on_cuda else None
        for b in sorted(self.buckets if buckets is None else buckets, reverse=True):
            t0 = time.monotonic()
            self._fill_host(b, [0], 0, self.pad_slot)
            self._dev.copy_(self._host)
            if stream is None:
                self.graphs[b] = _StepAgain(self, b)
                self.logits[b] = self.graphs[b].replay()
                continue
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._step(b)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self.logits[b] = self._step(b)
            self._pool = graph.pool()
            self.graphs[b] = graph
            torch.cuda.synchronize()
            log.info("prefill graph for %d rows captured in %.1f s", b, time.monotonic() - t0)

    @torch.inference_mode()
    def step(self, ids: list[int], start: int, slot: int) -> torch.Tensor:
        """The new tokens `ids` of the sequence in `slot` at positions start..; the cache reserved past them.
        Returns the last token's logits [1, vocab] (a view into the graph's output, valid until the next step)."""
        b = self.bucket(len(ids))
        if b not in self.graphs:
            self.capture([b])
        self._fill_host(b, ids, start, slot)
        self._dev.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.graphs[b].replay()
        return self.logits[b]

    def hidden_rows(self, rows: int) -> torch.Tensor:
        """A copy of the last step's first `rows` hidden rows (the graph's own are overwritten by the next)."""
        return self.hidden[self.bucket(rows)][:rows].clone()
