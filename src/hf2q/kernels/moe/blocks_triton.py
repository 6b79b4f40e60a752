"""Token-expert pairs laid out by expert, in blocks of a few, so that a kernel reads each chosen expert's weights
once for all its pairs (a program a block) instead of once a pair.

A decode step of 64 sequences of a 256-expert top-8 MoE has 512 pairs over about 220 experts: read once a pair,
its expert weights are read 2.3 times over (on an H100, 35B-A3B Q4_K_M: 12.7 of a 21.9-ms step in the expert
mat-vec at 97% of the copy rate). `expert_blocks` sorts the pairs by expert (each expert's in their order) into
blocks of `bm` slots, an expert's last block padded with the sentinel P, and names each block's expert (-1 for
the blocks past the last, which a launch sized for the most blocks any routing can make has). One program of
one launch, fixed sizes: it runs inside CUDA graphs with the routing it reads on the device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf2q.kernels.tuning import pdl

PADDING = 4  # slots past the last block: a kernel reading four slots from a block's start stays in the buffer
CHUNK = 32  # pairs (or blocks) a step of the kernel's loops


def most_blocks(pairs: int, experts: int, bm: int) -> int:
    """The most blocks of `bm` slots any routing of `pairs` pairs over `experts` experts fills: each expert that
    has pairs leaves at most bm - 1 slots of its last block empty."""
    return (pairs + (bm - 1) * min(pairs, experts)) // bm


@triton.jit
def _expert_blocks_kernel(e_ptr, pairs_ptr, block_e_ptr, P, E, NB, BM: tl.constexpr, EB: tl.constexpr,
                          CHUNK: tl.constexpr, PADDING: tl.constexpr, PDL: tl.constexpr = False):
    """One program: per-expert running counts over the pairs in order give each pair its rank among its
    expert's; the counts give each expert's first block; pairs go to block slots, blocks get their experts."""
    pdl.enter(PDL)
    c = tl.arange(0, CHUNK)
    ex = tl.arange(0, EB)
    counts = tl.zeros((EB,), tl.int32)
    # the slots, all padding first (the pairs' stores below come after the barrier)
    for s in range(0, NB * BM + PADDING, CHUNK):
        tl.store(pairs_ptr + s + c, P, mask=s + c < NB * BM + PADDING)
    for s in range(0, P, CHUNK):  # each pair's rank among its expert's pairs, kept in its slot index for now
        e = tl.load(e_ptr + s + c, mask=s + c < P, other=-1)
        hot = (e[:, None] == ex[None, :]).to(tl.int32)  # [CHUNK, EB]
        before = tl.cumsum(hot, axis=0) - hot + counts[None, :]
        rank = tl.sum(hot * before, axis=1)
        counts += tl.sum(hot, axis=0)
        tl.store(block_e_ptr + NB + s + c, rank, mask=s + c < P)  # scratch after the block experts
    blocks = (counts + BM - 1) // BM
    block_end = tl.cumsum(blocks, axis=0)
    first = (block_end - blocks) * BM
    tl.debug_barrier()
    for s in range(0, P, CHUNK):
        e = tl.load(e_ptr + s + c, mask=s + c < P, other=-1)
        hot = (e[:, None] == ex[None, :]).to(tl.int32)
        rank = tl.load(block_e_ptr + NB + s + c, mask=s + c < P, other=0)
        tl.store(pairs_ptr + tl.sum(hot * first[None, :], axis=1) + rank, s + c, mask=s + c < P)
    tl.debug_barrier()
    for s in range(0, NB, CHUNK):  # a block's expert: how many experts end at or before it
        b = s + c
        at = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32) * (ex < E)[None, :], axis=1)
        tl.store(block_e_ptr + b, tl.where(at < E, at, -1), mask=b < NB)


def expert_blocks(experts: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs by expert in blocks of bm slots: (slots [most_blocks * bm + PADDING] int32: pair indices into
    experts.reshape(-1), the sentinel P where empty; block experts [most_blocks] int32, -1 past the last)."""
    flat = experts.reshape(-1)
    p = flat.numel()
    nb = most_blocks(p, num_experts, bm)
    slots = torch.empty(nb * bm + PADDING, dtype=torch.int32, device=flat.device)
    block_e = torch.empty(nb + p, dtype=torch.int32, device=flat.device)  # the ranks' scratch after the blocks
    _expert_blocks_kernel[(1,)](flat, slots, block_e, p, num_experts, nb, BM=bm,
                                EB=triton.next_power_of_2(num_experts), CHUNK=CHUNK, PADDING=PADDING, num_warps=4,
                                **pdl.launch_options(flat.device))
    return slots, block_e[:nb]


def expert_blocks_ref(experts: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`expert_blocks` in torch (the kernel's oracle)."""
    flat = experts.reshape(-1).long().cpu()
    p = flat.numel()
    nb = most_blocks(p, num_experts, bm)
    slots = torch.full((nb * bm + PADDING,), p, dtype=torch.int32)
    block_e = torch.full((nb,), -1, dtype=torch.int32)
    at = 0
    for e in range(num_experts):
        mine = torch.nonzero(flat == e).flatten()
        for i in range(0, len(mine), bm):
            slots[at * bm: at * bm + len(mine[i:i + bm])] = mine[i:i + bm].int()
            block_e[at] = e
            at += 1
    return slots, block_e
