"""Speculation never changes the output: token-identical to plain decoding, whatever the drafts.

Random fixture weights accept no real proposal, so an oracle proposer drafts from the plain run's own
output with some tokens spoiled: every step then mixes accepted and rejected drafts, and requests
without drafts share the batch.
"""
from __future__ import annotations

import random

import pytest
import torch

import hf2q
from hf2q.config import CacheConfig
from hf2q.engine.engine import Engine, EngineConfig
from hf2q.engine.request import RequestOptions
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.scheduler import SchedulerConfig
from hf2q.kernels import choose
from hf2q.spec import SpecConfig

MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request):
    return hf2q.load(request.getfixturevalue(f"gguf_{request.param}_f32"))


class Oracle:
    """Drafts the plain run's continuation of a prompt, each token spoiled with probability `spoil`."""

    def __init__(self, answers: dict[tuple, list[int]], spoil: float, seed: int):
        self.answers, self.spoil, self.rng = answers, spoil, random.Random(seed)

    def propose(self, history, k):
        for prompt, answer in self.answers.items():
            if tuple(history[:len(prompt)]) == prompt:
                done = len(history) - len(prompt)
                return [t if self.rng.random() >= self.spoil else t + 1 for t in answer[done:done + k]]
        return []


class CountingMask:
    """A stand-in grammar: only even token ids, and it is complete after 6 tokens."""

    def __init__(self):
        self.n = 0

    def constraint(self):
        return self

    def mask(self, logits):
        logits[1::2] = float("-inf")

    def accept(self, token):
        self.n += 1
        return token % 2 == 0

    def is_terminated(self):
        return self.n >= 6


def make_engine(model, spec=SpecConfig()):
    return Engine(model, EngineConfig(
        max_model_len=128, spec=spec,
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk=32),
        cache=CacheConfig(num_slots=8, num_blocks=128, block_size=8)))


