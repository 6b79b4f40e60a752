"""Models by name against a local Hub endpoint (tests/support/fake_hub.py) serving a repository of tiny GGUFs
(tests/support/gguf_variants.py): `hf2q serve` downloads one once (progress bar, HF_TOKEN sent) and serves it,
and a second start serves it from the cache with the endpoint gone; `hf2q info` (which resolves names as serve
does, in seconds) fetches every part of a split GGUF and the projector beside it, resuming a transfer that broke
off, and offline mode finds them in the cache; a tag that matches nothing lists what the repository holds."""
from __future__ import annotations

import filecmp
import os
import re
import subprocess
import sys

import pytest

from tests.e2e.conftest import Server, free_port
from tests.support.fake_hub import FakeHub
from tests.support.gguf_variants import write_split_tiny_gguf, write_tiny_gguf

REPO = "tiny-org/Tiny-GGUF"
PROJECTOR_BYTES = 24 << 20  # cut half way, past the first 10 MiB chunk huggingface_hub writes (resumable from)


@pytest.fixture()
def hub(tmp_path, monkeypatch):
    repo = tmp_path / "hub" / REPO
    repo.mkdir(parents=True)
    write_tiny_gguf(repo / "Tiny-Q4_K_M.gguf")  # the demo model with a 259-token vocabulary: 1 MB, quick to load
    write_split_tiny_gguf(repo / "Tiny-Q8_0.gguf", tensors_per_part=20)  # Tiny-Q8_0-0000k-of-00003.gguf
    (repo / "mmproj-Tiny-F16.gguf").write_bytes(b"GGUF projector" + bytes(PROJECTOR_BYTES))  # not read by `info`
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


def test_info_fetches_a_split_model_and_the_projector_then_offline_mode_uses_the_cache(hub, caplog):
    """The projector's transfer breaks off half way, and its download resumes from what had been written."""
    parts = [f"Tiny-Q8_0-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    projector = "mmproj-Tiny-F16.gguf"
    hub.cut_once.add(projector)
    first = _hf2q("info", f"{REPO}:Q8_0")
    assert first.returncode == 0, first.stderr
    assert parts[0] in first.stdout
    assert hub.downloads == {**dict.fromkeys(parts, 1), projector: 1}  # every part, not Q4_K_M
    [(name, start)] = hub.resumed
    original = hub.root / REPO / projector
    assert name == projector and 0 < start <= original.stat().st_size // 2
    assert filecmp.cmp(next((hub.root.parent / "hf-home").rglob(projector)), original, shallow=False)
    hub.stop()
    assert offline_path(f"hf://{REPO}:Q8_0", hub.root.parent / "hf-home", caplog).name == parts[0]


def offline_path(name: str, hf_home, caplog):
    """local_model_path(name) in this process with HF_HUB_OFFLINE=1 (huggingface_hub reads the variable at
    import, so its constants are set as the variable would set them); it must not try the Hub."""
    import huggingface_hub.constants as constants

    from hf2q.checkpoint.hub import local_model_path

    with pytest.MonkeyPatch.context() as mp, caplog.at_level("INFO", logger="hf2q.hub"):
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        mp.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
        found = local_model_path(name)
    assert "using cached" in caplog.text and "unreachable" not in caplog.text, caplog.text
    return found


def test_a_tag_matching_nothing_lists_the_files(hub):
    run = _hf2q("serve", "--model", f"{REPO}:Q5_K_S", "--port", str(free_port()))
    assert run.returncode != 0
    assert "Q5_K_S matches no GGUF file" in run.stderr
    assert "Tiny-Q4_K_M.gguf, Tiny-Q8_0-00001-of-00003.gguf, Tiny-Q8_0-00002-of-00003.gguf" in run.stderr
    assert "Traceback" not in run.stderr
    assert not hub.downloads


def test_serves_a_hub_model_then_from_the_cache_with_the_network_gone(hub, tmp_path, monkeypatch):
    """The first start downloads the model once, with a progress bar and HF_TOKEN, and serves it; the second finds
    the Hub unreachable and serves the cached file. (The fixture's projector is no GGUF: --no-mmproj, which
    also leaves it on the Hub.)"""
    import openai

    flags = ["--max-model-len", "128", "--max-num-seqs", "1", "--log-level", "info", "--no-mmproj"]
    monkeypatch.setenv("HF_TOKEN", "hf_fixture")
    monkeypatch.setenv("TQDM_POSITION", "-1")  # huggingface_hub's switch: the bar even without a terminal
    server = Server(f"{REPO}:Q4_K_M", flags, tmp_path / "first.log")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(model="", prompt="hello", max_tokens=2, temperature=0)  # the served one
        assert reply.usage.completion_tokens == 2
        log = server.log_path.read_text()
        assert "fetching Tiny-Q4_K_M.gguf" in log and re.search(r"Tiny-Q4_K_M\.gguf: *100%", log), log
    finally:
        server.stop()
    assert hub.tokens == {"Bearer hf_fixture"}
    assert hub.downloads == {"Tiny-Q4_K_M.gguf": 1}
    hub.stop()  # the network is gone
    server = Server(f"hf://{REPO}", flags, tmp_path / "second.log")
    try:
        assert server.healthy()
        log = server.log_path.read_text()
        assert "the Hub is unreachable" in log and "using cached Tiny-Q4_K_M.gguf" in log, log
    finally:
        server.stop()
    assert hub.downloads == {"Tiny-Q4_K_M.gguf": 1}
