"""Async scheduling (hf2q.engine.overlap) gives the tokens of plain stepping: requests that finish while
already fed into the next step (by a stop token, so their retained prefix holds one token more), arrivals and
an abort in the middle, a penalised row that turns the overlap off while it runs, seeded and top-k sampling,
n = 2 choices forking one prompt, and a follow-up prompt that resumes from a request retained that way."""
from __future__ import annotations

import contextlib

import pytest
import torch

import hf2q
from hf2q.config import CacheConfig
from hf2q.engine.engine import Engine, EngineConfig
from hf2q.engine.request import RequestOptions
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.scheduler import SchedulerConfig


DEVICES = ["cpu"] + ["cuda"] * torch.cuda.is_available()
MODELS = [pytest.param((kind, dev), id=f"{kind}-{dev}", marks=[pytest.mark.gpu] if dev == "cuda" else [])
          for dev in DEVICES for kind in ("dense", "moe")]


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    """On CUDA the decode steps replay graphs and the tokens come back through pinned copies and events."""
    kind, device = request.param
    return hf2q.load(request.getfixturevalue(f"gguf_{kind}_f32"), device=device)


@contextlib.contextmanager
def no_device_sync(active):
    """On CUDA, while a step is queued ahead (`active`): any operation that waits for the GPU raises (a blocking
    copy or a read of a device value would end the overlap)."""
    if not (active and torch.cuda.is_available()):
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def make_engine(model, overlap: bool) -> Engine:
    return Engine(model, EngineConfig(
        max_model_len=256, async_scheduling=overlap,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk=16),
        cache=CacheConfig(num_slots=8, num_blocks=256, block_size=8, prefix_cache_bytes=1 << 26)))


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 150000 + 1000 for i in range(n)]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


def run(model, overlap: bool, stop_id: int, graphs: bool = False):
    """Outputs (tokens, finish reason, cached tokens) by request id, and how many steps were queued ahead.
    graphs: decode steps through the graphs' stand-in off CUDA (hf2q.engine.cuda_graphs)."""
    engine = make_engine(model, overlap)
    engine.runner.use_graphs |= graphs
    queued = []
    run_decode, draw = engine.runner.run_decode, engine.sampler.draw
    if engine.runner.device.type == "cuda":
        engine.warm_up()  # graphs captured and kernels compiled before any step is queued ahead

    def counting(reqs, ids):  # queues a step ahead of reading the one before, then its draw
        queued.append(len(reqs))
        with no_device_sync(True):
            return run_decode(reqs, ids)

    def drawing(logits, rows):
        with no_device_sync(len(queued) > drawn[0]):
            drawn[0] = len(queued)
            return draw(logits, rows)

    drawn = [0]
    engine.runner.run_decode, engine.sampler.draw = counting, drawing
    first = {"g0": (prompt(1, 20), greedy(max_tokens=12, ignore_eos=True)),
             "g1": (prompt(2, 5), greedy(max_tokens=1, ignore_eos=True)),
             "g2": (prompt(3, 9), greedy(max_tokens=2, ignore_eos=True)),
             "s0": (prompt(4, 30), SamplingParams(temperature=0.8, seed=5, max_tokens=9, ignore_eos=True)),
             "tk": (prompt(9, 6), SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=9, max_tokens=8,
                                                 ignore_eos=True)),
             "st": (prompt(5, 12), greedy(max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]))}
    later = {7: ("late", prompt(6, 7), greedy(max_tokens=6, ignore_eos=True)),
             10: ("pen", prompt(7, 4), greedy(max_tokens=4, ignore_eos=True, repetition_penalty=1.3))}
    out: dict[str, list] = {}
    aborted_in_flight = False
    for rid, (p, params) in first.items():
        engine.add_request(p, params, request_id=rid)
    two = SamplingParams(temperature=0.9, top_k=20, seed=11, n=2, max_tokens=7, ignore_eos=True)
    for c in range(2):  # n = 2: the second choice forks the first's prompt
        engine.add_request(prompt(11, 10), two.for_choice(c), request_id=f"n{c}", options=RequestOptions(group="n"))
    step = 0
    while engine.has_work():
        step += 1
        for o in engine.step():
            tokens, _, _ = out.setdefault(o.request_id, ([], None, None))
            out[o.request_id] = (tokens + o.new_token_ids, o.finish_reason, o.num_cached_tokens)
        if step in later:
            rid, p, params = later[step]
            engine.add_request(p, params, request_id=rid)
        if step == 6:  # in the async run, while a step holding g0 is queued
            queued_now = engine._launched.requests if engine._launched is not None else []
            aborted_in_flight = "g0" in [r.request_id for r in queued_now]
            assert engine.abort("g0").finish_reason == "abort"
    # the next turn of "st": its prompt and output, then more
    st_tokens = first["st"][0] + out["st"][0]
    follow = list(engine.generate(st_tokens + prompt(8, 3), greedy(max_tokens=5, ignore_eos=True)))
    out["follow"] = ([t for o in follow for t in o.new_token_ids], follow[-1].finish_reason,
                     follow[-1].num_cached_tokens)
    assert not engine.scheduler.running and not engine._finishing and engine._launched is None
    assert not graphs or engine.runner.graphs.graphs
    return out, queued, len(st_tokens), aborted_in_flight


