"""Timing of the quantized kernels on a 9B-shape Q4_K_M projection set (CUDA only).

Decode: each projection's fused mat-vec at 1 row, against the weight-bytes ceiling (bytes / bandwidth).
Prefill: dequantize-to-scratch + bf16 matmul at 4096 rows, against the plain bf16 matmul.
Run: python -m hf2q.kernels.quant_bench
"""
from __future__ import annotations

import torch

from hf2q.kernels.quant_ops import quant_linear
from hf2q.quant import random_blocks

BANDWIDTH = 4.25e12  # measured device-to-device copy rate on the H200 (bytes read + written per second)
H, I = 4096, 12288
# (name, out, in, type, times per 9B model): 24 DeltaNet + 8 attention layers, 32 FFNs, the head.
LAYER_SET = [("gdn.qkv", 8192, H, "Q4_K", 24), ("gdn.z", 4096, H, "Q4_K", 24), ("gdn.out", H, 4096, "Q4_K", 24),
             ("attn.q", 8192, H, "Q4_K", 8), ("attn.k", 1024, H, "Q4_K", 8), ("attn.v", 1024, H, "Q6_K", 8),
             ("attn.o", H, 4096, "Q4_K", 8), ("ffn.gate", I, H, "Q4_K", 32), ("ffn.up", I, H, "Q4_K", 32),
             ("ffn.down", H, I, "Q6_K", 32), ("lm_head", 248320, H, "Q6_K", 1)]


def _ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


def main() -> None:
    print(f"{'proj':10} {'type':5} {'shape':>14} {'MB':>7} {'b=1 us':>8} {'%bw':>5} {'4096 ms':>8} "
          f"{'bf16 ms':>8} {'TFLOP/s':>8}")
    tot_dec = tot_bytes = tot_pre = tot_bf = 0.0
    for name, n, k, qtype, times in LAYER_SET:
        raw = random_blocks(qtype, n, k, std=0.02, seed=n + k).cuda()
        x1 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        xp = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
        wd = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        dec = _ms(lambda: quant_linear(x1, raw, qtype, n))
        pre = _ms(lambda: quant_linear(xp, raw, qtype, n))
        bf = _ms(lambda: torch.nn.functional.linear(xp, wd))
        nbytes = raw.numel()
        pct = 100 * nbytes / BANDWIDTH / (dec * 1e-3)
        print(f"{name:10} {qtype:5} {f'{n}x{k}':>14} {nbytes / 1e6:7.1f} {dec * 1e3:8.1f} {pct:5.0f} {pre:8.2f} "
              f"{bf:8.2f} {2 * 4096 * n * k / (pre * 1e-3) / 1e12:8.0f}")
        tot_dec += dec * times
        tot_bytes += nbytes * times
        tot_pre += pre * times
        tot_bf += bf * times
        del raw, xp, wd
    print(f"9B Q4_K_M projections: {tot_bytes / 1e9:.2f} GB; decode matmuls {tot_dec:.2f} ms/token "
          f"({1e3 / tot_dec:.0f} tok/s bound, {100 * tot_bytes / BANDWIDTH / (tot_dec * 1e-3):.0f}% of bandwidth, "
          f"ceiling {BANDWIDTH / tot_bytes:.0f} tok/s); prefill 4096 matmuls {tot_pre:.1f} ms "
          f"({4096e3 / tot_pre:.0f} tok/s bound; bf16 weights {tot_bf:.1f} ms)")


if __name__ == "__main__":
    main()
