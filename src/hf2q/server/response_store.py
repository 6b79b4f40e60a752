"""The bounded in-memory store of finished responses: what `previous_response_id` continues from, and what
GET /v1/responses/{id}, DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items return.

Each entry keeps the Response object as returned, the chat conversation it ended (input and output, for the
next turn) and its input as Response items (with ids, as OpenAI lists them).
"""
from __future__ import annotations

import copy
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from hf2q.server.errors import APIError, bad_request

STORE_SIZE = 1000  # responses kept, least recently used dropped first
LIST_LIMIT = (1, 100, 20)  # input_items' `limit`: min, max, default (OpenAI's)


@dataclass
class StoredResponse:
    response: dict
    conversation: list[dict]
    input_items: list[dict]


class ResponseStore:
    def __init__(self, size: int = STORE_SIZE):
        self.size = size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def conversation(self, response_id: str) -> list[dict]:
        """The chat messages a `previous_response_id` continues (404 naming that field when unknown)."""
        if response_id not in self._items:
            raise APIError(404, f"Previous response with id {response_id!r} not found.",
                           param="previous_response_id", code="previous_response_not_found")
        return copy.deepcopy(self._entry(response_id).conversation)

    def put(self, response: dict, conversation: list[dict], input_items: list[dict]) -> None:
        self._items[response["id"]] = StoredResponse(copy.deepcopy(response), conversation, input_items)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def response(self, response_id: str) -> dict:
        return copy.deepcopy(self._found(response_id).response)

    def delete(self, response_id: str) -> dict:
        self._found(response_id)
        del self._items[response_id]
        return {"id": response_id, "object": "response", "deleted": True}

    def input_items(self, response_id: str, limit: int | None, order: str | None, after: str | None) -> dict:
        """One page of the response's input items, OpenAI's list shape (newest first unless order='asc')."""
        items = self._found(response_id).input_items
        low, high, default = LIST_LIMIT
        limit = default if limit is None else limit
        if not low <= limit <= high:
            raise bad_request(f"limit must be between {low} and {high}, got {limit}", param="limit")
        if order not in (None, "asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc', got {order!r}", param="order")
        ordered = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [item["id"] for item in ordered]
            if after not in ids:
                raise bad_request(f"no input item with id {after!r} in response {response_id!r}", param="after")
            ordered = ordered[ids.index(after) + 1:]
        page = copy.deepcopy(ordered[:limit])
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}

    def _entry(self, response_id: str) -> StoredResponse:
        self._items.move_to_end(response_id)
        return self._items[response_id]

    def _found(self, response_id: str) -> StoredResponse:
        if response_id not in self._items:
            raise APIError(404, f"Response with id {response_id!r} not found.", param="response_id",
                           code="response_not_found")
        return self._entry(response_id)


def input_items(items) -> list[dict]:
    """A request's `input` as stored Response items: a string becomes one user message; every item gets an id
    and a status; message text is a list of content parts."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    else:
        items = [item.model_dump(exclude_none=True) for item in items]
    listed = []
    for item in items:
        kind = item["type"]
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(kind, "rs")
        item = {"id": item.get("id") or f"{prefix}_{uuid.uuid4().hex}", **item, "status": "completed"}
        if kind == "message" and isinstance(item["content"], str):
            part = {"type": "output_text", "text": item["content"], "annotations": []} if item["role"] == "assistant" \
                else {"type": "input_text", "text": item["content"]}
            item["content"] = [part]
        listed.append(item)
    return listed
