"""Serve options that need no model: CORS (`--allowed-origins`), the port's range, the API key's reach and the
request-size cap."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from hf2q.server.app import build_app
from hf2q.server.launch import add_serve_args
from hf2q.server.state import ServerConfig, ServerState

PREFLIGHT = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def app_client(**config) -> TestClient:
    state = ServerState(model=None, engine=SimpleNamespace(), config=ServerConfig("tiny", **config))
    return TestClient(build_app(state), raise_server_exceptions=False)  # no engine here: a route past auth fails


def test_cors_off_by_default():
    client = app_client()
    r = client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 405
    assert not [h for h in r.headers if h.startswith("access-control-")]
    assert "access-control-allow-origin" not in client.get("/health", headers={"Origin": PREFLIGHT["Origin"]}).headers


@pytest.mark.parametrize("origins,allowed", [(("*",), "*"), (("http://localhost:3000",), "http://localhost:3000")])
def test_cors_preflight_and_response(origins, allowed):
    client = app_client(allowed_origins=origins)
    r = client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == allowed
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert client.get("/health", headers={"Origin": PREFLIGHT["Origin"]}).headers[
        "access-control-allow-origin"] == allowed


def test_preflight_needs_no_key_and_tokenize_does():
    """Browsers send no Authorization header on the preflight; the calls themselves need the key."""
    client = app_client(allowed_origins=("*",), api_key="k")
    assert client.options("/v1/chat/completions", headers=PREFLIGHT).status_code == 200
    r = client.post("/tokenize", json={"prompt": "hi"}, headers={"Origin": PREFLIGHT["Origin"]})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
    assert client.post("/detokenize", json={"tokens": [1]}).status_code == 401


def test_cors_other_origin_refused():
    client = app_client(allowed_origins=("https://app.example",))
    r = client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(list(argv))


def test_flags():
    assert parse().allowed_origins == ()
    assert parse("--allowed-origins", "https://a.example, http://localhost:3000").allowed_origins == (
        "https://a.example", "http://localhost:3000")
    assert parse("--port", "65535").port == 65535


@pytest.mark.parametrize("port", ["0", "65536", "99999", "-1", "http"])
def test_port_out_of_range(port, capsys):
    with pytest.raises(SystemExit) as exit:
        parse("--port", port)
    assert exit.value.code == 2 and "--port" in capsys.readouterr().err


def test_api_key_on_every_route_but_health():
    client = app_client(api_key="k")
    routes = [(r.path.replace("{name:path}", "x"), m) for r in client.app.routes for m in getattr(r, "methods", ())
              if m != "HEAD"]
    assert ("/metrics", "GET") in routes and ("/openapi.json", "GET") in routes
    for path, method in routes:
        r = client.request(method, path, json={} if method == "POST" else None)
        assert r.status_code == (200 if path == "/health" else 401), (method, path)
    assert client.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()["paths"]


def test_metrics_public_and_openapi_without_a_key():
    """--metrics-public opens /metrics only; with no key set at all, the document is public too."""
    client = app_client(api_key="k", metrics_public=True)
    assert client.get("/metrics").status_code != 401
    assert client.get("/openapi.json").status_code == 401
    assert app_client().get("/openapi.json").status_code == 200
    assert parse().max_request_bytes == 8 * 2**20 and parse("--metrics-public").metrics_public


def test_request_body_cap():
    client = app_client(max_request_bytes=1000)
    r = client.post("/v1/completions", content=b"x" * 1001, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    chunked = client.post("/v1/completions", content=iter([b"{" * 600, b" " * 600]))  # no Content-Length
    assert chunked.status_code == 413
    assert client.post("/detokenize", json={"tokens": "x"}).status_code == 400  # under the cap: parsed as usual


def test_loopback_by_default():
    assert parse().host == "127.0.0.1"
