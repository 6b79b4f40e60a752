"""Compressed K/V at model level: logits and greedy runs with tq8/fp8 K/V against the model-dtype K/V.

The yardstick is the model's own rounding: bf16 K/V against fp32 K/V on the same fixture.
"""
from __future__ import annotations

import pytest
import torch

import hf2q
from hf2q.cache.hybrid import HybridCache
from hf2q.cache.kv_pool import KVPool
from hf2q.config import CacheConfig
from hf2q.engine.engine import Engine, EngineConfig
from hf2q.engine.request import Request, RequestOptions
from hf2q.engine.runner import ModelRunner
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.scheduler import SchedulerConfig
from hf2q.spec.proposer import SpecConfig
from tests.support.fixtures import copier_gguf
from tests.support.trained_checkpoints import PERIOD, periodic

PROMPT = [3, 17, 250, 9, 1044, 77, 5, 610]
STEPS = 256
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request):
    return hf2q.load(request.getfixturevalue(f"gguf_{request.param}_f32"))


@torch.inference_mode()
def greedy(model, fmt: str, steps: int = STEPS, forced: list[int] | None = None, device: str = "cpu",
           cuda_graphs: bool = False, prompt: list[int] = PROMPT,
           state_dtype: str = "float32") -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits of every step, decoding one token at a time through a `fmt` K/V pool and a
    `state_dtype` DeltaNet state (feeding `forced` tokens instead of its own when given, so every format sees the
    same context); with cuda_graphs the decode steps must have run in a captured graph."""
    blocks = -(-(len(prompt) + steps) // 16) + 1  # one more for the graphs' padding row
    slots = 2 if cuda_graphs else 1  # the graphs hold a padding slot of their own
    cache = HybridCache(model.config, CacheConfig(num_slots=slots, num_blocks=blocks, block_size=16, kv_dtype=fmt,
                                                  state_dtype=state_dtype), device=device)
    runner = ModelRunner(model.net, cache, cuda_graphs=cuda_graphs)
    req = Request("r", list(prompt), SamplingParams())
    req.slot = cache.acquire()
    _, logits = runner.run([(req, len(prompt))])
    rows = [logits[-1].float()]
    for i in range(steps - 1):
        req.output_ids.append(forced[i] if forced else int(rows[-1].argmax()))
        _, logits = runner.run([(req, 1)])
        rows.append(logits[-1].float())
    if cuda_graphs:
        assert runner.graphs is not None and runner.graphs.graphs, f"{fmt}: no decode graph captured"
    req.output_ids.append(int(rows[-1].argmax()))
    return req.output_ids, torch.stack(rows)


def agreed(a: list[int], b: list[int]) -> int:
    """Length of the common greedy prefix."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def within_the_logit_bounds(errors: dict[str, float], arch: str) -> bool:
    """The relative logit errors against fp32 K/V that test_logits_with_compressed_kv_stay_close_to_fp32_kv states."""
    fp8_bound = 0.08 if arch.endswith("moe") else 0.015
    return errors["tq8"] < 0.008 and errors["fp8"] < fp8_bound and errors["bfloat16"] < 0.003


def test_logits_with_compressed_kv_stay_close_to_fp32_kv(model):
    """Relative logit error over 24 decode steps fed the same tokens (fp32 K/V's greedy run). Measured: dense tq8
    0.0018, fp8 0.0076, bf16 0.0005; MoE tq8 0.0039, fp8 0.054, bf16 0.0010 (bounds leave ~2× room, fp8's on the
    MoE ~1.5×). The MoE's fp8 figure is one step: at the prompt's last token one routing choice flips (experts 5, 4
    → 5, 0), 0.25 at that step, the 23 others 0.007–0.032; any fp8 scale that does not put each vector's amax
    exactly at 448 flips it (measured with fp32 scales amax/416, /300, /272, /240), so the E8M0 scale, whose amax
    lands in (224, 448], does too. With the amax/448 scale it measured 0.014 under a bound of 0.03."""
    tokens, base = greedy(model, "float32", 24)
    errors = {fmt: rel(greedy(model, fmt, 24, tokens)[1], base) for fmt in ("bfloat16", "fp8", "tq8")}
    print("relative logit error vs fp32 K/V:", errors)
    assert within_the_logit_bounds(errors, model.config.arch), errors