def test_async_scheduling_gives_the_tokens_of_plain_stepping(model):
    engine = make_engine(model, False)
    alone = [t for o in engine.generate(prompt(5, 12), greedy(max_tokens=12, ignore_eos=True)) for t in o.new_token_ids]
    stop_id = alone[3]  # "st" ends at its fourth token (or earlier, where that token comes first)
    plain, none_queued, _, _ = run(model, False, stop_id)
    overlapped, queued, st_len, aborted_in_flight = run(model, True, stop_id)
    assert not none_queued and queued and aborted_in_flight, "only the async run queued steps ahead (g0's among them)"
    assert {rid: o[:2] for rid, o in overlapped.items()} == {rid: o[:2] for rid, o in plain.items()}
    assert plain["st"][1] == "stop" and len(plain["st"][0]) <= 4
    assert len(plain["g0"][0]) < 12 and plain["g0"][1] is None  # aborted on the way
    # The follow-up resumed from "st"'s retained state: plain keeps all but the last sampled token, async the
    # last one too (it was fed into the step queued behind it).
    assert (plain["follow"][2], overlapped["follow"][2]) == (st_len - 1, st_len)


def test_queued_steps_through_the_decode_graphs(model):
    """Off CUDA through the graphs' stand-in (on the vectorised path, which the graphs' metadata is for): the
    queued steps' ids come from the device tensor of the step before, as on a GPU."""
    from hf2q.kernels.choose import fast_path

    if model.device.type == "cuda":
        pytest.skip("the CUDA runs replay real graphs in every test here")
    with fast_path("force"):
        engine = make_engine(model, False)
        alone = [t for o in engine.generate(prompt(5, 12), greedy(max_tokens=12, ignore_eos=True))
                 for t in o.new_token_ids]
        plain, _, _, _ = run(model, False, alone[3])
        overlapped, queued, _, _ = run(model, True, alone[3], graphs=True)
    assert queued and {rid: o[:2] for rid, o in overlapped.items()} == {rid: o[:2] for rid, o in plain.items()}


def test_a_failed_queued_step_leaves_no_request_behind(model):
    """The forward of a queued step raises (the server then fails every running request): the request that
    stopped in the step before it, already fed on, still gives its slot up."""
    engine = make_engine(model, True)
    alone = [t for o in engine.generate(prompt(5, 12), greedy(max_tokens=12, ignore_eos=True)) for t in o.new_token_ids]
    free = engine.cache.num_free_slots  # all but the CUDA graphs' padding slot
    engine.add_request(prompt(5, 12), greedy(max_tokens=12, ignore_eos=True, stop_token_ids=[alone[2]]),
                       request_id="st")
    engine.add_request(prompt(1, 20), greedy(max_tokens=12, ignore_eos=True), request_id="g0")
    run_decode, calls = engine.runner.run_decode, []

    def failing(reqs, ids):
        calls.append([r.request_id for r in reqs])
        if "st" not in calls[-1]:  # the step after "st" stopped (it was fed into the one before)
            raise RuntimeError("device fault")
        return run_decode(reqs, ids)

    engine.runner.run_decode = failing
    with pytest.raises(RuntimeError, match="device fault"):
        while engine.has_work():
            engine.step()
    engine.abort("g0")  # what the server does with every request still running
    assert not engine.scheduler.running and not engine._finishing and not engine.has_work()
    assert engine.cache.num_free_slots == free


