"""The runner's graph-replayed decode gives the eager runner's greedy tokens, with requests joining and leaving
(buckets captured on first use, padded rows) and a request with images among them (its tokens rotated by
index + delta, stored by index). On a CUDA GPU through captured graphs; on the CPU through the graphs'
stand-in (each replay runs the step again over the same buffers), which checks the buffers, the padding and
the metadata the graphs are built from."""
from __future__ import annotations

import pytest
import torch

from hf2q.bench_shapes import random_model, tiny_config
from hf2q.cache.hybrid import HybridCache
from hf2q.config import CacheConfig
from hf2q.engine.request import Request
from hf2q.engine.runner import ModelRunner
from hf2q.engine.sampling_params import SamplingParams
from hf2q.kernels.choose import fast_path

IMAGE_DELTA = -4  # the positions an image's rows save: text after it is rotated by index + delta


def image_like_positions(n: int) -> torch.Tensor:
    """[3, n] multimodal positions of a prompt with an image's 3 x 3 grid at rows 2..10, as Qwen3.5's M-RoPE
    lays them out (the grid's rows share t, vary h and w; text after it continues from the grid's end)."""
    pos = torch.arange(n).expand(3, -1).clone()
    for i in range(9):
        pos[:, 2 + i] = torch.tensor([2, 2 + i // 3, 2 + i % 3])
    pos[:, 11:] = torch.arange(11, n) + IMAGE_DELTA
    return pos


def greedy(runner: ModelRunner, prompts: list[list[int]], steps: int, logits: list | None = None,
           image_request: int | None = None) -> list[list[int]]:
    """Prefill all prompts, decode `steps` tokens; the last request joins after two decode steps. Request
    `image_request` has image-like positions. Each step's logits, on the CPU in fp32, are appended to
    `logits` if given."""
    reqs = []
    for i, p in enumerate(prompts):
        req = Request(f"r{i}", list(p), SamplingParams())
        req.slot = runner.cache.acquire()
        if i == image_request:
            req.mrope = (image_like_positions(len(p)), IMAGE_DELTA)
        reqs.append(req)
    active = reqs[:-1]
    scheduled = [(r, len(r.prompt_ids)) for r in active]
    for step in range(steps):
        sampling, step_logits = runner.run(scheduled)
        if logits is not None:
            logits.append(step_logits.to("cpu", torch.float32, copy=True))  # a graph's output is overwritten
        for req, token in zip(sampling, step_logits.argmax(-1).tolist()):
            req.output_ids.append(token)
        if step == 2:
            active.append(reqs[-1])
        scheduled = [(r, r.num_tokens - r.num_computed) for r in active]
    return [r.output_ids for r in reqs]


def compare(device: str, dtype: torch.dtype, prompts, image_request=None, prefill_graphs: bool = False):
    """(eager, graphed) greedy tokens and logits of the same requests; with `prefill_graphs` the prefill steps
    (three prompts, then one joining three decoding) replay the prefill graphs too."""
    net = random_model(tiny_config(False), device=device, dtype=dtype, std=0.08, seed=7)
    tokens, logits = [], []
    for graphs in (False, True):
        cache = HybridCache(net.config, CacheConfig(num_slots=6, num_blocks=64, block_size=16, kv_dtype=str(dtype)[6:]),
                            device=device)
        runner = ModelRunner(net, cache, cuda_graphs=graphs, short_prefill_graphs=graphs and prefill_graphs)
        runner.use_graphs = graphs  # on the CPU: the graphs' stand-in
        logits.append([])
        tokens.append(greedy(runner, prompts, 10, logits[-1], image_request))
        assert (runner.graphs is not None) == graphs
        if graphs:
            assert sorted(runner.graphs.graphs) == [4]  # 3 then 4 rows: both in the 4-bucket
            if prefill_graphs:  # 5 + 17 + 11 prompt rows, then 14 + 3 decode rows
                assert sorted(runner.prefill_graphs.graphs) == [32, 48]
    return tokens, logits


def prompts_of(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (5 + 3 * i + (9 if i == 1 else 0),), generator=gen).tolist() for i in range(4)]


@torch.inference_mode()
def test_graph_stand_in_matches_eager_on_the_cpu():
    prompts = prompts_of(tiny_config(False).vocab_size)
    with fast_path("force"):  # the graphs' metadata is the vectorised path's
        (eager, graphed), (a, b) = compare("cpu", torch.float32, prompts, image_request=1)
        (_, text), (_, c) = compare("cpu", torch.float32, prompts)
    assert graphed == eager
    for x, y in zip(a[3:], b[3:]):  # decode steps (the first three are prefill and the join)
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)  # fp32 GEMMs of 4 rows and of 3
    # the image request's decode rows do rotate by index + delta: without it its logits are others
    assert max(float((x[1] - y[1]).abs().max()) for x, y in zip(b[3:], c[3:])) > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.inference_mode()
