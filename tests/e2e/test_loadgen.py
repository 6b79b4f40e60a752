"""`hf2q bench serve`, the load generator: its arithmetic and SSE reading on canned input, then as a
subprocess against a real server (the shared plain one, and one it starts itself)."""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys

import pytest

from hf2q.loadgen import RequestResult, load_dataset, percentile, read_stream, summarize
from hf2q.loadgen_stream import sse_lines

from .conftest import free_port


def bench_serve(*flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf2q.cli", "bench", "serve", "--no-progress", *flags],
                          capture_output=True, text=True, timeout=timeout)


def test_percentile_interpolates_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_summary_counts_usage_tokens_and_leaves_out_failed_requests():
    ok = [RequestResult(prompt_tokens=8, completion_tokens=5, ttft=0.1, last_token=0.5, latency=0.6,
                        gaps=[0.2, 0.2]) for _ in range(3)]
    failed = RequestResult(error="HTTP 429: busy", latency=0.01)
    level = summarize(4, ok + [failed], wall=2.0)
    assert level["ok"] == 3 and level["errors"] == 1 and level["first_error"] == "HTTP 429: busy"
    assert level["output_tokens"] == 15 and level["output_tok_s"] == 7.5 and level["requests_s"] == 1.5
    # ITL = (last - first) / (tokens - 1): 0.4 s over 4 tokens after the first
    assert level["itl_ms"]["p50"] == pytest.approx(100.0)
    assert level["chunk_gap_ms"]["p99"] == pytest.approx(200.0)
    assert level["ttft_ms"]["p90"] == pytest.approx(100.0)
    assert len(level["per_request"]) == 4
    assert [r["text_chunks"] for r in level["per_request"]] == [3, 3, 3, 0]  # the failed one carried none


def _canned(*lines: str):
    async def gen():
        for line in lines:
            yield line
    return gen()


def _run_canned(*lines: str) -> RequestResult:
    ticks = iter(range(1, 100))
    return asyncio.run(read_stream(_canned(*lines), lambda: float(next(ticks)), 0.0))


def test_sse_stream_times_text_chunks_and_takes_tokens_from_usage():
    chunk = lambda text: "data: " + json.dumps({"choices": [{"index": 0, "text": text}]})
    result = _run_canned(
        ": a comment", "",
        "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}),  # no text: no token
        chunk("a"), "", chunk("bc"), chunk(""), chunk("d"),  # two tokens in one chunk, one chunk with none
        "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 4}}),
        "data: [DONE]")
    assert result.error is None
    assert (result.prompt_tokens, result.completion_tokens) == (8, 4)
    # the clock ticks 1 s at each reading: the three text chunks, then the end
    assert (result.ttft, result.last_token, result.latency, result.gaps) == (1.0, 3.0, 4.0, [1.0, 1.0])
    assert result.itl == pytest.approx(2.0 / 3)


def test_sse_stream_without_usage_or_with_an_error_is_an_error():
    no_usage = _run_canned("data: " + json.dumps({"choices": [{"index": 0, "text": "a"}]}), "data: [DONE]")
    assert no_usage.error == "the stream ended without usage"
    error = _run_canned("data: " + json.dumps({"error": {"message": "boom"}}), "data: [DONE]")
    assert error.error == "error in stream: boom"


def test_sse_lines_end_only_at_cr_and_lf():
    # text that `str.splitlines` would cut (U+2028, U+2029, U+0085), a CR LF split between reads, a bare CR, a
    # multi-byte character split between reads, and a last line without its end
    text = "a\u2028b\u2029c\x85d \u00e9"
    body = ("data: " + json.dumps({"choices": [{"index": 0, "text": text}]}, ensure_ascii=False) + "\r\n\r\n"
            + "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
            + "\r\rdata: [DONE]").encode()
    cuts = sorted([body.index(b"\r\n") + 1, body.index("\u00e9".encode()) + 1, len(body) - 3])

    async def reads():
        for start, end in zip([0] + cuts, cuts + [len(body)]):
            yield body[start:end]

    async def collect():
        return [line async for line in sse_lines(reads())]

    lines = asyncio.run(collect())
    assert lines[0] == "data: " + json.dumps({"choices": [{"index": 0, "text": text}]}, ensure_ascii=False)
    assert lines[1:] == ["", lines[2], "", "data: [DONE]"] and lines[2].startswith("data: {")
    ticks = iter(range(1, 100))
    result = asyncio.run(read_stream(sse_lines(reads()), lambda: float(next(ticks)), 0.0))
    assert result.error is None and result.text == text


def test_dataset_takes_the_first_user_turn_and_the_reply_length(tmp_path):
    path = tmp_path / "d.jsonl"
    records = [{"conversations": [{"from": "system", "value": "be nice"}, {"from": "human", "value": "hi there"},
                                  {"from": "gpt", "value": "x" * 40}, {"from": "human", "value": "again"}]},
               {"messages": [{"role": "user", "content": "what?"}, {"role": "assistant", "content": "abc"}]},
               {"conversations": [{"from": "gpt", "value": "no user turn"}]}]
    path.write_text("\n".join(json.dumps(r) for r in records))
    assert [(p.text, p.max_tokens) for p in load_dataset(str(path), None)] == [("hi there", 10), ("what?", 1)]
    assert [p.max_tokens for p in load_dataset(str(path), 7)] == [7, 7]


