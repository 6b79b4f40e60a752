"""`hf2q bench`: decode and prefill speed on a real-shape random-weight model, against the GPU's
memory-bandwidth ceiling and HF transformers' `generate` on the same shape, in one run.

Decode at batch 1 reads every weight once per token, so its ceiling is bytes read / copy bandwidth;
prefill is matmul-bound, so its ceiling is FLOPs / measured matmul rate. With `--quant` the weights are
random GGUF blocks (Q8_0, or llama.cpp's Q4_K_M mix) and the decode ceiling counts their bytes.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from hf2q.bench.profiling import profile_steps
from hf2q.bench_shapes import QUANT_MIXES, SHAPES, matrix_elems, random_model, random_quant_model, weight_bytes
from hf2q.config import STATE_DTYPES


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=sorted(SHAPES), default="9b", help="model shape (random weights)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="decode batch sizes")
    p.add_argument("--prompt", type=int, default=512, help="context before decoding")
    p.add_argument("--new", type=int, default=128, help="decode steps timed")
    p.add_argument("--prefill", type=int, default=4096, help="prefill length timed")
    p.add_argument("--hf-new", type=int, default=32, help="tokens HF generates per timing (0: skip HF)")
    p.add_argument("--quant", choices=QUANT_MIXES, default=None,
                   help="weights as random GGUF blocks of this mix, multiplied by the quantized kernels")
    p.add_argument("--batched-weights", choices=("quantized", "dense", "columns"), default="quantized",
                   help="with --quant: dense keeps a dequantized copy of every quantized projection, which steps of "
                        "16+ rows multiply (as `hf2q serve --batched-weights`); columns also lays out the Q4_K "
                        "projections by column for steps of 5-16 rows; the ceilings still count the blocks, the "
                        "bytes a step must read")
    p.add_argument("--dense-rows", type=int, default=None,
                   help="with --batched-weights dense: the fewest rows that multiply the copies (the server's "
                        "crossover, hf2q.kernels.linear.ops.DENSE_ROWS, is 16), to find where the copies win")
    p.add_argument("--state-dtype", choices=STATE_DTYPES, default="float32",
                   help="the DeltaNet recurrent state's dtype in the slot pools (as `hf2q serve --state-dtype`)")
    p.add_argument("--json", default=None, help="also write every figure to this JSON file")
    p.add_argument("--profile-prefill", action="store_true", help="also print the prefill's GPU time per kernel")
    p.add_argument("--spec-accept", type=int, nargs="+", default=None, metavar="L",
                   help="also time speculative verify rounds that accept exactly L drafts (0..k), per --batch "
                        "size, against plain eager steps (hf2q.bench.spec)")
    p.add_argument("--spec-k", type=int, default=3, help="drafts per verify round with --spec-accept")
    p.add_argument("--profile-spec", action="store_true",
                   help="with --spec-accept: also profile plain steps and the longest forced length at the first batch")


def _sync_time(fn, reps: int = 3) -> float:
    """Median seconds of fn() after one warm-up, synchronised."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def _put(report: dict, key: str, value) -> None:
    """Record a figure and print it at once, so a run cut short still shows what it measured."""
    report[key] = value
    print(f"{key}: {value:,.1f}", flush=True)


def ceilings() -> tuple[float, float]:
    """Device-to-device copy bandwidth (bytes read + written, B/s) and bf16 matmul rate (FLOP/s)."""
    a = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    bw = 2 * a.numel() * 2 / _sync_time(lambda: b.copy_(a), 5)
    del a, b
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    flops = 2 * 8192 ** 3 / _sync_time(lambda: x @ y, 5)
    return bw, flops


