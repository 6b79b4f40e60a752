"""Opening a GGUF file: validation with clear errors, metadata as plain Python values, tensors as torch.

Block formats are decoded by the `gguf` package's reference dequantization (never re-derived here). A split
GGUF (`NAME-00001-of-0000N.gguf`, as llama.cpp's `gguf-split` and `convert_hf_to_gguf.py --split-max-*` write
it) is opened by its first part: the metadata is the first part's, the tensors those of every part.
"""
from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # imported by tensor(): `hf2q info` reads no tensor and need not wait for torch
    import torch

GGUF_MAGIC = b"GGUF"

# Tensor types this server loads; everything else is refused by name.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")

SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


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

                def _get(self, offset, dtype, count=1, override_order=None):
                    end = int(offset) + np.dtype(dtype).itemsize * int(count)
                    if end > len(self.data):  # numpy would hand back a short array: refuse it here
                        raise GGUFError(f"needs bytes up to {end:,} but the file has {len(self.data):,}")
                    return super()._get(offset, dtype, count, override_order)

                def _build_tensors(self, start_offs, fields):
                    for field in fields:  # declared sizes first: their product can wrap in numpy
                        n = math.prod(int(d) for d in field.parts[3])
                        if n > 8 * len(self.data):
                            name = bytes(field.parts[1]).decode(errors="replace")
                            raise GGUFError(f"tensor {name!r} declares {n:,} elements, more than the file holds")
                    super()._build_tensors(start_offs, fields)

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
                    # Decode every string in one pass over bytes windows (slicing bytes is cheap); the field
                    # keeps one part spanning the array.
                    plain = self.data.view(np.ndarray)
                    length_at = struct.Struct(">Q" if self.byte_order == "S" else "<Q").unpack_from
                    strings = []
                    append = strings.append
                    window, pos, window_start = b"", 0, offs  # window holds the file from window_start
                    for _ in range(n):
                        end = pos + 8 + length_at(window, pos)[0] if pos + 8 <= len(window) else -1
                        if not 0 <= end <= len(window):
                            window_start, pos = window_start + pos, 0  # refill from the next string on
                            head = plain[window_start:window_start + 8].tobytes()
                            if len(head) < 8:
                                raise GGUFError(f"a string at byte {window_start:,} runs past the end of the file")
                            end = 8 + length_at(head)[0]
                            window = plain[window_start:window_start + max(1 << 24, end)].tobytes()
                            if end > len(window):
                                raise GGUFError(f"a string at byte {window_start:,} runs past the end of the file")
                        append(window[pos + 8:end].decode("utf-8"))
                        pos = end
                    offs = window_start + pos
                    region = plain[orig_offs + 12:offs]
                    self.string_arrays[id(region)] = strings
                    return (offs - orig_offs, [raw_itype, alen, region], [2],
                            [GGUFValueType.ARRAY, GGUFValueType.STRING])

            cls.cls = Reader
        return cls.cls


class GGUFError(ValueError):
    """A file that cannot be loaded; the message names the file and what is wrong."""


def _describe(exc: Exception) -> str:
    """The gguf reader's error in words, without numpy's or the codec's phrasing."""
    if isinstance(exc, UnicodeDecodeError):
        return "a key, tensor name or string is not valid UTF-8"
    bad_enum = re.search(r"(\d+)\)? is not a valid (GGUFValueType|GGMLQuantizationType)", str(exc))
    if bad_enum:
        kind = "metadata value type" if bad_enum[2] == "GGUFValueType" else "tensor type"
        return f"unknown {kind} {bad_enum[1]}"
    if isinstance(exc, KeyError):  # the reader's duplicate-key error
        return str(exc.args[0]) if exc.args else "duplicate key"
    if isinstance(exc, (IndexError, TypeError, OverflowError)) or "numpy" in type(exc).__module__:
        return f"its structure is inconsistent ({type(exc).__name__})"
    return str(exc)


