"""2 and 4 gloo ranks on CPU: greedy tokens identical to one device, logits within fp32 rounding.

Ranks are forked from the test process, so they inherit the loaded models instead of reading the files.
At 4 ranks the tiny models' 2 K/V heads and 2 DeltaNet key heads are replicated (2 ranks each).
"""
from __future__ import annotations

import pytest
import torch

from hf2q.config import CacheConfig
from hf2q.distributed.launch import generate_tp, run_ranks
from hf2q.distributed.sharding import shard_model
from hf2q.engine.engine import Engine, EngineConfig
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.scheduler import SchedulerConfig

PROMPTS = [[101, 2002, 30003, 4004, 505, 60006, 707, 8008, 90009, 1010, 111, 1212, 1313], [7, 77, 777], [248000]]
LOGIT_PROMPT = [11, 2222, 33333, 4444, 555, 66666, 77]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# small chunks and token budget: prefill takes several steps, batched with decodes; two slots for three
# prompts: the third reuses a released slot
CONFIG = EngineConfig(max_model_len=64, scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8,
                                                                  prefill_chunk=5),
                      cache=CacheConfig(num_slots=2, num_blocks=32, block_size=4))


def one_device(model) -> list[list[int]]:
    engine = Engine(model, CONFIG)
    reqs = [engine.add_request(p, PARAMS, request_id=str(i)) for i, p in enumerate(PROMPTS)]
    out = {r.request_id: [] for r in reqs}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[r.request_id] for r in reqs]


def _rank(rank, world, group, models, result_path, warm_up=False):
    torch.set_num_threads(1)
    results = {}
    for kind, model in models.items():
        tokens = generate_tp(model, rank, world, group, PROMPTS, PARAMS, CONFIG, warm_up=warm_up)
        logits = shard_model(model, rank, world, group).net.logits(LOGIT_PROMPT)  # a collective on every rank
        results[kind] = (tokens, logits)
    if rank == 0:
        torch.save(results, result_path)


@pytest.fixture(scope="module")
def expected(tp_models):
    return {kind: (one_device(m), m.logits(LOGIT_PROMPT)) for kind, m in tp_models.items()}


@pytest.mark.parametrize("world", [2, 4])
def test_tp_greedy_tokens_and_logits_match_one_device(tp_models, expected, world, tmp_path):
    path = tmp_path / "results.pt"
    run_ranks(_rank, world, tp_models, path, start_method="fork", timeout_s=120)
    got = torch.load(path)
    for kind, (tokens, logits) in expected.items():
        assert all(len(t) == PARAMS.max_tokens for t in tokens)
        assert got[kind][0] == tokens, kind
        rel = ((got[kind][1] - logits).abs().max() / logits.abs().max()).item()
        assert rel <= 1e-5, (kind, rel)


def _warmed_rank(rank, world, group, models, result_path):
    _rank(rank, world, group, {"dense": models["dense"]}, result_path, warm_up=True)


def test_tp_warm_up_requests_run_on_every_rank_and_leave_nothing_behind(tp_models, expected, tmp_path):
    """The server's tensor-parallel warm-up (throwaway requests stepped by every rank together: a whole prefill
    chunk, a batch of two, sixteen short prompts) ends on every rank, and the group then gives one device's tokens."""
    path = tmp_path / "results.pt"
    run_ranks(_warmed_rank, 2, tp_models, path, start_method="fork", timeout_s=120)
    assert torch.load(path)["dense"][0] == expected["dense"][0]
