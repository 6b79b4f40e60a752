"""The verify cost curve: decode tokens/s against acceptance length, on real shapes, at several batch sizes.

Random weights accept no real draft, so the acceptance is forced: every round each sequence feeds its last
token and k drafts (one forward of k + 1 positions, DeltaNet states kept per position as in serving),
takes the logits of every row, and settles as if exactly L drafts were accepted (the state after position
L, the K/V past it dropped). A round then emits L + 1 tokens. L = "plain" is a one-token eager step per
sequence, the baseline. `hf2q bench --spec-accept 0 1 2 3` runs it after the usual figures.
"""
from __future__ import annotations

import time

import torch

from hf2q.cache.hybrid import HybridCache
from hf2q.config import CacheConfig
from hf2q.forward import ForwardBatch
from hf2q.spec.states import PositionStates


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def spec_curve(net, cfg, batches: list[int], accepts: list[int], k: int = 3, prompt: int = 512,
               rounds: int = 16) -> dict[str, float]:
    """{"spec_b{B}_plain_tok_s": ..., "spec_b{B}_L{L}_tok_s": ...} for each batch B and forced length L <= k."""
    if any(not 0 <= a <= k for a in accepts):
        raise ValueError(f"forced acceptance lengths must be within 0..{k}, got {accepts}")
    device = net.embed.device
    block = 16
    ctx = prompt + (k + 1) * (rounds + 2) + 8
    max_b = max(batches)
    cache = HybridCache(cfg, CacheConfig(num_slots=max_b, num_blocks=max_b * -(-ctx // block) + 4,
                                         block_size=block, kv_dtype="bfloat16" if device.type == "cuda" else "float32",
                                         state_dtype="float32"), device=device)
    gen = torch.Generator().manual_seed(2)
    report = {}
    for b in batches:
        slots = [cache.acquire() for _ in range(b)]
        for s in slots:
            cache.reserve(s, ctx)
        for s in slots:
            ids = torch.randint(0, cfg.vocab_size, (prompt,), generator=gen).tolist()
            net(ForwardBatch.single(ids, slot=s, cache=cache, device=device))
            cache.commit(s, prompt)
        start = {s: prompt for s in slots}
        for name, length in [("plain", None)] + [(f"L{a}", a) for a in accepts]:
            _round(net, cache, slots, start, k, length)  # warm-up (compiles the shapes)
            _sync(device)
            t = time.perf_counter()
            emitted = sum(_round(net, cache, slots, start, k, length) for _ in range(rounds))
            _sync(device)
            report[f"spec_b{b}_{name}_tok_s"] = emitted / (time.perf_counter() - t)
            for s in slots:  # back to the prompt, so every length decodes at the same context
                cache.rewind(s, prompt)
                start[s] = prompt
        for s in slots:
            cache.release(s)
    return report


def _round(net, cache, slots, start, k, length) -> int:
    """One step for every slot: plain (length None) or a verify that keeps `length` drafts. Tokens emitted."""
    n = 1 if length is None else k + 1
    device = net.embed.device
    ids = torch.randint(0, net.config.vocab_size, (len(slots) * n,), device=device)
    positions = torch.cat([torch.arange(start[s], start[s] + n, device=device) for s in slots])
    batch = ForwardBatch(ids, positions, [n] * len(slots), [start[s] for s in slots], list(slots), cache)
    keep = {i: PositionStates(cache, n) for i in range(len(slots))} if length is not None else {}
    batch.extras["kept_states"] = {i: [states] for i, states in keep.items()}
    tokens = net.compute_logits(net(batch)).argmax(-1).tolist()  # every row decided, as the engine does
    for i, s in enumerate(slots):
        cache.commit(s, start[s] + n)
        valid = start[s] + (1 if length is None else 1 + length)
        if length is not None and length < k:
            cache.set_linear_state(s, keep[i].at(length))
            cache.rewind(s, valid)
        start[s] = valid
    return len(tokens) // n * (1 if length is None else length + 1)


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
