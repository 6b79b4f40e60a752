"""Small steps with prefill rows captured in CUDA graphs: up to 127 new tokens over up to 64 sequences (a short
prefill alone, or beside the decode rows of other requests), one graph per row bucket.

An eager step with a prefill in it is host-bound at these sizes (about 40 ms for 40 tokens on the H200, its GPU
work under half of that), and every request decoding beside it waits for it: a follow-up turn after a
prefix-cache hit is such a step, and so is each new request's prefill in a busy server. The graph's rows are
laid out as decode rows: each row's attention reads its sequence's block table up to its own position (the
paged decode kernel, causal by the context lengths), so the K/V written by the step is read back within it.
The DeltaNet layers see max_seqs + PADDING_SEQS sequences: the real ones, empty ones on the decode graphs'
private padding slot, and the padding rows, last, spread over PADDING_SEQS more on that slot too. Their step
is one kernel pair on the state pools in place (hf2q.kernels.gdn.verify_triton): it reads the row offsets from
the device, walks each real sequence's rows on its slot (the state in registers, nothing gathered or written
back for the empty ones) and skips the padding sequences (their rows read out zeros); a verify graph's also
keeps the states after each sequence's first rows, a prefill graph's those after one row of one sequence (a
prefix-cache checkpoint inside its chunk, so a chat follow-up's rest is one replay, not two cut at its anchor).
The logits are each sequence's last row's (a verify graph's: its last POSITIONS rows). Off CUDA a "graph" runs
its step again on replay (`_StepAgain`), which is how the CPU tests check the buffers and the metadata.
"""
from __future__ import annotations

import itertools
import logging
import time

import numpy as np
import torch

from hf2q.cache.state_at import GraphStateAt
from hf2q.engine.cuda_graphs import DecodeGraphs, pack_decode_rows, record
from hf2q.engine.graph_tables import GraphTables
from hf2q.forward import ForwardBatch
from hf2q.kernels.meta import FastMeta
from hf2q.spec.states import POSITIONS, KeptPositions

log = logging.getLogger(__name__)

# A bucket of exactly 4 rows keeps the quantized projections of a step of up to 4 rows on the few-row mat-vec,
# which reads each weight once for all of them (a bucket of 8 sends them through the tile kernel): a lone verify of
# 3 drafts, and the 2-token steps a chat follow-up takes (the piece after its anchor, the next turn's re-rendered
# history), which took 11.3-11.5 ms in the 8-row bucket on an H100 where a decode step of 9B Q4_K_M takes 3 ms.
# A bucket of 48 rows: a chat follow-up's rest (its new message and the generation prompt, often 33-48 tokens) ran
# in the 64-row bucket, its step 21-25 ms of device time on an H100, each 16 rows more a tile-kernel pass and a
# quarter more paged-attention rows over the whole history.
PREFILL_BUCKETS = (4, 8, 16, 32, 48, 64, 128)
VERIFY_BUCKETS = (4, 8, 16, 32, 64, 128)  # 4 rows a verifying request: a 48-row one would serve only 9-12 of them
MAX_ROWS = PREFILL_BUCKETS[-1] - 1  # the longest prefill chunk the scheduler sends to a graph
MAX_SEQS = 64
# A burst of prompts arriving together is one step of many short sequences (16 prompts of 64 tokens: 1,024 rows),
# past the buckets above: run eagerly, such steps took 107-330 ms on an H100 (9B Q4_K_M, 4 to 16 prompts, 256 to 772
# rows), over ten times their arithmetic, and every request waits for its first token behind them. They replay
# graphs of their own, whose sequences bring at most BURST_SEQ_ROWS rows each (the DeltaNet step walks a sequence's
# rows in order; fla's chunked kernel takes longer ones) and hold at most BURST_CONTEXT tokens, which keeps the
# per-row block tables narrow (BURST_CONTEXT / block_size columns, where the short graphs' span the model's context).
BURST_BUCKETS = (256, 512, 1024, 2048)
BURST_SEQ_ROWS = 128
BURST_CONTEXT = 4096
PADDING_SEQS = 8  # the padding rows' sequences: each one's rows are zeroed by programs of its own


def capturable(net, rows: int) -> bool:
    """Whether a step of `rows` rows can be captured: an MoE layer in another dtype than bf16 (no grouped GEMM
    there) takes more pairs than the expert GEMV's few through a loop that reads the routing on the host."""
    from hf2q.kernels.moe.ops import MOE_GEMV_PAIRS

    cfg = net.config
    if not cfg.is_moe or net.embed.device.type != "cuda" or net.embed.dtype == torch.bfloat16:
        return True
    return rows * cfg.num_experts_per_tok <= MOE_GEMV_PAIRS


def capturable_buckets(net, buckets, rows_per_bucket: int = 1) -> tuple[tuple[int, ...], bool]:
    """(the buckets whose steps of `rows_per_bucket` x bucket rows can be captured, sorted; whether any can).
    With none, the smallest bucket stands in so the sizes stay defined, and the graphs serve nothing."""
    usable = tuple(sorted(b for b in buckets if capturable(net, rows_per_bucket * b)))
    return usable or (min(buckets),), bool(usable)


