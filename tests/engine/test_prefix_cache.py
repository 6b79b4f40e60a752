"""Retained-prefix reuse: later prompts resume from checkpoints, and their tokens are exactly the tokens
a cache-off engine produces (greedy and seeded sampling, dense and MoE)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import hf2q
from hf2q.config import CacheConfig
from hf2q.engine import warm_up
from hf2q.engine.engine import Engine, EngineConfig
from hf2q.engine.request import RequestOptions
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.scheduler import SchedulerConfig
from hf2q.server.schemas import Message
from hf2q.server.serving_chat import next_turn_history, render_prompt, turn_anchor

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request):
    return hf2q.load(request.getfixturevalue(f"gguf_{request.param}_f32"))


@pytest.fixture(scope="module")
def dense_model(request):
    """The dense fixture alone, for tests of scheduling and rendering that the MoE variant adds nothing to."""
    return hf2q.load(request.getfixturevalue("gguf_dense_f32"))


def make_engine(model, prefix_bytes=1 << 30, stride=0, seqs=4, blocks=1024, chunk=64, batched=128,
                max_len=1024) -> Engine:
    return Engine(model, EngineConfig(
        max_model_len=max_len,
        scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=batched, prefill_chunk=chunk),
        cache=CacheConfig(num_slots=seqs, num_blocks=blocks, block_size=8, prefix_cache_bytes=prefix_bytes,
                          prefix_checkpoint_stride=stride)))


def run(engine, requests: dict) -> dict:
    """requests: id -> (prompt, params, anchor). Returns id -> (tokens, cached tokens)."""
    out = {}
    for rid, (prompt, params, anchor) in requests.items():
        engine.add_request(prompt, params, request_id=rid, options=RequestOptions(anchor=anchor))
        out[rid] = ([], 0)
    while engine.has_work():
        for o in engine.step():
            toks, cached = out[o.request_id]
            out[o.request_id] = (toks + o.new_token_ids, max(cached, o.num_cached_tokens))
    return out


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city on a day",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "day": {"type": "integer"}},
                   "required": ["city"]}}}


def _tool_call(t: int) -> list[Message]:
    call = {"id": f"call{t}", "type": "function",
            "function": {"name": "get_weather", "arguments": f'{{"city": "Paris", "day": {t}}}'}}
    return [Message(role="assistant", content="", tool_calls=[call]),
            Message(role="tool", tool_call_id=f"call{t}", content=f"Rain, {10 + t} degrees.")]


# What each turn adds to the conversation: a tool call and its result, a second call in the same agent loop,
# an answer and a new question, then one more tool call and result.
FOLLOW_UPS = [lambda t: _tool_call(t), lambda t: _tool_call(t),
              lambda t: [Message(role="assistant", content=f"Answer number {t}."),
                         Message(role="user", content=f"And tomorrow, day {t}?")],
              lambda t: _tool_call(t)]
USER_AFTER_LOOP = 3  # the turn that answers the two tool results and asks again


def chat_turns(model, thinking: bool):
    """Each turn's (prompt ids, anchor, re-render ids) of a 5-turn tool-using conversation through the real chat
    template, with a long system prompt (a realistic agent's instructions). The re-render ids are what the
    server prefills in the background after a turn that answers (`next_turn_history`), else None."""
    state = SimpleNamespace(model=model, config=SimpleNamespace(default_chat_template_kwargs={}))
    extra = {"enable_thinking": thinking}
    messages = [Message(role="system", content="You answer questions about the weather. " * 60),
                Message(role="user", content="Is it raining in Paris?")]
    result = []
    for t in range(len(FOLLOW_UPS) + 1):
        ids = model.tokenizer.encode(render_prompt(state, messages, [WEATHER_TOOL], extra))
        rerender = None
        if t < len(FOLLOW_UPS) and not FOLLOW_UPS[t](t)[0].tool_calls:
            # The server's message for an answer; with thinking, its reasoning (which the client may drop).
            answer = {"role": "assistant", "content": FOLLOW_UPS[t](t)[0].content}
            if thinking:
                answer["reasoning_content"] = "They asked again; the tool said rain."
            rerender = next_turn_history(state, messages, [WEATHER_TOOL], extra, answer)
        result.append((ids, turn_anchor(state, messages, [WEATHER_TOOL], extra, ids), rerender))
        if t < len(FOLLOW_UPS):
            messages += FOLLOW_UPS[t](t)
    return result


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_tool_calling_chat_hits_from_turn_two_and_matches_cache_off(model, request):
    """Each model and each rendering once (thinking on with the dense model, off with the MoE one): the template
    renders the turns the same for both models, and cache-on tokens must equal cache-off ones through either
    model's layers."""
    thinking = request.node.callspec.params["model"] == "dense"
    turns = chat_turns(model, thinking)
    on, off = (make_engine(model, prefix_bytes=b, chunk=256, batched=512) for b in (1 << 30, 0))
    rerenders = [(i, r) for i, (_, _, r) in enumerate(turns) if r is not None]
    assert [i for i, _ in rerenders] == [USER_AFTER_LOOP - 1]
    for i, (ids, anchor, rerender) in enumerate(turns):
        # Greedy and seeded sampling side by side, same prompt.
        turn = {f"g{i}": (ids, GREEDY, anchor), f"s{i}": (ids, SEEDED, anchor)}
        got_both, want_both = run(on, turn), run(off, turn)
        if rerender is not None:  # as the server does once the answer is out; idle while the user reads it
            assert on.prefill_in_background(rerender) is not None and off.prefill_in_background(rerender) is None
            while on.has_work():
                on.step()
        for rid in turn:
            got, want = got_both[rid], want_both[rid]
            assert got[0] == want[0], (i, rid)
            # The longest earlier checkpoint it extends: a turn anchor, or the re-rendered history.
            best = max([a for p, a, _ in turns[:i] if a and _common(p, ids) >= a] +
                       [len(r) for _, _, r in turns[:i] if r and ids[:len(r)] == r], default=0)
            if rid.startswith("s"):  # queued beside the greedy one: where the rest fits the step's room beside
                rest = len(ids) - best  # the greedy one's chunk, it computes it too; else it waits for that
                fits = rest <= min(256, 512 - min(rest, 256))  # prefill's anchor and resumes there
                assert got[1] == (best if fits else anchor), (i, got[1], best, anchor)
                continue
            assert got[1] == best, (i, got[1], best)
            if i == USER_AFTER_LOOP:
                # Qwen3.5 renders an agent loop's messages with a think block until a user speaks, then
                # without: the turns' own checkpoints end where the loop began; the background re-render of
                # the history after the answer is this prompt's prefix, and it resumes there.
                before = rerenders[0][1]
                assert ids[:len(before)] == before and got[1] == len(before)
                assert _common(turns[1][0], ids) == turns[0][1] < len(before)
            if i:
                assert got[1] >= 0.9 * len(ids), (i, got[1], len(ids))
    assert on.prefix.stats.rerenders == 1 and 0 < on.prefix.stats.rerender_tokens < len(rerenders[0][1])


def test_finished_request_is_a_checkpoint(model):
    prompt = list(range(1000, 1040))
    engine, off = make_engine(model), make_engine(model, prefix_bytes=0)
    first = run(engine, {"a": (prompt, GREEDY, None)})["a"][0]
    follow = prompt + first + [5, 6, 7]
    got = run(engine, {"b": (follow, GREEDY, None)})["b"]
    assert got[1] == len(prompt) + len(first) - 1  # the last sampled token was never fed
    assert got[0] == run(off, {"b": (follow, GREEDY, None)})["b"][0]


def test_shared_document_sent_with_eight_questions_at_once_reuses_the_stride_checkpoint(gguf_dense_f32):
    model = hf2q.load(gguf_dense_f32)
    doc = [1000 + (i * 37) % 5000 for i in range(3000)]
    questions = {f"q{i}": (doc + [200 + i, 300 + i, 400 + i], SEEDED, None) for i in range(8)}
    kwargs = dict(seqs=8, blocks=3200, chunk=512, batched=1024, max_len=3100)
    want = run(make_engine(model, prefix_bytes=0, **kwargs), questions)
    engine = make_engine(model, stride=512, **kwargs)
    got = run(engine, questions)  # all eight queued together: the first prefills, the others wait for its checkpoint
    assert {rid: g[0] for rid, g in got.items()} == {rid: w[0] for rid, w in want.items()}
    assert got["q0"][1] == 0
    assert all(got[f"q{i}"][1] == 2560 for i in range(1, 8)), got  # the document's last stride boundary
    assert engine.prefix.stats.hits == 7 and engine.prefix.stats.tokens_reused == 7 * 2560


def test_stride_checkpoints_inside_a_chunk_cost_no_step(model):
    """Stride boundaries inside a prefill chunk keep their states instead of cutting it: a 100-token prompt
    (chunks of 64, stride 16) takes the two steps a cache-off engine takes to its first token, holds a
    checkpoint at every boundary, and a prompt departing after token 50 resumes at 48 with cache-off tokens."""
    _check_strides_inside(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stride_checkpoints_inside_a_chunk_on_cuda(request):
    """The same through fla's kernels (the kept prefixes ride as more sequences of the delta-rule call)."""
    _check_strides_inside(hf2q.load(request.getfixturevalue("gguf_dense_f32"), device="cuda"))


def _check_strides_inside(model) -> None:
    prompt = list(range(5000, 5100))
    other = prompt[:50] + [7, 8, 9]
    want = run(make_engine(model, prefix_bytes=0), {"a": (prompt, GREEDY, None), "b": (other, GREEDY, None)})
    engine = make_engine(model, stride=16)
    engine.add_request(prompt, GREEDY, request_id="a")
    steps, tokens = 0, []
    while not tokens:
        steps += 1
        tokens = [t for o in engine.step() for t in o.new_token_ids]
    assert steps == 2 and all(engine.prefix.holds(prompt[:b]) for b in range(16, 100, 16))
    while engine.has_work():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == want["a"][0]
    assert run(engine, {"b": (other, GREEDY, None)})["b"] == (want["b"][0], 48)


def test_eviction_under_a_tiny_budget_never_breaks_a_running_request(model):
    """64 conversations at once, with room for 4 checkpoints."""
    convs = {f"c{c}": ([2000 + 97 * c + i for i in range(30)], GREEDY, 20) for c in range(64)}
    probe = make_engine(model)
    run(probe, dict(list(convs.items())[:1]))
    per_ckpt = probe.prefix.nbytes // len(probe.prefix)
    off = make_engine(model, prefix_bytes=0, seqs=64)
    first = run(off, convs)
    # Turn 2 sends the output back; the newest conversations come first, so their checkpoints are still held.
    turn2 = {rid: (p + first[rid][0] + [7, 8, 9, 10], GREEDY, None) for rid, (p, _, _) in reversed(convs.items())}
    turn2["c63"] = (turn2["c63"][0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), None)
    want = run(off, turn2)
    engine = make_engine(model, prefix_bytes=4 * per_ckpt, seqs=64)
    run(engine, convs)
    got = run(engine, turn2)
    assert {rid: g[0] for rid, g in got.items()} == {rid: w[0] for rid, w in want.items()}
    assert engine.prefix.stats.evictions > 0 and engine.prefix.nbytes <= 4 * per_ckpt
    assert got["c63"][1] == 35 and not got["c0"][1]
    assert engine.prefix.lookup(turn2["c63"][0]) is None  # evicted while c63 decoded on
    assert engine.cache.usage().slots_used == 0


def test_n_choices_fork_from_a_resumed_prompt(model):
    prompt = list(range(3000, 3050))
    follow = prompt + [11, 12, 13]
    results = []
    for prefix_bytes in (1 << 30, 0):
        engine = make_engine(model, prefix_bytes=prefix_bytes)
        run(engine, {"a": (prompt, GREEDY, 40)})
        for i in range(3):
            engine.add_request(follow, SEEDED.for_choice(i), request_id=f"c{i}", options=RequestOptions(group="g"))
        out = {f"c{i}": [] for i in range(3)}
        cached = set()
        while engine.has_work():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
                cached.add(o.num_cached_tokens)
        results.append((out, cached))
    (on, cached_on), (off, _) = results
    assert on == off
    assert min(cached_on) >= 40


def test_warm_up_requests_leave_nothing_behind(model):
    """The throwaway requests and prefills of the CUDA warm-up run through the whole engine but keep no prefix,
    slot or request, and the engine answers as a fresh one does."""
    engine, fresh = make_engine(model), make_engine(model)
    slots, blocks = engine.cache.num_free_slots, engine.cache.blocks.num_free_blocks
    engine._warm_up_requests()
    warm_up.prefill(engine.runner, [70, 69], then=((40, ()), (70, (68, 69))), inside=(35,))  # the CUDA warm-up's
    assert len(engine.prefix) == 0 and not engine.requests and not engine.has_work()
    assert (engine.cache.num_free_slots, engine.cache.blocks.num_free_blocks) == (slots, blocks)
    prompt = list(range(2000, 2030))
    assert run(engine, {"a": (prompt, SEEDED, None)}) == run(fresh, {"a": (prompt, SEEDED, None)})


def test_background_prefill_never_delays_or_changes_a_user_request(model):
    """A queued background prefill waits while a user request runs, though a slot is free for it; a running
    one is cancelled when a user request needs its slot. The user's tokens are a cache-off engine's."""
    user, history = list(range(5000, 5030)), list(range(4000, 4100))
    want = run(make_engine(model, prefix_bytes=0, seqs=1), {"u": (user, SEEDED, None)})["u"][0]
    for seqs, started in ((2, False), (1, True)):
        engine = make_engine(model, seqs=seqs, chunk=16)
        background = engine.prefill_in_background(history)
        if started:
            engine.step()  # idle: it starts, and holds the only slot
            assert background.num_computed == 16
        req = engine.add_request(user, SEEDED)
        tokens = []
        for _ in range(20):  # a bounded wait: a user request stuck behind the background one fails here
            tokens += [t for o in engine.step() if o.request_id == req.request_id for t in o.new_token_ids]
            assert background.num_computed == (16 if started else 0)  # no step of it while the user's runs
            if req.finished:
                break
        assert tokens == want
        while engine.has_work():
            engine.step()
        st = engine.prefix.stats
        assert engine.prefix.holds(history) is not started and engine.cache.usage().slots_used == 0
        assert (st.rerenders, st.rerender_cancelled, st.rerender_tokens) == ((0, 1, 0) if started else (1, 0, 100))
        assert (engine.prefill_in_background(history) is None) is not started


def _history_in_background(model):
    """A 100-token history one step (16 tokens) into its background prefill, the next turn extending it by
    three tokens, and that turn's tokens from a cache-off engine."""
    history = list(range(4000, 4100))
    follow = history + [7, 8, 9]
    want = run(make_engine(model, prefix_bytes=0), {"u": (follow, GREEDY, None)})["u"][0]
    engine = make_engine(model, chunk=16)
    background = engine.prefill_in_background(history)
    engine.step()
    assert background.num_computed == 16
    return history, follow, want, engine, background


def test_user_request_extending_a_running_background_prefill_resumes_at_its_end(model):
    """The next turn arrives while its history is still being prefilled: it waits for that checkpoint (which
    goes on though a user request now waits) instead of computing the history itself."""
    history, follow, want, engine, background = _history_in_background(model)
    got = run(engine, {"u": (follow, GREEDY, None)})["u"]
    assert got == (want, len(history)) and engine.prefix.stats.rerenders == 1
    assert engine.prefix.stats.hits == 1 and engine.prefix.stats.misses == 0  # the background's own admission: neither


def test_request_whose_rest_fits_one_step_does_not_wait_for_a_longer_checkpoint(model):
    """A running prefill will retain a longer checkpoint of the next turn's prompt, but the turn can compute
    what the held checkpoints leave in one step of its own: it is admitted at once (a wait could only delay
    its first token) and gives a cache-off engine's tokens."""
    history, follow, want, engine, background = _history_in_background(model)
    part = engine.add_request(history[:96], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while not part.finished:  # the background prefill waits meanwhile
        engine.step()
    assert engine.prefix.holds(history[:96]) and background.num_computed == 16
    engine.add_request(follow, GREEDY, request_id="u")
    tokens, cached, steps = [], 0, 0
    while engine.has_work():
        outputs = engine.step()
        steps += not tokens
        for o in outputs:
            if o.request_id == "u":
                tokens, cached = tokens + o.new_token_ids, max(cached, o.num_cached_tokens)
    assert (tokens, cached, steps) == (want, 96, 1)


def test_next_turn_finding_its_history_still_queued_computes_it_itself(model):
    """Every slot is held by background prefills when the next turn of another history arrives, its own
    history still queued: the turn takes that prefill's place (no step spent on it first), a running one is
    cancelled for its slot, and its first token comes after its own chunks only, as a cache-off engine's."""
    history = list(range(4000, 4100))
    follow = history + [7, 8, 9]
    want = run(make_engine(model, prefix_bytes=0), {"u": (follow, GREEDY, None)})["u"][0]
    engine = make_engine(model, seqs=2, chunk=16)
    others = [engine.prefill_in_background(list(range(s, s + 60))) for s in (6000, 7000)]
    engine.step()
    assert all(o.num_computed == 16 for o in others)
    engine.prefill_in_background(history)
    req, tokens, cached, steps = engine.add_request(follow, GREEDY), [], 0, 0
    for _ in range(40):  # bounded: a turn waiting on a prefill that never gets a slot fails here
        outputs = engine.step()
        steps += not tokens
        for o in outputs:
            tokens, cached = tokens + o.new_token_ids, max(cached, o.num_cached_tokens)
        if not engine.has_work():
            break
    st = engine.prefix.stats
    assert req.finished and (tokens, cached) == (want, 0) and steps == -(-len(follow) // 16)
    assert (st.rerenders, st.rerender_cancelled, st.rerender_absorbed) == (1, 1, 1)
    assert others[1].finished and engine.prefix.holds(others[0].prompt_ids) and not engine.prefix.holds(history)


def test_anchor_inside_a_chunk_costs_no_step_and_keeps_the_states_a_cut_there_leaves(model):
    """A chat turn's anchor sits a few tokens before its prompt's end. The chunk is not cut there: the first
    token comes after one step, not two, and the anchor's checkpoint holds the DeltaNet states of a chunk
    cut at the anchor (the way a cache that cannot keep inner states, under tensor parallelism, gets them).
    The next turn resumes from it with a cache-off engine's tokens."""
    # fp32 throughout; the projections multiply 40 rows here and 37 there (BLAS blocks them differently)
    _check_anchor_inside(model, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_anchor_inside_a_chunk_on_cuda(request):
    """The same through fla's kernels: the kept prefix rides as one more sequence of the recurrent call (every
    sequence of at most 64 tokens) and of the chunked one."""
    model = hf2q.load(request.getfixturevalue("gguf_dense_f32"), device="cuda")
    for chunk in (64, 128):
        _check_anchor_inside(model, rtol=1e-3, atol=1e-4, chunk=chunk)


def _check_anchor_inside(model, rtol: float, atol: float, chunk: int = 64) -> None:
    prompt, anchor = list(range(3000, 3100)), 93
    follow = prompt[:anchor] + [11, 12, 13, 14, 15]
    engines = {inside: make_engine(model, chunk=chunk) for inside in (True, False)}
    engines[False].cache.keeps_states_inside_a_chunk = False
    retained = {}
    for inside, engine in engines.items():
        engine.add_request(prompt, GREEDY, request_id="a", options=RequestOptions(anchor=anchor))
        steps = 1
        while not any(o.new_token_ids for o in engine.step()):
            steps += 1
        # chunks of 64: [0, 64), then [64, 100), or [64, 93) and [93, 100) where the anchor cuts
        assert steps == -(-len(prompt) // chunk) + (not inside)
        while engine.has_work():
            engine.step()
        retained[inside] = engine.cache._retained[engine.prefix._entries[tuple(prompt[:anchor])].key]
    (n, conv, rec), (n_cut, conv_cut, rec_cut) = retained[True], retained[False]
    assert n == n_cut == anchor
    torch.testing.assert_close(conv, conv_cut, rtol=rtol, atol=atol)
    torch.testing.assert_close(rec, rec_cut, rtol=rtol, atol=atol)
    want = run(make_engine(model, prefix_bytes=0), {"b": (follow, GREEDY, None)})["b"][0]
    assert run(engines[True], {"b": (follow, GREEDY, None)})["b"] == (want, anchor)


@pytest.mark.parametrize("thinking", [True, False])
def test_turn_anchor_from_the_shared_text_is_the_whole_probes(dense_model, thinking):
    """The server passes the prompt's text, and the anchor then comes from tokenizing the probe only from the
    last message start it shares with the prompt: the same anchor as tokenizing the whole probe, at every
    turn of the tool-using conversation (think blocks dropped and kept) and with a user turn ending it."""
    model, encoded = dense_model, []  # and the characters tokenized

    def encode(text):
        encoded.append(len(text))
        return model.tokenizer.encode(text)

    tokenizer = SimpleNamespace(encode=encode, token_to_id=model.tokenizer.token_to_id)
    state = SimpleNamespace(model=SimpleNamespace(chat_template=model.chat_template, tokenizer=tokenizer),
                            config=SimpleNamespace(default_chat_template_kwargs={}))
    extra = {"enable_thinking": thinking}
    messages = [Message(role="system", content="You answer questions about the weather. " * 60),
                Message(role="user", content="Is it raining in Paris?")]
    for t in range(len(FOLLOW_UPS) + 1):
        text = render_prompt(state, messages, [WEATHER_TOOL], extra)
        ids = model.tokenizer.encode(text)
        whole = turn_anchor(state, messages, [WEATHER_TOOL], extra, ids)
        encoded.clear()
        assert whole is not None and turn_anchor(state, messages, [WEATHER_TOOL], extra, ids, prompt_text=text) == whole
        assert sum(encoded) < len(text) // 4  # the system prompt alone is most of it
        if t < len(FOLLOW_UPS):
            messages += FOLLOW_UPS[t](t)


def test_a_turn_whose_rest_fits_a_prefill_graph_keeps_its_anchor_inside_one_replay(dense_model):
    """With prefill graphs (on the CPU their stand-in, over the vectorised path), a chat follow-up whose rest
    fits a graph (42 tokens over a cached history, its anchor 2 before the end) is one replay, not two cut at
    the anchor: the graph keeps the DeltaNet states after the anchor's row. Each turn's anchor checkpoint holds
    the eager engine's states (which keeps them from one more sequence of the delta rule), and the tokens are
    the eager engine's, for the turns and for the next one resumed from the follow-up's checkpoint."""
    from hf2q.engine.prefill_graphs import MAX_ROWS
    from hf2q.kernels.choose import fast_path

    prompt, anchor = list(range(3000, 3100)), 93
    follow = prompt[:anchor] + list(range(500, 540)) + [11, 12]  # the history, a new message, the suffix
    follow_anchor = len(follow) - 2
    after = follow[:follow_anchor] + [13, 14, 15]
    with fast_path("force"):
        engines = {graphed: make_engine(dense_model) for graphed in (False, True)}
        runner = engines[True].runner
        runner.use_graphs = runner.short_prefill_graphs = True
        engines[True].scheduler.graphed_prefill_rows = MAX_ROWS
        runner.paths = []
        got = {g: run(e, {"a": (prompt, GREEDY, anchor)})["a"] for g, e in engines.items()}
        assert got[True] == got[False] and sorted(runner.prefill_graphs.graphs) == [48, 64]  # 64 rows, then 36
        runner.paths = []
        got = {g: run(e, {"b": (follow, GREEDY, follow_anchor)})["b"] for g, e in engines.items()}
        assert got[True] == got[False] and got[True][1] == anchor
        assert runner.paths[0] == ("prefill graph", 1, len(follow) - anchor)  # one step before its first token
        assert all(how == "decode graph" for how, _, _ in runner.paths[1:])
        for tokens in (prompt[:anchor], follow[:follow_anchor]):
            kept = {g: e.cache._retained[e.prefix._entries[tuple(tokens)].key] for g, e in engines.items()}
            assert kept[True][0] == kept[False][0] == len(tokens)
            for x, y in zip(kept[False][1:], kept[True][1:]):
                torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5)
        want = run(make_engine(dense_model, prefix_bytes=0), {"c": (after, GREEDY, None)})["c"][0]
        assert run(engines[True], {"c": (after, GREEDY, None)})["c"] == (want, follow_anchor)
        # two follow-ups in one step: a graph keeps one row's states, so the second rest is cut at its anchor
        # and the step is still one replay (two anchors inside would have sent it to the eager forward)
        two = {f"d{i}": (prompt[:anchor] + list(range(600 + 50 * i, 640 + 48 * i)) + [11, 12], GREEDY, None)
               for i in (0, 1)}
        two = {rid: (ids, params, len(ids) - 2) for rid, (ids, params, _) in two.items()}
        runner.paths = []
        got = {g: run(e, two) for g, e in engines.items()}
        assert got[True] == got[False] and all(cached == anchor for _, cached in got[True].values())
        assert runner.paths[0] == ("prefill graph", 2, 42 + 38)  # d0's rest, and d1's up to its anchor
        assert all(how != "eager" for how, _, _ in runner.paths)
        for ids, _, at in two.values():
            assert engines[True].prefix.holds(ids[:at])
