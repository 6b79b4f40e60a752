"""Finish rules through the engine: stop strings across tokens, multi-byte text, EOS, length, context limit."""
from __future__ import annotations

import pytest

import hf2q
from hf2q.config import CacheConfig
from hf2q.engine.engine import Engine, EngineConfig, PromptTooLong
from hf2q.engine.request import RequestOptions
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.scheduler import SchedulerConfig


@pytest.fixture(scope="module")
def model(gguf_dense_f32):
    return hf2q.load(gguf_dense_f32)


def engine_for(model, max_len=128) -> Engine:
    return Engine(model, EngineConfig(max_model_len=max_len, scheduler=SchedulerConfig(max_num_seqs=2),
                                      cache=CacheConfig(num_slots=2, num_blocks=64, block_size=8)))


def scripted(model, text: str, **params) -> tuple[str, list, str]:
    """Force `text` as the model's reply (then EOS); return (streamed text, deltas, finish reason)."""
    ids = model.tokenizer.encode(text)
    engine = engine_for(model)
    outs = list(engine.generate([1, 2, 3], SamplingParams(temperature=0, **params), RequestOptions(scripted_ids=ids)))
    return "".join(o.new_text for o in outs), outs, outs[-1].finish_reason


def test_stop_string_spanning_tokens_is_stripped(model):
    text = "Hello world, the answer is forty-two. Goodbye"
    assert len(model.tokenizer.encode("answer is forty")) > 1
    streamed, outs, reason = scripted(model, text, stop=["answer is forty"])
    assert streamed == "Hello world, the "
    assert reason == "stop"
    assert all("answer" not in o.new_text for o in outs)


def test_multibyte_characters_never_split(model):
    text = "日本語のテキスト 🎉👩‍👩‍👧 ok"
    ids = model.tokenizer.encode(text)
    assert len(ids) > len(text.split())  # several byte-level pieces
    streamed, outs, reason = scripted(model, text)
    assert streamed == text
    assert all("\ufffd" not in o.new_text for o in outs)
    assert reason == "stop"  # the script ends with EOS


def test_eos_finishes_without_text(model):
    streamed, outs, reason = scripted(model, "short")
    assert reason == "stop" and streamed == "short"
    assert outs[-1].new_token_ids[0] in model.eos_token_ids and outs[-1].new_text == ""


def test_ignore_eos_runs_to_length(model):
    _, outs, reason = scripted(model, "short", ignore_eos=True, max_tokens=6)
    assert reason == "length" and outs[-1].num_output_tokens == 6


def test_length(model):
    engine = engine_for(model)
    outs = list(engine.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    assert [o.finish_reason for o in outs] == [None, None, None, "length"]


def test_context_limit_refused_before_compute(model):
    engine = engine_for(model, max_len=32)
    with pytest.raises(PromptTooLong, match="maximum context length is 32"):
        engine.add_request(list(range(100, 130)), SamplingParams(max_tokens=8))
    assert not engine.has_work()
