"""Broken GGUF files: every one refused with a one-line error naming the problem, quickly, in bounded memory.

Each case is a damaged copy of a tiny demo-layout model (tests/support/gguf_variants.py): truncations at and
inside every section, huge declared counts and lengths, wrong value types, bad tensor offsets, duplicate or
missing tensors, and metadata that contradicts itself or the tensors. Both `hf2q.load` and `hf2q info` must
refuse it with a GGUFError / ConfigError / ValueError whose message is one line, names the problem, and
leaks no numpy or struct internals; the CLI prints `error: ...` and no traceback.

Weights holding NaN or Inf load (as llama.cpp does): the file is well formed, and a model with a few
non-finite weights is the trainer's problem, not the loader's. That case is at the end.
"""
from __future__ import annotations

import resource
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q, GGUFValueType as V

import hf2q
from hf2q.cli import main
from tests.support.gguf_variants import layout, patched, rewritten, truncated, u32, u64, write_tiny_gguf

HUGE = 1 << 60
INTERNALS = ("out of bounds", "index ", "buffer", "struct", "numpy", "dtype", "unpack", "reshape", "Traceback",
             "codec can't", "object has no attribute", "not subscriptable", "invalid literal", "NoneType")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def _refused(path: Path, capsys, words: tuple[str, ...]) -> str:
    """Load and `hf2q info` both refuse `path` cleanly; returns the load error's message."""
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(ValueError) as err:  # GGUFError, ConfigError and TokenizerError are ValueErrors
        hf2q.load(path, device="cpu")
    message = str(err.value)
    assert "\n" not in message and not any(bad in message for bad in INTERNALS), message
    assert any(w.lower() in message.lower() for w in words), f"{message!r} names none of {words}"
    capsys.readouterr()
    rc = main(["info", str(path)])  # info reads no tensor data: it may describe a file load refuses
    out = capsys.readouterr()
    assert rc in (0, 1) and "Traceback" not in out.err, out.err
    if rc:
        lines = out.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), out.err
    assert time.monotonic() - start < 10
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mb < 200, f"peak memory grew by {grown_mb:.0f} MB"
    return message


# ---- truncations: at each section boundary and inside each section --------------------------------

def _cut_points(tiny: Path) -> dict[str, int]:
    L = layout(tiny)
    tokens = L.kv["tokenizer.ggml.tokens"]
    points = {
        "empty file": 0, "inside the magic": 2, "after the magic": 4, "inside the version": 6,
        "after the version": 8, "inside the tensor count": 12, "after the tensor count": 16,
        "inside the kv count": 20, "after the header": L.kv_start, "inside the first key": L.kv_start + 5,
        "inside the token list": (tokens[0] + tokens[1]) // 2, "after the token list": tokens[1],
        "before the last key ends": L.infos_start - 2, "after the key/values": L.infos_start,
        "inside the first tensor info": L.infos_start + 11, "between tensor infos": L.infos["blk.1.ffn_up.weight"][0],
        "inside the last tensor info": L.infos_end - 3, "after the tensor infos": L.infos_end,
        "at the data start": L.data_start, "inside the first tensor": L.data_start + 33,
        "between tensors": L.data["blk.2.ffn_up.weight"][0], "in the middle of the data": (L.data_start + L.size) // 2,
        "one byte short": L.size - 1,
    }
    if L.data_start > L.infos_end + 1:
        points["inside the alignment padding"] = L.infos_end + 1
    return points


def test_every_truncation_is_refused(tiny, tmp_path, capsys):
    for label, size in _cut_points(tiny).items():
        words = ("not a gguf", "magic") if size < 4 else ("truncated", "ends", "damaged")
        _refused(truncated(tiny, tmp_path / f"cut{size}.gguf", size), capsys, words)


# ---- byte-level damage: counts, lengths, types, offsets --------------------------------------------

