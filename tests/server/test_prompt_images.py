"""Image parts of a chat: which parts carry images, and the pad tokens widened to each image's soft tokens."""
import pytest
import torch

from hf2q.server.errors import APIError
from hf2q.server.prompt_images import NO_VISION, check_fits, expand_image_pads, image_urls, widen
from hf2q.server.schemas import Message
from hf2q.vision.inputs import ImageInput

PAD = 7


def image(grid_h: int, grid_w: int, tag: str) -> ImageInput:
    return ImageInput(pixel_values=torch.zeros(grid_h * grid_w, 8), grid_thw=(1, grid_h, grid_w), content_hash=tag)


def user(*parts) -> Message:
    return Message.model_validate({"role": "user", "content": list(parts)})


def image_part(**spec) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", **spec}}


def refused(call) -> APIError:
    with pytest.raises(APIError) as info:
        call()
    assert info.value.status == 400
    return info.value


def test_each_pad_widens_to_its_images_tokens():
    a, b = image(4, 6, "a"), image(2, 2, "b")  # 6 and 1 soft tokens after the 2x2 merge
    ids = [1, 2, PAD, 3, PAD, 4]
    assert expand_image_pads(ids, PAD, [a, b]) == [1, 2] + [PAD] * 6 + [3, PAD, 4]
    assert widen([1, 2, PAD, 3], PAD, [a, b]) == [1, 2] + [PAD] * 6 + [3]  # a prefix holding the first image


def test_pad_count_must_match_the_images():
    error = refused(lambda: expand_image_pads([1, PAD, PAD], PAD, [image(2, 2, "a")]))
    assert "2 image placeholders for 1 images" in error.message


def test_images_that_do_not_fit_the_context_are_named():
    check_fits(99, [image(20, 20, "a")], 100)
    error = refused(lambda: check_fits(100, [image(20, 20, "a")], 100))
    assert "100 of them for its 1 image(s)" in error.message and error.code == "context_length_exceeded"


def test_image_urls_in_prompt_order_with_their_params():
    messages = [Message(role="system", content="s"), user({"type": "text", "text": "x"}, image_part()),
                user(image_part(detail="auto"), {"type": "image_url", "image_url": "data:image/png;base64,BBBB"})]
    assert image_urls(messages, vision=True) == [
        ("data:image/png;base64,AAAA", "messages[1].content[1]"),
        ("data:image/png;base64,AAAA", "messages[2].content[0]"),
        ("data:image/png;base64,BBBB", "messages[2].content[1]")]


@pytest.mark.parametrize("message,vision,text,param", [
    (user(image_part()), False, NO_VISION, "messages[0].content[0]"),
    (user(image_part(detail="high")), True, "native resolution", "messages[0].content[0].image_url.detail"),
    (user(image_part(frob=1)), True, "unsupported field 'frob'", "messages[0].content[0].image_url.frob"),
    (user({"type": "image_url", "image_url": {"href": "x"}}), True, '{"url": "..."}',
     "messages[0].content[0].image_url"),
    (Message.model_validate({"role": "assistant", "content": [image_part()]}), True, "user messages only",
     "messages[0].content[0]"),
], ids=["no-vision", "detail-high", "unknown-field", "no-url", "assistant-image"])
def test_refused_image_parts(message, vision, text, param):
    error = refused(lambda: image_urls([message], vision))
    assert text in error.message and error.param == param
