"""The MTP proposer: same tokens as plain decoding, and its drafts are the MTP head's own predictions.

Random fixture weights accept few MTP drafts, so most rounds are rejections: the head's K/V must be
caught up after each one. Both fixtures carry one MTP layer.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import hf2q
from hf2q.config import CacheConfig
from hf2q.engine.engine import Engine, EngineConfig
from hf2q.engine.request import RequestOptions
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.scheduler import SchedulerConfig
from hf2q.spec import SpecConfig
from hf2q.spec.mtp import MTPProposer

PROMPTS = [[11, 22, 33, 44, 55], list(range(300, 340)), [7, 8, 9, 7, 8, 9, 7, 8]]  # the 40 tokens: two chunks


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request):
    return hf2q.load(request.getfixturevalue(f"gguf_{request.param}_f32"))


def make_engine(model, method="off", k=3, overlap=False):
    return Engine(model, EngineConfig(
        max_model_len=96, async_scheduling=overlap,
        spec=SpecConfig(method=method, num_tokens=k, ngram_min=1, cost_window=0),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=32),
        cache=CacheConfig(num_slots=6, num_blocks=96, block_size=8)))


def run(engine, sampled=True):
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=["e"]),
              SamplingParams(temperature=0.8, seed=3, n=2 if sampled else 1, max_tokens=8, ignore_eos=True)]
    outs = {}
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        for c in range(p.n):
            engine.add_request(prompt, p, request_id=f"r{i}.{c}",
                               options=RequestOptions(group="g" if p.n > 1 else None))
            outs[f"r{i}.{c}"] = ([], None)
    while engine.has_work():
        for o in engine.step():
            ids, _ = outs[o.request_id]
            outs[o.request_id] = (ids + o.new_token_ids, o.finish_reason)
    return outs


@pytest.mark.parametrize("method", ["mtp", "mtp+ngram"])
def test_outputs_identical_with_mtp_drafts(model, method):
    plain = run(make_engine(model))
    engine = make_engine(model, method)
    assert run(engine) == plain
    assert engine.spec.stats.drafted > 0
    assert engine.cache.num_free_slots == engine.cache.num_slots


def test_warm_up_runs_speculative_rounds_and_forgets_them(model):
    """The CUDA warm-up's throwaway requests with speculation are long enough to draft, so a first request finds
    the verify round, its settle and a rejected draft's rewind already run; after them the speculator holds no
    counts and no cost-control memory of them, and the engine answers as a fresh one does."""
    if model.config.is_moe:
        pytest.skip("the warm-up's requests are the model's; the dense fixture shows them (CI time)")
    engine = make_engine(model, "mtp+ngram")
    engine._warm_up_requests(engine.SPEC_WARM_UP_PROMPTS, max_tokens=engine.SPEC_WARM_UP_TOKENS)
    stats = engine.spec.stats
    assert stats.rounds > 0 and stats.drafted > stats.accepted  # rounds ran, with rejected drafts among them
    engine.spec._losing_streak["mtp"] = 5
    engine.spec.forget_history()
    assert engine.spec.stats.rounds == 0 and engine.spec._losing_streak["mtp"] == 0
    assert not engine.requests and engine.cache.num_free_slots == engine.cache.num_slots
    assert run(engine, sampled=False) == run(make_engine(model, "mtp+ngram"), sampled=False)


def test_first_draft_is_the_mtp_heads_argmax(model):
    """Every step, each request's first draft is what the MTP head predicts from a cache-free forward
    over its whole history: the head's K/V, caught up over chunked prefill and rejected drafts, is right."""
    engine = make_engine(model, "mtp", k=2)
    seen = []
    propose = engine.spec.propose

    def recording(running):
        propose(running)
        seen.extend((req.prompt_ids + req.output_ids, req.draft_ids[0]) for req in running if req.draft_ids)

    engine.spec.propose = recording
    run(engine, sampled=False)
    assert len(seen) > 10
    for history, draft in seen:
        assert draft == int(model.net.mtp_logits(history)[-1].argmax()), len(history)


def test_mtp_needs_an_mtp_head():
    with pytest.raises(ValueError, match="MTP head"):
        MTPProposer(SimpleNamespace(mtp=None), cache=None)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "async"])
