"""Text logits and greedy tokens with an image in the prompt equal HF's `Qwen3_5ForConditionalGeneration`."""
from __future__ import annotations

import pytest
import torch

import hf2q
from tests.support.fixtures import hf_vl_checkpoint, our_vl_ggufs
from tests.vision.test_positions import _prompt
from tests.vision.test_tower import random_image

IMAGE_TOKEN = 248056


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request):
    from transformers import AutoModelForImageTextToText

    text, mmproj = our_vl_ggufs(request.param)
    ours = hf2q.load(text, mmproj=mmproj)
    hf = AutoModelForImageTextToText.from_pretrained(hf_vl_checkpoint(request.param), dtype=torch.float32).eval()
    return ours, hf


def _hf_inputs(ids, images):
    return dict(input_ids=torch.tensor([ids]), pixel_values=torch.cat([im.pixel_values for im in images]),
                image_grid_thw=torch.tensor([im.grid_thw for im in images]),
                mm_token_type_ids=torch.tensor([[int(t == IMAGE_TOKEN) for t in ids]]))


def test_logits_with_images_equal_hf(pair):
    ours, hf = pair
    images = [random_image((1, 4, 6), 1), random_image((1, 6, 4), 2)]
    ids = _prompt(images, [5, 3, 4])
    got = ours.image_logits(ids, images)
    with torch.no_grad():
        ref = hf(**_hf_inputs(ids, images)).logits[0]
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel <= 1e-5, rel
    text_only = ours.logits(ids)  # the images matter: the same ids as plain text give other logits
    assert ((text_only - ref).norm() / ref.norm()).item() > 1e-3


def test_greedy_tokens_with_an_image_equal_hf(pair):
    """32 tokens: each step recomputes the whole sequence, positions after the prompt continue from delta."""
    from hf2q.forward import ForwardBatch
    from hf2q.vision.prompt import prompt_inputs

    ours, hf = pair
    images = [random_image((1, 6, 6), 3)]
    ids = _prompt(images, [4, 3])
    with torch.no_grad():
        ref = hf.generate(**_hf_inputs(ids, images), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    embeds, positions, delta = prompt_inputs(ours, ids, images)
    out = []
    with torch.inference_mode():
        for _ in range(32):
            batch = ForwardBatch.single(ids + out)
            n = len(out)
            tail = torch.arange(len(ids), len(ids) + n) + delta
            batch.positions = torch.cat([positions, tail.expand(3, -1)], dim=1)
            x = torch.cat([embeds, ours.net.embed_tokens(torch.tensor(out, dtype=torch.long))])
            out.append(int(ours.net.compute_logits(ours.net(batch, input_embeds=x))[-1].argmax()))
    assert out == ref
