"""Multimodal rotary positions equal HF's `Qwen3_5Model.get_rope_index`."""
from __future__ import annotations

import pytest
import torch

from hf2q.vision.positions import multimodal_positions
from tests.vision.test_tower import random_image

PAD, START, END = 248056, 248053, 248054


def _prompt(images, text_lens):
    ids = list(range(100, 100 + text_lens[0]))
    for im, n in zip(images, text_lens[1:]):
        ids += [START] + [PAD] * im.num_tokens + [END] + list(range(200, 200 + n))
    return ids


def test_positions_equal_hf():
    from transformers import Qwen3_5Model

    from tests.support.vision_checkpoints import tiny_vl_config

    images = [random_image((1, 4, 6), 1), random_image((1, 10, 4), 2)]
    ids = _prompt(images, [5, 3, 7])
    ours, delta = multimodal_positions(ids, PAD, images)
    hf = Qwen3_5Model.get_rope_index(
        type("M", (), {"config": tiny_vl_config("dense"), "get_vision_position_ids": Qwen3_5Model.get_vision_position_ids})(),
        torch.tensor([ids]), torch.tensor([[int(t == PAD) for t in ids]]),
        image_grid_thw=torch.tensor([im.grid_thw for im in images]))
    assert ours.equal(hf[0][:, 0]) and delta == int(hf[1])
    assert ours[:, -1].tolist() == [len(ids) - 1 + delta] * 3  # decode continues from here


def test_text_only_positions_count_on():
    pos, delta = multimodal_positions([1, 2, 3], PAD, [])
    assert pos.tolist() == [[0, 1, 2]] * 3 and delta == 0


@pytest.mark.parametrize("pads,n_images,message", [(3, 1, "needs 4 consecutive"), (4, 0, "more image placeholders"),
                                                   (0, 1, "fewer image placeholders")])
def test_mismatched_placeholders_are_refused(pads, n_images, message):
    images = [random_image((1, 4, 4), 1)] * n_images
    with pytest.raises(ValueError, match=message):
        multimodal_positions([1] + [PAD] * pads + [2], PAD, images)


def test_one_rotary_position_per_text_token():
    """What a decode graph rotates a token by: the shared position of a text row (index + delta after the
    prompt), none for an image row."""
    from types import SimpleNamespace

    from hf2q.vision.request_inputs import attach_images, text_rope_position

    images = [random_image((1, 4, 4), 1)]
    req = SimpleNamespace(prompt_ids=_prompt(images, [3, 2]))
    attach_images(req, PAD, images)
    positions, delta = req.mrope
    assert delta < 0
    n = len(req.prompt_ids)
    assert [text_rope_position(req, p) for p in (0, n - 1, n, n + 5)] == [0, n - 1 + delta, n + delta, n + 5 + delta]
    first_pad = req.prompt_ids.index(PAD)
    assert text_rope_position(req, first_pad) == int(positions[0, first_pad])  # the grid's corner: t = h = w
    assert text_rope_position(req, first_pad + 1) is None
