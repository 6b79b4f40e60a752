"""Request fields -> `SamplingParams` (fields a request leaves out: the model file's recommended values, if
any), and the engine's refusals -> OpenAI errors."""
from __future__ import annotations

import logging
import re
from typing import Any, Mapping, Optional

import numpy as np

from hf2q.engine.async_engine import ShuttingDown
from hf2q.engine.engine import PromptTooLong
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.scheduler import QueueFull, RequestTooLarge
from hf2q.server.errors import APIError, bad_request
from hf2q.server.schemas import _Sampling

log = logging.getLogger(__name__)
_PARAM = re.compile(r"^([a-z_]+) ")

# The sampling a model file recommends, GGUF key -> SamplingParams field (llama.cpp's converter copies a
# checkpoint's generation_config.json into these keys).
RECOMMENDED_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                    "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                    "general.sampling.penalty_repeat": "repetition_penalty"}


def recommended_sampling(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The model file's recommended value of each sampling field it names, for requests that leave the field
    out (as vLLM applies a checkpoint's generation_config). A value the sampler refuses is skipped, logged."""
    out = {}
    for key, name in RECOMMENDED_KEYS.items():
        value = metadata.get(key)
        if value is None:
            continue
        if isinstance(value, float):  # stored as float32: 0.95, not 0.949999988
            value = float(str(np.float32(value)))
        try:
            SamplingParams(**{name: value})
        except (TypeError, ValueError) as exc:
            log.warning("ignoring the model file's %s = %r: %s", key, value, exc)
            continue
        out[name] = value
    return out


def build_params(req: _Sampling, vocab_size: int, max_tokens: Optional[int], logprobs: bool,
                 top_logprobs: int, defaults: Mapping[str, Any] = {}) -> SamplingParams:
    """Unset fields take `defaults` (the model's recommended sampling), else keep `SamplingParams` defaults;
    any out-of-range value is a 400 naming the field."""
    given = {
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty, "logit_bias": req.logit_bias, "seed": req.seed,
        "max_tokens": max_tokens, "stop": req.stop, "stop_token_ids": req.stop_token_ids,
    }
    for name, value in defaults.items():
        if given[name] is None:
            given[name] = value
    kwargs = {k: v for k, v in given.items() if v is not None}
    kwargs.update(min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs,
                  top_logprobs=top_logprobs, n=req.n)
    try:
        params = SamplingParams(**kwargs)
        params.check_vocab(vocab_size)
    except ValueError as exc:
        raise _param_error(exc) from None
    if req.n > 16:
        raise bad_request(f"n must be at most 16, got {req.n}", param="n")
    return params


def _param_error(exc: ValueError) -> APIError:
    m = _PARAM.match(str(exc))
    return bad_request(str(exc), param=m.group(1) if m else None)


def engine_error(exc: BaseException, prompt_param: str) -> APIError | None:
    """The API error for an engine refusal raised before the first token, or None if it is a bug."""
    if isinstance(exc, PromptTooLong):
        return bad_request(str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, RequestTooLarge):
        return bad_request(str(exc), param="max_tokens", code="context_length_exceeded")
    if isinstance(exc, QueueFull):
        return APIError(429, f"the server is busy: {exc}; retry shortly", code="queue_full",
                        headers={"Retry-After": "1"})
    if isinstance(exc, ValueError):
        error = _param_error(exc)
        if error.param == "prompt":  # the engine's word for the field that carried the tokens
            error.param = prompt_param
        return error
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc), code="server_shutting_down")
    return None
