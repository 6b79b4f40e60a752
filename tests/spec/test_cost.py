"""The cost controller's rule (the seed's test vectors) and the engine's use of it, with an injected clock."""
from __future__ import annotations

import pytest

import hf2q
from hf2q.config import CacheConfig
from hf2q.engine.engine import Engine, EngineConfig
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.scheduler import SchedulerConfig
from hf2q.spec import SpecConfig
from hf2q.spec.cost import CostController


def test_no_speculation_before_a_plain_step_is_timed():
    c = CostController()
    assert not c.may_speculate()
    assert c.observe_round(3, 0.01)  # ignored: no baseline
    c.observe_plain(0.010)
    assert c.may_speculate()


def test_two_losing_windows_in_a_row_switch_it_off():
    c = CostController()
    c.observe_plain(0.010)
    for _ in range(7):  # 7 rounds of one token at 10 ms against a 10 ms baseline: ties
        assert c.observe_round(1, 0.010)
    assert not c.observe_round(1, 0.010)  # the 8th closes the second losing window
    assert not c.may_speculate()


def test_a_winning_window_clears_a_losing_one():
    c = CostController()
    c.observe_plain(0.010)
    for _ in range(4):
        c.observe_round(1, 0.010)  # one losing window
    for _ in range(4):
        c.observe_round(2, 0.015)  # 2 tokens in 15 ms against 20 ms: a gain
    for _ in range(4):
        assert c.observe_round(1, 0.010)  # a single losing window again: still on
    assert c.may_speculate()


class Clock:
    """A step takes `verify` seconds when some request verifies drafts in it, else `plain`: the engine reads
    the clock at the start and at the end of a step, and the end reading carries the step's time."""

    def __init__(self, engine, plain=0.010, verify=0.010):
        self.engine, self.plain, self.verify, self.now = engine, plain, verify, 0.0

    def __call__(self):
        drafting = any(r.draft_ids for r in self.engine.scheduler.running)
        self.now += self.verify if drafting else self.plain
        return self.now


class Always:
    """Drafts three tokens every step (never right on random weights): every decode step is a round."""

    def propose(self, history, k):
        return [1, 2, 3][:k]


def engine_for(model, max_batch=8):
    return Engine(model, EngineConfig(
        max_model_len=128, spec=SpecConfig(method="ngram", num_tokens=3, max_batch=max_batch),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk=32),
        cache=CacheConfig(num_slots=8, num_blocks=128, block_size=8)))


def speculating(model, verify, max_batch=8):
    engine = engine_for(model, max_batch)
    engine.spec.new_proposer = Always
    engine.spec.clock = Clock(engine, verify=verify)
    return engine


PROMPT = [500, 501, 502, 503]


@pytest.fixture(scope="module")
def model(gguf_dense_f32):
    return hf2q.load(gguf_dense_f32)


def run(engine, prompts, max_tokens=24):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
    return reqs


def test_a_losing_proposer_is_switched_off_for_that_request(model):
    engine = speculating(model, verify=0.050)  # one token per 50 ms round against 10 ms plain steps
    (req,) = run(engine, [PROMPT])
    cost = req.extras["cost"]["ngram"]
    assert not cost.enabled
    assert engine.spec.stats.rounds == 2 * cost.window  # off after two losing windows, never again


def test_a_winning_proposer_stays_on(model):
    engine = speculating(model, verify=0.008)  # one token per 8 ms round: a gain, however few accepted
    (req,) = run(engine, [PROMPT])
    assert req.extras["cost"]["ngram"].enabled
    assert engine.spec.stats.rounds > 2 * CostController().window


class SlowFirstDecode(Clock):
    """A request's first decode step takes 200 ms (the MTP head catching up on the prompt would add to it)."""

    def __call__(self):
        running = self.engine.scheduler.running
        if not any(r.draft_ids for r in running) and any(len(r.output_ids) == 2 for r in running):
            self.now += 0.200
            return self.now
        return super().__call__()


