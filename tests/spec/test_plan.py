"""The verify walk on scripted decisions (the seed's verified-block plan vectors), and the n-gram proposer
end to end: scripted replies fix each row's decision, so the drafts alone decide what is accepted."""
from __future__ import annotations

import pytest

import hf2q
from hf2q.engine.request import RequestOptions
from hf2q.engine.sampling_params import SamplingParams
from hf2q.spec import SpecConfig
from tests.spec.test_verify import make_engine

PROMPT = [101, 102, 103, 104]


@pytest.fixture(scope="module")
def model(gguf_dense_f32):
    return hf2q.load(gguf_dense_f32)


class Fixed:
    def __init__(self, drafts):
        self.drafts = drafts

    def propose(self, history, k):
        return self.drafts[:k] if len(history) == len(PROMPT) + 1 else []


def second_step(model, script, drafts):
    engine = make_engine(model, SpecConfig(method="ngram", num_tokens=3, cost_window=0))
    engine.spec.new_proposer = lambda: Fixed(drafts)
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=16),
                       options=RequestOptions(scripted_ids=script))
    engine.step()  # prefill: decides 5
    (out,) = engine.step()
    return out, engine.spec.stats


@pytest.mark.parametrize("case, decisions, output, accepted, finish", [
    ("full accept", [11, 12, 13, 14, 77], [11, 12, 13, 14], 3, None),
    ("partial", [11, 99, 100], [11, 99], 1, None),
    ("terminal draft", [11], [11, "eos"], 1, "stop"),  # the script ends with EOS: a matching EOS draft ends it
])
def test_plan_vectors(model, case, decisions, output, accepted, finish):
    eos = min(model.eos_token_ids)
    drafts = [11, 12, 13] if case != "terminal draft" else [11, eos, 13]
    out, stats = second_step(model, [5] + decisions, drafts)
    assert out.new_token_ids == [eos if t == "eos" else t for t in output]
    assert out.finish_reason == finish
    assert (stats.drafted, stats.accepted) == (3, accepted)


def test_ngram_proposer_end_to_end(model):
    prompt = list(range(1000, 1012)) + [1000, 1001]
    script = list(range(1002, 1012))
    outs = {}
    for spec in (SpecConfig(), SpecConfig(method="ngram", num_tokens=3, ngram_min=2, ngram_max=4)):
        engine = make_engine(model, spec)
        deltas = list(engine.generate(prompt, SamplingParams(temperature=0, max_tokens=16),
                                      RequestOptions(scripted_ids=script)))
        outs[spec.method] = ([t for o in deltas for t in o.new_token_ids], len(deltas), engine.spec)
    (plain, plain_steps, _), (spec, spec_steps, speculator) = outs["off"], outs["ngram"]
    assert spec == plain == script + [min(model.eos_token_ids)]
    assert speculator.stats.accepted >= 6 and spec_steps < plain_steps
