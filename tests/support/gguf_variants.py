"""A tiny demo-layout GGUF, a map of its sections, and ways to break it (for tests/checkpoint/test_gguf_fuzz.py).

The tiny file is the demo model (hf2q.demo) with a 259-token byte-level vocabulary instead of 248k tokens,
so a broken copy is a few hundred KB and loads in milliseconds.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-character map: the 256 single-byte tokens of a byte-level BPE vocabulary."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def tiny_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a 259-token byte-level BPE: the 256 bytes, one merge, two control tokens."""
    return _byte_tokens() + ["Ġt", "<|endoftext|>", "<|im_end|>"], [1] * 257 + [3, 3], ["Ġ t"]


def write_tiny_gguf(path: Path) -> None:
    import hf2q.demo as demo

    vocabulary = tiny_vocabulary()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(demo, "VOCAB", len(vocabulary[0]))
        mp.setattr(demo, "qwen35_vocabulary", lambda: vocabulary)
        demo.write_demo_gguf(path)


def write_split_tiny_gguf(path: Path, tensors_per_part: int = 10) -> list[Path]:
    """The tiny GGUF split as llama.cpp's converter splits one (the `gguf` package's own writer), beside `path`:
    NAME-00001-of-0000N.gguf ... for `path` NAME.gguf; the parts in order."""
    import functools

    import gguf

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFWriter", functools.partial(gguf.GGUFWriter, split_max_tensors=tensors_per_part))
        write_tiny_gguf(path)
    return sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))


@dataclass
class Layout:
    """Byte offsets of a GGUF file's sections and of each key/value and tensor info in them."""
    size: int
    kv: dict  # key -> (start, end) of the whole entry
    infos: dict  # tensor name -> (start, end) of its info
    kv_start: int
    infos_start: int
    infos_end: int
    data_start: int
    data: dict  # tensor name -> (start, end) of its bytes

    def value_at(self, key: str) -> int:
        """Offset of a key's value type (its u32), just after the key string."""
        return self.kv[key][0] + 8 + len(key.encode())

    def dims_at(self, name: str) -> int:
        return self.infos[name][0] + 8 + len(name.encode()) + 4


def layout(path: Path) -> Layout:
    from gguf.gguf_reader import GGUFReader

    r = GGUFReader(path)
    keys = [f for f in r.fields.values() if not f.name.startswith("GGUF.")]
    starts = [f.offset for f in keys]
    infos = [t.field for t in r.tensors]
    infos_start = infos[0].offset
    infos_end = infos[-1].offset + sum(int(p.nbytes) for p in infos[-1].parts)
    kv = {f.name: (f.offset, nxt) for f, nxt in zip(keys, starts[1:] + [infos_start])}
    info_ends = [f.offset for f in infos[1:]] + [infos_end]
    return Layout(size=path.stat().st_size, kv=kv,
                  infos={f.name: (f.offset, end) for f, end in zip(infos, info_ends)},
                  kv_start=starts[0], infos_start=infos_start, infos_end=infos_end, data_start=r.data_offset,
                  data={t.name: (int(t.data_offset), int(t.data_offset) + int(t.n_bytes)) for t in r.tensors})


def truncated(src: Path, dst: Path, size: int) -> Path:
    dst.write_bytes(src.read_bytes()[:size])
    return dst


def patched(src: Path, dst: Path, *edits: tuple[int, bytes]) -> Path:
    """A copy with bytes overwritten at the given offsets."""
    data = bytearray(src.read_bytes())
    for offset, new in edits:
        data[offset:offset + len(new)] = new
    dst.write_bytes(bytes(data))
    return dst


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def rewritten(src: Path, dst: Path, meta: dict | None = None, tensors: dict | None = None,
              drop_meta: tuple = ()) -> Path:
    """A copy written anew: `meta` key -> (value, GGUFValueType[, sub type]) set or added; `tensors`
    name -> array (None drops the tensor); keys in `drop_meta` left out."""
    from gguf import GGUFValueType, GGUFWriter
    from gguf.gguf_reader import GGUFReader

    r = GGUFReader(src)
    meta, tensors = dict(meta or {}), dict(tensors or {})
    writer = GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", *drop_meta) or f.name in meta:
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), f.types[0], sub)
    for key, spec in meta.items():
        writer.add_key_value(key, *spec)
    for t in r.tensors:
        value = tensors.pop(t.name, t.data)
        if value is not None:
            writer.add_tensor(t.name, np.array(value), raw_dtype=t.tensor_type if value is t.data else None)
    for name, value in tensors.items():
        writer.add_tensor(name, np.array(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
