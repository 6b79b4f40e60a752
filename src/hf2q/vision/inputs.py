"""One image of a request, as the server hands it to the engine.

The server decodes and preprocesses the image (`hf2q.vision.preprocess`, HF's Qwen2-VL image processor
semantics) and expands its `<|image_pad|>` placeholder to `num_tokens` pad tokens in the prompt; the engine
runs the vision tower on `pixel_values`, puts the embeddings at those pad positions and gives the text the
multimodal rotary positions. `content_hash` identifies the pixels: the prefix cache keys on it, so the same
image in a follow-up turn reuses its prefill and a different image never does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageInput:
    pixel_values: torch.Tensor  # [grid_t * grid_h * grid_w, channels * temporal_patch * patch * patch], fp32
    grid_thw: tuple[int, int, int]  # patches along time, height, width (before the 2x2 merge)
    content_hash: str  # hex sha256 of the preprocessed pixels and grid
    merge_size: int = 2

    @property
    def num_tokens(self) -> int:
        """Soft tokens the image occupies in the prompt (pad tokens), after the spatial merge."""
        t, h, w = self.grid_thw
        return t * h * w // (self.merge_size ** 2)
