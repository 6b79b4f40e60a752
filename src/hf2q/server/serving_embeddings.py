"""POST /v1/embeddings from the chat model: the final normed hidden state of the last token (or the mean over
the tokens, with the extension field `pooling: "mean"`), L2-normalised.

Each input is a prefill-only engine request, batched through the scheduler with the generating ones.
"""
from __future__ import annotations

import base64
import uuid
from contextlib import aclosing

import torch
import torch.nn.functional as F
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from hf2q.engine.request import RequestOptions
from hf2q.engine.sampling_params import SamplingParams
from hf2q.server.choices import Choices
from hf2q.server.errors import bad_request
from hf2q.server.request_fields import log_labels
from hf2q.server.schemas import EmbeddingRequest
from hf2q.server.serving_completions import encode_items, prompt_items
from hf2q.server.sse import unless_disconnected
from hf2q.server.state import ServerState


def encode_vector(vector: torch.Tensor, dimensions: int | None, encoding_format: str):
    """`dimensions` keeps the first ones and renormalises; base64 is little-endian float32, as OpenAI's."""
    if dimensions is not None:
        vector = F.normalize(vector[:dimensions], dim=0)
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


class EmbeddingServing:
    def __init__(self, state: ServerState):
        self.state = state

    async def create(self, req: EmbeddingRequest, raw: Request) -> Response:
        self.state.check_model(req.model)
        hidden = self.state.model.config.hidden_size
        if req.dimensions is not None and not 1 <= req.dimensions <= hidden:
            raise bad_request(f"dimensions must be an integer in [1, {hidden}], got {req.dimensions}",
                              param="dimensions")
        prompts = encode_items(self.state.model.tokenizer, prompt_items(req.input, "input"))
        choices = Choices(self.state, prompts, SamplingParams(), "input", RequestOptions(pooling=req.pooling))
        await choices.start()
        log_labels("embedding", f"embd-{uuid.uuid4().hex}", req)
        body = await unless_disconnected(raw, self._collect(choices, req))
        return JSONResponse(body) if body is not None else Response(status_code=499)

    async def _collect(self, choices: Choices, req: EmbeddingRequest) -> dict:
        vectors: list = [None] * len(choices.prompts)
        async with aclosing(choices.stream()) as stream:
            async for gen, out in stream:
                if out.embedding is not None:
                    vectors[gen.index] = encode_vector(out.embedding, req.dimensions, req.encoding_format)
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        tokens = sum(len(p) for p in choices.prompts)
        return {"object": "list", "data": data, "model": self.state.config.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