def spread(rows: int) -> list[int]:
    """`rows` padding rows over PADDING_SEQS sequences, as evenly as they go."""
    return [rows // PADDING_SEQS + (i < rows % PADDING_SEQS) for i in range(PADDING_SEQS)]


class PrefillGraphs:
    """Graph-replayed small steps, sharing the decode graphs' padding slot and (or a narrower) block-table width.

    `verify`: graphs for steps with drafts to verify (hf2q.spec): the logits of each sequence's last POSITIONS
    rows (a sequence's drafts and the row before them), and its DeltaNet states after each of its first
    PREFIXES rows kept in `kept` (hf2q.spec.states.KeptPositions), for the engine to settle the slot.
    Else `inside` (hf2q.cache.state_at.GraphStateAt) keeps the DeltaNet states after the row a step names.
    """

    def __init__(self, decode: DecodeGraphs, buckets=PREFILL_BUCKETS, max_seqs: int = MAX_SEQS,
                 verify: bool = False, width: int | None = None, seq_rows: int | None = None):
        self.net, self.cache = decode.net, decode.cache
        self.buckets, self.usable = capturable_buckets(decode.net, buckets)
        self.max_seqs = max_seqs
        self.verify = verify
        self.seq_rows = seq_rows  # the most rows one sequence may bring (None: any the buckets hold)
        self.pad_slot, self.pad_block = decode.pad_slot, decode.pad_block
        self.width = decode.width if width is None else min(width, decode.width)  # block-table columns
        self.block_size = decode.block_size
        dev = self.net.embed.device
        n, s = self.buckets[-1], max_seqs + PADDING_SEQS
        # one int64 pack: ids, positions, (unused) row slots, slot mapping, context lengths, block tables, then
        # the sequences' slots (the padding sequences last), their row offsets, the rows whose logits are
        # wanted (each sequence's last, or its last POSITIONS), the (sequence, row) whose states are kept, and each
        # row's sequence's first row (the attention kernel reads a sequence's keys once for several of its rows; a
        # padding row is its own)
        self._logit_rows = max_seqs * (POSITIONS if verify else 1)
        self._sizes = (s, s + 1, self._logit_rows, 2, n)
        self._fields = 5 * n + n * self.width + sum(self._sizes)
        self._host = torch.zeros(self._fields, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._dev = torch.zeros(self._fields, dtype=torch.long, device=dev)
        self.kept = KeptPositions(self.cache, max_seqs) if verify else None
        self.inside = None if verify else GraphStateAt(self.cache, self._views(self._dev, n)[8])
        self.graphs: dict = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        # The sequences' lengths on the host: a capture fixes none of them (the DeltaNet step reads the device's
        # row offsets); the CPU stand-in reads the real ones at every replay.
        self._lens = {b: [1] + [0] * (max_seqs - 1) + spread(b - 1) for b in self.buckets}
        self._pool = None
        self.on_cuda = dev.type == "cuda"
        self._copied = torch.cuda.Event() if self.on_cuda else None
        self._tables = GraphTables(self._host, self._dev, 5 * n, n, self.width)

    def serves(self, rows: list[int], blocks: list[int]) -> bool:
        """Whether a step of these sequences' new rows fits a graph, their sequences then `blocks` blocks long."""
        return (self.usable and len(rows) <= self.max_seqs and 1 <= sum(rows) <= self.buckets[-1]
                and max(blocks) <= self.width and (self.seq_rows is None or max(rows) <= self.seq_rows))

    def bucket(self, rows: int) -> int:
        """The smallest bucket that holds `rows` (a full one has no padding rows: its padding sequences are
        empty, as unused sequences are)."""
        return next(b for b in self.buckets if b >= rows)

    def _views(self, pack: torch.Tensor, b: int):
        """ids, positions, slot mapping, context lengths, block tables (b rows each), then the sequences' slots,
        row offsets, logit rows, the kept (sequence, row) and the rows' sequences' first rows."""
        n = self.buckets[-1]
        ids, pos, _, mapping, lens = (pack[i * n: i * n + b] for i in range(5))
        tail = 5 * n + n * self.width
        tables = pack[5 * n:tail].view(n, self.width)[:b]
        rest, at = [], tail
        for size in self._sizes:
            rest.append(pack[at:at + size])
            at += size
        return (ids, pos, mapping, lens, tables, *rest)

    def _fill_host(self, b: int, seqs: list[tuple[list[int], int, int]], keep: tuple[int, int] = (-1, -1)) -> None:
        """Pack the step: `seqs` are (new token ids, start position, slot) each; `keep`: (sequence, row) whose
        DeltaNet states `inside` keeps."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's upload has left the pinned buffer
        ids = [t for new, _, _ in seqs for t in new]
        positions = [p for new, start, _ in seqs for p in range(start, start + len(new))]
        slots = [slot for new, _, slot in seqs for _ in new]
        tables = [table for new, _, slot in seqs for table in [self.cache.block_table(slot)] * len(new)]
        n, empty = self.buckets[-1], self.max_seqs - len(seqs)
        lens = [len(new) for new, _, _ in seqs] + [0] * empty + spread(b - len(ids))
        cu = [0, *itertools.accumulate(lens)]
        firsts = [first for (new, _, _), first in zip(seqs, cu) for _ in new]
        fields, cells, values = pack_decode_rows(b, ids, positions, slots, tables, self.pad_slot, self.pad_block,
                                                 self.block_size, self.width, firsts=firsts)
        host = self._host.numpy()
        host[:5 * n].reshape(5, n)[:, :b] = np.asarray(fields, dtype=np.int64).reshape(5, b)
        self._tables.write(cells, values)
        slots = [slot for _, _, slot in seqs] + [self.pad_slot] * (empty + PADDING_SEQS)
        k = self._logit_rows // self.max_seqs  # each sequence's last k rows (the first repeated where it has fewer)
        logit_rows = [max(first, first + len(new) - k + p) for (new, _, _), first in zip(seqs, cu)
                      for p in range(k)] + [b - 1] * (k * empty)
        firsts += range(len(firsts), n)
        host[5 * n + n * self.width:] = slots + cu + logit_rows + list(keep) + firsts
        self._lens[b] = lens

    def _batch(self, b: int) -> ForwardBatch:
        ids, pos, mapping, lens, tables, slots, cu, _, _, firsts = self._views(self._dev, b)
        seq_lens = list(self._lens[b])
        starts = [0] * len(seq_lens)
        meta = FastMeta(decode=False, seq_lens=seq_lens, start_lens=starts, cu_seqlens=cu[:len(seq_lens) + 1],
                        slots=slots, slot_mapping=mapping, block_tables=tables, context_lens=lens,
                        block_size=self.block_size, rows_paged=True, kept_positions=self.kept, live_seqs=self.max_seqs,
                        state_inside=self.inside, row_firsts=firsts[:b])
        return ForwardBatch(ids, pos, seq_lens, starts, [self.pad_slot] * len(seq_lens), self.cache,
                            extras={"fast_meta": meta})

    def _step(self, b: int) -> torch.Tensor:
        self.hidden[b] = self.net(self._batch(b))
        logit_rows = self._views(self._dev, b)[7][:self.logit_rows_in(b)]
        return self.net.compute_logits(self.hidden[b].index_select(0, logit_rows))

    def logit_rows_in(self, b: int) -> int:
        """Rows the head multiplies in bucket b's graph: a step of b rows holds at most b sequences, so a small
        bucket's head takes that many (a 2-token step's 4 rows: the few-row mat-vec) instead of every sequence
        the graphs allow (up to 64 rows of a 248k-wide head through the tile kernel, where the step needs one)."""
        return min(b, self.max_seqs) * (POSITIONS if self.verify else 1)

    @torch.inference_mode()
    def capture(self, buckets=None) -> None:
        """Warm each bucket up (compiles its kernels) and capture its graph, largest first; all by default. The
        capture runs on the padding slot alone: one row at its first position, the rest padding."""
        stream = torch.cuda.Stream() if self.on_cuda else None
        for b in sorted(self.buckets if buckets is None else buckets, reverse=True):
            t0 = time.monotonic()
            self._fill_host(b, [([0], 0, self.pad_slot)])
            self._dev.copy_(self._host)
            self._tables.synced()
            record(self, b, stream)
            if stream is not None:
                log.info("prefill graph for %d rows captured in %.1f s", b, time.monotonic() - t0)

    @torch.inference_mode()
    def step(self, seqs: list[tuple[list[int], int, int]], keep: tuple[int, int] | None = None) -> torch.Tensor:
        """One step of `seqs` ((new token ids, start position, slot) each), the cache reserved past them; with
        `keep` (sequence, row; a prefill graph's) `inside` then holds the DeltaNet states after that row.
        Returns each sequence's last-row logits [len(seqs), vocab], or in a verify graph its last POSITIONS
        rows' [len(seqs), POSITIONS, vocab] (the first ones repeat its first row where it has fewer): a view
        into the graph's output, valid until the next step."""
        b = self.bucket(sum(len(new) for new, _, _ in seqs))
        if b not in self.graphs:
            self.capture([b])
        if keep is not None and self.inside is None:
            raise ValueError("a verify graph keeps no state after a chosen row")
        self._fill_host(b, seqs, keep if keep is not None else (-1, -1))
        fields, tail = 5 * self.buckets[-1], 5 * self.buckets[-1] + self.buckets[-1] * self.width
        self._dev[:fields].copy_(self._host[:fields], non_blocking=True)
        self._tables.upload()
        self._dev[tail:].copy_(self._host[tail:], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.graphs[b].replay()
        if self.verify:
            return self.logits[b].view(-1, POSITIONS, self.logits[b].shape[-1])[:len(seqs)]
        return self.logits[b][:len(seqs)]

    def hidden_rows(self, total: int) -> torch.Tensor:
        """A copy of the last step's first `total` hidden rows (the graph's own are overwritten by the next)."""
        return self.hidden[self.bucket(total)][:total].clone()