def test_requests_waiting_for_a_slot_and_queued_rerenders_do_not_stop_the_overlap(model):
    """Two slots, five requests: while three wait for a slot (and a background prefill waits for an idle
    engine), the running two still step ahead; every request gets plain stepping's tokens."""
    outs, while_waiting = {}, []
    for overlap in (False, True):
        engine = Engine(model, EngineConfig(
            max_model_len=256, async_scheduling=overlap,
            scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, prefill_chunk=16),
            cache=CacheConfig(num_slots=2, num_blocks=256, block_size=8, prefix_cache_bytes=1 << 26)))
        run_decode = engine.runner.run_decode

        def counting(reqs, ids, engine=engine):
            while_waiting.append(bool(engine.scheduler.waiting) and bool(engine.scheduler.background))
            return run_decode(reqs, ids)

        engine.runner.run_decode = counting
        assert engine.prefill_in_background(prompt(10, 40)) is not None
        for i in range(5):
            engine.add_request(prompt(20 + i, 6 + i), greedy(max_tokens=4 + 2 * i, ignore_eos=True), request_id=f"w{i}")
        got: dict[str, list[int]] = {}
        while engine.has_work():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert engine.prefix.stats.rerenders == 1  # the background prefill ran once the requests were done
        outs[overlap] = got
    assert outs[True] == outs[False] and any(while_waiting)