@pytest.mark.parametrize("prefill_graphs", [False, True], ids=["decode-graphs", "and-prefill-graphs"])
def test_graph_runner_matches_eager(prefill_graphs):
    prompts = prompts_of(tiny_config(False).vocab_size)
    (eager, graphed), _ = compare("cuda", torch.bfloat16, prompts, image_request=None if prefill_graphs else 1,
                                  prefill_graphs=prefill_graphs)
    assert graphed == eager


def short_prefills(device: str, dtype: torch.dtype, moe: bool, graphed: bool,
                   run_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Logits of one sequence fed a 200-token prompt (eager: too long for a prefill graph), then chunks of 2, 7,
    8, 15, 33, 63 and 127 known tokens (every bucket but 32, a full one but for its padding row), then 3 decode
    steps. With `run_dtype` the `dtype` weights are cast to it and the model runs in it (the same weights at
    a higher precision: the reference a lower one is measured against)."""
    net = random_model(tiny_config(moe), device=device, dtype=dtype, std=0.08, seed=7)
    if run_dtype is not None:
        net, dtype = net.to(run_dtype), run_dtype
    cache = HybridCache(net.config, CacheConfig(num_slots=4, num_blocks=64, block_size=16,
                                                kv_dtype=str(dtype)[6:]), device=device)
    runner = ModelRunner(net, cache, cuda_graphs=graphed, short_prefill_graphs=graphed)
    runner.use_graphs = graphed  # on the CPU: the graphs' stand-in
    gen = torch.Generator().manual_seed(3)
    req = Request("r", torch.randint(0, net.config.vocab_size, (200,), generator=gen).tolist(), SamplingParams())
    req.slot = cache.acquire()
    assert runner.run([(req, 199)])[0] == []  # its last prompt token comes in the first step of the loop
    logits = []
    for n in (1, 2, 7, 8, 15, 33, 63, 127, 1, 1, 1):
        if len(logits):  # known tokens the step feeds (as a follow-up turn's new tokens)
            req.output_ids += torch.randint(0, net.config.vocab_size, (n,), generator=gen).tolist()
        sampling, step_logits = runner.run([(req, n)])
        assert sampling == [req]
        logits.append(step_logits.to("cpu", torch.float32, copy=True))
    assert (runner.prefill_graphs is not None) == graphed
    if graphed:
        assert sorted(runner.prefill_graphs.graphs) == [4, 8, 16, 48, 64, 128]  # decode steps replay the decode graphs
        # a bucket's head multiplies as many rows as it can hold sequences, not every sequence the graphs allow
        graphs = runner.prefill_graphs
        assert [graphs.logits[b].shape[0] for b in (4, 8, 128)] == [min(b, graphs.max_seqs) for b in (4, 8, 128)]
    return logits


@torch.inference_mode()
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_short_prefill_graph_stand_in_matches_eager_on_the_cpu(moe):
    """A lone prefill of 2 to 63 tokens replays its bucket's graph (on the CPU the stand-in, over the same
    buffers and metadata): each row a paged-attention query at its own position, the padding rows a second
    DeltaNet sequence on the padding slot. Its logits, and those of the decode steps after it (which read the
    K/V and states it left), are the eager runner's."""
    with fast_path("force"):  # the graphs' metadata is the vectorised path's
        eager, graphed = (short_prefills("cpu", torch.float32, moe, g) for g in (False, True))
    for x, y in zip(eager, graphed):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)  # fp32; attention gathered in another order


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.inference_mode()
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_short_prefill_graphs_match_eager(moe):
    """The same through captured graphs in bf16: each step's logits as close to the fp32 run of the same weights
    as the eager runner's are, within twice the eager runner's own error plus 0.02 (the graphs run a 127-token
    chunk through fla's recurrent kernel, the eager runner through its chunked one: two roundings of the same
    sums). Greedy tokens are not compared: where the fp32 run's best two logits are closer than a bf16 run's
    error, that run may pick the other (on an H200, the dense fixture's 127-token chunk: gap 0.084, the eager
    runner's error 0.240, its token not the fp32 run's, the graphs' error 0.105 and token the fp32 run's), and
    where they are further apart than twice these errors the bound already keeps both runs' choice."""
    eager, graphed = (short_prefills("cuda", torch.bfloat16, moe, g) for g in (False, True))
    reference = short_prefills("cuda", torch.bfloat16, moe, False, run_dtype=torch.float32)
    for step, (r, x, y) in enumerate(zip(reference, eager, graphed)):
        eager_error, graph_error = float((x - r).abs().max()), float((y - r).abs().max())
        assert graph_error <= 2 * eager_error + 0.02, (step, graph_error, eager_error)


