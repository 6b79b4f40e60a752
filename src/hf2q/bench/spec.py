"""The verify cost curve: decode tokens/s against acceptance length, on real shapes, at several batch sizes.

Random weights accept no real draft, so the acceptance is forced: every round each sequence feeds its last
token and k drafts (one verify step of k + 1 positions, its DeltaNet states kept per position), every row is
decided, and the slot is settled as if exactly L drafts were accepted (the state after position L, the K/V
past it dropped). A round then emits L + 1 tokens. L = "plain" is a one-token step per sequence, the baseline.
Both go through the server's runner: on CUDA the plain steps replay the decode graphs and the verify steps the
verify graphs (hf2q.engine.prefill_graphs), as `hf2q serve --short-prefill-graphs` runs them; elsewhere both
run eagerly. `hf2q bench --spec-accept 0 1 2 3` runs it after the usual figures.
"""
from __future__ import annotations

import time

import torch

from hf2q.bench.profiling import profile_steps
from hf2q.cache.hybrid import HybridCache
from hf2q.config import CacheConfig
from hf2q.engine.request import Request
from hf2q.engine.runner import ModelRunner
from hf2q.engine.sampling_params import SamplingParams


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def spec_curve(net, cfg, batches: list[int], accepts: list[int], k: int = 3, prompt: int = 512,
               rounds: int = 16, graphs: bool | None = None, profile: bool = False) -> dict:
    """{"spec_b{B}_plain_tok_s": ..., "spec_b{B}_L{L}_tok_s": ...} for each batch B and forced length L <= k.
    `graphs`: replay graphs (None: where CUDA runs them; True off CUDA: their stand-in, for tests).
    `profile`: also "spec_b{B}_{plain|L{max}}_profile" at the first batch: where a round's time goes."""
    if any(not 0 <= a <= k for a in accepts):
        raise ValueError(f"forced acceptance lengths must be within 0..{k}, got {accepts}")
    device = net.embed.device
    block = 16
    ctx = prompt + (k + 1) * (rounds + 2) + 8
    max_b = max(batches)
    cache = HybridCache(cfg, CacheConfig(num_slots=max_b + 1, num_blocks=(max_b + 1) * -(-ctx // block) + 4,
                                         block_size=block, kv_dtype="bfloat16" if device.type == "cuda" else "float32",
                                         state_dtype="float32"), device=device)
    runner = ModelRunner(net, cache, short_prefill_graphs=True, verify_seqs=max_b)  # graphs where CUDA runs them
    if graphs is not None:
        runner.use_graphs = graphs
    gen = torch.Generator().manual_seed(2)
    report = {}
    for b in batches:
        for name, length in [("plain", None)] + [(f"L{a}", a) for a in accepts]:
            reqs = []
            for i in range(b):
                req = Request(f"{name}-{i}", torch.randint(0, cfg.vocab_size, (prompt,), generator=gen).tolist(),
                              SamplingParams(), max_total_len=ctx)
                req.slot = cache.acquire()
                reqs.append(req)
            sampling, logits = runner.run([(req, prompt) for req in reqs])
            for req, token in zip(sampling, logits.argmax(-1).tolist()):
                req.output_ids.append(token)
            _round(runner, reqs, k, length, gen)  # warm-up (captures and compiles the shapes)
            _sync(device)
            t = time.perf_counter()
            emitted = sum(_round(runner, reqs, k, length, gen) for _ in range(rounds))
            _sync(device)
            report[f"spec_b{b}_{name}_tok_s"] = emitted / (time.perf_counter() - t)
            if profile and b == batches[0] and name in ("plain", f"L{max(accepts)}"):
                report[f"spec_b{b}_{name}_profile"] = profile_steps(lambda: _round(runner, reqs, k, length, gen))
            for req in reqs:
                cache.release(req.slot)
    return report


def _round(runner: ModelRunner, reqs: list[Request], k: int, length, gen: torch.Generator) -> int:
    """One step for every request: plain (length None) or a verify of k drafts settled as if `length` were
    accepted (every row decided, as the engine does). Tokens emitted."""
    vocab = runner.net.config.vocab_size
    for req in reqs:
        req.draft_ids = [] if length is None else torch.randint(0, vocab, (k,), generator=gen).tolist()
    sampling, logits = runner.run([(req, req.num_tokens - req.num_computed + len(req.draft_ids)) for req in reqs])
    emitted = 0
    for req, token in zip(sampling, logits.argmax(-1).tolist()):
        verify = req.extras.pop("verify", None)
        if verify is None:
            req.output_ids.append(token)
            emitted += 1
            continue
        verify.logits.argmax(-1).tolist()  # the draft rows decided
        valid = verify.start + verify.known + length
        if length < len(verify.drafts):
            runner.cache.set_linear_state(req.slot, verify.states.at(verify.known + length - 1))
            runner.cache.rewind(req.slot, valid)
        req.num_computed = valid
        req.output_ids += verify.drafts[:length] + [token]
        req.draft_ids = []
        emitted += length + 1
    return emitted


def format_curve(report: dict, batches: list[int], accepts: list[int]) -> str:
    """tokens/s per batch and forced acceptance length, and the speed-up over plain steps."""
    out = ["| batch | plain tok/s | " + " | ".join(f"L={a} tok/s (x)" for a in accepts) + " |",
           "|---" * (len(accepts) + 2) + "|"]
    for b in batches:
        plain = report[f"spec_b{b}_plain_tok_s"]
        cells = [f"{report[f'spec_b{b}_L{a}_tok_s']:,.1f} ({report[f'spec_b{b}_L{a}_tok_s'] / plain:.2f}x)"
                 for a in accepts]
        out.append(f"| {b} | {plain:,.1f} | " + " | ".join(cells) + " |")
    return "\n".join(out)