def test_head_is_off_for_requests_of_a_batch_too_large_to_draft(model, overlap):
    """While `max_batch` or more requests decode nobody drafts, and keeping the head in step would cost a head
    forward every step: the head goes off for those requests. No head forward runs at all, the tokens are plain
    decoding's, each request is counted once, and with async scheduling the steps are queued ahead."""
    prompts = PROMPTS + [list(range(40, 52))]
    engine = make_engine(model, "mtp", k=2, overlap=overlap)
    engine.spec.config = dataclasses.replace(engine.spec.config, max_batch=3)
    forwards = []
    head = engine.spec.mtp._forward
    engine.spec.mtp._forward = lambda pending, ids: (forwards.append(len(pending)), head(pending, ids))
    draft = engine.spec.mtp.draft
    engine.spec.mtp.draft = lambda wanted: (forwards.append(len(wanted)) if wanted else None, draft(wanted))[1]

    def tokens(engine):
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), request_id=str(i))
        out = {str(i): [] for i in range(len(prompts))}
        while engine.has_work():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        return out

    assert tokens(engine) == tokens(make_engine(model, overlap=overlap))
    assert not forwards and engine.spec.stats.drafted == 0
    assert engine.spec.stats.batch_disabled == len(prompts)
    from prometheus_client import CollectorRegistry

    from hf2q.server.spec_metrics import SpecMetrics

    registry = CollectorRegistry()
    SpecMetrics(registry).observe(engine.spec.stats)
    assert registry.get_sample_value("hf2q_spec_decode_batch_disabled_total") == len(prompts)
    assert (engine.steps_queued_ahead > 0) == overlap


def test_a_queued_step_of_a_large_batch_turns_the_head_off():
    """A batch may reach `max_batch` in steps queued ahead, where `propose` does not run: the queued catch-up
    turns the head off for those requests instead of running it; below `max_batch` the head catches up."""
    from hf2q.spec.cost import CostController
    from hf2q.spec.speculator import Speculator

    spec = Speculator(SpecConfig(method="ngram", max_batch=2), cache=None)
    caught_up = []
    spec.mtp = SimpleNamespace(catch_up_queued=lambda reqs, ids: caught_up.append(len(reqs)))

    def requests(n):
        return [SimpleNamespace(extras={"cost": {"mtp": CostController(), "ngram": CostController()}})
                for _ in range(n)]

    large, small = requests(2), requests(1)
    spec.catch_up_queued(large, torch.zeros(2, dtype=torch.long))
    assert not caught_up and spec.stats.batch_disabled == 2
    assert not any(req.extras["cost"]["mtp"].enabled for req in large)
    spec.catch_up_queued(small, torch.zeros(1, dtype=torch.long))
    assert caught_up == [1] and small[0].extras["cost"]["mtp"].enabled


def test_head_catches_up_on_graph_replays(model):
    """The verify steps, the head's catch-up and drafts and the decode steps replay graphs (on the CPU their
    stand-in, on the vectorised path that their metadata is for): the drafts are the head's argmax over the
    whole history, and the tokens are plain decoding's."""
    from hf2q.kernels.choose import fast_path

    with fast_path("force"):
        check_catch_up_through_graphs(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_head_catches_up_on_cuda_graph_replays(kind, request):
    """On a GPU the drafts may part from a cache-free forward's argmax at a near-tie (other kernels); rows handed
    over wrongly would part from it nearly always."""
    model = hf2q.load(request.getfixturevalue(f"gguf_{kind}_f32"), device="cuda")
    check_catch_up_through_graphs(model, agree=0.9)


def check_catch_up_through_graphs(model, agree: float = 1.0):
    prompts = PROMPTS + [list(range(40, 52))]
    lengths = [3, 5, 20, 20]

    def tokens(engine):
        for i, (prompt, n) in enumerate(zip(prompts, lengths)):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), request_id=str(i))
        out = {str(i): [] for i in range(len(prompts))}
        while engine.has_work():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        return out

    def speculating(graphed: bool):
        """The tokens, every step's drafts, and the engine, with the verify steps and the head's catch-up and
        drafts replayed in graphs or not (decode steps replay theirs either way)."""
        engine = make_engine(model, "mtp", k=2)
        engine.runner.use_graphs = True
        if not graphed:
            engine.runner.verify_seqs = 0  # no verify graphs, nor the head's
        seen = []
        propose = engine.spec.propose
        engine.spec.propose = lambda running: (propose(running), seen.extend(
            (req.prompt_ids + req.output_ids, list(req.draft_ids)) for req in running if req.draft_ids))
        return tokens(engine), seen, engine

    plain = tokens(make_engine(model))
    got, seen, engine = speculating(graphed=True)
    assert got == plain
    runner = engine.runner
    assert runner.graphs is not None and runner.graphs.graphs  # some decode steps replayed
    assert runner.verify_graphs is not None and runner.verify_graphs.graphs  # the verify steps too
    assert runner.mtp_draft_graphs is not None and runner.mtp_draft_graphs.graphs  # and the head's drafts
    assert len(seen) > 10
    same = [drafts[0] == int(model.net.mtp_logits(history)[-1].argmax()) for history, drafts in seen]
    assert sum(same) >= agree * len(same), same
    if agree == 1.0:  # the CPU: the graphs' drafts, second ones included, are the eager head's
        eager_got, eager_seen, eager = speculating(graphed=False)
        assert eager.runner.verify_graphs is None and eager.runner.mtp_draft_graphs is None
        assert eager_got == plain and eager_seen == seen and any(len(d) == 2 for _, d in seen)
