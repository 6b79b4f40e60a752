"""POST /tokenize, /detokenize and GET /tokenizer_info (vLLM's shape) through a real server: the ids chat requests
are built from, and what a client needs to tokenize through them (lm-evaluation-harness does)."""
from __future__ import annotations

import httpx

from tests.e2e.conftest import PLAIN_FLAGS

MAX_MODEL_LEN = int(PLAIN_FLAGS[PLAIN_FLAGS.index("--max-model-len") + 1])
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_prompt_round_trip(plain_server):
    r = post(plain_server, "/tokenize", {"prompt": "Hello, world!", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == MAX_MODEL_LEN
    assert len(body["token_strs"]) == body["count"] and "".join(body["token_strs"]).startswith("Hello")
    assert post(plain_server, "/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": "Hello, world!"}


def test_messages_as_chat_renders_them(plain_server, client):
    """The count is the chat request's prompt_tokens; `developer` renders as `system`."""
    ids = post(plain_server, "/tokenize", {"messages": MSGS}).json()["tokens"]
    chat = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=1)
    assert chat.usage.prompt_tokens == len(ids)
    developer = [{"role": "developer", "content": "Be brief."}, MSGS[1]]
    assert post(plain_server, "/tokenize", {"messages": developer}).json()["tokens"] == ids
    bare = post(plain_server, "/tokenize", {"messages": MSGS, "add_generation_prompt": False}).json()["tokens"]
    assert len(bare) < len(ids) and ids[:len(bare)] == bare


def test_refusal_is_what_the_assistant_said(plain_server):
    refused = {"role": "assistant", "content": None, "refusal": "I cannot help with that.", "annotations": []}
    ids = post(plain_server, "/tokenize", {"messages": [MSGS[1], refused, MSGS[1]]}).json()["tokens"]
    assert "I cannot help with that." in post(plain_server, "/detokenize", {"tokens": ids}).json()["prompt"]


def test_bad_requests(plain_server):
    for path, body, param in [("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens[0]"),
                              ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
                              ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "x", "messages": MSGS}, "prompt"),
                              ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens")]:
        r = post(plain_server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_tokenizer_info_is_the_gguf_tokenizer(plain_server, served_model_path):
    from hf2q.checkpoint.gguf_file import GGUFFile

    meta = GGUFFile(served_model_path).metadata
    info = httpx.get(plain_server.url + "/tokenizer_info", timeout=60).json()
    tokens = meta["tokenizer.ggml.tokens"]
    assert info["eos_token"] == tokens[meta["tokenizer.ggml.eos_token_id"]]
    assert info["chat_template"] == meta["tokenizer.chat_template"] and info["model_max_length"] == MAX_MODEL_LEN
    assert info["add_bos_token"] is bool(meta.get("tokenizer.ggml.add_bos_token", False)) is False
    # what lm-evaluation-harness sends: the special-token text is one id, and this model adds no BOS
    eos = post(plain_server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert eos["tokens"] == [meta["tokenizer.ggml.eos_token_id"]]
    added = post(plain_server, "/tokenize", {"prompt": "Hi", "add_special_tokens": True}).json()["tokens"]
    assert added == post(plain_server, "/tokenize", {"prompt": "Hi"}).json()["tokens"]
