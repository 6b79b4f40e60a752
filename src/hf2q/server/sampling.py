"""Request fields -> `SamplingParams`, and the engine's refusals -> OpenAI errors."""
from __future__ import annotations

import re
from typing import Optional

from hf2q.engine.async_engine import ShuttingDown
from hf2q.engine.engine import PromptTooLong
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.scheduler import QueueFull, RequestTooLarge
from hf2q.server.errors import APIError, bad_request
from hf2q.server.schemas import _Sampling

_PARAM = re.compile(r"^([a-z_]+) ")


def build_params(req: _Sampling, vocab_size: int, max_tokens: Optional[int], logprobs: bool,
                 top_logprobs: int) -> SamplingParams:
    """Unset fields keep `SamplingParams` defaults; any out-of-range value is a 400 naming the field."""
    given = {
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty, "logit_bias": req.logit_bias, "seed": req.seed,
        "max_tokens": max_tokens, "stop": req.stop, "stop_token_ids": req.stop_token_ids,
    }
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
