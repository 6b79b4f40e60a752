"""Prefix checkpoints outlive the server: serve with `--prefix-cache-dir`, chat, stop with SIGINT, serve again
on the same directory, and the next turn of the conversation resumes from the file its first turn left (with
two tensor-parallel ranks: from each rank's shard of it)."""
from __future__ import annotations

import signal

import openai
import pytest

from tests.e2e.conftest import Server

FLAGS = ["--max-model-len", "512", "--max-num-seqs", "2", "--served-model-name", "tiny"]
MESSAGES = [{"role": "system", "content": "You are a terse assistant for restart tests. " * 30},
            {"role": "user", "content": "Name a colour."}]


def _chat(server: Server, messages: list[dict]):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)


@pytest.mark.parametrize("tp", [1, 2])
def test_next_turn_after_a_restart_hits_from_disk(served_model_path, tmp_path, tp):
    store = tmp_path / "prefixes"
    flags = [*FLAGS, "--prefix-cache-dir", str(store), "--tensor-parallel-size", str(tp)]
    first = Server(served_model_path, flags, tmp_path / "first.log")
    try:
        assert _chat(first, MESSAGES).usage.prompt_tokens_details.cached_tokens == 0
    finally:
        first.proc.send_signal(signal.SIGINT)
        assert first.proc.wait(timeout=30) in (0, 130), first.log()  # 130: stopped by SIGINT, cleanly
        first._log.close()
    files = [sorted(p.name for p in store.glob("*.safetensors" if tp == 1 else f"tp2/rank{r}/*.safetensors"))
             for r in range(tp)]
    assert files[0] and all(f == files[0] for f in files), first.log()  # every rank wrote its shard
    follow_up = [*MESSAGES, {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]
    second = Server(served_model_path, flags, tmp_path / "second.log")
    try:
        usage = _chat(second, follow_up).usage
    finally:
        second.stop()
    assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens, usage