def test_the_first_decode_step_is_no_baseline(model):
    """50 ms rounds against a 200 ms first step would look like a gain; the plain steps after it take 10 ms."""
    engine = speculating(model, verify=0.050)
    engine.spec.clock = SlowFirstDecode(engine, verify=0.050)
    (req,) = run(engine, [PROMPT])
    assert not req.extras["cost"]["ngram"].enabled
    assert engine.spec.stats.rounds == 2 * CostController().window


def test_no_speculation_in_a_large_batch(model):
    # 7 tokens: the first from the prompt, the first decode step (no baseline), a timed plain step, 3 rounds,
    # a last step with no room to draft
    for max_batch, rounds in ((2, 0), (3, 2 * 3)):
        engine = speculating(model, verify=0.008, max_batch=max_batch)
        run(engine, [PROMPT, PROMPT[1:]], max_tokens=7)
        assert engine.spec.stats.rounds == rounds, max_batch


def test_a_proposer_that_lost_for_the_requests_before_starts_off(model):
    """STREAK_TO_START_OFF requests in a row turn a losing proposer off: later requests start with it off, but for
    one in PROBE_EVERY, which tries it for one window; a window that probe wins lets the next requests draft again."""
    from hf2q.spec.speculator import PROBE_EVERY, STREAK_TO_START_OFF

    engine = speculating(model, verify=0.050)
    stats, window = engine.spec.stats, CostController().window
    for _ in range(STREAK_TO_START_OFF):
        run(engine, [PROMPT])
    assert stats.cost_disabled["ngram"] == STREAK_TO_START_OFF and stats.rounds == STREAK_TO_START_OFF * 2 * window
    for _ in range(PROBE_EVERY - 1):
        (req,) = run(engine, [PROMPT])
        assert not req.extras["cost"]["ngram"].enabled
    assert stats.started_off["ngram"] == PROBE_EVERY - 1 and stats.rounds == STREAK_TO_START_OFF * 2 * window
    (probe,) = run(engine, [PROMPT])  # a losing probe is turned off after one window, not two
    assert not probe.extras["cost"]["ngram"].enabled and stats.rounds == STREAK_TO_START_OFF * 2 * window + window
    for _ in range(PROBE_EVERY - 1):
        run(engine, [PROMPT])
    engine.spec.clock.verify = 0.008  # the next probe's rounds gain
    (probe,) = run(engine, [PROMPT])
    assert probe.extras["cost"]["ngram"].enabled and stats.rounds > STREAK_TO_START_OFF * 2 * window
    rounds = stats.rounds
    (req,) = run(engine, [PROMPT])
    assert req.extras["cost"]["ngram"].enabled and stats.rounds > rounds


def test_the_heads_catch_up_in_a_plain_step_is_no_baseline(model):
    """With the MTP head on, a plain step also runs the head's catch-up (eager, 40 ms here), which plain
    decoding with the head off does not pay: 35-ms rounds must lose against the 10-ms plain step, not win
    against 50 ms."""
    engine = Engine(model, EngineConfig(
        max_model_len=128, spec=SpecConfig(method="mtp", num_tokens=3),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk=32),
        cache=CacheConfig(num_slots=8, num_blocks=128, block_size=8)))
    spec, now = engine.spec, [0.0]
    spec.clock = lambda: now[0]
    head, observe = spec.mtp.catch_up_and_draft, spec.observe_step

    def catch_up_and_draft(reqs, wanted):
        if reqs and not wanted:
            now[0] += 0.040
        return head(reqs, wanted)

    def observe_step(sampled):
        now[0] += 0.035 if any(r.draft_ids for r in engine.scheduler.running) else 0.010
        return observe(sampled)

    spec.mtp.catch_up_and_draft, spec.observe_step = catch_up_and_draft, observe_step
    (req,) = run(engine, [PROMPT], max_tokens=40)
    assert not req.extras["cost"]["mtp"].enabled
    assert spec.stats.rounds == 2 * CostController().window
