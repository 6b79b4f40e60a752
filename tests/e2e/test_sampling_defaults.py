"""A model file's recommended sampling: llama.cpp's converter (and `hf2q convert`, which uses its metadata
code) copies a checkpoint's generation_config.json into general.sampling.*; a request that leaves those fields
out is sampled with them, one that sets them with its own, and `--sampling-defaults openai` ignores them."""
from __future__ import annotations

import json

import openai
import pytest

from tests.e2e.conftest import Server

RECOMMENDED = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}


@pytest.fixture(scope="module")
def recommending_gguf(hf_dense_dir, tmp_path_factory):
    """The dense test checkpoint with a generation_config.json as Qwen's, converted."""
    from hf2q.checkpoint.convert import convert

    d = tmp_path_factory.mktemp("recommending") / "hf"
    d.mkdir()
    for f in hf_dense_dir.iterdir():
        (d / f.name).symlink_to(f)
    (d / "generation_config.json").unlink()
    config = json.loads((hf_dense_dir / "generation_config.json").read_text()) | {"do_sample": True, **RECOMMENDED}
    (d / "generation_config.json").write_text(json.dumps(config))
    return convert(d, d.parent / "recommending.gguf", "bf16")


def sample(client, **fields) -> str:
    extension = {k: v for k, v in fields.items() if k == "top_k"}  # not in the SDK's signature
    out = client.completions.create(model="m", prompt="The weather", max_tokens=12, seed=7,
                                    extra_body={"ignore_eos": True, **extension},
                                    **{k: v for k, v in fields.items() if k != "top_k"})
    return out.choices[0].text


def test_requests_without_sampling_fields_get_the_files_recommendation(recommending_gguf, tmp_path):
    server = Server(recommending_gguf, ["--max-num-seqs", "2", "--max-model-len", "256", "--served-model-name", "m",
                                        "--log-level", "info"], tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        left_out = sample(client)
        assert left_out == sample(client, **RECOMMENDED)
        assert left_out != sample(client, **OPENAI_DEFAULTS, top_k=-1)
        assert "recommended sampling: temperature 0.6, top_k 20, top_p 0.95" in server.log()
    finally:
        server.stop()


def test_sampling_defaults_openai_ignores_the_file():
    from types import SimpleNamespace

    from hf2q.server.launch import _sampling_defaults

    model = SimpleNamespace(metadata={"general.sampling.temp": 0.6, "general.sampling.top_k": 20})
    assert _sampling_defaults(SimpleNamespace(sampling_defaults="model"), model) == {"temperature": 0.6, "top_k": 20}
    assert _sampling_defaults(SimpleNamespace(sampling_defaults="openai"), model) == {}