def _byte_cases(L) -> dict[str, tuple[list, tuple]]:
    """label -> (edits, words one of which the message must hold)."""
    name_off = L.kv["general.name"][0]
    tok = L.value_at("tokenizer.ggml.tokens")
    ttype = L.value_at("tokenizer.ggml.token_type")
    up = "blk.0.ffn_up.weight"
    up_info_end = L.infos[up][1]
    same_len = next((a, b) for a in L.kv for b in L.kv if a < b and len(a) == len(b))
    return {
        "version 99": ([(4, u32(99))], ("version",)),
        "tensor count 2^60": ([(8, u64(HUGE))], ("truncated", "ends", "damaged", "tensor")),
        "kv count 2^60": ([(16, u64(HUGE))], ("truncated", "ends", "damaged")),
        "no tensors": ([(8, u64(0))], ("tensor", "truncated", "damaged")),
        "key length 2^60": ([(name_off, u64(HUGE))], ("truncated", "ends", "damaged")),
        "string length 2^60": ([(L.value_at("general.name") + 4, u64(HUGE))], ("truncated", "ends", "damaged")),
        "string array length 2^60": ([(tok + 8, u64(HUGE))], ("truncated", "ends", "damaged")),
        "int array length 2^60": ([(ttype + 8, u64(HUGE))], ("truncated", "ends", "damaged")),
        "token string length 2^60": ([(tok + 16, u64(HUGE))], ("truncated", "ends", "damaged")),
        "value type 99": ([(L.value_at("qwen35.block_count"), u32(99))], ("type",)),
        "array item type 99": ([(tok + 4, u32(99))], ("type",)),
        "key not UTF-8": ([(name_off + 8, b"\xff\xfe")], ("utf-8", "damaged")),
        "duplicate key": ([(L.kv[same_len[1]][0] + 8, same_len[0].encode())], ("duplicate",)),
        "tensor name length 2^60": ([(L.infos[up][0], u64(HUGE))], ("truncated", "ends", "damaged")),
        "tensor with 2^32-1 dims": ([(L.dims_at(up) - 4, u32(0xFFFFFFFF))], ("truncated", "ends", "damaged", "dim")),
        "tensor dim 2^60": ([(L.dims_at(up), u64(HUGE))], ("truncated", "ends", "beyond", "dim")),
        "tensor dims wrap to 0": ([(L.dims_at(up), u64(1 << 32) + u64(1 << 32))], ("dim", "size", "elements")),
        "tensor dim 0": ([(L.dims_at(up), u64(0))], ("shape", "dim", "empty")),
        "tensor type 99": ([(up_info_end - 12, u32(99))], ("type",)),
        "tensor type Q2_K": ([(up_info_end - 12, u32(Q.Q2_K))], ("Q2_K",)),
        "tensor offset 2^62": ([(up_info_end - 8, u64(1 << 62))], ("truncated", "ends", "beyond")),
        "tensor offset misaligned": ([(up_info_end - 8, u64(L.data[up][0] - L.data_start + 4))], ("align",)),
        "tensors overlap": ([(up_info_end - 8, u64(L.data["blk.0.ffn_gate.weight"][0] - L.data_start))],
                            ("overlap",)),
        "duplicate tensor": ([(L.infos["blk.1.attn_norm.weight"][0] + 8, b"blk.0")], ("duplicate",)),
        "tensor name not UTF-8": ([(L.infos[up][0] + 8, b"\xff")], ("utf-8", "damaged")),
    }


def test_every_damaged_header_is_refused(tiny, tmp_path, capsys):
    cases = _byte_cases(layout(tiny))
    for i, (label, (edits, words)) in enumerate(cases.items()):
        _refused(patched(tiny, tmp_path / f"b{i}.gguf", *edits), capsys, words)


# ---- metadata with wrong types or contradicting itself or the tensors -----------------------------

