"""The warm-up's throwaway requests: served end to end before `/health` says 200, so that a first real request
finds every kernel on its path compiled, every shape met and every code path run once."""
from __future__ import annotations

from hf2q.engine.sampling_params import SamplingParams

# Prompt lengths of the warm-up requests: Triton specialises a kernel on whether an integer argument
# is 1 or divisible by 16, a batch of two prompts is a varlen batch, and prompts of at most 64 tokens take
# fla's recurrent kernel, so each meets code the full-chunk prefill does not (on the H200 a first 64-token
# request waited 1.4 s for it, later ones 0.1 s; a first lone 32-token prompt 6.8 s, and a first batch of
# 16 short prompts 5.7 s, before the lone and the 16 short prompts were added here). A lone 64-token prompt and
# three of them give lengths that are multiples of 16, alone and as a varlen batch, which the MTP head's catch-up
# over their prompts meets too (on an H100 the first lone 64-token request took 265 ms to its first token, the
# next ones about 100 ms; a first burst of 64 such prompts with `--speculative mtp` waited 16 s).
PROMPTS = ((67,), (64,), (33, 50), (40,), (64,) * 3, (20,) * 16)

# With speculation, throwaway requests long enough to draft: two tokens leave no room for a draft, so the
# requests above never ran a verify round, its settle or a rejected draft's rewind, and the first real
# request met them (on an H100 it took 823 ms where the next ones took 715, all at acceptance 0). The
# speculator forgets these requests after (`Speculator.forget_history`): neither the metrics nor the cost
# control's memory across requests count them.
SPEC_PROMPTS = ((64,), (64, 40))
SPEC_TOKENS = 12


def serve(engine, prompts: tuple = PROMPTS, max_tokens: int = 2) -> None:
    """Serve throwaway requests through `engine` (scheduler, runner, sampler, greedy and sampled): each entry of
    `prompts` is a batch of prompt lengths, each request `max_tokens` long. They leave nothing in the prefix
    cache."""
    prefix, engine.scheduler.prefix = engine.scheduler.prefix, None
    try:
        for lengths in prompts:
            reqs = []
            for i, n in enumerate(lengths):
                n = max(1, min(n, engine.max_model_len - max_tokens))
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0 if i == 0 else 0.8,
                                        top_p=1.0 if i == 0 else 0.9, seed=i)
                reqs.append(engine.add_request([(7 * j + 3) % engine.model.config.vocab_size for j in range(n)],
                                               params, request_id=f"warm-up-{n}-{i}"))
            while any(not r.finished for r in reqs):
                engine.step()
    finally:
        engine.scheduler.prefix = prefix
