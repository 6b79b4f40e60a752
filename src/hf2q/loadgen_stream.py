"""One streamed request of `hf2q bench serve`: the SSE body read and timed, tokens taken from the server's usage.

Shared by the fixed-prompt levels (`hf2q.loadgen`) and the multi-turn conversations
(`hf2q.loadgen_conversations`).
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import AsyncIterable, AsyncIterator, Callable, Optional

import httpx


# Common English words that are one token in the usual BPE vocabularies (Qwen, Llama, GPT): a prompt of N of
# them, each with its leading space, is N tokens. Drawn at random per request so that requests share no
# cached prefix.
PROMPT_WORDS = (" hello", " world", " house", " water", " river", " green", " table", " light", " music",
                " paper", " stone", " night", " bread", " chair", " cloud", " money")


@dataclass
class RequestResult:
    """One request as the client saw it; times are seconds from when it was sent."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: Optional[float] = None  # first chunk carrying text
    last_token: Optional[float] = None  # last chunk carrying text
    latency: Optional[float] = None  # the stream's end
    gaps: list[float] = field(default_factory=list)  # between successive chunks carrying text
    error: Optional[str] = None
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: prompt tokens the server resumed
    text: str = ""  # the answer's content, sent back by the next turn of a conversation (--multi-turn)
    turn: int = 0  # the request's turn in its conversation (--multi-turn)

    @property
    def itl(self) -> Optional[float]:
        """Inter-token latency: the decode time spread over the tokens after the first."""
        if self.error or self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.last_token - self.ttft) / (self.completion_tokens - 1)

    @property
    def text_chunks(self) -> int:
        """Chunks that carried text: fewer than the tokens where tokens without text of their own (a
        character's first bytes, skipped special tokens) were sent with a later one or not at all, and then
        TTFT waited for such tokens and ITL spreads the time after the first text over all the tokens."""
        return 0 if self.ttft is None else len(self.gaps) + 1


# ---------------------------------------------------------------- prompts


_LINE_END = re.compile(rb"\r\n|\r|\n")


async def sse_lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """An SSE body's lines, ended where the SSE standard ends them (CR LF, LF or CR) and nowhere else: a
    reader that follows `str.splitlines` (httpx's `aiter_lines`) also splits at U+2028, U+2029 and U+0085,
    which JSON and so a server's `data:` payload may carry raw."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        held = 1 if pending.endswith(b"\r") else 0  # a CR may be the first half of a CR LF
        *lines, rest = _LINE_END.split(pending[:len(pending) - held])
        pending = rest + pending[len(pending) - held:]
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if pending:
        yield pending.rstrip(b"\r").decode("utf-8", errors="replace")


def parse_sse_line(line: str):
    """The JSON payload of a `data:` line, "[DONE]" for the end, None for anything else (comments, blank
    lines, other SSE fields)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return data
    return json.loads(data)


def _chunk_text(chunk: dict) -> str:
    """The text a chunk carries: completions `text`, chat `content` / `reasoning_content` / tool calls."""
    out = []
    for choice in chunk.get("choices") or []:
        if choice.get("text"):
            out.append(choice["text"])
        delta = choice.get("delta") or {}
        for key in ("content", "reasoning_content", "reasoning"):
            if delta.get(key):
                out.append(delta[key])
        if delta.get("tool_calls"):
            out.append(json.dumps(delta["tool_calls"]))
    return "".join(out)


async def read_stream(lines: AsyncIterable[str], clock: Callable[[], float], start: float) -> RequestResult:
    """Time an SSE response body: text chunks, the usage chunk, the end."""
    result = RequestResult()
    usage = None
    async for line in lines:
        try:
            payload = parse_sse_line(line)
        except json.JSONDecodeError:
            result.error = f"bad SSE data: {line[:200]}"
            break
        if payload is None:
            continue
        if payload == "[DONE]":
            break
        if "error" in payload:
            err = payload["error"]
            result.error = "error in stream: " + (err.get("message", str(err)) if isinstance(err, dict) else str(err))
            break
        if payload.get("usage"):
            usage = payload["usage"]
        for choice in payload.get("choices") or []:
            result.text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        if _chunk_text(payload):
            now = clock() - start
            if result.ttft is None:
                result.ttft = now
            else:
                result.gaps.append(now - result.last_token)
            result.last_token = now
    result.latency = clock() - start
    if result.error is None and usage is None:
        result.error = "the stream ended without usage"
    if usage is not None:
        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        result.completion_tokens = int(usage.get("completion_tokens") or 0)
        result.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return result


async def send(client: httpx.AsyncClient, path: str, body: dict) -> RequestResult:
    start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", errors="replace")
                return RequestResult(error=f"HTTP {response.status_code}: {text[:300]}",
                                     latency=time.perf_counter() - start)
            return await read_stream(sse_lines(response.aiter_bytes()), time.perf_counter, start)
    except httpx.HTTPError as exc:
        return RequestResult(error=f"{type(exc).__name__}: {exc}", latency=time.perf_counter() - start)


# ---------------------------------------------------------------- one concurrency level
