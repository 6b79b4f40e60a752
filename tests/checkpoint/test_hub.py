"""Choosing the GGUF a Hugging Face model name means (the download itself: tests/e2e/test_hub.py)."""
import pytest

from hf2q.checkpoint.hub import (
    HubError, HubReference, choose_gguf, choose_mmproj, model_parts, parse_reference,
)

FILES = ["README.md", "Model-Q4_K.gguf", "Model-Q4_K_M.gguf", "model.Q8_0.gguf", "mmproj-Model-F16.gguf"]


def test_references_and_local_paths(tmp_path):
    assert parse_reference("Qwen/Qwen3.6-GGUF:Q8_0") == HubReference("Qwen/Qwen3.6-GGUF", "Q8_0")
    assert parse_reference("hf://Qwen/Qwen3.6-GGUF") == HubReference("Qwen/Qwen3.6-GGUF", None)
    local = tmp_path / "a"
    local.mkdir()
    assert parse_reference(str(local)) is None  # an existing path stays a path
    assert parse_reference("models/tiny.gguf") is None
    with pytest.raises(HubError, match="hf://OWNER/REPO"):
        parse_reference("hf://no-repo")


def test_the_quant_tag_picks_a_whole_word():
    assert choose_gguf(FILES, None, "o/r") == "Model-Q4_K_M.gguf"  # the default tag
    assert choose_gguf(FILES, "q4_k", "o/r") == "Model-Q4_K.gguf"  # not Q4_K_M, any case
    assert choose_gguf(FILES, "Q8_0", "o/r") == "model.Q8_0.gguf"
    assert choose_gguf(["x/only-F16.gguf", "README.md"], None, "o/r") == "x/only-F16.gguf"  # the only GGUF
    assert choose_mmproj(FILES, "Model-Q4_K_M.gguf") == "mmproj-Model-F16.gguf"
    assert choose_mmproj(FILES, "sub/Model-Q4_K_M.gguf") is None  # only beside the model


def test_no_match_lists_the_files():
    with pytest.raises(HubError, match=r"Q2_K matches no GGUF file; .*Model-Q4_K.gguf, Model-Q4_K_M.gguf, "
                                       r"model.Q8_0.gguf"):
        choose_gguf(FILES, "Q2_K", "o/r")
    with pytest.raises(HubError, match="default"):
        choose_gguf(["a-F16.gguf", "a-BF16.gguf"], None, "o/r")


def test_a_split_gguf_is_one_model_of_all_its_parts():
    split = ["M-Q4_K_M-00002-of-00003.gguf", "M-Q4_K_M-00001-of-00003.gguf", "M-Q4_K_M-00003-of-00003.gguf"]
    names = [*split, "M-Q8_0.gguf", "mmproj-M-F16.gguf"]
    assert choose_gguf(names, None, "o/r") == "M-Q4_K_M-00001-of-00003.gguf"
    assert model_parts(names, "M-Q4_K_M-00001-of-00003.gguf") == sorted(split)
    assert model_parts(names, "M-Q8_0.gguf") == ["M-Q8_0.gguf"]
    assert choose_mmproj(names, "M-Q4_K_M-00001-of-00003.gguf") == "mmproj-M-F16.gguf"
    only = ["sub/X-00002-of-00002.gguf", "sub/X-00001-of-00002.gguf"]
    assert choose_gguf(only, None, "o/r") == "sub/X-00001-of-00002.gguf"  # the only model, in two parts
    with pytest.raises(HubError, match="incomplete: M-Q4_K_M-00002-of-00003.gguf missing"):
        choose_gguf([split[1], split[2]], "Q4_K_M", "o/r")
