"""Multimodal rotary positions (Qwen3.5's interleaved M-RoPE) for a prompt with images.

Text tokens take the same position on all three axes (time, height, width), counting on. The soft tokens of
an image take (start, start + row, start + column) over its merged grid; the text after it continues from
the largest position the image used, plus one. Decoding continues from the prompt's largest position: a token
at sequence index i has position i + delta on every axis.
"""
from __future__ import annotations

import torch

from hf2q.vision.inputs import ImageInput


def multimodal_positions(token_ids: list[int], image_token_id: int,
                         images: list[ImageInput]) -> tuple[torch.Tensor, int]:
    """([3, len(token_ids)] long positions, delta for later tokens): each run of image pads is one image's."""
    rows: list[torch.Tensor] = []
    pending = iter(images)
    i, start, n = 0, 0, len(token_ids)
    while i < n:
        if token_ids[i] != image_token_id:
            j = i
            while j < n and token_ids[j] != image_token_id:
                j += 1
            rows.append(torch.arange(start, start + j - i).expand(3, -1))
            start += j - i
            i = j
            continue
        image = next(pending, None)
        if image is None:
            raise ValueError("the prompt has more image placeholders than images")
        t, h, w = image.grid_thw
        m = image.merge_size
        gh, gw = h // m, w // m
        if token_ids[i:i + image.num_tokens] != [image_token_id] * image.num_tokens:
            raise ValueError(f"an image needs {image.num_tokens} consecutive image pad tokens in the prompt")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        rows.append(torch.stack([tt, hh, ww]).reshape(3, -1) + start)
        start += max(gh, gw)
        i += image.num_tokens
    if next(pending, None) is not None:
        raise ValueError("the prompt has fewer image placeholders than images")
    positions = torch.cat(rows, dim=1) if rows else torch.zeros(3, 0, dtype=torch.long)
    delta = int(positions.max()) + 1 - n if n else 0
    return positions, delta