META = {  # label -> (metadata to set, words)
    "architecture llama": ({"general.architecture": ("llama", V.STRING)}, ("architecture",)),
    "block_count a string": ({"qwen35.block_count": ("four", V.STRING)}, ("block_count",)),
    "block_count an array": ({"qwen35.block_count": ([4, 4], V.ARRAY, V.UINT32)}, ("block_count",)),
    "block_count a float": ({"qwen35.block_count": (4.5, V.FLOAT32)}, ("block_count",)),
    "block_count negative": ({"qwen35.block_count": (-4, V.INT32)}, ("block_count",)),
    "block_count 5 (4 blocks)": ({"qwen35.block_count": (5, V.UINT32)}, ("block_count", "missing", "blocks")),
    "block_count 3 (4 blocks)": ({"qwen35.block_count": (3, V.UINT32)}, ("block_count", "blocks")),
    "block_count 2^60": ({"qwen35.block_count": (HUGE, V.UINT64)}, ("block_count", "blocks")),
    "nextn layers > blocks": ({"qwen35.nextn_predict_layers": (9, V.UINT32)}, ("nextn_predict_layers",)),
    "embedding_length 0": ({"qwen35.embedding_length": (0, V.UINT32)}, ("embedding_length",)),
    "embedding_length 2^60": ({"qwen35.embedding_length": (HUGE, V.UINT64)}, ("embedding_length", "shape")),
    "head_count 0": ({"qwen35.attention.head_count": (0, V.UINT32)}, ("head_count",)),
    "head_count_kv 0": ({"qwen35.attention.head_count_kv": (0, V.UINT32)}, ("head_count_kv",)),
    "head counts do not divide": ({"qwen35.attention.head_count": (3, V.UINT32),
                                   "qwen35.attention.head_count_kv": (2, V.UINT32)}, ("head_count",)),
    "ssm time_step_rank 0": ({"qwen35.ssm.time_step_rank": (0, V.UINT32)}, ("time_step_rank",)),
    "ssm inner size not divisible": ({"qwen35.ssm.time_step_rank": (3, V.UINT32)}, ("inner_size", "time_step_rank")),
    "ssm heads do not divide": ({"qwen35.ssm.group_count": (3, V.UINT32)}, ("group_count",)),
    "full_attention_interval 0": ({"qwen35.full_attention_interval": (0, V.UINT32)}, ("full_attention_interval",)),
    "rope dims above head size": ({"qwen35.rope.dimension_count": (128, V.UINT32)}, ("dimension_count",)),
    "rope base NaN": ({"qwen35.rope.freq_base": (float("nan"), V.FLOAT32)}, ("freq_base",)),
    "rms eps a string": ({"qwen35.attention.layer_norm_rms_epsilon": ("tiny", V.STRING)}, ("epsilon",)),
    "context_length 0": ({"qwen35.context_length": (0, V.UINT32)}, ("context_length",)),
    "rope sections a string": ({"qwen35.rope.dimension_sections": ("3,3,2", V.STRING)}, ("dimension_sections",)),
    "tokens a string": ({"tokenizer.ggml.tokens": ("abc", V.STRING)}, ("tokenizer.ggml.tokens",)),
    "eos id a string": ({"tokenizer.ggml.eos_token_id": ("end", V.STRING)}, ("eos_token_id",)),
    "eos id out of range": ({"tokenizer.ggml.eos_token_id": (10**6, V.UINT32)}, ("special token",)),
    "tokenizer model llama": ({"tokenizer.ggml.model": ("llama", V.STRING)}, ("tokenizer.ggml.model",)),
    "alignment 3": ({"general.alignment": (3, V.UINT32)}, ("alignment",)),
    "alignment a string": ({"general.alignment": ("32", V.STRING)}, ("alignment",)),
}


@pytest.mark.parametrize("label", list(META))
def test_inconsistent_metadata_is_refused(tiny, tmp_path, capsys, label):
    meta, words = META[label]
    _refused(rewritten(tiny, tmp_path / "m.gguf", meta=meta), capsys, words)


def test_missing_required_keys_are_named(tiny, tmp_path, capsys):
    for key in ("qwen35.block_count", "qwen35.attention.head_count", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        _refused(rewritten(tiny, tmp_path / "k.gguf", drop_meta=(key,)), capsys, (key,))


def test_missing_extra_and_misshapen_tensors_are_named(tiny, tmp_path, capsys):
    cases = {
        "missing": ({"blk.2.ffn_up.weight": None}, ("missing", "blk.2")),
        "no embedding": ({"token_embd.weight": None}, ("token_embd",)),
        "unknown": ({"mystery.weight": np.zeros(4, np.float32)}, ("mystery.weight",)),
        "extra block": ({"blk.4.ffn_up.weight": np.zeros((128, 64), np.float32)}, ("blk.4", "block")),
        "wrong shape": ({"blk.0.ffn_up.weight": np.zeros((64, 64), np.float32)}, ("blk.0.ffn_up.weight",)),
    }
    for label, (tensors, words) in cases.items():
        _refused(rewritten(tiny, tmp_path / f"t-{label}.gguf", tensors=tensors), capsys, words)


def test_nan_and_inf_weights_load(tiny, tmp_path):
    """A policy, not an accident: non-finite weights load as they are (llama.cpp does the same)."""
    w = np.full((128, 64), 0.01, np.float32)
    w[0, 0], w[1, 1] = np.nan, np.inf
    model = hf2q.load(rewritten(tiny, tmp_path / "nan.gguf", tensors={"blk.0.ffn_up.weight": w}), device="cpu")
    assert model.config.num_layers == 4
