"""Which vision projector `hf2q serve` loads: --mmproj, else the one beside the model, never with --no-mmproj."""
import argparse
import logging

import pytest

from hf2q.checkpoint.gguf_file import GGUFError
from hf2q.server.launch import _mmproj_path, add_serve_args


def args(*flags):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(["--model", "m.gguf", *flags])


def test_projector_choice(tmp_path, caplog):
    model = tmp_path / "model.gguf"
    model.touch()
    assert _mmproj_path(args(), model, is_demo=False) is None  # none beside: text only
    beside = tmp_path / "mmproj-model-f16.gguf"
    beside.touch()
    with caplog.at_level(logging.INFO, logger="hf2q.serve"):
        assert _mmproj_path(args(), model, is_demo=False) == beside
    assert f"vision projector: {beside}" in caplog.text
    assert _mmproj_path(args("--no-mmproj"), model, is_demo=False) is None
    assert _mmproj_path(args("--mmproj", "/x/p.gguf"), model, is_demo=False).as_posix() == "/x/p.gguf"
    (tmp_path / "mmproj-model-f32.gguf").touch()
    with pytest.raises(GGUFError, match="several vision projector files"):
        _mmproj_path(args(), model, is_demo=False)
    with pytest.raises(SystemExit):
        args("--mmproj", "p.gguf", "--no-mmproj")