@torch.inference_mode()
def test_mixed_prefill_and_decode_steps_replay_prefill_graphs_on_the_cpu():
    """Three prompts prefilled together, and later a fourth prefilled beside the three decoding: both steps
    replay a prefill graph (each sequence a DeltaNet sequence of its own, its rows paged-attention queries),
    and every step's logits are the eager runner's."""
    prompts = prompts_of(tiny_config(False).vocab_size)
    with fast_path("force"):
        (eager, graphed), (a, b) = compare("cpu", torch.float32, prompts, prefill_graphs=True)
    assert graphed == eager
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)


def burst(device: str, dtype: torch.dtype, graphed: bool, run_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Logits of six prompts of 25-35 tokens prefilled in one step (171 rows, past the short graphs' 127), then
    a prompt of more rows than a burst sequence may bring (129), then two decode steps of all seven. With
    `run_dtype` the `dtype` weights are cast to it and the model runs in it."""
    from hf2q.engine.prefill_graphs import BURST_SEQ_ROWS

    net = random_model(tiny_config(False), device=device, dtype=dtype, std=0.08, seed=7)
    if run_dtype is not None:
        net, dtype = net.to(run_dtype), run_dtype
    gen = torch.Generator().manual_seed(1)
    lengths = [25, 26, 27, 28, 30, 35, BURST_SEQ_ROWS + 1]
    prompts = [torch.randint(0, net.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    cache = HybridCache(net.config, CacheConfig(num_slots=9, num_blocks=96, block_size=16, kv_dtype=str(dtype)[6:]),
                        device=device)
    runner = ModelRunner(net, cache, cuda_graphs=graphed, short_prefill_graphs=graphed)
    runner.use_graphs = graphed  # on the CPU: the graphs' stand-in
    reqs = [Request(f"r{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
    for req in reqs:
        req.slot = cache.acquire()
    logits = []
    for step in ([(r, len(r.prompt_ids)) for r in reqs[:6]], [(reqs[6], len(reqs[6].prompt_ids))], None, None):
        sampling, out = runner.run(step or [(r, 1) for r in reqs])
        logits.append(out.to("cpu", torch.float32, copy=True))
        for req, token in zip(sampling, out.argmax(-1).tolist()):
            req.output_ids.append(token)
    if graphed:  # the burst took the 256-row graph, the long prompt none (the short graphs neither)
        assert sorted(runner.burst_graphs.graphs) == [256] and not runner.prefill_graphs.graphs
    return logits


@torch.inference_mode()
def test_a_burst_of_short_prompts_replays_a_burst_graph_on_the_cpu(monkeypatch):
    """By default the burst replays the 256-row burst graph (each prompt a DeltaNet sequence of its
    own, its rows paged-attention queries), the long prompt runs eagerly; every step's logits, and those of the
    decode steps after (which read what the prefills left), are the eager runner's. HF2Q_BURST_GRAPHS=0: none."""
    net = random_model(tiny_config(False), device="cpu", dtype=torch.float32, std=0.08, seed=7)
    cache = HybridCache(net.config, CacheConfig(num_slots=4, num_blocks=32, block_size=16, kv_dtype="float32"))
    monkeypatch.setenv("HF2Q_BURST_GRAPHS", "0")
    assert ModelRunner(net, cache, cuda_graphs=True, short_prefill_graphs=True)._burst_graphs() is None
    monkeypatch.delenv("HF2Q_BURST_GRAPHS")
    with fast_path("force"):
        eager, graphed = (burst("cpu", torch.float32, g) for g in (False, True))
    for x, y in zip(eager, graphed):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.inference_mode()
def test_a_burst_graph_matches_eager(monkeypatch):
    """The same through captured graphs in bf16, each step as close to the fp32 run of the same weights as the
    eager runner's (the bound of test_short_prefill_graphs_match_eager)."""
    monkeypatch.setenv("HF2Q_BURST_GRAPHS", "1")
    eager, graphed = (burst("cuda", torch.bfloat16, g) for g in (False, True))
    reference = burst("cuda", torch.bfloat16, False, run_dtype=torch.float32)
    for step, (r, x, y) in enumerate(zip(reference, eager, graphed)):
        eager_error, graph_error = float((x - r).abs().max()), float((y - r).abs().max())
        assert graph_error <= 2 * eager_error + 0.02, (step, graph_error, eager_error)


@torch.inference_mode()
def test_a_burst_graph_that_fails_to_capture_leaves_bursts_to_the_eager_forward(monkeypatch, caplog):
    """A capture that fails (here a RuntimeError, as an operation a graph cannot hold raises) is logged and the
    burst graphs serve nothing after it: the warm-up goes on, and a burst runs eagerly."""
    from hf2q.engine.prefill_graphs import PrefillGraphs

    monkeypatch.setenv("HF2Q_BURST_GRAPHS", "1")  # read when the runner is built
    net = random_model(tiny_config(False), device="cpu", dtype=torch.float32, std=0.08, seed=7)
    cache = HybridCache(net.config, CacheConfig(num_slots=4, num_blocks=32, block_size=16, kv_dtype="float32"))
    runner = ModelRunner(net, cache, cuda_graphs=True, short_prefill_graphs=True)
    runner.use_graphs = True  # on the CPU: the graphs' stand-in

    def fails(self, buckets=None):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(PrefillGraphs, "capture", fails)
    with caplog.at_level("WARNING"):
        runner._capture_burst_graphs()
    assert "bursts of short prompts run eagerly" in caplog.text and "not permitted" in caplog.text
    assert not runner.burst_graphs.serves([60, 70, 80], [5, 5, 6])


@torch.inference_mode()
def test_an_eager_steps_output_layer_runs_a_decode_buckets_rows(monkeypatch):
    """With decode graphs, an eager step wanting 3 rows' logits runs the output layer over 4 (the last row
    repeated: the 4-row bucket's kernels are the ones the warm-up compiled) and returns the eager runner's 3."""
    net = random_model(tiny_config(False), device="cpu", dtype=torch.float32, std=0.08, seed=7)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, net.config.vocab_size, (129 + i,), generator=gen).tolist() for i in range(3)]
    rows, logits = [], []
    plain = net.compute_logits
    monkeypatch.setattr(net, "compute_logits", lambda h: rows.append(h.shape[0]) or plain(h))
    for graphed in (False, True):
        cache = HybridCache(net.config, CacheConfig(num_slots=6, num_blocks=64, block_size=16, kv_dtype="float32"))
        runner = ModelRunner(net, cache, cuda_graphs=graphed, short_prefill_graphs=graphed)
        runner.use_graphs = graphed  # on the CPU: the graphs' stand-in
        if graphed:
            runner._decode_graphs()
        reqs = [Request(f"r{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
        for req in reqs:
            req.slot = cache.acquire()
        with fast_path("force"):
            logits.append(runner.run([(r, len(r.prompt_ids)) for r in reqs])[1].clone())
    assert rows == [3, 4] and logits[1].shape[0] == 3
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_the_warm_up_keeps_states_inside_its_chunks(monkeypatch):
    """The warm-up's first prefill hands the DeltaNet states after its middle token to a `StateAt`, as a prefix
    checkpoint inside a chunk does, and its whole chunks over the prefix those after two and three of their last
    tokens, so the kernels of those longer delta rules are compiled and tuned before serving."""
    from hf2q.cache import state_at
    from hf2q.engine import warm_up
    from hf2q.engine.warm_up import FOLLOW_UP_CHUNKS

    net = random_model(tiny_config(False), device="cpu", dtype=torch.float32, std=0.08, seed=7)
    handed = []
    plain = state_at.StateAt.__call__
    monkeypatch.setattr(state_at.StateAt, "__call__",
                        lambda self, j, *a: handed.append((self.lengths, j)) or plain(self, j, *a))
    chunks = warm_up.chunks_over_prefix(40)
    assert chunks == (*((n, ()) for n in FOLLOW_UP_CHUNKS), (40, (38, 39)), (40, (37, 38, 39)))
    cache = HybridCache(net.config, CacheConfig(num_slots=4, num_blocks=64, block_size=16, kv_dtype="float32"))
    runner = ModelRunner(net, cache)
    with fast_path("force"):
        warm_up.prefill(runner, [40], then=chunks, inside=(20,))
    deltanet_layers = cache.empty_linear_states(1)[0].shape[0]
    assert deltanet_layers > 0
    assert handed == [((m,), j) for kept in ((20,), (38, 39), (37, 38, 39)) for j in range(deltanet_layers)
                      for m in kept]


@torch.inference_mode()
def test_the_warm_up_runs_chunks_beside_decode_rows(monkeypatch):
    """The warm-up's steps of a chunk beside 2, 4 and 8 other sequences' decode rows send those rows through one
    paged-attention call each (the split counts a served mixed step meets), as many as the free slots allow, and
    leave every slot free."""
    from hf2q.engine import warm_up
    from hf2q.engine.warm_up import DECODE_ROWS
    from hf2q.kernels.attention import ops

    net = random_model(tiny_config(False), device="cpu", dtype=torch.float32, std=0.08, seed=7)
    cache = HybridCache(net.config, CacheConfig(num_slots=10, num_blocks=64, block_size=16, kv_dtype="float32"))
    runner = ModelRunner(net, cache)
    rows = []
    plain = ops.paged_decode_attention
    monkeypatch.setattr(ops, "paged_decode_attention", lambda q, *a, **kw: rows.append(q.shape[0]) or plain(q, *a, **kw))
    with fast_path("force"):
        warm_up.beside_decode_rows(runner, 40)
    attention_layers = len(net.config.full_attention_layers)
    assert attention_layers > 0
    assert rows == [k for k in DECODE_ROWS for _ in range(attention_layers)]
    assert cache.num_free_slots == 10
    rows.clear()
    small = HybridCache(net.config, CacheConfig(num_slots=4, num_blocks=64, block_size=16, kv_dtype="float32"))
    with fast_path("force"):  # room for 2 decode rows beside the chunk, not for 4 or 8
        warm_up.beside_decode_rows(ModelRunner(net, small), 40)
    assert rows == [2] * attention_layers and small.num_free_slots == 4
    tiny = HybridCache(net.config, CacheConfig(num_slots=2, num_blocks=64, block_size=16, kv_dtype="float32"))
    warm_up.beside_decode_rows(ModelRunner(net, tiny), 40)  # no room for two: left out, nothing held
    assert tiny.num_free_slots == 2
