"""Models by name against a local Hub endpoint (tests/support/fake_hub.py) serving a repository built from the
fixture GGUF: fetched once with its projector (HF_TOKEN sent), then found in the cache with the endpoint gone or offline mode
on; a tag that matches nothing lists what the repository holds. `hf2q info` resolves names as `hf2q serve`
does and starts in seconds; the full serve round trip (two server starts) is opt-in: HF2Q_SERVE_FROM_HUB=1."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.e2e.conftest import Server, free_port
from tests.support.fake_hub import FakeHub

REPO = "tiny-org/Tiny-GGUF"


@pytest.fixture()
def hub(tmp_path, served_model_path, monkeypatch):
    repo = tmp_path / "hub" / REPO
    repo.mkdir(parents=True)
    shutil.copy(served_model_path, repo / "Tiny-Q4_K_M.gguf")
    (repo / "Tiny-Q8_0.gguf").write_bytes(b"GGUF not this one")
    (repo / "mmproj-Tiny-F16.gguf").write_bytes(b"GGUF projector")
    (repo / "README.md").write_text("fixture")
    fake = FakeHub(tmp_path / "hub")
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    yield fake
    fake.stop()


def _hf2q(*argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf2q.cli", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_fetched_once_then_found_in_the_cache_without_the_hub(hub):
    first = _hf2q("info", f"{REPO}:Q4_K_M", HF_TOKEN="hf_fixture")
    assert first.returncode == 0, first.stderr
    assert hub.tokens == {"Bearer hf_fixture"}
    assert "Tiny-Q4_K_M.gguf" in first.stdout
    assert hub.downloads == {"Tiny-Q4_K_M.gguf": 1, "mmproj-Tiny-F16.gguf": 1}  # the projector too, not Q8_0
    hub.stop()  # the network is gone
    again = _hf2q("info", f"hf://{REPO}")
    assert again.returncode == 0, again.stderr
    assert "Tiny-Q4_K_M.gguf" in again.stdout and "unreachable" in again.stderr
    assert hub.downloads["Tiny-Q4_K_M.gguf"] == 1


def test_a_tag_matching_nothing_lists_the_files(hub):
    run = _hf2q("serve", "--model", f"{REPO}:Q5_K_S", "--port", str(free_port()))
    assert run.returncode != 0
    assert "Q5_K_S matches no GGUF file" in run.stderr
    assert "Tiny-Q4_K_M.gguf, Tiny-Q8_0.gguf" in run.stderr
    assert "Traceback" not in run.stderr
    assert not hub.downloads


@pytest.mark.skipif(not os.environ.get("HF2Q_SERVE_FROM_HUB"), reason="two server starts: set HF2Q_SERVE_FROM_HUB")
def test_serves_a_hub_model_then_offline_from_the_cache(hub, tmp_path, monkeypatch):
    import openai

    flags = ["--max-model-len", "128", "--max-num-seqs", "1", "--log-level", "info"]
    server = Server(f"{REPO}:Q4_K_M", flags, tmp_path / "first.log")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        assert client.completions.create(model="Hf_Dense", prompt="hello", max_tokens=2).choices[0].text is not None
        assert "fetching Tiny-Q4_K_M.gguf" in server.log_path.read_text()
    finally:
        server.stop()
    hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    server = Server(f"hf://{REPO}", flags, tmp_path / "second.log")
    try:
        assert server.healthy()
        assert "using cached Tiny-Q4_K_M.gguf" in server.log_path.read_text()
    finally:
        server.stop()
    assert hub.downloads["Tiny-Q4_K_M.gguf"] == 1
