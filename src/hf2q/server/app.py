"""The HTTP application: routes, API-key check, CORS, request metrics (`hf2q serve` is server/launch.py)."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hf2q.engine.step_profiler import ProfileError
from hf2q.server.body_limit import BodyLimit
from hf2q.server.errors import APIError, install_error_handlers
from hf2q.server.metrics import CONTENT_TYPE
from hf2q.server.openapi import install_openapi
from hf2q.server.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                                 ResponsesRequest, TokenizeRequest)
from hf2q.server.serving_chat import ChatServing
from hf2q.server.serving_completions import CompletionServing
from hf2q.server.serving_embeddings import EmbeddingServing
from hf2q.server.serving_responses import ResponsesServing
from hf2q.server.serving_tokens import detokenize, tokenize, tokenizer_info
from hf2q.server.state import ServerState

log = logging.getLogger("hf2q.serve")


class _RequestMetrics:
    """Pure ASGI middleware (keeps disconnect signalling intact) counting answers by route and status."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = scope.get("path", "")
            route = path if path in _ROUTES else "other"
            self.state.metrics.requests.labels(route=route, status=str(status["code"])).inc()


_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/v1/models", "/tokenize",
           "/detokenize", "/tokenizer_info", "/health", "/metrics", "/openapi.json", "/start_profile", "/stop_profile")


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app over an already started engine (`state.engine`)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        # uvloop where installed (a dependency; uvicorn picks it): a streamed token costs it less GIL time
        log.info("event loop: %s", type(asyncio.get_running_loop()).__module__.split(".")[0])
        yield
        state.engine.shutdown()

    # /openapi.json (the request models, for clients and schema-driven fuzzers) is a route below, behind the key
    app = FastAPI(title="hf2q", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.hf2q = state
    install_error_handlers(app)
    install_openapi(app)
    app.add_middleware(BodyLimit, limit=state.config.max_request_bytes)
    app.add_middleware(_RequestMetrics, state=state)
    if state.config.allowed_origins:  # browsers' cross-origin calls; off unless --allowed-origins is given
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(state.config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    chat, completions, embeddings = ChatServing(state), CompletionServing(state), EmbeddingServing(state)
    responses = ResponsesServing(state, chat)

    async def check_key(request: Request) -> None:  # async: a plain function would cost each request a thread hop
        key = state.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    auth = [Depends(check_key)]  # every route but /health (and /metrics with --metrics-public)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create(body, request)

    @app.post("/v1/completions", dependencies=auth)
    async def text_completions(body: CompletionRequest, request: Request) -> Response:
        return await completions.create(body, request)

    @app.post("/v1/responses", dependencies=auth)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await responses.create(body, request)

    @app.get("/v1/responses/{response_id}", dependencies=auth)
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.store.response(response_id))

    @app.delete("/v1/responses/{response_id}", dependencies=auth)
    async def delete_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.store.delete(response_id))

    @app.get("/v1/responses/{response_id}/input_items", dependencies=auth)
    async def list_input_items(response_id: str, limit: int | None = None, order: str | None = None,
                               after: str | None = None) -> JSONResponse:
        return JSONResponse(responses.store.input_items(response_id, limit, order, after))

    @app.post("/v1/embeddings", dependencies=auth)
    async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await embeddings.create(body, request)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize_route(body: TokenizeRequest) -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(tokenize, state, body))

    @app.post("/detokenize", dependencies=auth)
    async def detokenize_route(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(detokenize(state, body))

    @app.get("/tokenizer_info", dependencies=auth)
    async def tokenizer_info_route() -> JSONResponse:
        return JSONResponse(tokenizer_info(state))

    @app.get("/v1/models", dependencies=auth)
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    @app.get("/v1/models/{name:path}", dependencies=auth)
    async def model(name: str) -> JSONResponse:
        state.check_model(name)
        return JSONResponse(_model_card(state))

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "model": state.config.model_name, "demo": state.config.is_demo,
                             "uptime_seconds": round(time.monotonic() - state.metrics.started, 3)})

    @app.get("/metrics", dependencies=[] if state.config.metrics_public else auth)
    async def metrics() -> Response:
        state.metrics.observe_engine(state.engine.engine)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    profiler = getattr(state.engine, "profiler", None)
    if profiler is not None:  # --profile-dir: torch's profiler over the steps between the two calls
        async def on_engine(fn) -> JSONResponse:
            try:
                return JSONResponse(await state.engine.call(fn))
            except ProfileError as exc:
                raise APIError(409, str(exc), code="profile_state") from None

        @app.post("/start_profile", dependencies=auth)
        async def start_profile() -> JSONResponse:
            return await on_engine(profiler.start)

        @app.post("/stop_profile", dependencies=auth)
        async def stop_profile() -> JSONResponse:
            return await on_engine(profiler.stop)

    @app.get("/openapi.json", dependencies=auth, include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    return app


def _model_card(state: ServerState) -> dict:
    cfg = state.model.config
    card = {"id": state.config.model_name, "object": "model", "created": state.created, "owned_by": "hf2q",
            "max_model_len": state.config.max_model_len, "context_length": cfg.context_length,
            "arch": cfg.arch, "demo": state.config.is_demo}
    if state.config.is_demo:
        card["description"] = "built-in demo model: tiny random weights, output is gibberish"
    return card

