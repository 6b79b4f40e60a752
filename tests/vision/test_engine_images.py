"""The engine with images: greedy tokens equal HF's generate through chunked prefill and cached decode, and
the prefix cache reuses an image's prefill for the same image only."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import hf2q
from hf2q.config import CacheConfig
from hf2q.engine.engine import Engine, EngineConfig
from hf2q.engine.request import RequestOptions
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.scheduler import SchedulerConfig
from tests.support.fixtures import hf_vl_checkpoint, our_vl_ggufs
from tests.vision.test_image_logits import _hf_inputs
from tests.vision.test_positions import _prompt
from tests.vision.test_tower import random_image


@pytest.fixture(scope="module")
def dense_vl():
    text, mmproj = our_vl_ggufs("dense")
    return hf2q.load(text, mmproj=mmproj)


def _engine(model, prefix_bytes=0, chunk=16, async_scheduling=False):
    return Engine(model, EngineConfig(
        max_model_len=256, async_scheduling=async_scheduling,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=chunk),
        cache=CacheConfig(num_slots=4, num_blocks=256, block_size=8, prefix_cache_bytes=prefix_bytes,
                          prefix_checkpoint_stride=0)))


def _run(engine, ids, images, max_tokens=32, **kw):
    outs = list(engine.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens),
                                RequestOptions(images=tuple(images), **kw)))
    return [t for o in outs for t in o.new_token_ids], outs[-1]


def test_engine_greedy_with_images_equals_hf(dense_vl):
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(hf_vl_checkpoint("dense"), dtype=torch.float32).eval()
    images = [random_image((1, 6, 6), 3), random_image((1, 4, 8), 4)]
    ids = _prompt(images, [4, 3, 2])  # 36 prompt tokens: three prefill chunks of 16, one inside each image
    with torch.no_grad():
        ref = hf.generate(**_hf_inputs(ids, images), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    engine = _engine(dense_vl)
    text_ids, _ = _run(engine, ids, [])  # the same ids as text on the same engine: other tokens
    got, _ = _run(engine, ids, images)
    assert got == ref
    assert text_ids != ref
    queued = _engine(dense_vl, async_scheduling=True)  # decode steps queued ahead rotate by index + delta too
    got, _ = _run(queued, ids, images)
    assert got == ref and queued.steps_queued_ahead >= 16


def test_prefix_cache_keys_on_the_image(dense_vl):
    engine = _engine(dense_vl, prefix_bytes=64 << 20)
    a, b = random_image((1, 6, 6), 5), random_image((1, 6, 6), 6)
    ids = _prompt([a], [4, 3])
    anchor = len(ids) - 1
    first, _ = _run(engine, ids, [a], max_tokens=4, anchor=anchor)
    again, out = _run(engine, ids, [a], max_tokens=4, anchor=anchor)
    assert out.num_cached_tokens == anchor and again == first
    other, out = _run(engine, ids, [b], max_tokens=4, anchor=anchor)
    assert out.num_cached_tokens < ids.index(248056)  # never past the first pad row of a different image
    fresh, _ = _run(_engine(dense_vl), ids, [b], max_tokens=4)
    assert other == fresh


def test_queued_request_waits_only_for_a_checkpoint_of_its_own_image(dense_vl):
    """Admission holds a request back for a running prefill's coming checkpoint only when the prefix cache
    could resume it there: with the same image, not with a different one behind the same text."""
    engine = Engine(dense_vl, EngineConfig(
        max_model_len=256, scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=8),
        cache=CacheConfig(num_slots=4, num_blocks=256, block_size=8, prefix_cache_bytes=64 << 20,
                          prefix_checkpoint_stride=8)))
    a, b = random_image((1, 6, 6), 5), random_image((1, 6, 6), 6)
    ids = _prompt([a], [4, 3])
    params = SamplingParams(temperature=0, max_tokens=2)
    engine.add_request(ids, params, options=RequestOptions(images=(a,)))
    engine.step()  # the first 8 prompt tokens; the image's pad rows are still ahead
    same = engine.add_request(ids, params, "same", RequestOptions(images=(a,)))
    other = engine.add_request(ids, params, "other", RequestOptions(images=(b,)))
    assert engine.scheduler._awaits_checkpoint(same, budget=64)
    assert not engine.scheduler._awaits_checkpoint(other, budget=64)


def test_bad_image_requests_are_refused(dense_vl):
    engine = _engine(dense_vl)
    image = random_image((1, 4, 4), 7)
    with pytest.raises(ValueError, match="needs 4 consecutive image pad tokens"):
        engine.add_request([1, 248056, 2], SamplingParams(), options=RequestOptions(images=(image,)))
    text_only = dataclasses.replace(dense_vl, vision=None)
    with pytest.raises(ValueError, match="no vision tower"):
        _engine(text_only).add_request(_prompt([image], [1, 1]), SamplingParams(),
                                       options=RequestOptions(images=(image,)))
