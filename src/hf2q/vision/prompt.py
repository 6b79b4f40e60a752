"""A prompt with images as the text model takes it: input embeddings with the images' soft tokens at their
`<|image_pad|>` rows, and the multimodal rotary positions."""
from __future__ import annotations

import torch

from hf2q.vision.inputs import ImageInput
from hf2q.vision.positions import multimodal_positions

IMAGE_PAD = "<|image_pad|>"


def image_pad_id(tokenizer) -> int:
    pad = tokenizer.token_to_id(IMAGE_PAD)
    if pad is None:
        raise ValueError(f"the model's vocabulary has no {IMAGE_PAD} token")
    return pad


def prompt_inputs(model, token_ids: list[int], images: list[ImageInput]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input embeddings [T, hidden], positions [3, T], position delta for the tokens after the prompt)."""
    if model.vision is None:
        raise ValueError("this model was loaded without a vision projector (mmproj)")
    pad = image_pad_id(model.tokenizer)
    positions, delta = multimodal_positions(token_ids, pad, images)
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=model.device)
    embeds = model.net.embed_tokens(ids)
    if images:
        soft = model.vision(images).to(embeds.dtype)
        embeds = embeds.clone()
        embeds[ids == pad] = soft
    return embeds, positions.to(model.device), delta
