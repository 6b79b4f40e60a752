"""The warm-up's prefill steps: what a first request's prefill would otherwise compile or tune while it waits (a long
prompt's first chunk and its later chunks over a cached prefix, prefix checkpoints inside a chunk, two sequences in
one step, a chunk beside other sequences' decode rows), run on scratch slots before serving. The runner's warm_up
calls them before it captures its graphs."""
from __future__ import annotations

import logging
import time

import torch

from hf2q.cache.hybrid import CacheError
from hf2q.cache.state_at import StateAt
from hf2q.forward import ForwardBatch
from hf2q.kernels.tuning.timing import SPENT

log = logging.getLogger(__name__)

# the warm-up's short chunks over a cached prefix (a follow-up turn after a prefix hit): Triton compiles a kernel
# apart for integer arguments that are multiples of 16, so one is and one is not, and so their starts
FOLLOW_UP_CHUNKS = (40, 48)
# the warm-up's steps of a chunk beside other sequences' decode rows: their one paged-attention call
# (kernels/attention/ops.py) takes as many splits for 2, 3-4 and 5 or more rows (paged_triton.config_for), over the
# eager step's block tables, not the graphs' (other pointer types): each split count is a kernel pair of its own
DECODE_ROWS = (2, 4, 8)
DECODE_ROWS_PREFIX = 16  # tokens cached before the decode rows' step


def chunks_over_prefix(n: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The warm-up's chunks over a cached prefix, (tokens, insides) each: a follow-up's short rests, then whole
    chunks keeping the states after two and three of their last tokens. A checkpoint inside a chunk runs the
    chunk's first tokens again as one more sequence of the delta rule, and fla's L2 norm tunes itself for each
    2,048 rows more (its key counts rows x heads / 65,536): a chunk of n rows with up to three checkpoints inside
    (two stride points and a chat anchor) reaches four such buckets; the first chunk's one checkpoint, the
    second. Met first by a request, 25 candidates compiled while it waited (5-9 s on an H100)."""
    whole = tuple((n, tuple(range(n - k, n))) for k in (2, 3) if n > k)
    return (*((m, ()) for m in FOLLOW_UP_CHUNKS), *whole)


def prefill(runner, lengths: list[int], then: tuple[tuple[int, tuple[int, ...]], ...] = (),
            inside: tuple[int, ...] = ()) -> None:
    """One prefill of sequences of `lengths` tokens in scratch slots, released after; `then`: further chunks
    of the first sequence, (tokens, insides) each (a long prompt's later chunks and a follow-up turn
    attend over a cached prefix, other kernels than a first chunk's). Triton specialises a
    kernel on whether an integer argument is 1 or a multiple of 16, so the chunked delta rule over one
    sequence compiles other code than over two (long prompts in one step, and a prefix-cache checkpoint
    inside a chunk, which runs the chunk's first tokens as one more sequence), and an odd total other code
    than a multiple of 16: the warm-up meets each (on an H100 a first 8,047-token chat turn with the prefix
    cache on waited 11.6 s for its first token, 0.8 s with it off). `inside`: token counts after which the
    first step also keeps the DeltaNet states, as prefix checkpoints inside a chunk do (`chunks_over_prefix`)."""
    slots: list[int] = []
    try:
        slots.extend(runner.cache.acquire() for _ in lengths)
        step(runner, slots, list(lengths), [0] * len(lengths), inside)
        try:
            for n, kept in then:  # further chunks of the first sequence, over what it has cached
                step(runner, slots[:1], [n], [runner.cache.seq_len(slots[0])], kept)
        except CacheError as err:  # no room in the pool: a first request compiles what they would
            log.info("warm-up: chunks over a cached prefix left out (%s)", err)
    finally:
        for slot in slots:
            runner.cache.release(slot)


def beside_decode_rows(runner, prefill_tokens: int) -> None:
    """Steps of a prompt's chunk beside the decode rows of DECODE_ROWS other sequences, as long prompts arriving
    while others decode make them: on an H100 the first 16 x 2,048-token prompts waited for three kernel pairs
    (0.6-1.4 s each) built after the warm-up. Scratch slots, released after: as many decode rows as the free slots
    allow beside the chunk's (a server of few sequences meets no more), none where the pool is too small."""
    t0, spent = time.monotonic(), SPENT.snapshot()
    rows = [k for k in DECODE_ROWS if k < runner.cache.num_free_slots]
    if not rows:
        log.info("warm-up: chunks beside decode rows left out (%d free slots)", runner.cache.num_free_slots)
        return
    most = max(rows)
    slots: list[int] = []
    try:
        slots.extend(runner.cache.acquire() for _ in range(most + 1))
        step(runner, slots[1:], [DECODE_ROWS_PREFIX] * most, [0] * most)
        for k in rows:
            chunk = max(prefill_tokens - k, 1)
            seqs = [slots[0], *slots[1:k + 1]]
            step(runner, seqs, [chunk] + [1] * k, [runner.cache.seq_len(s) for s in seqs])
            runner.cache.reset(slots[0])  # the next chunk from the start again: the pool holds one at a time
        log.info("warm-up: chunks beside %s decode rows in %.1f s (%s)", "/".join(map(str, rows)),
                 time.monotonic() - t0, SPENT.since(spent))
    except CacheError as err:  # too few slots or blocks: a first mixed step compiles what they would
        log.info("warm-up: chunks beside decode rows left out (%s)", err)
    finally:
        for slot in slots:
            runner.cache.release(slot)


def step(runner, slots: list[int], lengths: list[int], starts: list[int], inside: tuple[int, ...] = ()) -> None:
    """One forward of `lengths[i]` zero tokens after the `starts[i]` cached in `slots[i]`, kept in the cache;
    the first sequence's states after each of `inside`'s token counts are kept too (`StateAt`)."""
    for slot, n, start in zip(slots, lengths, starts):
        runner.cache.reserve(slot, start + n)
    ids = torch.zeros(sum(lengths), dtype=torch.long, device=runner.device)
    positions = torch.cat([torch.arange(start, start + n, dtype=torch.long)
                           for n, start in zip(lengths, starts)]).to(runner.device)
    batch = ForwardBatch(ids, positions, lengths, starts, slots, runner.cache)
    if inside:
        batch.extras["kept_states"] = {0: [StateAt(runner.cache, m) for m in inside]}
    runner.net.compute_logits(runner.net(batch)[-1:])
    for slot, n, start in zip(slots, lengths, starts):
        runner.cache.commit(slot, start + n)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
