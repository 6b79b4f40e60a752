"""Opening a GGUF file: validation with clear errors, metadata as plain Python values, tensors as torch.

Block formats are decoded by the `gguf` package's reference dequantization (never re-derived here).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

GGUF_MAGIC = b"GGUF"

# Tensor types this server loads; everything else is refused by name.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")


class _FastReader:
    """Built lazily: `gguf.GGUFReader` with array fields read in one pass.

    The stock reader makes several numpy views per array element; for a 248k-token vocabulary and 500k
    merges that takes most of a minute. Scalar arrays here become one view, string arrays one pass.
    """

    cls = None

    @classmethod
    def get(cls):
        if cls.cls is None:
            from gguf.gguf_reader import GGUFReader, GGUFValueType

            class Reader(GGUFReader):
                string_arrays: dict  # id(field part) -> decoded strings of an array field

                def __init__(self, *args, **kwargs):
                    self.string_arrays = {}
                    super().__init__(*args, **kwargs)

                def _get_field_parts(self, orig_offs, raw_type):
                    if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
                        return super()._get_field_parts(orig_offs, raw_type)
                    raw_itype = self._get(orig_offs, np.uint32)
                    alen = self._get(orig_offs + 4, np.uint64)
                    itype = GGUFValueType(int(raw_itype[0]))
                    offs, n = orig_offs + 12, int(alen[0])
                    nptype = self.gguf_scalar_to_np.get(itype)
                    if nptype is not None:  # one part holds the whole array
                        arr = self._get(offs, nptype, n)
                        return 12 + int(arr.nbytes), [raw_itype, alen, arr], [2], [GGUFValueType.ARRAY, itype]
                    if itype != GGUFValueType.STRING:
                        return super()._get_field_parts(orig_offs, raw_type)
                    # Decode every string in one pass; the field keeps one part spanning the array.
                    plain = self.data.view(np.ndarray)
                    order = "big" if self.byte_order == "S" else "little"
                    strings = []
                    window_start, window = offs, b""
                    for _ in range(n):
                        rel = offs - window_start
                        if rel + 8 > len(window) or rel + 8 + int.from_bytes(window[rel:rel + 8], order) > len(window):
                            window_start, rel = offs, 0  # refill a bytes window: slicing bytes is cheap
                            window = plain[offs:offs + max(1 << 24, 8 + int.from_bytes(
                                plain[offs:offs + 8].tobytes(), order))].tobytes()
                        length = int.from_bytes(window[rel:rel + 8], order)
                        strings.append(window[rel + 8:rel + 8 + length].decode("utf-8"))
                        offs += 8 + length
                    region = plain[orig_offs + 12:offs]
                    self.string_arrays[id(region)] = strings
                    return (offs - orig_offs, [raw_itype, alen, region], [2],
                            [GGUFValueType.ARRAY, GGUFValueType.STRING])

            cls.cls = Reader
        return cls.cls


class GGUFError(ValueError):
    """A file that cannot be loaded; the message names the file and what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]  # torch order (outermost first), e.g. [out_features, in_features]
    n_bytes: int


class GGUFFile:
    """A validated, memory-mapped GGUF file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise GGUFError(f"Model not found: {self.path}")
        if self.path.is_dir():
            raise GGUFError(f"Not a GGUF file (a directory): {self.path}")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise GGUFError(f"Not a GGUF file (bad magic {magic!r}): {self.path}")
        try:
            self._reader = _FastReader.get()(self.path, "r")
        except Exception as exc:  # the reader's numpy errors on a short header say nothing to a user
            size = self.path.stat().st_size
            raise GGUFError(f"Damaged or truncated GGUF file {self.path}: its header (metadata and tensor "
                            f"list) cannot be read from its {size} bytes; download or convert it again") from exc
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._check_extent()
        self.metadata: dict[str, Any] = self._read_metadata()

    def _check_extent(self) -> None:
        size = self.path.stat().st_size
        for t in self._reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise GGUFError(f"Truncated GGUF file {self.path}: tensor {t.name!r} ends at byte {end} "
                                f"but the file has {size} bytes")

    def _read_metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                strings = self._reader.string_arrays.get(id(field.parts[-1])) if field.parts else None
                meta[key] = strings if strings is not None else field.contents()
            except Exception as exc:
                raise GGUFError(f"Damaged metadata field {key!r} in {self.path}: its value cannot be read") from exc
        return meta

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def info(self, name: str) -> TensorInfo:
        t = self._tensors[name]
        return TensorInfo(name, t.tensor_type.name, tuple(int(x) for x in reversed(t.shape.tolist())),
                          int(t.n_bytes))

    def check_types(self) -> None:
        for t in self._reader.tensors:
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise GGUFError(f"Unsupported tensor type {t.tensor_type.name} for tensor {t.name!r} in "
                                f"{self.path} (supported: {', '.join(SUPPORTED_TYPES)})")

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (blocks for quantized types)."""
        return self._tensors[name].data

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor dequantized to `dtype`, in torch order (outermost dimension first)."""
        import gguf

        t = self._tensors[name]
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        kind = t.tensor_type.name
        if kind == "F32":
            arr = np.asarray(t.data, dtype=np.float32)
        elif kind == "F16":
            arr = np.asarray(t.data, dtype=np.float16).astype(np.float32)
        elif kind == "BF16":
            bits = np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16
            arr = bits.view(np.float32)
        elif kind in SUPPORTED_TYPES:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        else:
            raise GGUFError(f"Unsupported tensor type {kind} for tensor {name!r} in {self.path}")
        return torch.from_numpy(np.array(arr, copy=True).reshape(shape)).to(dtype)