def split_part_names(name: str) -> list[str]:
    """The names of every part, first first, of the split GGUF one of whose parts is `name` (a file name or a
    path in a repository); [name] for a single file."""
    match = SPLIT_PART.search(name)
    if match is None:
        return [name]
    return [SPLIT_PART.sub(f"-{i:05d}-of-{match[2]}.gguf", name) for i in range(1, int(match[2]) + 1)]


def split_parts(path: Path) -> list[Path]:
    """The files of the GGUF `path` names: itself, or every part of a split GGUF named by its first part."""
    match = SPLIT_PART.search(path.name)
    if match is None:
        return [path]
    if int(match[1]) != 1 or int(match[2]) < 1:
        raise GGUFError(f"{path} is part {int(match[1])} of a split GGUF: name its first part, "
                        f"{path.name[:match.start()]}-00001-of-{match[2]}.gguf")
    parts = [path.with_name(name) for name in split_part_names(path.name)]
    missing = [p.name for p in parts if not p.exists()]
    if missing and path.exists():
        raise GGUFError(f"Split GGUF {path} is incomplete: {', '.join(missing)} not found beside it")
    return parts


def _check_extent(path: Path, reader) -> None:
    """Every tensor's data inside the file, aligned, and apart from the others."""
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise GGUFError(f"Truncated GGUF file {path}: tensor {t.name!r} ends at byte {end} "
                            f"but the file has {size} bytes")
    spans = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name) for t in reader.tensors)
    for start, _, name in spans:
        if (start - reader.data_offset) % reader.alignment:
            raise GGUFError(f"Damaged GGUF file {path}: tensor {name!r} data offset is not a multiple "
                            f"of the alignment ({reader.alignment})")
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise GGUFError(f"Damaged GGUF file {path}: the data of tensors {a!r} and {b!r} overlap")


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
        readers = [self._open(part) for part in split_parts(self.path)]
        self._reader = readers[0]  # the metadata's
        self._tensors = {}
        for reader in readers:
            for t in reader.tensors:
                if t.name in self._tensors:
                    raise GGUFError(f"Damaged split GGUF {self.path}: tensor {t.name!r} is in more than one part")
                self._tensors[t.name] = t
        self.metadata: dict[str, Any] = self._read_metadata()
        for key in ("split.no", "split.count"):
            self.metadata.pop(key, None)
        expected = self.metadata.pop("split.tensors.count", None)
        if expected is not None and expected != len(self._tensors):
            raise GGUFError(f"Damaged split GGUF {self.path}: its parts hold {len(self._tensors)} tensors, "
                            f"not the {expected} the first part lists")

    @staticmethod
    def _open(path: Path):
        if not path.exists():
            raise GGUFError(f"Model not found: {path}")
        if path.is_dir():
            raise GGUFError(f"Not a GGUF file (a directory): {path}")
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise GGUFError(f"Not a GGUF file (bad magic {magic!r}): {path}")
        try:
            reader = _FastReader.get()(path, "r")
        except Exception as exc:  # the reader raises many kinds on damaged headers
            raise GGUFError(f"Damaged or truncated GGUF file {path}: {_describe(exc)}") from exc
        _check_extent(path, reader)
        return reader

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
        for t in self._tensors.values():
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise GGUFError(f"Unsupported tensor type {t.tensor_type.name} for tensor {t.name!r} in "
                                f"{self.path} (supported: {', '.join(SUPPORTED_TYPES)})")

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (blocks for quantized types)."""
        return self._tensors[name].data

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor dequantized to `dtype` (float32 when None), in torch order (outermost dimension first)."""
        import gguf
        import torch

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
        if kind == "F32":  # the file's read-only pages; every other branch made a fresh array
            arr = np.array(arr, copy=True)
        return torch.from_numpy(arr.reshape(shape)).to(torch.float32 if dtype is None else dtype)
