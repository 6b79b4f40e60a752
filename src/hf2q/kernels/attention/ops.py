"""Attention over the paged K/V pool: causal attention of a batch's new rows over their prefixes with the
output gate, paged decode attention (one query per sequence) and the store of new rows into a compressed
pool. Picks the vectorised path (Triton kernels where they run) or the exact torch path."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf2q.devices import upload
from hf2q.forward import ForwardBatch
from hf2q.kernels.attention.reference import prefix_attention
from hf2q.kernels.choose import triton_runs, use_fast_path
from hf2q.kernels.meta import fast_meta

if TYPE_CHECKING:
    from hf2q.cache.hybrid import HybridCache
    from hf2q.cache.kv_pool import KVPool


class LayerKV(NamedTuple):
    """One attention layer's K/V in the batch's cache: the pool, the layer's index in it, its flat payload rows
    (`pool.rows(index)`) and side values (`pool.sides(index)`, None for a dense pool), and the cache that maps a
    slot's positions to rows."""
    cache: HybridCache
    pool: KVPool
    index: int
    k_rows: torch.Tensor
    v_rows: torch.Tensor
    sides: tuple[torch.Tensor, torch.Tensor] | None


def layer_kv(batch: ForwardBatch, layer_id: int) -> LayerKV | None:
    """The K/V of decoder layer `layer_id` in the batch's cache; None for a forward without a cache."""
    cache = batch.cache
    if cache is None:
        return None
    index = cache.kv_index(layer_id)
    return LayerKV(cache, cache.kv, index, *cache.kv.rows(index), cache.kv.sides(index))


def gated_causal_attention(q, k, v, gate, batch: ForwardBatch, kv: LayerKV | None, scale: float) -> torch.Tensor:
    """softmax(q kᵀ · scale) v over each sequence's prefix (its cached rows, then its new rows, causal; GQA),
    times sigmoid(gate). q/gate: [T, nh, hd] of the new tokens, k/v: [T, nkv, hd] (already in the pool when
    kv is given). Returns [T, nh * hd]. Vectorised path: a decode step reads the pool in the paged kernel, the
    gate in its epilogue; a prefill attends over its new rows alone where they are the whole prefix. Exact
    path: every sequence over its prefix gathered from the pool."""
    t = q.shape[0]
    if not use_fast_path(q):
        out = _each_sequence(q, k, v, batch, kv, scale, fused=False)
        return out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
    meta = fast_meta(batch)
    if kv is not None and (meta.decode or meta.rows_paged):
        out = paged_decode_attention(q, kv.k_rows, kv.v_rows, meta.block_tables, meta.context_lens,
                                     meta.block_size, scale, gate=gate, pool=kv.pool, sides=kv.sides,
                                     row_firsts=meta.row_firsts)
        return out.reshape(t, -1)
    decoding = _decode_rows(batch) if kv is not None else None
    out = _each_sequence(q, k, v, batch, kv, scale, fused=True, skip=decoding)
    if decoding is not None:
        seqs, rows = decoding
        out[rows] = paged_decode_attention(q[rows], kv.k_rows, kv.v_rows, meta.block_tables[seqs],
                                           meta.context_lens[seqs], meta.block_size, scale, pool=kv.pool,
                                           sides=kv.sides)
    return out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))


def _decode_rows(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(sequence indices, rows) on the device of a mixed step's decode rows (one new token after a cached
    prefix), which one paged-attention call takes together; None where there are fewer than two. Made once a
    forward (`batch.extras`)."""
    made = batch.extras.get("decode_rows", False)
    if made is False:
        picked = [(i, row) for i, row, n, start, _ in batch.segments() if _decodes(n, start)]
        made = None
        if len(picked) > 1:
            index = upload(torch.tensor(picked, dtype=torch.long).T.contiguous(), batch.input_ids.device)
            made = (index[0], index[1])
        batch.extras["decode_rows"] = made
    return made


def _decodes(n: int, start: int) -> bool:
    """Whether a sequence's rows in a step are a decode row: one new token after a cached prefix."""
    return n == 1 and start > 0


