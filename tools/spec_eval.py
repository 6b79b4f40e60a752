"""Acceptance and speed of speculative decoding on held-out text, and proof that the output is unchanged.

    python tools/spec_eval.py --model DIR/model-bf16.gguf --prompts DIR/heldout.json
                              [--modes off,mtp,ngram,mtp+ngram] [--k 1,2,3] [--max-tokens 128] [-- SERVE FLAGS]

For each mode (and each k where the mode drafts) the engine is built exactly as `hf2q serve` builds it
(`launch.sized_engine_config`, the same flags: anything after `--` is passed on, e.g. `--spec-cost-window 0`),
then every prompt of each kind in the prompts file (`tools/train_mtp.py` writes `heldout.json`: held-out
stdlib code and pydoc prose) is decoded greedily at batch 1. Per kind and mode: the mean acceptance length
(accepted drafts + 1 per verify round), rounds, drafts and acceptances per proposer, tokens per decode step,
decode tok/s (after each request's first token), its speed-up over `off` and whether every output equals
`off`'s token for token (where one does not: its first differing position and the plain logits' top-2 gap there),
and the start of one plain output, to tell real text from repetition. JSON on
stdout; exit status 1 when any output differs.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time


def serve_args(model_path: str, mode: str, k: int, serve_flags: list[str]) -> argparse.Namespace:
    """The flags `hf2q serve --model PATH --speculative MODE --num-speculative-tokens K SERVE_FLAGS` reads."""
    from hf2q.server import launch

    parser = argparse.ArgumentParser()
    launch.add_serve_args(parser)
    return parser.parse_args(["--model", model_path, "--speculative", mode, "--num-speculative-tokens", str(k),
                              *serve_flags])


def build_engine(model, args: argparse.Namespace):
    """The engine as `hf2q serve` sizes and warms it."""
    from hf2q.devices import resolve_device, resolve_dtype
    from hf2q.engine.engine import Engine
    from hf2q.server import launch
    from hf2q.spec.proposer import spec_config

    device = resolve_device(args.device)
    engine = Engine(model, launch.sized_engine_config(args, model, device, resolve_dtype(args.dtype, device),
                                                      spec_config(args)))
    engine.warm_up()
    return engine


def decode_one(engine, prompt: list[int], max_tokens: int, sync) -> tuple[list[int], float, int]:
    """Greedy tokens of one request alone, its decode seconds (after the first token) and decode steps."""
    from hf2q.engine.sampling_params import SamplingParams

    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    first = None
    steps = 0
    while engine.has_work():
        outs = engine.step()
        sync()
        for out in outs:
            tokens.extend(out.new_token_ids)
        if first is None and tokens:
            first = time.perf_counter()
        elif first is not None:
            steps += 1
    return tokens, time.perf_counter() - (first or time.perf_counter()), steps


def run_mode(engine, prompts: list[list[int]], max_tokens: int, sync) -> dict:
    decode_one(engine, prompts[0], 8, sync)  # the verify shapes' first use, untimed
    stats = engine.spec.stats if engine.spec is not None else None
    before = (stats.rounds, stats.accepted, stats.drafted) if stats else (0, 0, 0)
    before_by = {name: list(counts) for name, counts in stats.by_proposer.items()} if stats else {}
    outputs, seconds, steps, decoded = [], 0.0, 0, 0
    for prompt in prompts:
        tokens, s, n = decode_one(engine, prompt, max_tokens, sync)
        outputs.append(tokens)
        seconds, steps, decoded = seconds + s, steps + n, decoded + len(tokens) - 1
    row = {"decode_tok_s": round(decoded / seconds, 1) if seconds else None,
           "tokens_per_step": round(decoded / steps, 3) if steps else None}
    if stats:
        rounds, accepted, drafted = (a - b for a, b in zip((stats.rounds, stats.accepted, stats.drafted), before))
        row.update(verify_rounds=rounds, drafted=drafted, accepted=accepted,
                   acceptance_length=round((accepted + rounds) / rounds, 3) if rounds else None,
                   by_proposer={name: dict(zip(("rounds", "drafted", "accepted"),
                                               (a - b for a, b in zip(counts, before_by[name]))))
                                for name, counts in stats.by_proposer.items()})
    return row, outputs


def divergence(model, prompt: list[int], got: list[int], plain: list[int]) -> dict:
    """Where an output parts from plain decoding's: the first differing position, both tokens, and the gap
    between the two largest logits a cache-free forward over the prompt and the plain tokens before it gives
    there (a gap near zero is a near-tie that other kernels' rounding can flip; a wide one is a defect)."""
    at = next((i for i, (a, b) in enumerate(zip(got, plain)) if a != b), min(len(got), len(plain)))
    top = model.net.logits(prompt + plain[:at])[-1].topk(2).values.tolist()
    return {"position": at, "token": got[at] if at < len(got) else None,
            "plain_token": plain[at] if at < len(plain) else None, "top2_gap": round(top[0] - top[1], 4)}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="GGUF file (with an MTP head for the mtp modes)")
    p.add_argument("--prompts", required=True, help="JSON: {kind: [{'text': ...}, ...]} (train_mtp's heldout.json)")
    p.add_argument("--modes", default="off,mtp,ngram,mtp+ngram")
    p.add_argument("--k", default="3", help="drafts per round to try, comma-separated (1..3)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=0, help="prompts of each kind (0: all)")
    a = p.parse_args(argv)
    import torch

    import hf2q
    from hf2q.devices import keep_quantized, resolve_device, resolve_dtype

    modes = [m for m in a.modes.split(",") if m != "off"]
    ks = [int(x) for x in a.k.split(",")]
    plain = serve_args(a.model, "off", 1, serve_flags)
    device = resolve_device(plain.device)
    model = hf2q.load(a.model, device=device, dtype=resolve_dtype(plain.dtype, device),
                      keep_quantized=keep_quantized(plain))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    kinds = json.loads(open(a.prompts).read())
    prompts = {kind: [model.tokenizer.encode(item["text"]) for item in items[:a.limit or None]]
               for kind, items in kinds.items() if items}
    report, mismatches = {"model": a.model, "device": str(device), "max_tokens": a.max_tokens, "kinds": {}}, 0
    for mode, k in [("off", 1)] + [(m, k) for m in modes for k in ks]:
        engine = build_engine(model, serve_args(a.model, mode, k, serve_flags))
        for kind, ids in prompts.items():
            row, outputs = run_mode(engine, ids, a.max_tokens, sync)
            table = report["kinds"].setdefault(kind, {"prompts": len(ids)})
            if mode == "off":  # a sample shows whether high acceptance is just repetition
                table["_reference"], table["sample"] = outputs, model.tokenizer.decode(outputs[0])[:300]
            else:
                same = [o == r for o, r in zip(outputs, table["_reference"])]
                row["identical"] = all(same)
                row["first_differences"] = [divergence(model, prompt, out, ref)
                                            for prompt, out, ref, ok in zip(ids, outputs, table["_reference"], same)
                                            if not ok]
                plain = table["off"]["decode_tok_s"]
                row["speedup"] = round(row["decode_tok_s"] / plain, 3) if plain and row["decode_tok_s"] else None
                mismatches += same.count(False)
            table["off" if mode == "off" else f"{mode} k={k}"] = row
            print(json.dumps({"kind": kind, "mode": mode, "k": k, **row}), file=sys.stderr, flush=True)
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for table in report["kinds"].values():
        table.pop("_reference")
    report["identical"] = mismatches == 0
    print(json.dumps(report, indent=1))
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
