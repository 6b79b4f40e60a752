"""Continuous batching: every request gets exactly the output it would get alone."""
from __future__ import annotations

import asyncio
import random

import pytest

import hf2q
from hf2q.config import CacheConfig
from hf2q.engine.async_engine import AsyncEngine
from hf2q.engine.engine import Engine, EngineConfig
from hf2q.engine.request import RequestOptions
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.scheduler import QueueFull, SchedulerConfig


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request):
    return hf2q.load(request.getfixturevalue(f"gguf_{request.param}_f32"))


def make_engine(model, seqs=16, budget=64, chunk=16, blocks=512, waiting=64) -> Engine:
    return Engine(model, EngineConfig(
        max_model_len=256,
        scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, prefill_chunk=chunk,
                                  max_waiting=waiting),
        cache=CacheConfig(num_slots=seqs, num_blocks=blocks, block_size=8)))


def workload(n=16, seed=0):
    rng = random.Random(seed)
    return [([rng.randrange(100, 200000) for _ in range(rng.randrange(1, 40))], rng.randrange(1, 12))
            for _ in range(n)]


def run_all(engine, requests) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=rid)
        out[rid] = []
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def solo(model, prompt, params) -> list[int]:
    engine = make_engine(model, seqs=1)
    return [t for o in engine.generate(prompt, params) for t in o.new_token_ids]


def test_16_concurrent_greedy_equal_solo(model):
    reqs = {f"r{i}": (p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
            for i, (p, m) in enumerate(workload())}
    batched = run_all(make_engine(model), reqs)
    for rid, (prompt, params) in reqs.items():
        assert batched[rid] == solo(model, prompt, params), rid


def test_seeded_sampling_independent_of_batch_composition(model):
    base = workload(6, seed=1)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=m, ignore_eos=True)
              for i, (_, m) in enumerate(base)]
    reqs = {f"s{i}": (p, params[i]) for i, (p, _) in enumerate(base)}
    together = run_all(make_engine(model), reqs)
    reordered = run_all(make_engine(model, budget=24, chunk=5), dict(reversed(list(reqs.items()))))
    assert together == reordered
    assert together["s0"] == solo(model, *reqs["s0"])


def test_abort_leaves_others_unchanged_and_frees_slot(model):
    reqs = {f"a{i}": (p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
            for i, (p, _) in enumerate(workload(4, seed=2))}
    expected = run_all(make_engine(model), reqs)
    engine = make_engine(model, seqs=4)
    got = {rid: [] for rid in reqs}
    for rid, (prompt, params) in reqs.items():
        engine.add_request(prompt, params, request_id=rid)
    steps = 0
    while engine.has_work():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
        steps += 1
        if steps == 3:
            engine.abort("a1")
    for rid in ("a0", "a2", "a3"):
        assert got[rid] == expected[rid]
    assert got["a1"] == expected["a1"][: len(got["a1"])] and len(got["a1"]) < 10
    assert engine.cache.num_free_slots == 4 and engine.cache.usage().kv_blocks_used == 0


def test_queue_limit_refuses_cleanly(model):
    engine = make_engine(model, seqs=1, waiting=2)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request([1, 2, 3], params)
    engine.add_request([1, 2, 3], params)
    with pytest.raises(QueueFull):
        engine.add_request([1, 2, 3], params)
    while engine.has_work():
        engine.step()
    engine.add_request([4, 5], params)  # room again once the queue drains


def test_choices_of_one_request_fork_the_prompt(model):
    prompt = workload(1, seed=3)[0][0] + [5, 6, 7, 8, 9, 10, 11, 12]
    params = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=6, ignore_eos=True) for i in range(3)]
    engine = make_engine(model, seqs=4, budget=256, chunk=256)
    computed = []
    run = engine.runner.run

    def counting_run(scheduled):
        computed.append(sum(n for _, n in scheduled))
        return run(scheduled)

    engine.runner.run = counting_run
    out = run_all_group(engine, prompt, params)
    for i, p in enumerate(params):
        assert out[f"c{i}"] == solo(model, prompt, p), i
    # The prompt ran once (up to its last token), then each choice ran its own last prompt token.
    assert computed[0] == len(prompt) - 1
    assert sum(computed) == len(prompt) - 1 + 3 + 3 * 5
    assert engine.cache.num_free_slots == 4


def run_all_group(engine, prompt, params) -> dict[str, list[int]]:
    out = {}
    for i, p in enumerate(params):
        engine.add_request(prompt, p, request_id=f"c{i}", options=RequestOptions(group="g"))
        out[f"c{i}"] = []
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def test_a_failing_row_fails_only_its_request(model):
    """One request's sampler row and another's output step raise; the third finishes as it would alone."""
    (good_prompt, _), (p1, _), (p2, _) = workload(3, seed=4)
    good = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    bad_sampler = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    object.__setattr__(bad_sampler, "repetition_penalty", 1e39)  # past validation: torch.full overflows
    engine = make_engine(model, seqs=4)
    engine.add_request(good_prompt, good, request_id="good")
    engine.add_request(p1, bad_sampler, request_id="bad-sampler")
    bad_output = engine.add_request(p2, good, request_id="bad-output").output

    def broken_push(token):
        raise UnicodeError("detokenizer broke")

    bad_output.detok.push = broken_push
    got = {rid: [] for rid in ("good", "bad-sampler", "bad-output")}
    last = {}
    while engine.has_work():
        outs = engine.step()
        assert len({o.request_id for o in outs}) == len(outs)
        for o in outs:
            got[o.request_id] += o.new_token_ids
            last[o.request_id] = o
    assert got["good"] == solo(model, good_prompt, good) and last["good"].finish_reason == "length"
    for rid, error in (("bad-sampler", "overflow"), ("bad-output", "detokenizer broke")):
        assert last[rid].finish_reason == "error" and error in last[rid].error, last[rid]
        assert got[rid] == []
    assert engine.cache.num_free_slots == 4 and engine.cache.usage().kv_blocks_used == 0 and not engine.requests


def test_async_engine_raises_in_the_failed_request_only(model):
    """The engine's "error" output reaches its caller as an exception; the other caller is untouched."""
    (good_prompt, _), (bad_prompt, _) = workload(2, seed=5)
    good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    bad = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    object.__setattr__(bad, "repetition_penalty", 1e39)
    aengine = AsyncEngine(make_engine(model, seqs=4))

    async def collect(rid, prompt, params):
        return [t async for o in aengine.generate(rid, prompt, params) for t in o.new_token_ids]

    async def both():
        return await asyncio.gather(collect("good", good_prompt, good), collect("bad", bad_prompt, bad),
                                    return_exceptions=True)

    aengine.start()
    try:
        tokens, error = asyncio.run(both())
    finally:
        aengine.shutdown()
    assert tokens == solo(model, good_prompt, good)
    assert isinstance(error, RuntimeError) and "overflow" in str(error)