# SDPA's backends for a prefill's rows, cuDNN's left out: it builds an execution plan for every new shape, and
# served steps bring a new row count almost every time (a prompt's chunk beside a changing number of decode rows):
# on an H100 the engine thread spent half its time inside that SDPA call while 16 x 2,048-token prompts were served
_PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _each_sequence(q, k, v, batch: ForwardBatch, kv: LayerKV | None, scale: float, fused: bool, skip=None):
    """Each sequence's new rows over its prefix, read from the pool (decoded where it is compressed). With
    `fused`, SDPA's fused kernels (`_PREFILL_BACKENDS`): a sequence without cached rows over a model-dtype pool
    attends over k/v directly, one with cached rows over its gathered prefix (both `_over_prefix_fused`). With
    `skip` (`_decode_rows`), the decode rows are left to the caller."""
    out = torch.empty_like(q)
    with sdpa_kernel(_PREFILL_BACKENDS):
        for _, row, n, start, slot in batch.segments():
            if skip is not None and _decodes(n, start):
                continue
            rows = slice(row, row + n)
            if kv is None or (fused and start == 0 and kv.pool.is_dense):
                keys, values = k[rows], v[rows]
            else:
                keys, values = kv.pool.gather(kv.index, kv.cache.token_indices(slot, 0, start + n), q.dtype)
            attend = _over_prefix_fused if fused else prefix_attention
            out[rows] = attend(q[rows], keys, values, start, scale)
    return out


def _over_prefix_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """`prefix_attention` through SDPA's flash or memory-efficient kernel: the causal mask of new rows at the
    prefix's end is the bottom-right triangle, which those kernels take as a `causal_lower_right` bias, where
    an explicit boolean mask sends SDPA to its math kernel (every score materialised: 0.8 ms a layer for 48
    rows over 8,000 on the H200); without a prefix (n == total) torch runs it as plain causal attention. K/V heads
    are repeated for GQA: the flash call takes equal head counts."""
    from torch.nn.attention.bias import causal_lower_right

    n, total = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)[None]  # [1, nh, n, hd]
    kh, vh = (a.repeat_interleave(rep, dim=1).transpose(0, 1)[None] for a in (k, v))  # [1, nh, total, hd]
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(n, total), scale=scale)
    return o[0].transpose(0, 1)


def paged_decode_attention(q, k_rows, v_rows, block_tables, context_lens, block_size: int, scale: float,
                           gate=None, pool=None, sides=None, row_firsts=None):
    """q: [B, nh, hd]; k_rows/v_rows: flat payload rows [rows, nkv, hd] of `pool` (None: a dense pool's rows) and,
    for a compressed pool, sides = its (K, V) side values [rows, nkv]; a compressed pool's rows are decoded as its
    `decode` does. Returns [B, nh, hd], times sigmoid(gate) ([B, nh, hd]) when given. row_firsts (each row's
    sequence's first row) lets the kernel read a sequence's keys once for several rows, each row through its first
    row's block table (the others' are not read); the result is the same."""
    compressed = pool is not None and not pool.is_dense
    k_side, v_side = sides if compressed else (None, None)
    if triton_runs(q):
        from hf2q.kernels.attention.paged_triton import paged_decode_attention as kernel
        return kernel(q, k_rows, v_rows, block_tables, context_lens, block_size, scale, gate=gate,
                      kv_format=pool.format if compressed else None, k_side=k_side, v_side=v_side,
                      row_firsts=row_firsts)
    if row_firsts is not None:
        block_tables = block_tables[row_firsts.long()]
    longest = block_tables.shape[1] * block_size
    pos = torch.arange(longest, device=q.device)
    rows = block_tables.long()[:, pos // block_size] * block_size + pos % block_size  # [B, L]
    keys, values = k_rows[rows], v_rows[rows]  # [B, L, nkv, hd]
    if compressed:
        keys, values = pool.decode(keys, k_side[rows]), pool.decode(values, v_side[rows])
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    mask = (pos[None, :] < context_lens[:, None].long())[:, None, None, :]  # [B, 1, 1, L]
    o = F.scaled_dot_product_attention(q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
                                       attn_mask=mask, scale=scale, enable_gqa=True)[:, :, 0]
    return o if gate is None else o * torch.sigmoid(gate)


def store_compressed_kv(pool, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Encode K/V [T, nkv, hd] of new tokens into a compressed pool's layer at flat rows slot_mapping [T] (the
    Triton store where it runs, the pool's own `store` elsewhere)."""
    if triton_runs(k) and k.stride(-1) == 1 and v.stride(-1) == 1:
        from hf2q.kernels.attention.compressed_triton import store
        return store(pool.format, k, v, *pool.rows(layer), *pool.sides(layer), slot_mapping)
    pool.store(layer, slot_mapping, k, v)
