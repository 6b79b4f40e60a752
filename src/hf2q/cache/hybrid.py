"""The hybrid cache: paged K/V pools for full-attention layers and fixed-size DeltaNet state per slot.

K/V grows by token and lives in blocks (`BlockManager` decides which); DeltaNet conv/recurrent state is
one fixed tensor per slot and cannot be truncated, so going back means restoring a snapshot or a
captured state. Every operation names one slot and never touches another slot's data.

The recurrent state is kept in `CacheConfig.state_dtype` (fp32, or bf16 at half the bytes a decode step
reads and writes; the kernels compute in fp32 either way). The conv state stays fp32: it holds the last
K-1 raw inputs, which are in the model's dtype already (bf16 on CUDA), and it is 5% of a slot's bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hf2q.cache.block_manager import BlockManager, CacheError, CacheFull, CopyPairs
from hf2q.cache.kv_pool import KVPool, make_pool, row_bytes
from hf2q.config import CacheConfig, ModelConfig
from hf2q.devices import upload

__all__ = ["HybridCache", "CacheSnapshot", "CacheUsage", "CacheError", "CacheFull", "NoFreeSlot", "SlotError",
           "kv_bytes_per_token", "state_bytes_per_slot"]


class NoFreeSlot(CacheError):
    """Every slot is in use."""


class SlotError(CacheError):
    """A slot index is out of range or not acquired."""


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dt


# One slot's DeltaNet states: conv [n_lin, K-1, C] and recurrent [n_lin, h, dk, dv], in the slots' layout.
LinearStates = tuple[torch.Tensor, torch.Tensor]


def _holder(key: str) -> tuple[str, str]:
    """Block-manager table name of a retained prefix (slots are ints, so the two never collide)."""
    return ("retained", key)


def _itemsize(name: str) -> int:
    return torch.empty((), dtype=_dtype(name)).element_size()


def kv_bytes_per_token(mc: ModelConfig, kv_dtype: str) -> int:
    """K and V bytes one token takes across every KV layer (decoder full attention + MTP) in a K/V format."""
    return mc.num_kv_layers * 2 * mc.num_kv_heads * row_bytes(kv_dtype, mc.head_dim)


def state_bytes_per_slot(mc: ModelConfig, state_dtype: str) -> int:
    """DeltaNet conv (fp32) + recurrent (`state_dtype`) state bytes one slot holds, whatever its length."""
    conv = (mc.conv_kernel - 1) * mc.conv_channels * _itemsize("float32")
    rec = mc.linear_num_v_heads * mc.linear_k_head_dim * mc.linear_v_head_dim * _itemsize(state_dtype)
    return len(mc.linear_layers) * (conv + rec)


@dataclass
class CacheSnapshot:
    """A deep copy of one slot's prefix: K/V of positions [0, num_tokens) and the DeltaNet state there."""

    num_tokens: int
    k: torch.Tensor  # [num_kv_layers, num_tokens, n_kv, head_dim]: the pool's stored payload (codes, or values)
    v: torch.Tensor  # [num_kv_layers, num_tokens, n_kv, head_dim]
    conv: torch.Tensor  # [num_linear_layers, conv_kernel - 1, conv_channels]
    recurrent: torch.Tensor  # [num_linear_layers, n_v_heads, k_head_dim, v_head_dim]
    k_side: torch.Tensor | None = None  # [num_kv_layers, num_tokens, n_kv]: a compressed pool's scales or norms
    v_side: torch.Tensor | None = None

    @property
    def kv_planes(self) -> tuple[torch.Tensor, ...]:
        """The K/V tensors in the order of the pool's `planes`."""
        return (self.k, self.v) if self.k_side is None else (self.k, self.v, self.k_side, self.v_side)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_planes + (self.conv, self.recurrent))

    def to(self, device: str | torch.device) -> "CacheSnapshot":
        """Same snapshot on another device (e.g. host memory for an LRU of prefixes)."""
        sides = (None, None) if self.k_side is None else (self.k_side.to(device), self.v_side.to(device))
        return CacheSnapshot(self.num_tokens, self.k.to(device), self.v.to(device),
                             self.conv.to(device), self.recurrent.to(device), *sides)


@dataclass(frozen=True)
class CacheUsage:
    kv_blocks_used: int
    kv_blocks_total: int
    slots_used: int
    slots_total: int