def decode_ceiling(net, cfg, batch: int, context: int, bw: float, state_dtype: str = "float32") -> float:
    """Tokens/s if a step only moved its unavoidable bytes: weights (experts actually touched), each
    sequence's DeltaNet state (its recurrent part in `state_dtype`) read and written, its K/V read."""
    from hf2q.cache.hybrid import state_bytes_per_slot

    active = None
    if cfg.is_moe:
        e, k = cfg.num_experts, cfg.num_experts_per_tok
        active = e * (1 - (1 - k / e) ** batch)
    kv = len(cfg.full_attention_layers) * 2 * cfg.num_kv_heads * cfg.head_dim * 2 * context
    step = weight_bytes(net, active) + batch * (2 * state_bytes_per_slot(cfg, state_dtype) + kv)
    return batch * bw / step


def prefill_ceiling(net, cfg, tokens: int, flops: float) -> float:
    mats = matrix_elems(net)
    if cfg.is_moe:
        per_layer = 3 * cfg.num_experts * cfg.moe_intermediate_size * cfg.hidden_size
        mats -= cfg.num_layers * per_layer * (1 - cfg.num_experts_per_tok / cfg.num_experts)
    if net.tie_embeddings:
        mats += net.embed.numel()
    attn = len(cfg.full_attention_layers) * 2 * cfg.num_heads * cfg.head_dim * tokens  # causal QK^T + PV
    return flops / (2 * mats + attn)


def _prefill(net, cache, slot, ids, start=0) -> torch.Tensor:
    from hf2q.forward import ForwardBatch
    cache.reserve(slot, start + len(ids))
    batch = ForwardBatch.single(ids, start=start, slot=slot, cache=cache, device="cuda")
    out = net.compute_logits(net(batch)[-1:])
    cache.commit(slot, start + len(ids))
    return out


@torch.inference_mode()
def bench_ours(net, cfg, args, report: dict) -> None:
    from hf2q.cache.hybrid import HybridCache
    from hf2q.config import CacheConfig
    from hf2q.engine.cuda_graphs import DecodeGraphs

    max_b = max(args.batch)
    ctx = args.prompt + args.new + 16
    blocks = (max_b + 2) * (-(-ctx // 16)) + -(-args.prefill // 16) + 8
    cache = HybridCache(cfg, CacheConfig(num_slots=max_b + 3, num_blocks=blocks, block_size=16,
                                         kv_dtype="bfloat16", state_dtype=args.state_dtype), device="cuda")
    gen = torch.Generator().manual_seed(1)
    slot = cache.acquire()
    long_ids = torch.randint(0, cfg.vocab_size, (args.prefill,), generator=gen).tolist()

    def prefill_once():
        cache.reset(slot)
        _prefill(net, cache, slot, long_ids)
    _put(report, "prefill_tok_s", args.prefill / _sync_time(prefill_once, 3))
    if getattr(args, "profile_prefill", False):
        report["profile_prefill"] = profile_steps(prefill_once, reps=1, top=30)["gpu_top"]
        for row in report["profile_prefill"]:
            print("prefill kernel", row, flush=True)
    cache.release(slot)

    # one graph per measured batch size: the serving buckets would also compile and tune sizes not timed here
    graphs = DecodeGraphs(net, cache, buckets=sorted(set(args.batch)), max_context=ctx)
    t = time.perf_counter()
    graphs.capture()
    _put(report, "graph_capture_s", time.perf_counter() - t)
    for b in args.batch:
        slots = [cache.acquire() for _ in range(b)]
        prompts = torch.randint(0, cfg.vocab_size, (b, args.prompt), generator=gen)
        last = [_prefill(net, cache, s, prompts[i].tolist()) for i, s in enumerate(slots)]
        for s in slots:
            cache.reserve(s, ctx)
        ids = torch.cat(last).argmax(-1)
        pos = [args.prompt] * b
        for _ in range(3):  # warm-up steps advance the sequences too
            ids = graphs.step(ids, pos, slots).argmax(-1)
            pos = [p + 1 for p in pos]
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.new - 3):
            ids = graphs.step(ids, pos, slots).argmax(-1)
            pos = [p + 1 for p in pos]
        torch.cuda.synchronize()
        _put(report, f"decode_b{b}_tok_s", b * (args.new - 3) / (time.perf_counter() - t))
        _put(report, f"decode_b{b}_eager_tok_s", b * 8 / _eager_steps(net, cache, slots, pos, ids, 8))
        if b == args.batch[0]:
            report[f"profile_b{b}"] = profile_steps(lambda: graphs.step(ids, pos, slots), reps=5, top=15)["gpu_top"]
            for row in report[f"profile_b{b}"]:
                print(f"decode b={b} kernel", row, flush=True)
        for s in slots:
            cache.release(s)


def _eager_steps(net, cache, slots, pos, ids, n) -> float:
    """Seconds for n eager decode steps, after one untimed step (kernels the graphs never launch compile or
    load on their first call)."""
    from hf2q.forward import ForwardBatch
    for i in range(n + 1):
        if i == 1:
            torch.cuda.synchronize()
            t = time.perf_counter()
        batch = ForwardBatch(ids, torch.tensor(pos, device="cuda"), [1] * len(slots), list(pos), list(slots), cache)
        ids = net.compute_logits(net(batch)).argmax(-1)
        pos = [p + 1 for p in pos]
    torch.cuda.synchronize()
    return time.perf_counter() - t


def hf_config(shape: str):
    cfg, tie = SHAPES[shape]
    if cfg.is_moe:
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
        return Qwen3_5MoeTextConfig(), Qwen3_5MoeForCausalLM
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    if shape == "9b":
        return Qwen3_5TextConfig(), Qwen3_5ForCausalLM
    return Qwen3_5TextConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                             num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                             num_key_value_heads=cfg.num_kv_heads, linear_num_value_heads=cfg.linear_num_v_heads,
                             tie_word_embeddings=tie), Qwen3_5ForCausalLM


