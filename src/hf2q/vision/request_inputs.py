"""What the engine needs per request with images: prefix-cache keys, positions, and the rows of each step.

The tower runs once per request, at the first prefill chunk that holds image pad rows; its soft tokens replace
those rows' embeddings. Positions of the prompt are the multimodal ones; tokens after the prompt take
index + delta on every axis, so their decode steps rotate by one number per token, as the decode graphs
take it (`text_rope_position`), and address the cache by index.
"""
from __future__ import annotations

import hashlib

import torch

from hf2q.vision.inputs import ImageInput
from hf2q.vision.positions import multimodal_positions


def image_key_tokens(prompt_ids: list[int], pad_id: int, images: list[ImageInput]) -> list[int]:
    """The prompt with each image's pad rows replaced by one negative id from its content hash (never a
    token id), so the prefix cache matches the same image and never a different one."""
    keys, it = list(prompt_ids), iter(images)
    i = 0
    while i < len(keys):
        if keys[i] != pad_id:
            i += 1
            continue
        image = next(it)
        tag = -1 - int.from_bytes(hashlib.sha256(image.content_hash.encode()).digest()[:7], "big")
        keys[i:i + image.num_tokens] = [tag] * image.num_tokens
        i += image.num_tokens
    return keys


def attach_images(req, pad_id: int, images: list[ImageInput]) -> None:
    """Give a request its images, prefix-cache keys and multimodal positions (mismatched pads: ValueError)."""
    positions, delta = multimodal_positions(req.prompt_ids, pad_id, images)
    req.images = list(images)
    req.key_tokens = image_key_tokens(req.prompt_ids, pad_id, images)
    req.mrope = (positions, delta)


def rows_positions(req, start: int, n: int) -> torch.Tensor:
    """[3, n] positions of tokens [start, start + n) of a request."""
    if req.mrope is None:
        return torch.arange(start, start + n).expand(3, -1)
    positions, delta = req.mrope
    prompt = len(req.prompt_ids)
    head = positions[:, start:min(start + n, prompt)]
    tail = torch.arange(max(start, prompt), max(start + n, prompt)) + delta
    return torch.cat([head, tail.expand(3, -1)], dim=1)


def text_rope_position(req, p: int) -> int | None:
    """The one rotary position of token p when every axis holds the same (text; after the prompt index +
    delta), else None (an image row)."""
    if req.mrope is None:
        return p
    positions, delta = req.mrope
    if p >= len(req.prompt_ids):
        return p + delta
    t, h, w = (int(v) for v in positions[:, p])
    return t if t == h == w else None


def rows_embeddings(tower, req, start: int, n: int, embeds: torch.Tensor) -> None:
    """Overwrite `embeds` (the rows of tokens [start, start + n)) at image pad rows with the soft tokens."""
    key = req.key_tokens
    if key is None or all(k >= 0 for k in key[start:min(start + n, len(key))]):
        return
    soft = req.extras.get("soft_tokens")
    if soft is None:
        soft = tower(req.images).to(embeds.dtype)
        req.extras["soft_tokens"] = soft
    is_image = torch.tensor([k < 0 for k in key], device=embeds.device)
    rank = torch.cumsum(is_image, 0) - 1  # soft token row of each pad row
    rows = torch.arange(start, min(start + n, len(key)), device=embeds.device)
    mask = is_image[rows]
    embeds[:len(rows)][mask] = soft[rank[rows][mask]]
