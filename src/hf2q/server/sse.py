"""Server-sent events framing, and the disconnect watch shared by the non-streaming handlers."""
from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Optional, TypeVar

from fastapi import Request

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


# JSON leaves U+0085, U+2028 and U+2029 raw, and line readers that follow `str.splitlines` (httpx's
# `iter_lines` among them) end a line there, cutting an event's JSON in two; escaped, the payload is the same
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def json_data(payload: dict) -> str:
    """`payload` as JSON for an event's `data:` field: UTF-8 text kept as is, nothing a line reader splits on."""
    text = json.dumps(payload, ensure_ascii=False)
    if "\u2028" in text or "\u2029" in text or "\x85" in text:
        text = text.translate(_LINE_BREAKS)
    return text


def event(payload: dict) -> str:
    return f"data: {json_data(payload)}\n\n"


async def unless_disconnected(request: Request, work: Awaitable[T]) -> Optional[T]:
    """Await `work`; None if the client went away first (then `work` is cancelled, which aborts its
    generations and frees their slots)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done():
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()
