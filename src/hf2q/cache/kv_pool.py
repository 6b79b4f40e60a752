"""K/V pools: where the full-attention layers' keys and values live, in the model dtype or compressed.

A pool holds, per K and V, one payload tensor [layers, blocks, block_size, n_kv, head_dim]: the dense pool keeps the
values themselves, the compressed pools keep each (token, head) vector's head_dim code bytes (u8), and beside it one
side tensor [layers, blocks, block_size, n_kv] of each vector's scale or norm in the codec's side dtype (fp8: the
E8M0 exponent byte; TurboQuant: the fp32 norm). Keeping the side values apart leaves every payload row head_dim
bytes, 16-byte aligned, so the kernels read codes 16 bytes at a time. Block copies, forks and snapshots move every
plane (`planes`) as stored and never decode; layers write through `store` and read through `gather`, which decodes
only the rows asked for.
"""
from __future__ import annotations

from functools import cached_property

import torch

from hf2q.kv_codec import Fp8Codec, TurboQuantCodec

DENSE_FORMATS = ("float32", "bfloat16", "float16")
COMPRESSED_FORMATS = ("fp8", "tq8", "tq6", "tq5")
KV_FORMATS = DENSE_FORMATS + COMPRESSED_FORMATS


def _codec(fmt: str, head_dim: int):
    if fmt == "fp8":
        return Fp8Codec(head_dim)
    return TurboQuantCodec(head_dim, int(fmt[2:]))


def row_bytes(fmt: str, head_dim: int) -> int:
    """Stored bytes of one (token, head) vector in a format."""
    if fmt in DENSE_FORMATS:
        return head_dim * torch.empty((), dtype=getattr(torch, fmt)).element_size()
    if fmt in COMPRESSED_FORMATS:
        return head_dim + _codec(fmt, 8).side_dtype.itemsize  # the codes, then the scale or norm in its own plane
    raise ValueError(f"unknown K/V cache format {fmt!r}; choose one of {', '.join(KV_FORMATS)}")


class KVPool:
    """Paged K/V storage for every K/V layer in one format. Subclasses say how a vector is stored."""

    def __init__(self, fmt: str, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device):
        self.format, self.num_kv_heads, self.head_dim = fmt, num_kv_heads, head_dim
        payload, side = self.dtypes()
        shape = (num_layers, num_blocks, block_size, num_kv_heads)
        # One tensor per plane keeps cross-layer copies (fork, snapshot) to one op; the lists are per-layer views.
        self.k = torch.zeros(shape + (head_dim,), dtype=payload, device=device)
        self.v = torch.zeros(shape + (head_dim,), dtype=payload, device=device)
        self.k_side = None if side is None else torch.zeros(shape, dtype=side, device=device)
        self.v_side = None if side is None else torch.zeros(shape, dtype=side, device=device)
        self.k_layers: list[torch.Tensor] = list(self.k.unbind(0))
        self.v_layers: list[torch.Tensor] = list(self.v.unbind(0))

    @property
    def is_dense(self) -> bool:
        return self.format in DENSE_FORMATS

    @property
    def planes(self) -> tuple[torch.Tensor, ...]:
        """Every stored tensor, each [layers, blocks, block_size, n_kv, ...]: K and V payloads, then (compressed)
        K and V side values. What block copies, forks and snapshots move as is."""
        if self.k_side is None:
            return self.k, self.v
        return self.k, self.v, self.k_side, self.v_side

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat payload rows of a layer, [num_blocks * block_size, n_kv, head_dim] for K and for V."""
        return (self.k_layers[layer].view(-1, self.num_kv_heads, self.head_dim),
                self.v_layers[layer].view(-1, self.num_kv_heads, self.head_dim))

    def sides(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Flat side values of a layer, [num_blocks * block_size, n_kv] for K and for V; None for a dense pool."""
        if self.k_side is None:
            return None
        return self.k_side[layer].view(-1, self.num_kv_heads), self.v_side[layer].view(-1, self.num_kv_heads)

    def store(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V [n, n_kv, head_dim] of n tokens at flat pool rows `slot_mapping` [n]."""
        sides = self.sides(layer) or (None, None)
        for rows, side, x in zip(self.rows(layer), sides, (k, v)):
            payload, side_values = self.encode(x)
            rows.index_copy_(0, slot_mapping, payload)
            if side is not None:
                side.index_copy_(0, slot_mapping, side_values)

    def gather(self, layer: int, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [len(rows), n_kv, head_dim] of the given flat rows, decoded to `dtype`."""
        sides = self.sides(layer) or (None, None)
        return tuple(self.decode(payload[rows], None if side is None else side[rows]).to(dtype)
                     for payload, side in zip(self.rows(layer), sides))

    def dtypes(self) -> tuple[torch.dtype, torch.dtype | None]:
        """(payload dtype, side dtype or None)."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[..., head_dim] → (payload [..., head_dim], side values [...] or None)."""
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, side: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class DenseKVPool(KVPool):
    """K/V in a float dtype, stored as is."""

    def dtypes(self) -> tuple[torch.dtype, None]:
        return getattr(torch, self.format), None

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x.to(self.k.dtype), None

    def decode(self, payload: torch.Tensor, side: None) -> torch.Tensor:
        return payload


class CompressedKVPool(KVPool):
    """K/V through a codec (tq8/tq6/tq5/fp8): head_dim u8 codes per vector, its side value in its own plane."""

    @cached_property
    def codec(self) -> Fp8Codec | TurboQuantCodec:
        return _codec(self.format, self.head_dim)

    def dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        return torch.uint8, _codec(self.format, 8).side_dtype

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        payload, side = self.codec.encode(x)
        return payload.view(torch.uint8), side

    def decode(self, payload: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        if self.format == "fp8":
            payload = payload.view(torch.float8_e4m3fn)
        return self.codec.decode(payload, side)


def format_identity(fmt: str) -> str:
    """A format and, for TurboQuant, its codebook width and sign-table and codebook digests; FP8, its scale rule.

    Independent of the head shape (the model's identity covers that): what a saved row needs to mean the same."""
    row_bytes(fmt, 8)  # rejects unknown names
    if fmt in DENSE_FORMATS:
        return fmt
    codec = _codec(fmt, 8)
    if isinstance(codec, Fp8Codec):
        return codec.fingerprint
    return f"{fmt}:bits={codec.bits}:signs={TurboQuantCodec(256, codec.bits).sign_table_id}:{codec.fingerprint}"


def kv_cache_format(flag: str, model_dtype: str) -> str:
    """The pool format of a `--kv-cache-dtype` value (auto: the model's dtype)."""
    name = {"auto": model_dtype, "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(flag, flag)
    row_bytes(name, 8)
    return name


def make_pool(fmt: str, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
              device: torch.device) -> KVPool:
    """The pool class of a format name (CacheConfig.kv_dtype)."""
    row_bytes(fmt, head_dim)  # rejects unknown names
    cls = DenseKVPool if fmt in DENSE_FORMATS else CompressedKVPool
    return cls(fmt, num_layers, num_blocks, block_size, num_kv_heads, head_dim, device)
