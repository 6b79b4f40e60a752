"""Schema-driven fuzzing of a running `hf2q serve`, from the server's own /openapi.json.

schemathesis turns each operation of the document into hypothesis strategies: valid requests ("positive")
and requests that break the schema ("negative"). Every answer must be below 500, every error must be an
OpenAI error envelope, and no stream may carry an internal error. Generation is kept a few tokens long so
a CPU demo model answers thousands of requests in minutes.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

MAX_GEN_TOKENS = 4
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)


@dataclass
class FuzzStats:
    statuses: Counter = field(default_factory=Counter)  # (operation, status) -> answers
    failures: list = field(default_factory=list)  # (operation, status, problem, request body, answer)
    seconds: float = 0.0
    log: list | None = None  # (operation, mode, status, body, answer) of every request, when a list

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    def by_status(self) -> dict[int, int]:
        out: Counter = Counter()
        for (_, status), n in self.statuses.items():
            out[status] += n
        return dict(sorted(out.items()))


def bound_generation(body, model: str, path: str = ""):
    """Lower valid token limits above MAX_GEN_TOKENS (and set absent ones): the CPU demo model would
    otherwise write up to the whole context. Invalid limits are left for the server to refuse. Most
    model names become the served one, or nearly every valid request would be a 404."""
    if not isinstance(body, dict):
        return body
    if isinstance(body.get("model"), str) and len(body["model"]) % 4:
        body["model"] = model
    if path == "/v1/responses":  # its token limit is max_output_tokens
        value = body.get("max_output_tokens")
        if value is None:
            body["max_output_tokens"] = MAX_GEN_TOKENS
        elif type(value) is int and MAX_GEN_TOKENS < value <= 512:
            body["max_output_tokens"] = 1 + value % MAX_GEN_TOKENS
        return body
    if "input" in body:  # an embeddings request: it generates nothing and has no token limit
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if type(value) is int and MAX_GEN_TOKENS < value <= 512:
            body[key] = 1 + value % MAX_GEN_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_GEN_TOKENS
    return body


def error_problem(status: int, text: str) -> str | None:
    """Why an answer breaks the contract, or None when it keeps it."""
    if status >= 500:
        return "server error"
    if status < 400:
        return _stream_problem(text)
    try:
        body = json.loads(text)
    except ValueError:
        return "error body is not JSON"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return "error body is not an OpenAI error envelope"
    if not isinstance(err["message"], str) or not isinstance(err["type"], str) or not err["message"]:
        return "error message or type is not a non-empty string"
    if not all(v is None or isinstance(v, str) for v in (err["param"], err["code"])):
        return "error param or code is neither a string nor null"
    return None


def _stream_problem(text: str) -> str | None:
    for line in text.splitlines():
        if line.startswith("data: {") and '"error"' in line:
            data = json.loads(line[6:])
            if data.get("type") == "error":  # /v1/responses' error event: the error's fields inline
                if data.get("code") in ("internal_error", "generation_error"):
                    return f"stream carried a server error: {data.get('message')}"
                continue
            err = data.get("error")
            if isinstance(err, dict) and err.get("type") == "server_error":
                return f"stream carried a server error: {err.get('message')}"
    return None


def fuzz(url: str, examples: int, seed: int = 0, stats: FuzzStats | None = None) -> FuzzStats:
    """Up to `examples` requests per operation and mode against the server at `url`."""
    stats = stats or FuzzStats()
    doc = httpx.get(url + "/openapi.json", timeout=30).raise_for_status().json()
    schema = schemathesis.openapi.from_dict(doc)
    start = time.monotonic()
    with httpx.Client(base_url=url, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for result in schema.get_all_operations():
            op = result.ok()
            for mode in MODES:
                _fuzz_operation(client, op, mode, examples, seed, stats, model)
    stats.seconds += time.monotonic() - start
    return stats


def _fuzz_operation(client: httpx.Client, op, mode: GenerationMode, examples: int, seed: int,
                    stats: FuzzStats, model: str) -> None:
    label = f"{op.method.upper()} {op.path}"
    strategy = op.as_strategy(generation_mode=mode)

    @hypothesis_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(case=strategy)
    def run(case) -> None:
        kwargs = case.as_transport_kwargs(base_url=str(client.base_url))
        body = bound_generation(kwargs.pop("json", None), model, op.path)
        headers = dict(kwargs.get("headers") or {})
        if body is not None:
            content, headers["content-type"] = json.dumps(body).encode(), "application/json"
        else:
            content = kwargs.get("data")
        resp = client.request(kwargs["method"], kwargs["url"], params=kwargs.get("params"), headers=headers,
                              content=content)
        stats.statuses[(label, resp.status_code)] += 1
        if stats.log is not None:
            stats.log.append((label, mode.value, resp.status_code, body, resp.text[:300]))
        problem = error_problem(resp.status_code, resp.text)
        if problem and len(stats.failures) < 50:
            stats.failures.append((label, resp.status_code, problem, body if body is not None else content,
                                   resp.text[:500]))

    try:
        run()
    except Unsatisfiable:  # negative mode on an operation with nothing to break (no body, no parameters)
        pass
