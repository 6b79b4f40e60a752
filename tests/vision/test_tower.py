"""The vision tower from llama.cpp's mmproj file equals HF's `Qwen3_5VisionModel` (fp32 CPU, <= 1e-5 relative)."""
from __future__ import annotations

import hashlib

import pytest
import torch

from hf2q.checkpoint.mmproj import load_mmproj
from hf2q.vision.inputs import ImageInput
from hf2q.vision.tower import VisionTower
from tests.support.fixtures import hf_vl_checkpoint, our_vl_ggufs


def random_image(grid_thw: tuple[int, int, int], seed: int) -> ImageInput:
    """Preprocessed-looking pixels (normalised range) for a patch grid; 3 channels x 2 frames x 16 x 16 each."""
    t, h, w = grid_thw
    pixels = torch.randn(t * h * w, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(seed))
    digest = hashlib.sha256(pixels.numpy().tobytes() + repr(grid_thw).encode()).hexdigest()
    return ImageInput(pixels, grid_thw, digest)


@pytest.fixture(scope="module")
def hf_visual_dense():
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(hf_vl_checkpoint("dense"), dtype=torch.float32).eval()
    return model.model.visual


@pytest.mark.parametrize("outtype", ["f32"])
def test_tower_equals_hf(hf_visual_dense, outtype):
    tower = VisionTower.from_mmproj(load_mmproj(our_vl_ggufs("dense", outtype)[1]))
    images = [random_image((1, 4, 6), 1), random_image((1, 10, 8), 2), random_image((1, 2, 2), 3)]
    ours = tower(images)
    with torch.no_grad():
        ref = hf_visual_dense(torch.cat([im.pixel_values for im in images]),
                              torch.tensor([im.grid_thw for im in images])).pooler_output
    assert ours.shape == (sum(im.num_tokens for im in images), 128)
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert rel <= 1e-5, rel
    alone = tower(images[1:2])  # an image's tokens do not depend on the other images of the request
    torch.testing.assert_close(alone, ours[images[0].num_tokens:images[0].num_tokens + images[1].num_tokens],
                               rtol=1e-5, atol=1e-6)
