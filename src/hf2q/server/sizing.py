"""Serving limits chosen from the device: sequences decoded together, the K/V pool, the longest request.

On CUDA the K/V pool takes what the loaded model leaves free, less a reserve for activations, the
decode graphs and the dequantization scratch; the longest request defaults to the model's own context
when one sequence of it fits in that pool. On the CPU nothing is measured: a fixed default context and
a pool that holds every sequence at full length. Flags the user gave are kept as given.
"""
from __future__ import annotations

from dataclasses import dataclass

from hf2q.config import CacheConfig, ModelConfig

BLOCK = 16
CPU_MAX_MODEL_LEN = 8192  # the CPU default: long contexts are impractical there anyway
CPU_MAX_NUM_SEQS = 8
CUDA_MAX_NUM_SEQS = 64  # the largest decode graph bucket
RESERVE_FRACTION = 0.10  # of the card's memory, kept out of the K/V pool
RESERVE_MIN_BYTES = 4 << 30


@dataclass(frozen=True)
class ServingLimits:
    max_num_seqs: int
    max_model_len: int
    cache: CacheConfig
    why: str  # one log line: what was chosen and from what


def serving_reserve(total_bytes: int) -> int:
    """The bytes of a card of `total_bytes` kept out of everything sized from its free memory."""
    return max(RESERVE_MIN_BYTES, int(RESERVE_FRACTION * total_bytes))


def choose(cfg: ModelConfig, device_type: str, kv_dtype: str, max_num_seqs: int | None,
           max_model_len: int | None, free_bytes: int | None = None, total_bytes: int | None = None,
           held_states: int = 0, state_dtype: str = "float32") -> ServingLimits:
    """Limits for serving `cfg`. `free_bytes`/`total_bytes`: the device's memory after loading (CUDA);
    `held_states`: DeltaNet states held outside the slots (the verify graphs' per-position states);
    `state_dtype`: the DeltaNet recurrent state's."""
    from hf2q.cache.hybrid import kv_bytes_per_token, state_bytes_per_slot  # torch: not for `hf2q serve --help`

    if max_model_len is not None and max_model_len < 1:
        raise ValueError(f"--max-model-len must be at least 1, not {max_model_len}")
    if max_num_seqs is not None and max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be at least 1, not {max_num_seqs}")
    cuda = device_type == "cuda" and free_bytes is not None
    seqs = max_num_seqs or (CUDA_MAX_NUM_SEQS if cuda else CPU_MAX_NUM_SEQS)
    slots = seqs + 1  # one more slot holds the decode graphs' padding rows
    per_block = kv_bytes_per_token(cfg, kv_dtype) * BLOCK
    if not cuda:
        length = min(max_model_len or CPU_MAX_MODEL_LEN, cfg.context_length)
        blocks = seqs * -(-length // BLOCK) + 1
        why = (f"max_num_seqs {seqs}, max_model_len {length} (model context {cfg.context_length}), "
               f"K/V pool {blocks} blocks: every sequence at full length; "
               f"{_capacity(cfg, kv_dtype, blocks, length, state_dtype)}")
        return ServingLimits(seqs, length, _cache(slots, blocks, kv_dtype, state_dtype), why)
    reserve = serving_reserve(total_bytes or free_bytes)
    budget = free_bytes - reserve - state_bytes_per_slot(cfg, state_dtype) * (slots + held_states)
    wanted = min(max_model_len or cfg.context_length, cfg.context_length)
    cap = seqs * -(-wanted // BLOCK) + 1  # more blocks than every sequence at full length is waste
    blocks = min(budget // per_block, cap) if per_block else 0
    if per_block and blocks * BLOCK < min(wanted, 2 * BLOCK):
        raise ValueError(f"the model leaves {free_bytes / 2**30:.1f} GiB free on the GPU, too little for a K/V "
                         f"pool after a {reserve / 2**30:.1f} GiB reserve")
    fits = blocks * BLOCK - BLOCK if per_block else wanted
    length = wanted if max_model_len is not None or not per_block else min(wanted, fits)
    if max_model_len is not None and per_block and max_model_len > fits:
        raise ValueError(f"--max-model-len {max_model_len} does not fit in the K/V pool the GPU's free memory "
                         f"allows ({fits} tokens)")
    why = (f"max_num_seqs {seqs}, max_model_len {length} (model context {cfg.context_length}), K/V pool "
           f"{blocks} blocks = {blocks * BLOCK} tokens, {blocks * per_block / 2**30:.1f} GiB of "
           f"{free_bytes / 2**30:.1f} GiB free after loading ({reserve / 2**30:.1f} GiB kept in reserve); "
           f"{_capacity(cfg, kv_dtype, blocks, length, state_dtype)}")
    return ServingLimits(seqs, length, _cache(slots, blocks, kv_dtype, state_dtype), why)


def _capacity(cfg: ModelConfig, kv_dtype: str, blocks: int, length: int, state_dtype: str) -> str:
    """The K/V format, its bytes per token and how many sequences of `length` tokens the pool holds; the DeltaNet
    state's dtype and bytes a sequence."""
    from hf2q.cache.hybrid import kv_bytes_per_token, state_bytes_per_slot

    per_seq = -(-length // BLOCK)
    return (f"K/V {kv_dtype} at {kv_bytes_per_token(cfg, kv_dtype)} B/token: room for {blocks // per_seq} "
            f"sequences of {length} tokens; DeltaNet state {state_bytes_per_slot(cfg, state_dtype) / 2**20:.1f} MiB "
            f"a sequence (recurrent {state_dtype})")


def _cache(slots: int, blocks: int, kv_dtype: str, state_dtype: str) -> CacheConfig:
    return CacheConfig(num_slots=slots, num_blocks=max(blocks, 1), block_size=BLOCK, kv_dtype=kv_dtype,
                       state_dtype=state_dtype)