def workload(model):
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randrange(3, 12))] for _ in range(7)]
    sp = dict(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [
        (prompts[0], SamplingParams(temperature=0, **sp), {}),
        (prompts[1], SamplingParams(temperature=0.9, top_p=0.9, seed=7, **sp), {}),
        (prompts[2], SamplingParams(temperature=0, logprobs=True, top_logprobs=2, repetition_penalty=1.3,
                                    presence_penalty=0.5, **sp), {}),
        (prompts[3], SamplingParams(temperature=0, stop=["e", "a"], **sp), {}),
        (prompts[4], SamplingParams(temperature=0, **sp), {"thinking_budget": 3, "starts_in_reasoning": True}),
        (prompts[5], SamplingParams(temperature=0, **sp), {"grammar": "mask"}),
        (prompts[6], SamplingParams(temperature=0.7, seed=3, n=2, **sp), {"group": "g"}),
    ]


def run(engine, work):
    outs = {}
    for i, (prompt, params, kw) in enumerate(work):
        kw = dict(kw, grammar=CountingMask()) if kw.get("grammar") else kw
        for c in range(params.n):
            rid = f"r{i}.{c}"
            engine.add_request(prompt, params, request_id=rid, options=RequestOptions(**kw))
            outs[rid] = {"ids": [], "text": "", "logprobs": [], "finish": None}
    while engine.has_work():
        for o in engine.step():
            got = outs[o.request_id]
            got["ids"] += o.new_token_ids
            got["text"] += o.new_text
            got["logprobs"] += [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs or []]
            got["finish"] = o.finish_reason
    return outs


# off: the exact reference layers; force: the fast path, which keeps several sequences' states at once; graphs:
# the fast path with the verify steps replayed in graphs (on the CPU their stand-in: the same buffers, layout
# and metadata), each sequence's states per position in the graph's static buffers
PATHS = ["off", "force", "graphs"]


def verify_in_graphs(engine: Engine) -> list[int]:
    """Let `engine`'s verify steps replay the verify graphs (the CPU stand-in off CUDA); the returned list counts
    the steps they served."""
    engine.runner.use_graphs = engine.runner.short_prefill_graphs = True
    served, run_verify = [], engine.runner._run_verify_graph
    engine.runner._run_verify_graph = lambda scheduled: (
        lambda out: (served.append(len(scheduled)) if out is not None else None, out)[1])(run_verify(scheduled))
    return served


@pytest.mark.parametrize("path", PATHS)
def test_outputs_identical_with_mixed_accepted_and_rejected_drafts(model, path):
    with choose.fast_path("off" if path == "off" else "force"):
        mixed_drafts_against_plain(model, graphs=path == "graphs")


def mixed_drafts_against_plain(model, graphs: bool = False):
    work = workload(model)
    plain = run(make_engine(model), work)
    forced = model.tokenizer.encode("\n</think>\n\n")
    assert plain["r3.0"]["finish"] == "stop" and len(plain["r3.0"]["ids"]) < MAX_TOKENS  # a stop string hit
    assert plain["r4.0"]["ids"][3:5] == forced[:2]  # the thinking budget forced its close
    assert plain["r5.0"]["finish"] == "stop" and len(plain["r5.0"]["ids"]) == 6  # the grammar completed
    assert all(t % 2 == 0 for t in plain["r5.0"]["ids"])
    answers = {tuple(p): plain[f"r{i}.0"]["ids"] for i, (p, params, kw) in enumerate(work) if i != 0}
    engine = make_engine(model, SpecConfig(method="ngram", num_tokens=3, cost_window=0))  # r0 never gets a draft
    engine.spec.new_proposer = lambda: Oracle(answers, spoil=0.25, seed=5)
    served = verify_in_graphs(engine) if graphs else []
    spec = run(engine, work)
    assert (len(served) >= 4 and max(served) >= 6) if graphs else not served, served  # every verify step here
    for rid in plain:
        got, want = spec[rid], plain[rid]
        assert (got["ids"], got["text"], got["finish"]) == (want["ids"], want["text"], want["finish"]), rid
        # the verify chunk and a one-token step round differently: logprobs agree to float noise
        assert [(t, [i for i, _ in top]) for t, _, top in got["logprobs"]] == \
            [(t, [i for i, _ in top]) for t, _, top in want["logprobs"]]
        assert [lp for _, lp, _ in got["logprobs"]] == pytest.approx([lp for _, lp, _ in want["logprobs"]], abs=1e-4)
    stats = engine.spec.stats
    assert 0 < stats.accepted < stats.drafted and stats.accepted_hist[0] > 0 and stats.accepted_hist[3] > 0
    graphs_pad = engine.runner.graphs is not None  # the graphs' padding slot
    assert engine.cache.num_free_slots == engine.cache.num_slots - graphs_pad


def test_full_verify_buckets_have_no_padding_rows(model, monkeypatch):
    """Verify steps of exactly a bucket's rows (one request with 3 drafts: 4 rows; two: 8) replay that bucket
    with no padding row, and the tokens stay plain decoding's."""
    from hf2q.engine.prefill_graphs import PrefillGraphs

    rng = random.Random(4)
    work = [([rng.randrange(100, 20000) for _ in range(5)], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                          ignore_eos=True), {}) for _ in range(2)]
    seen, step = [], PrefillGraphs.step
    monkeypatch.setattr(PrefillGraphs, "step", lambda self, seqs, keep=None: (
        seen.append((sum(len(new) for new, _, _ in seqs), self.bucket(sum(len(new) for new, _, _ in seqs)))),
        step(self, seqs, keep))[1])
    with choose.fast_path("force"):
        plain = run(make_engine(model), work)
        for batch in ([work[0]], work):  # alone: 4-row steps; together: 8
            engine = make_engine(model, SpecConfig(method="ngram", num_tokens=3, cost_window=0))
            answers = {tuple(p): plain[f"r{i}.0"]["ids"] for i, (p, _, _) in enumerate(work)}
            engine.spec.new_proposer = lambda: Oracle(answers, spoil=0.2, seed=2)
            verify_in_graphs(engine)
            spec = run(engine, batch)
            assert {rid: o["ids"] for rid, o in spec.items()} == {rid: plain[rid]["ids"] for rid in spec}
    assert (4, 4) in seen and (8, 8) in seen, seen


