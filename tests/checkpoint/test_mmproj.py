"""`load_mmproj` is strict like the text loader; `find_mmproj` finds the one projector beside a model."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
from gguf import GGUFValueType

from hf2q.checkpoint.gguf_file import GGUFError
from hf2q.checkpoint.mmproj import find_mmproj, load_mmproj
from tests.support.fixtures import hf_vl_checkpoint, our_vl_ggufs
from tests.support.gguf_variants import rewritten


@pytest.fixture(scope="module")
def mmproj_path():
    return our_vl_ggufs("dense")[1]


def test_load_matches_checkpoint(mmproj_path):
    from safetensors.torch import load_file

    m = load_mmproj(mmproj_path)
    assert (m.config.depth, m.config.hidden_size, m.config.num_heads, m.config.out_hidden_size) == (2, 64, 2, 128)
    assert m.config.num_position_embeddings == 64 and m.config.image_mean == (0.5, 0.5, 0.5)
    hf = load_file(str(hf_vl_checkpoint("dense") / "model.safetensors"))
    kernel = hf["model.visual.patch_embed.proj.weight"]
    assert m.tensors["patch_embed.kernel_t1"].equal(kernel[:, :, 1])
    assert m.tensors["blocks.1.attn.qkv.weight"].equal(hf["model.visual.blocks.1.attn.qkv.weight"])
    assert m.tensors["merger.fc2.bias"].equal(hf["model.visual.merger.linear_fc2.bias"])


@pytest.mark.parametrize("edit,message", [
    (dict(tensors={"v.blk.0.ln1.bias": None}), "missing vision tensors for blocks.0.norm1.bias"),
    (dict(tensors={"v.blk.0.extra.weight": np.zeros(4, np.float32)}), "unexpected tensor 'v.blk.0.extra.weight'"),
    (dict(tensors={"mm.2.bias": np.zeros(7, np.float32)}), "'mm.2.bias' has shape (7,), expected (128,)"),
    (dict(meta={"clip.projector_type": ("gemma3", GGUFValueType.STRING)}), "projector type 'gemma3'"),
    (dict(drop_meta=("clip.vision.patch_size",)), "no clip.vision.patch_size"),
])
def test_load_refuses_broken_files(mmproj_path, tmp_path, edit, message):
    bad = rewritten(mmproj_path, tmp_path / "mmproj-bad.gguf", **edit)
    with pytest.raises(GGUFError) as info:
        load_mmproj(bad)
    assert message in str(info.value)


def test_load_refuses_text_model():
    with pytest.raises(GGUFError, match="not a vision projector file"):
        load_mmproj(our_vl_ggufs("dense")[0])


def test_find_mmproj(mmproj_path, tmp_path):
    model = tmp_path / "model.gguf"
    model.touch()
    assert find_mmproj(model) is None
    shutil.copyfile(mmproj_path, tmp_path / "mmproj-F32.gguf")
    assert find_mmproj(model) == tmp_path / "mmproj-F32.gguf"
    (tmp_path / "mmproj-F16.gguf").touch()
    with pytest.raises(GGUFError, match="several vision projector files beside model.gguf: mmproj-F16.gguf, mmproj-F32"):
        find_mmproj(model)