@pytest.fixture(scope="module", params=["dense", "moe"])
def copier(request):
    return hf2q.load(copier_gguf(request.param))


COPY_PROMPT = periodic(1, 2 * PERIOD, torch.Generator().manual_seed(7))[0].tolist()
COPIED = [COPY_PROMPT[i % PERIOD] for i in range(len(COPY_PROMPT), len(COPY_PROMPT) + STEPS)]


def margins(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit of every step."""
    top = logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


@pytest.mark.slow
def test_greedy_agreement_against_the_bf16_yardstick(copier):
    """Greedy tokens over 256 steps on a model trained to continue a periodic sequence (copying the token a period
    back, which only attention over the K/V can fetch): tq8 and fp8 K/V agree with fp32 K/V at least as long as bf16
    K/V does. The fp32 run must copy every token, each by a margin of 2 logits or more, so the agreement is not bought
    by a model whose choices need no K/V or sit on near-ties (as the random fixtures' did: there tq8 parted from fp32
    after 172 tokens dense and 17 MoE, fp8 after 44 and 10, bf16 never).

    Measured (CPU): every format agrees for all 256 tokens, dense and MoE. Smallest margins, fp32 / bf16 / tq8 / fp8
    K/V: dense 7.29 / 7.23 / 7.27 / 6.45, MoE 6.96 / 6.96 / 6.95 / 5.57.
    """
    assert_copier_agreement(copier)


def assert_copier_agreement(copier, **run) -> None:
    """The copier's fp32-K/V greedy run copies every token by a margin of 2 logits or more, and tq8 and fp8 K/V
    agree with it at least as long as bf16 K/V does (`run`: greedy's device and cuda_graphs)."""
    runs = {fmt: greedy(copier, fmt, prompt=COPY_PROMPT, **run) for fmt in ("float32", "bfloat16", "fp8", "tq8")}
    tokens, logits = runs["float32"]
    smallest = {fmt: round(margins(r[1]).min().item(), 2) for fmt, r in runs.items()}
    lengths = {fmt: agreed(runs[fmt][0], tokens) for fmt in ("bfloat16", "fp8", "tq8")}
    print("smallest top-1 margin:", smallest, "greedy agreement with fp32 K/V (tokens of 256):", lengths)
    assert agreed(tokens, COPIED) == STEPS and smallest["float32"] >= 2.0
    assert lengths["tq8"] >= lengths["bfloat16"] and lengths["fp8"] >= lengths["bfloat16"]


def test_the_copier_needs_its_keys(copier, monkeypatch):
    """With every stored key zeroed the copier stops copying within a period (measured: from the first token, dense
    and MoE): the agreement above rests on the K/V."""
    store = KVPool.store
    monkeypatch.setattr(KVPool, "store", lambda pool, layer, rows, k, v: store(pool, layer, rows, k * 0, v))
    tokens, _ = greedy(copier, "float32", 2 * PERIOD, prompt=COPY_PROMPT)
    copied = agreed(tokens, COPIED)
    print("tokens copied with zeroed keys:", copied)
    assert copied < PERIOD


def make_engine(model, prefix_bytes=0, spec=SpecConfig()) -> Engine:
    return Engine(model, EngineConfig(
        max_model_len=512, spec=spec,
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=16),
        cache=CacheConfig(num_slots=4, num_blocks=256, block_size=8, kv_dtype="tq8", prefix_cache_bytes=prefix_bytes,
                          prefix_checkpoint_stride=0)))


def run_engine(engine, requests) -> tuple[dict, dict]:
    """requests: id -> (prompt, group), run together; returns id -> tokens, id -> cached tokens."""
    tokens, cached = {}, {}
    for rid, (prompt, group) in requests.items():
        engine.add_request(prompt, GREEDY, request_id=rid, options=RequestOptions(group=group))
        tokens[rid], cached[rid] = [], 0
    while engine.has_work():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            cached[o.request_id] = max(cached[o.request_id], o.num_cached_tokens)
    return tokens, cached


LONG = [(7 * i) % 500 + 3 for i in range(40)]


def test_prefix_checkpoints_resume_a_compressed_pool(model):
    """A prompt extending a finished request's sequence resumes from its tq8 checkpoint and gives the tokens of a
    fresh tq8 run."""
    engine = make_engine(model, prefix_bytes=1 << 28)
    first, _ = run_engine(engine, {"a": (LONG, None)})
    follow = LONG + first["a"] + [11, 12]
    reused, cached = run_engine(engine, {"b": (follow, None)})
    fresh, _ = run_engine(make_engine(model), {"b": (follow, None)})
    assert cached["b"] >= len(LONG) + len(first["a"]) - 1 and reused["b"] == fresh["b"]


def test_forks_share_compressed_blocks(model):
    """n = 2 siblings fork from the leader's tq8 prefix; greedy, both equal a lone request."""
    alone, _ = run_engine(make_engine(model), {"x": (LONG, None)})
    forked, _ = run_engine(make_engine(model), {"x0": (LONG, "g"), "x1": (LONG, "g")})
    assert forked["x0"] == forked["x1"] == alone["x"]


class HalfRight:
    """Drafts the plain run's next tokens with the last one wrong: every verify accepts some and rolls back one."""

    def __init__(self, prompt_len: int, plain: list[int]):
        self.prompt_len, self.plain = prompt_len, plain

    def propose(self, history, k):
        drafts = list(self.plain[len(history) - self.prompt_len:][:k])
        return drafts[:-1] + [drafts[-1] + 1] if len(drafts) > 1 else []


def test_speculation_rolls_back_a_compressed_pool(model):
    """Drafts verified against a tq8 pool, rejected ones truncated from it: the tokens equal a run without
    speculation."""
    plain, _ = run_engine(make_engine(model), {"s": (LONG, None)})
    engine = make_engine(model, spec=SpecConfig("ngram", 3))
    engine.spec.new_proposer = lambda: HalfRight(len(LONG), plain["s"])
    spec, _ = run_engine(engine, {"s": (LONG, None)})
    assert 0 < engine.spec.stats.accepted < engine.spec.stats.drafted
    assert spec["s"] == plain["s"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["dense", "moe"])
@torch.inference_mode()
def test_cuda_graphs_with_compressed_pools_stay_within_the_cpu_bounds(kind, request):
    """On CUDA a compressed pool runs the fast path's kernels in captured decode graphs: the fixture's logits with
    tq8 / fp8 / bf16 K/V, graph-replayed and fed fp32 K/V's greedy tokens, stay within the CPU test's bounds of
    fp32 K/V's (test_logits_with_compressed_kv_stay_close_to_fp32_kv), and each format's own greedy run agrees
    with fp32 K/V's at least as far as the floors the random fixtures' 256-step CPU runs gave (dense tq8 172, fp8 44;
    MoE tq8 17, fp8 10; the floors are half the MoE's). On the trained copier, graph-replayed, tq8 and fp8 agree
    with fp32 K/V at least as long as bf16 does over 256 tokens, as on the CPU."""
    model = hf2q.load(request.getfixturevalue(f"gguf_{kind}_f32"), device="cuda")

    def run(fmt, steps, forced=None):
        return greedy(model, fmt, steps, forced, device="cuda", cuda_graphs=True)

    tokens, base = run("float32", 24)
    errors = {fmt: rel(run(fmt, 24, tokens)[1], base) for fmt in ("bfloat16", "fp8", "tq8")}
    print("CUDA graphs, relative logit error vs fp32 K/V:", errors)
    assert within_the_logit_bounds(errors, model.config.arch), errors  # the MoE's fp8 0.051 on an H100
    greedy_base = run("float32", 64)[0]
    lengths = {fmt: agreed(run(fmt, 64)[0], greedy_base) for fmt in ("bfloat16", "fp8", "tq8")}
    print("CUDA graphs, greedy agreement with fp32 K/V (tokens of 64):", lengths)
    assert lengths["tq8"] >= 8 and lengths["fp8"] >= 5
    assert_copier_agreement(hf2q.load(copier_gguf(kind), device="cuda"), device="cuda", cuda_graphs=True)
