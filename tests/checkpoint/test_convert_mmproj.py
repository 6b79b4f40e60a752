"""`hf2q convert --mmproj` writes the same bytes as llama.cpp's `convert_hf_to_gguf.py --mmproj`."""
from __future__ import annotations

import filecmp

import gguf
import pytest

from hf2q.checkpoint.gguf_file import GGUFFile
from hf2q.cli import main
from tests.support.fixtures import hf_checkpoint, hf_vl_checkpoint, llama_cpp_mmproj, our_vl_ggufs


@pytest.mark.parametrize("kind,outtype", [("dense", "f32"), ("dense", "f16"), ("moe", "f16")])
def test_mmproj_bytes_equal_llama_cpp(kind, outtype, tmp_path):
    ref = llama_cpp_mmproj(kind, outtype)
    out = tmp_path / "mmproj.gguf"
    assert main(["convert", str(hf_vl_checkpoint(kind)), "--mmproj", "-o", str(out), "--outtype", outtype]) == 0
    assert filecmp.cmp(out, ref, shallow=False), "mmproj differs from llama.cpp's"
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == "clip"
    assert {t.name for t in reader.tensors} >= {"v.patch_embd.weight", "v.patch_embd.weight.1", "mm.0.weight",
                                                  "mm.2.weight", "v.post_ln.weight", "v.position_embd.weight"}


def test_vl_fixture_text_gguf_is_the_text_model():
    text, mmproj = (GGUFFile(p) for p in our_vl_ggufs("dense"))
    assert text.metadata["general.architecture"] == "qwen35"
    assert not any(name.startswith(("v.", "mm.")) for name in text.tensor_names)
    assert mmproj.metadata["general.type"] == "mmproj"


@pytest.mark.parametrize("args,message", [
    (["--outtype", "bf16"], "outtype must be one of"),
    ([], "not a Qwen3.5 image-text checkpoint"),
])
def test_mmproj_refusals(args, message, tmp_path, capsys):
    src = hf_vl_checkpoint("dense") if args else hf_checkpoint("dense")
    assert main(["convert", str(src), "--mmproj", "-o", str(tmp_path / "x.gguf"), *args]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