@torch.inference_mode()
def bench_hf(shape: str, args, report: dict) -> None:
    """HF transformers (with fla kernels when installed) on the same shape, greedy generate."""
    hcfg, cls = hf_config(shape)
    hcfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = cls(hcfg).eval()
    finally:
        torch.set_default_dtype(old)
    gen = torch.Generator().manual_seed(2)
    for b in args.batch:
        new = args.hf_new if b == 1 else max(4, args.hf_new // 4)
        ids = torch.randint(0, 240000, (b, args.prompt), generator=gen).cuda()
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        t_pre = _sync_time(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False), 1)
        t_all = _sync_time(lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False), 1)
        _put(report, f"hf_decode_b{b}_tok_s", b * (new - 1) / max(t_all - t_pre, 1e-9))
    ids = torch.randint(0, 240000, (1, args.prefill), generator=gen).cuda()
    _put(report, "hf_prefill_tok_s", args.prefill / _sync_time(lambda: model(ids), 2))
    del model
    torch.cuda.empty_cache()


def bench_shape(shape: str, args) -> dict:
    cfg, tie = SHAPES[shape]
    bw, flops = ceilings()
    report = {"shape": shape, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "copy_TBps": bw / 1e12, "matmul_TFLOPs": flops / 1e12}
    if args.quant:
        net = random_quant_model(cfg, args.quant, tie=tie, device="cuda", dtype=torch.bfloat16)
    else:
        net = random_model(cfg, tie=tie, device="cuda", dtype=torch.bfloat16)
    report["quant"] = args.quant or "bf16"
    report["state_dtype"] = args.state_dtype
    if args.quant and getattr(args, "batched_weights", "quantized") == "columns":
        report["columns_GB"] = net.keep_column_weights() / 1e9
    if args.quant and getattr(args, "batched_weights", "quantized") in ("dense", "columns"):
        report["dense_copies_GB"] = net.keep_dense_weights(torch.bfloat16) / 1e9
        if getattr(args, "dense_rows", None) is not None:
            from hf2q.kernels.linear import ops as linear_ops
            linear_ops.DENSE_ROWS = report["dense_rows"] = args.dense_rows
    report["params_B"] = (matrix_elems(net) + net.embed.numel()) / 1e9
    report["weight_GB"] = weight_bytes(net) / 1e9
    report["prefill_ceiling_tok_s"] = prefill_ceiling(net, cfg, args.prefill, flops)
    for b in args.batch:
        report[f"decode_b{b}_ceiling_tok_s"] = decode_ceiling(net, cfg, b, args.prompt + args.new // 2, bw,
                                                              args.state_dtype)
    bench_ours(net, cfg, args, report)
    if getattr(args, "spec_accept", None):
        from hf2q.bench.spec import spec_curve
        report.update(spec_curve(net, cfg, args.batch, args.spec_accept, args.spec_k, args.prompt,
                                 profile=getattr(args, "profile_spec", False)))
    del net
    torch.cuda.empty_cache()
    if args.hf_new:
        try:
            bench_hf(shape, args, report)
        except Exception as e:  # noqa: BLE001 - HF is a comparison, not the subject
            report["hf_error"] = repr(e)[:300]
    return report


