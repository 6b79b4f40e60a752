"""A cap on request bodies, enforced before anything parses them.

Without it a client can make the server buffer and JSON-parse any amount of data. The declared
Content-Length is checked first; a body sent without one (chunked) is counted as it arrives and refused at
the first chunk past the cap, so an oversized upload is never held whole.
"""
from __future__ import annotations

from hf2q.server.errors import APIError

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


class BodyLimit:
    """Pure ASGI middleware: reads the body (at most `limit` bytes), then hands it to the app as sent."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._refuse(scope, receive, send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:  # the whole body once, then the real channel (disconnects)
                sent = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send) -> None:
        error = APIError(413, f"the request body exceeds {self.limit} bytes (the server's --max-request-bytes)",
                         code="request_too_large", headers={"Connection": "close"})
        await error.response()(scope, receive, send)
