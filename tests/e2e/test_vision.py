"""Images end to end: the real `openai` client against `hf2q serve` with the tiny image-text fixture and its
mmproj; one server for the whole module."""
from __future__ import annotations

import base64
import io

import numpy as np
import openai
import PIL.Image
import pytest

from tests.e2e.conftest import Server
from tests.support.fixtures import our_vl_ggufs

MODEL = "tiny-vl"


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def png_url(seed: int, width: int = 96, height: int = 64) -> str:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    PIL.Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return data_url(buffer.getvalue())


def image(seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": png_url(seed)}}


@pytest.fixture(scope="module")
def vision_client(tmp_path_factory):
    text, mmproj = our_vl_ggufs("dense")
    server = Server(text, ["--mmproj", str(mmproj), "--max-model-len", "2048", "--max-num-seqs", "2",
                           "--served-model-name", MODEL], tmp_path_factory.mktemp("vision") / "server.log")
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    server.stop()


def chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, **kw)


def test_two_images_streaming_and_not(vision_client):
    text_only = chat(vision_client, [{"role": "user", "content": [{"type": "text", "text": "Compare."}]}])
    one = chat(vision_client, [{"role": "user", "content": [image(1), {"type": "text", "text": "Compare."}]}])
    messages = [{"role": "user", "content": [image(1), image(2), {"type": "text", "text": "Compare."}]}]
    two = chat(vision_client, messages)
    per_image = one.usage.prompt_tokens - text_only.usage.prompt_tokens  # pads + vision_start/end
    assert per_image > 3 and two.usage.prompt_tokens == text_only.usage.prompt_tokens + 2 * per_image
    stream = chat(vision_client, messages, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == two.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == two.usage.prompt_tokens


def test_follow_up_reuses_the_image_prefill_and_a_different_image_does_not(vision_client):
    question = {"type": "text", "text": "What is in this picture? " * 4}
    first_turn = [{"role": "user", "content": [question, image(3)]}]
    first = chat(vision_client, first_turn)
    image_end = first.usage.prompt_tokens - 5  # the image closes a few tokens before the prompt ends
    follow_up = first_turn + [{"role": "assistant", "content": first.choices[0].message.content},
                              {"role": "user", "content": "And its colours?"}]
    second = chat(vision_client, follow_up)
    assert second.usage.prompt_tokens_details.cached_tokens >= image_end, second.usage
    other = [{"role": "user", "content": [question, image(4)]}] + follow_up[1:]
    third = chat(vision_client, other)
    text_before_image = chat(vision_client, [{"role": "user", "content": [question]}]).usage.prompt_tokens
    assert third.usage.prompt_tokens_details.cached_tokens < text_before_image, third.usage


def test_responses_input_image_is_the_chat_image(vision_client):
    content = [{"type": "input_text", "text": "Compare."}, {"type": "input_image", "image_url": png_url(1)}]
    response = vision_client.responses.create(model=MODEL, input=[{"role": "user", "content": content}],
                                              max_output_tokens=8, temperature=0)
    as_chat = chat(vision_client, [{"role": "user", "content": [{"type": "text", "text": "Compare."}, image(1)]}])
    assert response.usage.input_tokens == as_chat.usage.prompt_tokens


def test_bad_images_are_a_400_and_the_server_keeps_serving(vision_client):
    truncated = base64.b64decode(png_url(1).split(",", 1)[1])[:120]
    corrupt = {"type": "image_url", "image_url": {"url": data_url(truncated)}}
    with pytest.raises(openai.BadRequestError) as err:
        chat(vision_client, [{"role": "user", "content": [image(1), corrupt]}])
    assert err.value.body["param"] == "messages[0].content[1]" and "corrupt" in err.value.body["message"]
    buffer = io.BytesIO()
    PIL.Image.new("RGB", (2048, 2048), (200, 30, 30)).save(buffer, format="PNG")
    big = {"type": "image_url", "image_url": {"url": data_url(buffer.getvalue())}}
    with pytest.raises(openai.BadRequestError) as err:  # 4096 soft tokens: more than the 2048-token context
        chat(vision_client, [{"role": "user", "content": [big]}])
    assert "does not fit" in err.value.body["message"]
    assert chat(vision_client, [{"role": "user", "content": [image(1)]}]).choices[0].finish_reason == "length"