@pytest.mark.parametrize("path", PATHS)
def test_slot_state_after_rejections_equals_plain_decoding(model, path):
    """After every step (each with drafts, some accepted, some rejected), each slot holds what plain decoding
    holds at that length: K/V of the valid positions, DeltaNet conv and recurrent state, the same blocks.
    A partial accept leaves the slot one token behind like a plain step, so no accepted token is fed again.
    Two requests verify side by side, so each must take its own states."""
    prompts, params = [[11, 22, 33, 44, 55], [66, 77, 88]], \
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def states(engine):
        reqs = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
        seen = {}
        while engine.has_work():
            engine.step()
            for req in reqs:
                if not req.finished and req.output_ids:
                    assert req.num_computed == req.num_tokens - 1  # never behind: nothing to feed twice
                    blocks = len(engine.cache.block_table(req.slot))  # the admission's room kept
                    seen[req.request_id, req.num_computed] = (list(req.output_ids), blocks,
                                                              engine.cache.snapshot(req.slot))
        return seen

    with choose.fast_path("off" if path == "off" else "force"):
        plain = states(make_engine(model))
        answers = {tuple(p): max((v[0] for (rid, _), v in plain.items() if rid == f"r{i}"), key=len) + [0]
                   for i, p in enumerate(prompts)}
        engine = make_engine(model, SpecConfig(method="ngram", num_tokens=3, cost_window=0))
        engine.spec.new_proposer = lambda: Oracle(answers, spoil=0.3, seed=2)
        served = verify_in_graphs(engine) if path == "graphs" else []
        spec = states(engine)
    assert len(served) >= 2 if path == "graphs" else not served, served
    hist = engine.spec.stats.accepted_hist
    assert hist[0] > 0 and sum(hist[1:3]) > 0 and engine.spec.stats.accepted > 0  # rejections, partial accepts
    assert len(spec) >= 4
    for key, (ids, blocks, snap) in spec.items():
        want_ids, want_blocks, want = plain[key]
        assert (ids, blocks) == (want_ids, want_blocks)
        for a, b in ((snap.k, want.k), (snap.v, want.v), (snap.conv, want.conv), (snap.recurrent, want.recurrent)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_end_of_request_prefix_after_unused_drafts_is_exact(model):
    """A request that stops on a token with drafts fed after it is settled before its slot is kept as a
    retained prefix: a follow-up prompt that resumes from it gets the tokens a cold run gives."""
    rng = random.Random(3)
    firsts = [[rng.randrange(100, 20000) for _ in range(9)] for _ in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    free = run(make_engine(model), [(p, greedy, {}) for p in firsts])
    answers = {tuple(p): free[f"r{i}.0"]["ids"] for i, p in enumerate(firsts)}  # drafts run past the stop
    stops = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[free[f"r{i}.0"]["ids"][4]])
             for i in range(len(firsts))]
    plain = run(make_engine(model), list(zip(firsts, stops, [{}] * 3)))
    assert all(plain[r]["finish"] == "stop" for r in plain)
    follow = [p + plain[f"r{i}.0"]["ids"] + [101, 102] for i, p in enumerate(firsts)]
    cold = run(make_engine(model), [(p, greedy, {}) for p in follow])

    engine = Engine(model, EngineConfig(
        max_model_len=128, spec=SpecConfig(method="ngram", num_tokens=4, cost_window=0),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk=32),
        cache=CacheConfig(num_slots=8, num_blocks=256, block_size=8, prefix_cache_bytes=1 << 30)))
    engine.spec.new_proposer = lambda: Oracle(answers, spoil=0.0, seed=11)
    first = run(engine, list(zip(firsts, stops, [{}] * 3)))
    assert [first[r]["ids"] for r in plain] == [plain[r]["ids"] for r in plain]
    hits = engine.prefix.stats.hits
    warm = run(engine, [(p, greedy, {}) for p in follow])
    assert engine.prefix.stats.hits >= hits + len(follow)  # each follow-up resumed from its first turn
    assert [warm[r]["ids"] for r in cold] == [cold[r]["ids"] for r in cold]