def test_ngram_speculation_drafts_only_when_no_step_is_queued_ahead(model):
    """With n-gram speculation, steps queue ahead while the batch is at least --spec-max-batch (where nobody
    drafts), and speculation takes over once it shrinks; every request gets the tokens of plain stepping
    without speculation."""
    from hf2q.spec.proposer import SpecConfig
    from tests.spec.test_verify import Oracle

    def engine_for(overlap: bool, spec: str) -> Engine:
        engine = Engine(model, EngineConfig(
            max_model_len=256, async_scheduling=overlap,
            spec=SpecConfig(method=spec, max_batch=3, ngram_min=2, ngram_max=4, cost_window=0),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk=16),
            cache=CacheConfig(num_slots=8, num_blocks=256, block_size=8, prefix_cache_bytes=0)))
        if engine.runner.device.type == "cuda":
            engine.warm_up()
        return engine

    def tokens(engine: Engine) -> dict[str, list[int]]:
        for i in range(5):
            engine.add_request(prompts[i], greedy(max_tokens=4 + 5 * i, ignore_eos=True), request_id=f"r{i}")
        got: dict[str, list[int]] = {}
        while engine.has_work():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        return got

    prompts = [prompt(30 + i, 9) for i in range(5)]
    plain = tokens(engine_for(False, "off"))
    engine = engine_for(True, "ngram")  # the proposer drafts plain's answers, a quarter of the tokens spoiled
    answers = {tuple(prompts[i]): plain[f"r{i}"] for i in range(5)}
    engine.spec.new_proposer = lambda: Oracle(answers, spoil=0.25, seed=3)
    run_decode, queued = engine.runner.run_decode, []

    def counting(reqs, ids):
        queued.append(len(reqs))
        assert len(reqs) >= 3 and not any(req.draft_ids for req in reqs)
        return run_decode(reqs, ids)

    engine.runner.run_decode = counting
    assert tokens(engine) == plain
    stats = engine.spec.stats
    assert queued and 0 < stats.accepted < stats.drafted, (queued, stats)


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_small_batches_queue_ahead_while_no_request_could_draft(model, method):
    """Below --spec-max-batch, steps queue ahead while no request could draft after the token on the device:
    n-gram, while the newest tokens occur nowhere earlier (checked afterwards: the proposer would have
    drafted nothing for any queued step); MTP, once the cost control has turned the head off. Speculation
    still drafts where it can, and every token is plain stepping's."""
    from hf2q.spec.ngram import NgramProposer
    from hf2q.spec.proposer import SpecConfig

    # With MTP the cost control is on: each request's first decode step is plain (its baseline) and drafts
    # nothing, yet a head still on must keep the steps after it from queuing ahead.
    spec = SpecConfig(method=method, max_batch=8, ngram_min=2, ngram_max=4, cost_window=4 if method == "mtp" else 0)

    def engine_for(overlap: bool, spec: SpecConfig = SpecConfig()) -> Engine:
        engine = Engine(model, EngineConfig(
            max_model_len=256, async_scheduling=overlap, spec=spec,
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk=16),
            cache=CacheConfig(num_slots=8, num_blocks=256, block_size=8, prefix_cache_bytes=0)))
        if engine.runner.device.type == "cuda":
            engine.warm_up()
        return engine

    prompts = [prompt(40, 11), prompt(42, 9), prompt(41, 6)]
    # the second draws from two tokens only, so its bigrams soon repeat: n-gram drafts, no step queued ahead
    params = [greedy(max_tokens=14, ignore_eos=True),
              greedy(max_tokens=8, ignore_eos=True, logit_bias={5000: 100.0, 5001: 100.0}),
              greedy(max_tokens=14, ignore_eos=True)]

    def tokens(engine: Engine) -> dict[str, list[int]]:
        for i, (p, params_i) in enumerate(zip(prompts, params)):
            engine.add_request(p, params_i, request_id=f"r{i}")
        got: dict[str, list[int]] = {}
        while engine.has_work():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        return got

    plain = tokens(engine_for(False))
    engine = engine_for(True, spec)
    run_decode, propose, queued = engine.runner.run_decode, engine.spec.propose, []

    def recording(reqs, ids):  # who was queued ahead, and how much of its history the host knew
        queued.append([(req.request_id, req.num_tokens) for req in reqs])
        return run_decode(reqs, ids)

    def proposing(running):  # MTP drafts for each request's first rounds, then its cost control turns it off
        propose(running)
        for req in running:
            if method == "mtp" and len(req.output_ids) >= 4:
                req.extras["cost"]["mtp"].enabled = False

    engine.runner.run_decode, engine.spec.propose = recording, proposing
    assert tokens(engine) == plain
    assert engine.spec.stats.drafted > 0 and queued, (engine.spec.stats, queued)  # three requests: below 8
    for step in queued:
        for rid, known in step:
            i = int(rid[1:])
            history = prompts[i] + plain[rid][:known - len(prompts[i]) + 1]  # with the token on the device
            room = len(prompts[i]) + params[i].max_tokens - len(history) - 1  # what propose leaves for drafts
            if method == "ngram":
                assert NgramProposer(2, 4).propose(history, min(3, room)) == [], (rid, known)
            else:
                assert known - len(prompts[i]) >= 4, (rid, known)


def test_step_trace_names_each_steps_path_and_changes_no_token(model, monkeypatch, caplog):
    """HF2Q_STEP_TRACE=1: a log line a step with its path (eager prefill, decode graph, queued decode graph on the
    graphs' stand-in off CUDA), and the same tokens as without it."""
    import logging

    from hf2q.kernels.choose import fast_path

    if model.device.type == "cuda":
        pytest.skip("the CUDA runs replay real graphs in every test here")
    outs = []
    with fast_path("force"):
        for trace in ("0", "1"):
            monkeypatch.setenv("HF2Q_STEP_TRACE", trace)
            engine = make_engine(model, True)
            engine.runner.use_graphs = True
            with caplog.at_level(logging.INFO, logger="hf2q.engine.engine"):
                outs.append([t for o in engine.generate(prompt(3, 12), greedy(max_tokens=6, ignore_eos=True))
                             for t in o.new_token_ids])
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step: ")]
    assert outs[0] == outs[1] and len(outs[0]) == 6
    assert steps[0].startswith("step: eager of 1 sequences, 12 tokens + queued decode graph of 1 sequences, 1 tokens: "
                               "host ")
    assert all("queued decode graph of 1 sequences, 1 tokens: host" in s for s in steps[1:]) and len(steps) == 5
    assert engine.runner.paths is None or engine.runner.paths == []  # nothing kept between traced steps