class HybridCache:
    """Paged K/V pools + per-slot DeltaNet state for one model, with slot lifecycle and snapshots.

    Contract with the layers: attention layer i (`kv_index(layer_id)`) writes new K/V with
    `kv.store(i, token_indices(slot, start, end), k, v)` and reads positions [0, end) with
    `kv.gather(i, token_indices(slot, 0, end), dtype)`; DeltaNet layer j (`linear_index(layer_id)`)
    updates `conv_state[j][slot]` and `recurrent_state[j][slot]` in place. The runner calls
    `reserve` before the forward and `commit` after it.
    """

    # Retained prefixes may take DeltaNet states the forward kept inside a chunk (`hf2q.cache.state_at`).
    keeps_states_inside_a_chunk = True

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, device: str | torch.device = "cpu"):
        mc, cc = model_config, cache_config
        if cc.num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {cc.num_slots}")
        self.model_config, self.cache_config = mc, cc
        self.device = torch.device(device)
        self.num_slots, self.num_blocks, self.block_size = cc.num_slots, cc.num_blocks, cc.block_size
        self.blocks = BlockManager(cc.num_blocks, cc.block_size)
        st_dt, n_lin = _dtype(cc.state_dtype), len(mc.linear_layers)
        self.kv: KVPool = make_pool(cc.kv_dtype, mc.num_kv_layers, cc.num_blocks, cc.block_size, mc.num_kv_heads,
                                    mc.head_dim, self.device)
        self._planes = self.kv.planes  # stored K/V, moved as is by forks, snapshots and block copies
        self._conv = torch.zeros((n_lin, cc.num_slots, mc.conv_kernel - 1, mc.conv_channels),
                                 dtype=torch.float32, device=self.device)
        self._rec = torch.zeros((n_lin, cc.num_slots, mc.linear_num_v_heads, mc.linear_k_head_dim,
                                 mc.linear_v_head_dim), dtype=st_dt, device=self.device)
        self.conv_state: list[torch.Tensor] = list(self._conv.unbind(0))
        self.recurrent_state: list[torch.Tensor] = list(self._rec.unbind(0))
        self._kv_rank = {layer: r for r, layer in enumerate(mc.full_attention_layers)}
        self._kv_rank.update({mc.num_layers + m: len(mc.full_attention_layers) + m for m in range(mc.num_mtp_layers)})
        self._lin_rank = {layer: r for r, layer in enumerate(mc.linear_layers)}
        self._acquired = [False] * cc.num_slots
        self._lens = [0] * cc.num_slots
        self._index_memo: dict[int, dict[tuple[int, int], torch.Tensor]] = {}
        self._retained: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}  # key -> (tokens, conv, recurrent)

    # ---- layer routing -------------------------------------------------------------------------
    def kv_index(self, layer_id: int) -> int:
        """Pool index of a full-attention decoder layer, or of MTP layer m given as num_layers + m."""
        if layer_id not in self._kv_rank:
            raise ValueError(f"layer {layer_id} has no K/V cache")
        return self._kv_rank[layer_id]

    def linear_index(self, layer_id: int) -> int:
        """State index of a DeltaNet (linear attention) decoder layer."""
        if layer_id not in self._lin_rank:
            raise ValueError(f"layer {layer_id} is not a linear-attention layer")
        return self._lin_rank[layer_id]

    # ---- slots ---------------------------------------------------------------------------------
    def acquire(self) -> int:
        """Take the lowest free slot; it starts empty with zero DeltaNet state."""
        for s, used in enumerate(self._acquired):
            if not used:
                self._acquired[s] = True
                self._clear(s)
                return s
        raise NoFreeSlot(f"all {self.num_slots} cache slots are in use")

    def release(self, slot: int) -> None:
        """Give a slot back: its blocks return to the pool and its state is zeroed."""
        self._check(slot)
        self._clear(slot)
        self._acquired[slot] = False

    def reset(self, slot: int) -> None:
        """Empty a slot but keep it acquired."""
        self._check(slot)
        self._clear(slot)

    def seq_len(self, slot: int) -> int:
        self._check(slot)
        return self._lens[slot]

    def block_table(self, slot: int) -> list[int]:
        self._check(slot)
        return self.blocks.block_table(slot)

    @property
    def num_free_slots(self) -> int:
        return self._acquired.count(False)

    # ---- length ---------------------------------------------------------------------------------
    def can_reserve(self, slot: int, new_len: int) -> bool:
        self._check(slot)
        return self.blocks.blocks_needed(slot, new_len) <= self.blocks.num_free_blocks

    def reserve(self, slot: int, new_len: int) -> None:
        """Make room for positions [0, new_len) before a forward; CacheFull (nothing changed) if impossible."""
        self._check(slot)
        pairs = self.blocks.allocate_for(slot, new_len)
        if pairs:  # a copy-on-write moved a block: cached indices are stale
            self._index_memo.pop(slot, None)
        self._copy_blocks(pairs)

    def commit(self, slot: int, new_len: int) -> None:
        """Record that positions [0, new_len) now hold valid K/V and the DeltaNet state is at new_len."""
        self._check(slot)
        if not self._lens[slot] <= new_len <= self.blocks.num_tokens(slot):
            raise ValueError(f"slot {slot}: commit {new_len} outside [{self._lens[slot]}, "
                             f"{self.blocks.num_tokens(slot)}] (reserve first; truncate to go back)")
        self._lens[slot] = new_len

    def truncate(self, slot: int, new_len: int) -> None:
        """Drop K/V past new_len. DeltaNet state is untouched: the caller restores it from a snapshot/capture."""
        self._check(slot)
        if not 0 <= new_len <= self._lens[slot]:
            raise ValueError(f"slot {slot}: cannot truncate length {self._lens[slot]} to {new_len}")
        self.blocks.truncate(slot, new_len)
        self._index_memo.pop(slot, None)
        self._lens[slot] = new_len

    def rewind(self, slot: int, new_len: int) -> None:
        """Drop K/V past new_len (a verify's rejected drafts) but keep the room reserved past it: admission
        reserved the request's whole length, and blocks freed here could be taken by another request. A
        shared block the slot now ends in is copied (as any write into it would be)."""
        held = self.blocks.num_tokens(slot)
        self.truncate(slot, new_len)
        try:
            self.reserve(slot, held)
        except CacheFull:  # only a copy-on-write without a free block; the next reserve retries
            pass

    def token_indices(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Flat row indices into the K/V pool's rows (`kv.rows(i)`) for positions [start, end) of a slot."""
        self._check(slot)
        if not 0 <= start <= end <= self._reserved(slot):
            raise ValueError(f"slot {slot}: positions [{start}, {end}) outside reserved [0, {self._reserved(slot)})")
        memo = self._index_memo.setdefault(slot, {})
        idx = memo.get((start, end))
        if idx is None:
            if len(memo) >= 8:
                memo.clear()
            table = self._upload(self.blocks.block_table(slot))
            pos = torch.arange(start, end, dtype=torch.long, device=self.device)
            idx = table[pos // self.block_size] * self.block_size + pos % self.block_size
            memo[(start, end)] = idx
        return idx

    # ---- snapshots and forks --------------------------------------------------------------------
    def snapshot(self, slot: int, n: int | None = None, states: LinearStates | None = None) -> CacheSnapshot:
        """Deep copy of the slot's committed prefix and DeltaNet state; later writes never reach it. With `n`
        and `states`: its first n tokens, whose DeltaNet states (kept by the forward that computed them) those
        are."""
        self._check(slot)
        n, (conv, rec) = self._prefix_of(slot, n, states)
        idx = self.token_indices(slot, 0, n)
        k, v, *sides = (self._flat(plane).index_select(1, idx) for plane in self._planes)
        return CacheSnapshot(n, k, v, conv.clone(), rec.clone(), *sides)

    def restore(self, slot: int, snap: CacheSnapshot) -> None:
        """Make the slot exactly the snapshot's prefix; CacheFull (nothing changed) if blocks run short."""
        self._check(slot)
        self._check_snapshot(snap)
        need = self.blocks.blocks_for(snap.num_tokens)
        if need > self.blocks.num_free_blocks + self.blocks.reclaimable(slot):
            raise CacheFull(f"restore of {snap.num_tokens} tokens needs {need} blocks")
        self.blocks.free(slot)
        self._index_memo.pop(slot, None)
        self.blocks.allocate_for(slot, snap.num_tokens)
        idx = self.token_indices(slot, 0, snap.num_tokens)
        for plane, saved in zip(self._planes, snap.kv_planes):
            self._flat(plane).index_copy_(1, idx, saved.to(self.device, plane.dtype))
        self._conv[:, slot].copy_(snap.conv)
        self._rec[:, slot].copy_(snap.recurrent)
        self._lens[slot] = snap.num_tokens

    def linear_state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the slot's DeltaNet (conv, recurrent) state: what a speculative verify restores, since
        that state cannot be rewound by truncation."""
        self._check(slot)
        return self._conv[:, slot].clone(), self._rec[:, slot].clone()

    def empty_linear_states(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Uninitialised (conv [n_lin, n, K-1, C], recurrent [n_lin, n, h, dk, dv]) in the slots' layout: room
        for n states of one slot, such as the state after each position of a speculative verify."""
        return (self._conv.new_empty((self._conv.shape[0], n) + tuple(self._conv.shape[2:])),
                self._rec.new_empty((self._rec.shape[0], n) + tuple(self._rec.shape[2:])))

    def set_linear_state(self, slot: int, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._check(slot)
        self._conv[:, slot].copy_(state[0])
        self._rec[:, slot].copy_(state[1])

    def fork(self, src: int, dst: int) -> None:
        """Make dst an independent copy of src: full blocks shared by refcount, partial block and state copied."""
        self._check(src)
        self._check(dst)
        if src == dst:
            raise SlotError("fork needs two different slots")
        pairs = self.blocks.share(src, dst, self._lens[src])
        self._index_memo.pop(dst, None)
        self._copy_blocks(pairs)
        self._conv[:, dst].copy_(self._conv[:, src])
        self._rec[:, dst].copy_(self._rec[:, src])
        self._lens[dst] = self._lens[src]

    # ---- retained prefixes (the device side of `hf2q.cache.prefix_cache`) -----------------------
    def retain(self, slot: int, key: str, n: int | None = None, states: LinearStates | None = None) -> None:
        """Keep the slot's committed prefix under `key`: full K/V blocks shared by refcount (the slot never
        writes them again), the partial last block copied, and a copy of the DeltaNet state, which is at
        exactly that token. With `n` and `states`: its first n tokens, whose DeltaNet states those are (a
        checkpoint inside the chunk just computed). CacheFull (nothing changed) when the partial block
        finds no free block."""
        self._check(slot)
        if key in self._retained:
            raise ValueError(f"retained prefix {key!r} exists")
        n, (conv, rec) = self._prefix_of(slot, n, states)
        self._copy_blocks(self.blocks.share(slot, _holder(key), n))
        self._retained[key] = (n, conv.clone(), rec.clone())

    def _prefix_of(self, slot: int, n: int | None, states: LinearStates | None) -> tuple[int, LinearStates]:
        """(tokens, DeltaNet states) of what `retain` or `snapshot` keeps: the slot's committed prefix and
        state, or, with `states`, its first n tokens and those states."""
        if states is None:
            if n is not None and n != self._lens[slot]:
                raise ValueError(f"slot {slot} holds {self._lens[slot]} tokens, not {n}: its state is at its end")
            return self._lens[slot], (self._conv[:, slot], self._rec[:, slot])
        if not 0 < n <= self._lens[slot]:
            raise ValueError(f"slot {slot} holds {self._lens[slot]} tokens, not a prefix of {n}")
        return n, states

    def resume(self, key: str, slot: int) -> int:
        """Make the slot start as the retained prefix `key` (blocks shared, partial block and state copied,
        so the prefix stays intact); returns its length. CacheFull (slot unchanged) if no block is free."""
        self._check(slot)
        n, conv, rec = self._retained[key]
        pairs = self.blocks.share(_holder(key), slot, n)
        self._index_memo.pop(slot, None)
        self._copy_blocks(pairs)
        self._conv[:, slot].copy_(conv)
        self._rec[:, slot].copy_(rec)
        self._lens[slot] = n
        return n

    def drop(self, key: str) -> None:
        """Forget a retained prefix; its blocks go back to the pool unless a slot still shares them."""
        del self._retained[key]
        self.blocks.free(_holder(key))

    def retained_blocks(self, key: str) -> list[int]:
        return self.blocks.block_table(_holder(key))

    # ---- sizing and usage -----------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model_config, self.cache_config.kv_dtype)

    @property
    def fixed_bytes_per_slot(self) -> int:
        return state_bytes_per_slot(self.model_config, self.cache_config.state_dtype)

    @property
    def total_bytes(self) -> int:
        """Device bytes held by the pools (K/V blocks + every slot's state)."""
        return (self.bytes_per_token * self.num_blocks * self.block_size
                + self.fixed_bytes_per_slot * self.num_slots)

    @classmethod
    def plan(cls, model_config: ModelConfig, budget_bytes: int, max_slots: int, block_size: int = 16,
             kv_dtype: str = "float32", state_dtype: str = "float32") -> CacheConfig:
        """Size a CacheConfig to fit `budget_bytes`: slot state first, the rest as K/V blocks.

        Never plans more blocks than `max_slots` sequences of `context_length` tokens can use.
        """
        per_block = kv_bytes_per_token(model_config, kv_dtype) * block_size
        left = budget_bytes - state_bytes_per_slot(model_config, state_dtype) * max_slots
        if per_block == 0:
            num_blocks = 0
        else:
            cap = -(-model_config.context_length // block_size) * max_slots
            num_blocks = min(max(left, 0) // per_block, cap)
        if left < 0 or (per_block and num_blocks == 0):
            raise CacheFull(f"{budget_bytes} bytes cannot hold {max_slots} slots and one K/V block")
        return CacheConfig(num_slots=max_slots, num_blocks=num_blocks, block_size=block_size,
                           kv_dtype=kv_dtype, state_dtype=state_dtype)

    def usage(self) -> CacheUsage:
        return CacheUsage(self.blocks.num_used_blocks, self.num_blocks,
                          self.num_slots - self.num_free_slots, self.num_slots)

    # ---- internals ------------------------------------------------------------------------------
    def _check(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise SlotError(f"slot {slot!r} out of range [0, {self.num_slots})")
        if not self._acquired[slot]:
            raise SlotError(f"slot {slot} is not acquired")

    def _check_snapshot(self, snap: CacheSnapshot) -> None:
        saved = snap.kv_planes
        mismatch = [t.dtype == torch.uint8 for t in saved] != [p.dtype == torch.uint8 for p in self._planes]
        if len(saved) != len(self._planes) or mismatch:  # codes and side values vs values
            raise ValueError(f"snapshot K/V is {[s.dtype for s in saved]}, this cache stores "
                             f"{self.cache_config.kv_dtype} as {[p.dtype for p in self._planes]}")
        for s, p in zip(saved, self._planes):
            want = (p.shape[0], snap.num_tokens) + tuple(p.shape[3:])
            if tuple(s.shape) != want:
                raise ValueError(f"snapshot K/V shape {tuple(s.shape)} does not match {want}")
        if snap.conv.shape != self._conv[:, 0].shape or snap.recurrent.shape != self._rec[:, 0].shape:
            raise ValueError("snapshot DeltaNet state does not match this model")
        if snap.recurrent.dtype != self._rec.dtype:
            raise ValueError(f"snapshot DeltaNet state is {snap.recurrent.dtype}, this cache keeps {self._rec.dtype}")

    def _reserved(self, slot: int) -> int:
        return self.blocks.num_tokens(slot)

    def _clear(self, slot: int) -> None:
        self.blocks.free(slot)
        self._index_memo.pop(slot, None)
        self._conv[:, slot].zero_()
        self._rec[:, slot].zero_()
        self._lens[slot] = 0

    def _flat(self, plane: torch.Tensor) -> torch.Tensor:
        return plane.view(plane.shape[0], -1, *plane.shape[3:])  # [L, num_blocks * block_size, n_kv, ...]

    def _upload(self, values: list[int]) -> torch.Tensor:
        """`values` as int64 on the cache's device without waiting for it (a blocking copy held the host for a
        whole step whenever a step retained a checkpoint)."""
        return upload(torch.tensor(values, dtype=torch.long), self.device)

    def _copy_blocks(self, pairs: CopyPairs) -> None:
        if not pairs:
            return
        src = self._upload([p[0] for p in pairs])
        dst = self._upload([p[1] for p in pairs])
        for plane in self._planes:
            plane.index_copy_(1, dst, plane.index_select(1, src))
