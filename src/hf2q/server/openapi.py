"""The OpenAPI document served at /openapi.json: FastAPI's, with errors described as they are answered.

FastAPI documents request-validation failures as 422 `{"detail": [...]}`; this server answers every error
(validation included, as a 400) in OpenAI's envelope, so the document says that instead.
"""
from __future__ import annotations

from typing import Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    error: ErrorBody


def install_openapi(app: FastAPI) -> None:
    """Replace `app.openapi` with the document above, built once on first request."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            envelope = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(envelope.pop("$defs"))
            schemas["ErrorResponse"] = envelope
            error = {"description": "OpenAI error envelope", "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
            for path in doc.get("paths", {}).values():
                for op in path.values():
                    op["responses"].pop("422", None)
                    op["responses"]["4XX"] = error
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
