"""Security through a real server: the API key's reach and its absence from the log, a hostile chat template
answered per request with a clean error, the request-size cap, and request fields that are never paths."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

KEY = "sk-secret-4d1b9c"
HI = [{"role": "user", "content": "hi"}]
HOSTILE = """{%- if attack == 'mro' %}{{ ''.__class__.__mro__[1].__subclasses__() }}
{%- elif attack == 'repeat' %}{{ 'x' * 10**10 }}
{%- elif attack == 'range' %}{{ range(10**10)|list }}
{%- elif attack == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}
{%- endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def guarded(server_factory, tmp_path_factory):
    """A keyed server with a trapped --chat-template, logging at info (access lines included)."""
    path = tmp_path_factory.mktemp("template") / "hostile.jinja"
    path.write_text(HOSTILE)
    return server_factory("--api-key", KEY, "--chat-template", str(path), "--served-model-name", "guarded",
                          "--max-model-len", "512", "--max-num-seqs", "2", "--log-level", "info")


def get(server, path, key=None):
    return httpx.get(server.url + path, timeout=30, headers={"Authorization": f"Bearer {key}"} if key else {})


def chat(server, key=KEY, **body):
    return httpx.post(server.url + "/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {key}"},
                      json={"messages": HI, "max_tokens": 2, **body})


def test_key_guards_metrics_and_the_document(guarded):
    for path in ("/metrics", "/openapi.json", "/v1/models", "/tokenizer_info"):
        assert get(guarded, path).status_code == 401, path
        assert get(guarded, path, key=KEY).status_code == 200, path
    assert get(guarded, "/health").status_code == 200


@pytest.mark.parametrize("attack", ["mro", "repeat", "range", "loop"])
def test_hostile_template_is_a_clean_error_per_request(guarded, attack):
    done = {}
    worker = threading.Thread(target=lambda: done.setdefault("r", chat(guarded, chat_template_kwargs={"attack": attack})))
    worker.start()
    while worker.is_alive():  # the render runs off the event loop: the server answers meanwhile
        t0 = time.monotonic()
        assert get(guarded, "/health").status_code == 200 and time.monotonic() - t0 < 1
        worker.join(0.2)
    r = done["r"]
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and "chat template" in r.json()["error"]["message"]
    assert "<class" not in r.text
    assert chat(guarded).status_code == 200  # and the next request is served as usual


def test_api_key_never_logged(guarded):
    for key in (None, "wrong", KEY + "x"):
        assert get(guarded, "/v1/models", key=key).status_code == 401
    assert chat(guarded).status_code == 200
    assert chat(guarded, key="sk-other").status_code == 401
    log = guarded.log_path.read_text(errors="replace")
    assert "/v1/models" in log  # the access log is on, so the check below means something
    assert KEY not in log and "sk-other" not in log


def test_request_labels_logged_with_the_request_id(guarded):
    """`user`, `safety_identifier`, `prompt_cache_key` and `metadata` only label a request: they go to the log
    beside the id the client got back (README.md's request-field table)."""
    labels = {"user": "user-7", "safety_identifier": "hash-7", "prompt_cache_key": "conv-7", "metadata": {"team": "qa"}}
    for path, body in (("/v1/chat/completions", {"messages": HI, **labels}),
                       ("/v1/completions", {"prompt": "hi", "user": "user-8"})):
        r = httpx.post(guarded.url + path, timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                       json={**body, "max_tokens": 1})
        assert r.status_code == 200, r.text
        line = next((x for x in guarded.log_path.read_text().splitlines() if r.json()["id"] in x), "")
        assert all(f"{k}={body[k]!r}" in line for k in labels if k in body), line


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "..%2F..%2Fetc%2Fpasswd", "~/.ssh/id_rsa"])
def test_model_name_is_not_a_path(plain_server, name):
    r = httpx.post(plain_server.url + "/v1/chat/completions", json={"model": name, "messages": HI}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.get(plain_server.url + "/v1/models/" + name, timeout=30)
    assert r.status_code == 404 and "root:" not in r.text


def test_20_mb_body_refused_fast_health_meanwhile(plain_server):
    host, port = "127.0.0.1", plain_server.port
    with socket.create_connection((host, port), timeout=10) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 20000000\r\n\r\n" + b"{" * 65536)
        assert get(plain_server, "/health").status_code == 200  # the upload in progress blocks nothing
        head = sock.recv(65536).decode(errors="replace")
        assert time.monotonic() - t0 < 1
    assert head.startswith("HTTP/1.1 413") and "request_too_large" in head, head
    t0 = time.monotonic()
    r = httpx.post(plain_server.url + "/v1/completions", content=b" " * 20_000_000, timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert time.monotonic() - t0 < 1
    assert plain_server.healthy()


def test_long_prompt_tokenizes_off_the_event_loop(plain_server):
    done = {}
    prompt = "the quick brown fox jumps over it. " * 40_000  # 1.4 MB: a second or more of tokenization
    worker = threading.Thread(target=lambda: done.setdefault("r", httpx.post(
        plain_server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)))
    worker.start()
    slowest = 0.0
    while worker.is_alive():
        t0 = time.monotonic()
        assert get(plain_server, "/health").status_code == 200
        slowest = max(slowest, time.monotonic() - t0)
        worker.join(0.1)
    assert done["r"].status_code == 400 and done["r"].json()["error"]["code"] == "context_length_exceeded"
    assert slowest < 0.5, slowest