def test_fixed_prompts_against_a_real_server(plain_server, tmp_path):
    out = tmp_path / "out.json"
    run = bench_serve("--url", plain_server.url, "--clients", "1", "3", "--requests-per-client", "2",
                      "--prompt-tokens", "8", "--max-tokens", "4", "--json", str(out))
    assert run.returncode == 0, run.stderr
    assert "| clients |" in run.stdout
    report = json.loads(out.read_text())
    assert report["model"] == "tiny"
    # one warm-up request first, reported apart and counted in no level
    warm = report["warm_up"]
    assert (warm["requests"], warm["errors"]) == (1, 0) and 0 < warm["ttft_ms"] <= warm["latency_ms"]
    assert "warm-up (not counted): 1 request(s)" in run.stdout
    for level in report["levels"]:
        assert level["errors"] == 0 and level["first_error"] is None
        n = level["clients"] * 2
        assert level["requests"] == level["ok"] == n
        # ignore_eos: every request makes exactly max_tokens, as the server's usage says
        assert level["output_tokens"] == n * 4 == sum(r["completion_tokens"] for r in level["per_request"])
        assert all(r["prompt_tokens"] == 8 and 1 <= r["text_chunks"] <= 4 for r in level["per_request"])
        assert level["ttft_ms"]["p50"] > 0 and level["itl_ms"]["p50"] > 0 and level["output_tok_s"] > 0


def test_dataset_over_chat_against_a_real_server(plain_server, tmp_path):
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue, or red"}]},
        {"messages": [{"role": "user", "content": "Count to two."}, {"role": "assistant", "content": "1 2"}]}]))
    out = tmp_path / "out.json"
    run = bench_serve("--url", plain_server.url + "/v1", "--endpoint", "chat", "--dataset", str(data),
                      "--clients", "2", "--json", str(out))
    assert run.returncode == 0, run.stderr
    level = json.loads(out.read_text())["levels"][0]
    assert level["errors"] == 0
    # max_tokens hints: 12 characters / 4 = 3 and 3 / 4 -> 1
    assert sorted(r["completion_tokens"] for r in level["per_request"]) == [1, 3]
    assert level["output_tokens"] == 4


def test_starts_and_stops_its_own_server(served_model_path, tmp_path):
    out = tmp_path / "out.json"
    run = bench_serve("--model", str(served_model_path), "--serve-args", "--max-model-len 128 --max-num-seqs 2",
                      "--clients", "2", "--prompt-tokens", "4", "--max-tokens", "3", "--json", str(out))
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["levels"][0]["errors"] == 0 and report["levels"][0]["output_tokens"] == 6
    with pytest.raises(OSError):  # stopped: nothing listens on its port any more
        socket.create_connection(("127.0.0.1", int(report["url"].rsplit(":", 1)[1])), timeout=2)


@pytest.mark.parametrize("flags, message", [
    (("--url", "http://127.0.0.1:{port}"), "cannot reach"),
    (("--url", "ftp://nowhere"), "bad --url"),
    (("--model", "/no/such/model.gguf"), "no model file"),
])
def test_usage_errors_are_one_clean_line(flags, message):
    run = bench_serve(*(f.format(port=free_port()) for f in flags), "--clients", "1")
    assert run.returncode != 0
    assert message in run.stderr and "Traceback" not in run.stderr


def test_multi_turn_conversations_report_the_prefix_cache_hit_rate(plain_server, tmp_path):
    out = tmp_path / "multi.json"
    done = bench_serve("--url", plain_server.url, "--endpoint", "chat", "--multi-turn", "3",
                       "--shared-prefix-tokens", "150", "--clients", "2", "--prompt-tokens", "6", "--max-tokens", "3",
                       "--json", str(out))
    assert done.returncode == 0, done.stderr
    (level,) = json.loads(out.read_text())["levels"]
    requests = level["per_request"]
    assert len(requests) == 6 and sorted(r["turn"] for r in requests) == [0, 0, 1, 1, 2, 2]
    for r in requests:  # each follow-up resumes at least the turn before it (its prompt minus the new turn)
        assert (r["cached_tokens"] > 150) == (r["turn"] > 0), r
    assert level["hit_rate"] == level["cached_tokens"] / level["prompt_tokens"] > 0.5
    assert level["follow_up_ttft_ms"]["p50"] is not None and "follow-up TTFT" in done.stdout


def test_multi_turn_clients_play_their_conversations_one_after_another(plain_server, tmp_path):
    """--requests-per-client with --multi-turn: each client's conversations in turn, each with questions of its own."""
    out = tmp_path / "each.json"
    done = bench_serve("--url", plain_server.url, "--endpoint", "chat", "--multi-turn", "2", "--clients", "1",
                       "--requests-per-client", "2", "--prompt-tokens", "6", "--max-tokens", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr
    requests = json.loads(out.read_text())["levels"][0]["per_request"]
    assert [r["turn"] for r in requests] == [0, 1, 0, 1]
    assert requests[1]["cached_tokens"] > 0 and requests[2]["prompt_tokens"] < requests[1]["prompt_tokens"]
