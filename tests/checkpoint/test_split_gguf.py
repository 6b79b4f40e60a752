"""A split GGUF (`NAME-00001-of-0000N.gguf`, written here by the `gguf` package's own splitting writer, as
llama.cpp's converter writes one) opens by its first part and loads as the same model as the unsplit file."""
from __future__ import annotations

import pytest
import torch

import hf2q
from hf2q.checkpoint.gguf_file import GGUFError, GGUFFile
from tests.support.gguf_variants import write_split_tiny_gguf, write_tiny_gguf


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the tiny GGUF whole, its parts in order)."""
    folder = tmp_path_factory.mktemp("split")
    write_tiny_gguf(folder / "tiny.gguf")
    return folder / "tiny.gguf", write_split_tiny_gguf(folder / "tiny-Q8_0.gguf")


def test_the_first_part_opens_the_whole_model(files):
    whole, parts = files
    assert len(parts) > 2
    one, split = GGUFFile(whole), GGUFFile(parts[0])
    assert split.metadata == one.metadata  # the split.* keys are the files' business, not the model's
    assert split.tensor_names == one.tensor_names
    for name in one.tensor_names:
        assert torch.equal(split.tensor(name), one.tensor(name)), name
    ids = [1, 2, 3, 4]
    assert torch.equal(hf2q.load(parts[0]).logits(ids), hf2q.load(whole).logits(ids))


def test_a_later_or_missing_part_is_a_clear_error(files, tmp_path):
    _, parts = files
    with pytest.raises(GGUFError, match=f"part 2 of a split GGUF: name its first part, {parts[0].name}"):
        GGUFFile(parts[1])
    for part in parts[:1] + parts[2:]:
        (tmp_path / part.name).symlink_to(part)
    with pytest.raises(GGUFError, match=f"incomplete: {parts[1].name} not found beside it"):
        GGUFFile(tmp_path / parts[0].name)
