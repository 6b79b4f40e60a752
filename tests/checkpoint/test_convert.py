"""`hf2q convert` against llama.cpp's own converter on the same tiny checkpoints.

Both files must carry the same metadata (every key, `general.*` included: both converters derive the
name and size label from the folder name and parameter count), the same tensor names, types and
shapes, and identical tensor bytes. In practice the files are byte-identical, which is checked first
(fast); any difference falls back to a per-item comparison that names what differs.
"""
from __future__ import annotations

import argparse
import filecmp
import json
from concurrent.futures import ThreadPoolExecutor

import gguf
import numpy as np
import pytest

from hf2q.checkpoint.convert import convert
from hf2q.checkpoint.convert_cli import add_convert_args, run_convert
from hf2q.checkpoint.gguf_file import GGUFFile
from tests.support import llama_cpp_sources
from tests.support.fixtures import hf_checkpoint, llama_cpp_gguf

# (kind, outtype, no_mtp) of every reference file llama.cpp's converter makes for these tests.
REFERENCES = [("dense", "f32", False), ("moe", "f32", False), ("dense", "q8_0", False), ("moe", "q8_0", False),
              ("dense", "bf16", False), ("dense", "f32", True)]


@pytest.fixture(scope="module")
def llama_cpp_refs() -> dict:
    """Every reference file, made two at a time: each is a converter subprocess of its own (about 20 s)."""
    try:
        llama_cpp_sources.llama_cpp_converter()  # fetch and unpack the sources once, before the threads
    except llama_cpp_sources.SourcesUnavailable as exc:
        pytest.skip(str(exc))
    for kind in ("dense", "moe"):
        hf_checkpoint(kind)
    with ThreadPoolExecutor(max_workers=2) as pool:
        made = {ref: pool.submit(llama_cpp_gguf, *ref) for ref in REFERENCES}
    return {ref: future.result() for ref, future in made.items()}

MISSING = object()


def gguf_differences(ours, ref) -> list[str]:
    """What differs between two GGUF files: metadata, tensor names, types, shapes, bytes."""
    a, b = GGUFFile(ours), GGUFFile(ref)
    diffs = []
    for key in sorted(set(a.metadata) | set(b.metadata)):
        va, vb = a.metadata.get(key, MISSING), b.metadata.get(key, MISSING)
        if va is MISSING or vb is MISSING or va != vb:
            diffs.append(f"metadata {key}: ours {str(va)[:80]!r} vs llama.cpp {str(vb)[:80]!r}")
    names_a, names_b = set(a.tensor_names), set(b.tensor_names)
    diffs += [f"tensor {n} only in ours" for n in sorted(names_a - names_b)]
    diffs += [f"tensor {n} only in llama.cpp's" for n in sorted(names_b - names_a)]
    for name in sorted(names_a & names_b):
        if a.info(name) != b.info(name):
            diffs.append(f"tensor {name}: ours {a.info(name)} vs llama.cpp {b.info(name)}")
        elif not np.array_equal(np.asarray(a.raw(name)).view(np.uint8), np.asarray(b.raw(name)).view(np.uint8)):
            diffs.append(f"tensor {name}: data differs")
    return diffs


def assert_same_gguf(ours, ref) -> None:
    if filecmp.cmp(ours, ref, shallow=False):
        return
    diffs = gguf_differences(ours, ref)
    assert not diffs, "\n".join(diffs[:40])


@pytest.mark.parametrize("kind,outtype", [("dense", "f32"), ("moe", "f32"), ("dense", "q8_0"),
                                          ("moe", "q8_0"), ("dense", "bf16")])
def test_same_file_as_llama_cpp(kind, outtype, request, llama_cpp_refs):
    ref = llama_cpp_refs[(kind, outtype, False)]
    ours = request.getfixturevalue(f"gguf_{kind}_{outtype}")
    assert_same_gguf(ours, ref)


def test_no_mtp_drops_mtp_layer(hf_dense_dir, tmp_path, llama_cpp_refs):
    ref = llama_cpp_refs[("dense", "f32", True)]
    out = convert(hf_dense_dir, tmp_path / "nomtp.gguf", "f32", no_mtp=True)
    g = GGUFFile(out)
    n_layers = json.loads((hf_dense_dir / "config.json").read_text())["num_hidden_layers"]
    assert "qwen35.nextn_predict_layers" not in g.metadata
    assert g.metadata["qwen35.block_count"] == n_layers
    assert len(g.metadata["qwen35.attention.recurrent_layers"]) == n_layers
    assert not [n for n in g.tensor_names if ".nextn." in n or n.startswith(f"blk.{n_layers}.")]
    assert_same_gguf(out, ref)


def test_difference_report_names_what_differs(tmp_path):
    def write(path, block_count, data):
        w = gguf.GGUFWriter(path, "qwen35")
        w.add_block_count(block_count)
        w.add_tensor("blk.0.attn_q.weight", data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    data = np.arange(64, dtype=np.float32).reshape(2, 32)
    write(tmp_path / "a.gguf", 4, data)
    write(tmp_path / "b.gguf", 5, data + 1)
    write(tmp_path / "c.gguf", 4, data)
    diffs = gguf_differences(tmp_path / "a.gguf", tmp_path / "b.gguf")
    assert any("qwen35.block_count" in d for d in diffs)
    assert any("blk.0.attn_q.weight: data differs" in d for d in diffs)
    assert gguf_differences(tmp_path / "a.gguf", tmp_path / "c.gguf") == []


def test_unknown_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    parser = argparse.ArgumentParser()
    add_convert_args(parser)
    args = parser.parse_args([str(tmp_path), "-o", str(tmp_path / "out.gguf"), "--outtype", "q8_0", "--no-mtp"])
    assert (args.outtype, args.no_mtp) == ("q8_0", True)
    with pytest.raises(ValueError, match="Unsupported architecture 'LlamaForCausalLM'.*Qwen3_5ForCausalLM"):
        run_convert(args)
    assert not (tmp_path / "out.gguf").exists()
