"""Device-side batch metadata for the vectorised (CUDA) path.

The reference path walks `ForwardBatch.segments()` in Python; the fast path needs the same facts as
tensors, built once per forward (or held in static buffers by a CUDA graph): which slot each sequence
owns, where each new token's K/V row goes, each sequence's block table and length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from hf2q.forward import ForwardBatch

if TYPE_CHECKING:
    from hf2q.cache.state_at import GraphStateAt
    from hf2q.spec.states import KeptPositions


@dataclass
class FastMeta:
    decode: bool  # every sequence has exactly one new token (decode step)
    seq_lens: list[int]  # new tokens per sequence (host copy)
    start_lens: list[int]  # cached tokens per sequence (host copy)
    cu_seqlens: torch.Tensor  # [N + 1] int64 row offsets of the sequences
    slots: Optional[torch.Tensor] = None  # [N] int64 cache slot per sequence (None without a cache)
    slot_mapping: Optional[torch.Tensor] = None  # [T] int64 flat K/V row of each new token
    block_tables: Optional[torch.Tensor] = None  # [N, max_blocks] int32
    context_lens: Optional[torch.Tensor] = None  # [N] int32 tokens visible to each sequence after this step
    block_size: int = 0
    # Every row reads the K/V of its own block-table row up to its own context length, as decode rows do: the
    # rows of a small prefill step replayed in a graph (engine/prefill_graphs.py), each a query at its position;
    # such a step's DeltaNet runs on the state pools in place (gdn_ops.gdn_verify_), reading the row offsets
    # from the device only.
    rows_paged: bool = False
    # [rows] each row's sequence's first row, in a rows_paged step: the paged attention kernel reads a sequence's
    # keys once for a group of its rows (None: each row alone)
    row_firsts: Optional[torch.Tensor] = None
    # A verify step replayed in a graph keeps each sequence's DeltaNet states after each of its first rows
    # (hf2q.spec.states.KeptPositions), in a layout fixed at capture.
    kept_positions: Optional["KeptPositions"] = None
    # A prefill step replayed in a graph keeps the DeltaNet states after one row of one sequence (a prefix-cache
    # checkpoint inside its chunk, hf2q.cache.state_at.GraphStateAt), the row read from the device.
    state_inside: Optional["GraphStateAt"] = None
    # A graph step's sequences before its padding ones (rows_paged steps): the DeltaNet step runs on the state
    # pools in place for these and leaves the padding sequences' state alone.
    live_seqs: int = 0


def build_meta(batch: ForwardBatch) -> FastMeta:
    """Host-side build of the metadata; one small upload per field."""
    dev = batch.input_ids.device
    lens, starts = list(batch.seq_lens), list(batch.start_lens)
    cu = torch.zeros(len(lens) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.long), 0)
    meta = FastMeta(decode=all(n == 1 for n in lens), seq_lens=lens, start_lens=starts,
                    cu_seqlens=cu.to(dev, non_blocking=True))
    cache = batch.cache
    if cache is None:
        return meta
    bs = cache.block_size
    tables = [cache.block_table(s) for s in batch.slots]
    width = max(1, max(len(t) for t in tables))
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    seq_id = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]) if lens else torch.zeros(0, dtype=torch.long)
    mapping = bt[seq_id, pos // bs].long() * bs + pos % bs
    meta.slots = torch.tensor(batch.slots, dtype=torch.long).to(dev, non_blocking=True)
    meta.slot_mapping = mapping.to(dev, non_blocking=True)
    meta.block_tables = bt.to(dev, non_blocking=True)
    meta.context_lens = torch.tensor([s + n for s, n in zip(starts, lens)], dtype=torch.int32).to(dev, non_blocking=True)
    meta.block_size = bs
    return meta


def fast_meta(batch: ForwardBatch) -> FastMeta:
    """The batch's metadata, built on first use and kept in `batch.extras`."""
    meta = batch.extras.get("fast_meta")
    if meta is None:
        meta = build_meta(batch)
        batch.extras["fast_meta"] = meta
    return meta
