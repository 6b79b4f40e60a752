"""Server-sent events framing, and the disconnect watch shared by the non-streaming handlers."""
from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Optional, TypeVar

from fastapi import Request

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


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
