"""Images in a chat prompt: the parts that carry them, and the pad tokens that stand for them.

The chat template writes `<|vision_start|><|image_pad|><|vision_end|>` for each image part, in message order;
the tower turns an image into `ImageInput.num_tokens` embeddings, so each single `<|image_pad|>` token is
widened to that many pad tokens, whose positions the engine fills with the image's embeddings.
"""
from __future__ import annotations

from typing import Any

from hf2q.server.errors import bad_request
from hf2q.vision.inputs import ImageInput
from hf2q.vision.prompt import IMAGE_PAD

NO_VISION = ("this model has no vision projector, so it cannot read images: start the server with --mmproj "
             "(or put the mmproj GGUF beside the model)")
_DETAILS = (None, "auto")  # the tower always sees the image at its native resolution within the pixel budget


def image_url_of(part: Any, param: str) -> str:
    """The URL of an `image_url` content part ({"type": "image_url", "image_url": {"url": ..., "detail": ...}})."""
    spec = (part.model_extra or {}).get("image_url")
    if isinstance(spec, str):  # some clients send the URL itself
        return spec
    if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
        raise bad_request('an image_url part needs "image_url": {"url": "..."}', param=f"{param}.image_url")
    unknown = sorted(set(spec) - {"url", "detail"})
    if unknown:
        raise bad_request(f"unsupported field {unknown[0]!r} in image_url", param=f"{param}.image_url.{unknown[0]}")
    if spec.get("detail") not in _DETAILS:
        raise bad_request(f"image_url.detail {spec['detail']!r} is not supported: images are always processed at "
                          f"the model's native resolution (use \"auto\")", param=f"{param}.image_url.detail")
    return spec["url"]


def image_urls(messages: list, vision: bool) -> list[tuple[str, str]]:
    """(url, param) of every image part, in prompt order; a 400 when the model has no vision tower."""
    found = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.type != "image_url":
                continue
            param = f"messages[{i}].content[{j}]"
            if not vision:
                raise bad_request(NO_VISION, param=param)
            if message.role != "user":
                raise bad_request(f"images are accepted in user messages only, not in a {message.role} message",
                                  param=param)
            found.append((image_url_of(part, param), param))
    return found


def expand_image_pads(ids: list[int], pad_id: int, images: list[ImageInput]) -> list[int]:
    """`ids` with its k-th pad token widened to images[k].num_tokens pad tokens; the pads must be the images'."""
    count = ids.count(pad_id)
    if count != len(images):
        raise bad_request(f"the prompt holds {count} image placeholders for {len(images)} images: the text must "
                          f"not contain {IMAGE_PAD}", param="messages")
    return widen(ids, pad_id, images)


def widen(ids: list[int], pad_id: int, images: list[ImageInput]) -> list[int]:
    """Widen the pads present in `ids` (a prefix of the prompt may hold fewer than all images)."""
    out: list[int] = []
    k = 0
    for token in ids:
        if token == pad_id and k < len(images):
            out.extend([pad_id] * images[k].num_tokens)
            k += 1
        else:
            out.append(token)
    return out


def check_fits(prompt_len: int, images: list[ImageInput], max_model_len: int) -> None:
    """A prompt whose images do not fit the context is a 400 that says how many tokens the images take."""
    if not images or prompt_len < max_model_len:
        return
    image_tokens = sum(image.num_tokens for image in images)
    raise bad_request(f"the prompt is {prompt_len} tokens, {image_tokens} of them for its {len(images)} image(s), "
                      f"which does not fit this server's context of {max_model_len} tokens: send smaller or fewer "
                      f"images", param="messages", code="context_length_exceeded")
