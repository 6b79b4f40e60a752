"""Every failure leaves the server in OpenAI's error envelope: {"error": {message, type, param, code}}.

Clients (the `openai` SDK included) parse that shape; a plain-text or FastAPI-style `{"detail": ...}` body
turns a clear mistake into an opaque one.
"""
from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "server_error"}


class APIError(Exception):
    """An error answered to the client as-is."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_TYPE_NAMES = {"int", "float", "str", "bool", "none", "dict", "list"}


def _loc_to_param(loc: tuple) -> Optional[str]:
    # pydantic puts union members (int, TextPart, list[...]) into loc; they mean nothing to the client.
    parts = [str(p) for p in (loc[1:] if loc[:1] == ("body",) else loc)]
    parts = [p for p in parts if p not in _TYPE_NAMES and not p[:1].isupper() and "[" not in p and "-" not in p]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
    param = _loc_to_param(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        return bad_request(f"unsupported field {param!r}: this server does not accept it", param=param)
    if first.get("type") == "model_attributes_type":
        return bad_request("the request body must be a JSON object", param=param)
    msg = first.get("msg", "invalid value")
    return bad_request(f"invalid value for {param}: {msg}" if param else msg, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} not allowed on {request.url.path}"
        return APIError(exc.status_code, message, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(500, f"internal error: {exc}", code="internal_error").response()
