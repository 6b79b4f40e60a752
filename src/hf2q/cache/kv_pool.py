"""K/V pools: where the full-attention layers' keys and values live, in the model dtype or compressed.

A pool holds, per K and V, one tensor [layers, blocks, block_size, n_kv, row] of stored rows: the dense pool keeps
the values themselves (row = head_dim), the compressed pools keep each (token, head) vector as head_dim payload
bytes followed by its fp32 norm or scale as 4 more bytes (row = head_dim + 4, u8). Block copies, forks and snapshots
move stored rows and never decode; layers write through `store` and read through `gather`, which decodes only the
rows asked for.
"""
from __future__ import annotations

from functools import cached_property

import torch

from hf2q.cache.kv_codec import Fp8Codec, TurboQuantCodec

DENSE_FORMATS = ("float32", "bfloat16", "float16")
COMPRESSED_FORMATS = ("fp8", "tq8", "tq6", "tq5")
KV_FORMATS = DENSE_FORMATS + COMPRESSED_FORMATS
_SIDE = 4  # bytes of the fp32 norm / scale stored after each vector's payload


def _codec(fmt: str, head_dim: int):
    if fmt == "fp8":
        return Fp8Codec(head_dim)
    return TurboQuantCodec(head_dim, int(fmt[2:]))


def row_bytes(fmt: str, head_dim: int) -> int:
    """Stored bytes of one (token, head) vector in a format."""
    if fmt in DENSE_FORMATS:
        return head_dim * torch.empty((), dtype=getattr(torch, fmt)).element_size()
    if fmt in COMPRESSED_FORMATS:
        return head_dim + _SIDE
    raise ValueError(f"unknown K/V cache format {fmt!r}; choose one of {', '.join(KV_FORMATS)}")


class KVPool:
    """Paged K/V storage for every K/V layer in one format. Subclasses say how a vector is stored."""

    def __init__(self, fmt: str, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device):
        self.format, self.num_kv_heads, self.head_dim = fmt, num_kv_heads, head_dim
        row, dtype = self.row_layout()
        shape = (num_layers, num_blocks, block_size, num_kv_heads, row)
        # One tensor per kind keeps cross-layer copies (fork, snapshot) to one op; the lists are per-layer views.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.k_layers: list[torch.Tensor] = list(self.k.unbind(0))
        self.v_layers: list[torch.Tensor] = list(self.v.unbind(0))

    @property
    def is_dense(self) -> bool:
        return self.format in DENSE_FORMATS

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat stored rows of a layer, [num_blocks * block_size, n_kv, row] for K and for V."""
        return (self.k_layers[layer].view(-1, self.num_kv_heads, self.k.shape[-1]),
                self.v_layers[layer].view(-1, self.num_kv_heads, self.v.shape[-1]))

    def store(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K/V [n, n_kv, head_dim] of n tokens at flat pool rows `slot_mapping` [n]."""
        k_rows, v_rows = self.rows(layer)
        k_rows.index_copy_(0, slot_mapping, self.encode(k))
        v_rows.index_copy_(0, slot_mapping, self.encode(v))

    def gather(self, layer: int, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [len(rows), n_kv, head_dim] of the given flat rows, decoded to `dtype`."""
        k_rows, v_rows = self.rows(layer)
        return self.decode(k_rows[rows]).to(dtype), self.decode(v_rows[rows]).to(dtype)

    def row_layout(self) -> tuple[int, torch.dtype]:
        """(elements per stored row, storage dtype)."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class DenseKVPool(KVPool):
    """K/V in a float dtype, stored as is."""

    def row_layout(self) -> tuple[int, torch.dtype]:
        return self.head_dim, getattr(torch, self.format)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.k.dtype)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        return stored


class CompressedKVPool(KVPool):
    """K/V through a codec (tq8/tq6/tq5/fp8): head_dim payload bytes + one fp32 side value per vector."""

    @cached_property
    def codec(self) -> Fp8Codec | TurboQuantCodec:
        return _codec(self.format, self.head_dim)

    def row_layout(self) -> tuple[int, torch.dtype]:
        return self.head_dim + _SIDE, torch.uint8

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        payload, side = self.codec.encode(x)
        # [..., head_dim] payload bytes, then the fp32 side value's 4 bytes: [..., head_dim + 4] u8
        return torch.cat([payload.view(torch.uint8), side.unsqueeze(-1).view(torch.uint8)], dim=-1)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        d = self.head_dim
        payload = stored[..., :d]
        if self.format == "fp8":
            payload = payload.view(torch.float8_e4m3fn)
        side = stored[..., d:].contiguous().view(torch.float32).squeeze(-1)
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