def format_table(r: dict, batches) -> str:
    rows = [(f"decode b={b}", f"decode_b{b}_tok_s", f"decode_b{b}_ceiling_tok_s", f"hf_decode_b{b}_tok_s")
            for b in batches] + [("prefill", "prefill_tok_s", "prefill_ceiling_tok_s", "hf_prefill_tok_s")]
    out = [f"## {r['shape']} {r.get('quant', 'bf16')} on {r['gpu']}: copy {r['copy_TBps']:.2f} TB/s, bf16 matmul {r['matmul_TFLOPs']:.0f} TFLOP/s",
           "| workload | hf2q tok/s | ceiling | of ceiling | HF tok/s | vs HF | eager (no graphs) |",
           "|---|---|---|---|---|---|---|"]
    for name, ours, ceil, hf in rows:
        v, c, h = r.get(ours), r.get(ceil), r.get(hf)
        eager = r.get(ours.replace("_tok_s", "_eager_tok_s"))
        out.append(f"| {name} | {v:,.1f} | {c:,.0f} | {v / c:.0%} | " + (f"{h:,.1f} | {v / h:.1f}x" if h else "- | -")
                   + (f" | {eager:,.1f} |" if eager else " | - |"))
    return "\n".join(out)


def run_bench(args) -> int:
    if getattr(args, "profile_spec", False) and not args.spec_accept:
        print("hf2q bench: --profile-spec profiles the --spec-accept rounds; give --spec-accept too")
        return 2
    if getattr(args, "batched_weights", "quantized") != "quantized" and not args.quant:
        print(f"hf2q bench: --batched-weights {args.batched_weights} lays out quantized blocks; give --quant too")
        return 2
    if getattr(args, "dense_rows", None) is not None and getattr(args, "batched_weights", "quantized") != "dense":
        print("hf2q bench: --dense-rows sets where the dense copies take over; give --batched-weights dense too")
        return 2
    if getattr(args, "dense_rows", None) is not None and args.dense_rows < 1:
        print(f"hf2q bench: --dense-rows must be at least 1, not {args.dense_rows}")
        return 2
    if not torch.cuda.is_available():
        print("hf2q bench needs a CUDA GPU")
        return 2
    from hf2q.kernels.tuning.parallel_compile import compile_candidates_in_parallel

    with compile_candidates_in_parallel() as compiled:  # a fresh machine's first prefill: fla's candidates
        report = bench_shape(args.shape, args)
    print(compiled, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report))
    print(format_table(report, args.batch))
    if args.spec_accept:
        from hf2q.bench.spec import format_curve
        print(format_curve(report, args.batch, args.spec_accept))
        for key in [key for key in report if key.endswith("_profile")]:
            prof = report[key]
            print(f"## {key}: {prof['wall_ms']} ms a round, GPU busy {prof['gpu_busy_ms']} ms")
            for side in ("gpu_top", "host_top"):
                for name, ms, count in prof[side]:
                    print(f"{side} {ms:9.4f} ms {count:5d}x {name}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="hf2q bench", description=__doc__.splitlines()[0])
    add_bench_args(p)
    return run_bench(p.parse_args(argv))

