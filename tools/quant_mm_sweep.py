"""Batched decode on Q4_K_M weights: the tensor-core kernel (mm_triton) in several configurations, and with its K-quant
values made by bf16 fmas (HF2Q_QUANT_MM=packed), against the int8 tensor-core kernel (mmq_triton, HF2Q_QUANT_MM=mmq;
Q8_0 and K-quants), the int8 mat-vec and dequantize + cuBLAS, per 9B projection and row count (CUDA only); with
--gemlite, also GemLite's weight-only int4/int8 kernels (a Triton low-bit library, carried as a wheel) on the same
weights in their affine groups of 32 (hf2q.quant.affine_groups: Q4_K and Q4_0 as 4-bit codes, Q5_K and Q8_0 as 8-bit;
Q6_K stays on the tile kernel in the "gemlite path" total); with --int4pack, PyTorch's own int4 weight-only CUDA
kernel (torch._weight_int4pack_mm, "tinygemm": bf16 scale and zero a group of 32) on the 4-bit types' affine groups.

    python tools/quant_mm_sweep.py [--rows 8 16 32 64] [--gemlite] [--int4pack]

mmq is timed on activations already in int8 rows (as a producer that writes them would leave them) and
with their quantization (quantize_rows) in the timed call; its error is relative (Frobenius) to
dequantize + cuBLAS on the same bf16 activations, beside the tile kernel's.
Times are CUDA-graph replays over weight copies that overflow L2 (kernels/tuning/timing.py), summed over a 9B
token's projections (hf2q.bench.quant.LAYER_SET); the last lines give the step time of each path. The row counts
take the first rows of one activation matrix, and a line per projection says whether activation row 0's result is
bitwise the same at every count (the tile kernel's is by design; a kernel whose split of K follows the row count's
tuning is not, and then a request's tokens depend on how many others share its step).
"""
from __future__ import annotations

import argparse
import os

import torch

from hf2q.kernels.quant import int8_rows
from hf2q.kernels.quant import mm_triton as mm
from hf2q.kernels.quant import mmq_triton as mmq
from hf2q.bench.quant import LAYER_SET
from hf2q.kernels.quant.dp4a_triton import gemv
from hf2q.kernels.quant.ops import dequantize, scratch
from hf2q.kernels.tuning.timing import cold_copies, graph_time_us
from hf2q.quant import AFFINE_TYPES, affine_groups, keep_blocks, random_blocks


def _us(fn, weights) -> float:
    fn(weights[0])
    torch.cuda.synchronize()
    return graph_time_us(fn, weights)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _gemlite_layers(raw: torch.Tensor, qtype: str, n: int, k: int, count: int, dtype: torch.dtype) -> list:
    """`count` GemLite layers of one ggml-order weight (each its own memory, to overflow L2 as the copies do), taking
    and giving `dtype` (their scales and zeros in it too). Packed with zero zeros, then given the exact offsets:
    GemLite's fused form is codes · scales + zeros."""
    import gemlite

    codes, scale, offset = affine_groups(raw, qtype, (n, k))
    kind = {torch.bfloat16: gemlite.DType.BF16, torch.float16: gemlite.DType.FP16}[dtype]
    layers = []
    for _ in range(count):
        layer = gemlite.GemLiteLinear(AFFINE_TYPES[qtype], group_size=32, in_features=k, out_features=n,
                                      input_dtype=kind, output_dtype=kind)
        layer.pack(codes.cuda(), scale.to("cuda", dtype), torch.zeros_like(scale, dtype=dtype, device="cuda"))
        layer.zeros.data.copy_(offset.t().to(layer.zeros.device, layer.zeros.dtype))
        layers.append(layer)
    return layers


def _int4pack_layers(raw: torch.Tensor, qtype: str, n: int, k: int, count: int) -> list:
    """`count` copies of one 4-bit ggml-order weight in torch._weight_int4pack_mm's form: codes packed two a byte
    (the even column in the high nibble, the order torch's CUDA packing reads) and tiled by torch, and
    [k / 32, n, 2] bf16 (scale, zero) with value = (code - 8) · scale + zero, i.e. zero = offset + 8 · scale (both
    rounded to bf16: not exact)."""
    codes, scale, offset = affine_groups(raw, qtype, (n, k))
    codes = codes.to("cuda", torch.int32)
    packed = torch._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), 8)
    sz = torch.stack([scale, offset + 8 * scale], dim=-1).transpose(0, 1).contiguous().to("cuda", torch.bfloat16)
    return [(packed, sz)] + [(packed.clone(), sz.clone()) for _ in range(count - 1)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--matvec", action="store_true", help="also time the int8 mat-vec (tunes per row count)")
    p.add_argument("--configs", nargs="+", default=["64,4", "64,8", "128,8"], metavar="BLOCK_N,WARPS",
                   help="tile configurations to time (each at the splits of K --split-factors gives)")
    p.add_argument("--split-factors", type=int, nargs="+", default=[1, 2], metavar="F",
                   help="splits of K to time, as multiples of the default (more programs a SM: Nsight Compute found "
                        "the default grid under one wave at 16 rows)")
    p.add_argument("--stages", type=int, nargs="+", default=[0], metavar="S",
                   help="software-pipeline depths to time (0: the kernel's, mm_triton.pipeline_stages: 2 at 33-64 "
                        "rows, Triton's 3 below; fewer stages take less shared memory, which held 64-row programs to "
                        "two a SM at 3)")
    p.add_argument("--gemlite", action="store_true", help="also time GemLite's kernels on the affine groups")
    p.add_argument("--int4pack", action="store_true", help="also time torch._weight_int4pack_mm on the 4-bit types")
    p.add_argument("--gemlite-dtype", choices=["bf16", "fp16"], default="bf16",
                   help="GemLite's activations, scales and zeros (fp16: the bf16 activations cast in the timed call)")
    p.add_argument("--gemlite-configs", metavar="FILE", help="GemLite's autotuned configurations: read first if the "
                   "file exists, written after each projection (its autotuning takes most of a first sweep)")
    args = p.parse_args()
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs]
    gl_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.gemlite_dtype]
    if args.gemlite and args.gemlite_configs and os.path.exists(args.gemlite_configs):
        import gemlite

        gemlite.load_config(args.gemlite_configs)
    totals: dict[tuple, float] = {}
    best_of: dict[tuple, float] = {}  # (rows, projection) -> its best configuration's time, times its count
    names = [entry[0] for entry in LAYER_SET]
    for name, n, k, qtype, times in LAYER_SET:
        ggml = random_blocks(qtype, n, k, std=0.02, seed=n + k)
        raw = keep_blocks(ggml, qtype, "cuda")
        copies = cold_copies(raw)
        gl = _gemlite_layers(ggml, qtype, n, k, len(copies), gl_dtype) \
            if args.gemlite and qtype in AFFINE_TYPES else None
        i4 = _int4pack_layers(ggml, qtype, n, k, len(copies)) \
            if args.int4pack and AFFINE_TYPES.get(qtype) == 4 else None
        rows_all = torch.randn(max(args.rows), k, device="cuda", dtype=torch.bfloat16)
        first_rows: dict[str, list] = {}  # path -> its result for activation row 0 at each row count
        for m in args.rows:
            x = rows_all[:m]  # the same first rows at every count: does a row's result depend on the batch?
            row = {}
            _, _, auto_split = mm.config(n, k)
            for bn, warps in configs:
                for split in sorted({min(auto_split * f, -(-k // 256)) for f in args.split_factors}):
                    for stages in args.stages:  # a configuration's key names its stages where they are not Triton's
                        cfg = (bn, warps, split, stages) if stages else (bn, warps, split)
                        row[cfg] = _us(lambda w, c=cfg[:3], s=stages or None: mm.quant_mm(x, w, qtype, n, c, s), copies)
            row["default"] = _us(lambda w: mm.quant_mm(x, w, qtype, n), copies)
            row["dequant+cublas"] = _us(lambda w: torch.nn.functional.linear(
                x, dequantize(w, qtype, (n, k), x.dtype, out=scratch("sweep", n * k, x.dtype, x.device))), copies)
            if args.matvec and m <= 16:
                row["int8 mat-vec"] = _us(lambda w: gemv(x, w, qtype, n), copies)
            ref = torch.nn.functional.linear(x, dequantize(raw, qtype, (n, k), x.dtype))  # the errors' reference
            mmq_note = ""
            if qtype in mmq.TYPES:
                rows8 = int8_rows.quantize_rows(x, blocked=True)
                row["mmq"] = _us(lambda w: mmq.quant_mmq(rows8, w, qtype, n, out_dtype=x.dtype), copies)
                # a new view of x each call: quantize_rows finds no earlier result, the graph holds its launch
                row["mmq+quantize"] = _us(lambda w: mmq.quant_mmq(x.view_as(x), w, qtype, n), copies)
                mmq_note = (f", mmq {row['mmq']:8.1f} (+quantize {row['mmq+quantize']:8.1f}), error mmq "
                            f"{_rel(mmq.quant_mmq(rows8, raw, qtype, n), ref):.1e} tile "
                            f"{_rel(mm.quant_mm(x, raw, qtype, n), ref):.1e}")
            first_rows.setdefault("tile", []).append(mm.quant_mm(x, raw, qtype, n)[0].clone())
            packed_note = ""
            if qtype in mm.PACKED_TYPES:  # HF2Q_QUANT_MM=packed: each value one bf16 fma
                row["packed"] = _us(lambda w: mm.quant_mm(x, w, qtype, n, packed=True), copies)
                once = mm.quant_mm(x, raw, qtype, n, packed=True)
                first_rows.setdefault("packed", []).append(once[0].clone())
                packed_note = f", packed {row['packed']:8.1f} (error {_rel(once, ref):.1e})"
            row["packed path"] = row.get("packed", row["default"])
            gl_note = ""
            if gl is not None:
                first_rows.setdefault("gemlite", []).append(gl[0](x.to(gl_dtype))[0].clone())
                row["gemlite"] = _us(lambda layer: layer(x.to(gl_dtype)), gl)
                once = gl[0](x.to(gl_dtype))
                again = all(torch.equal(once, gl[0](x.to(gl_dtype))) for _ in range(3))  # split-K adds by atomics
                gl_note = (f", gemlite {row['gemlite']:8.1f} (error {_rel(once, ref):.1e}, "
                           f"{'the same' if again else 'NOT the same'} on repeats)")
            if i4 is not None:
                i4mm = lambda w: torch._weight_int4pack_mm(x, w[0], 32, w[1])  # noqa: E731
                once = i4mm(i4[0])
                first_rows.setdefault("int4pack", []).append(once[0].clone())
                row["int4pack"] = _us(i4mm, i4)
                gl_note += f", int4pack {row['int4pack']:8.1f} (error {_rel(once, ref):.1e})"
            row["int4pack path"] = row.get("int4pack", row["default"])
            row["gemlite path"] = row.get("gemlite", row["default"])
            for path in ("mmq", "mmq+quantize"):  # the step with HF2Q_QUANT_MM=mmq: other types on the tile kernel
                row[path + " path"] = row.get(path, row["default"])
            best = min((v, c) for c, v in row.items() if isinstance(c, tuple))
            print(f"{name:12} {qtype} {n}x{k} m={m:3}: default {row['default']:8.1f} us, best {best[0]:8.1f} "
                  f"{best[1]}, dequant+cublas {row['dequant+cublas']:8.1f}" + mmq_note
                  + (f", int8 mat-vec {row['int8 mat-vec']:8.1f}" if "int8 mat-vec" in row else "") + packed_note
                  + gl_note,
                  flush=True)
            for c, v in row.items():
                totals[(m, c)] = totals.get((m, c), 0.0) + v * times
            best_of[(m, name)] = best[0] * times
        if len(args.rows) > 1:
            print(f"{name:12} row 0 the same at {', '.join(map(str, args.rows))} rows: " + ", ".join(
                f"{path} {'yes' if all(torch.equal(r, got[0]) for r in got) else 'no'}"
                for path, got in first_rows.items()), flush=True)
        del raw, copies, gl, i4
        if args.gemlite and args.gemlite_configs:
            import gemlite

            gemlite.cache_config(args.gemlite_configs)
    for m in args.rows:
        per = {c: v for (mm_, c), v in totals.items() if mm_ == m}
        best = sum(best_of[(m, name)] for name in names)
        print(f"9B step, m={m}: default {per['default'] / 1e3:.3f} ms; best configuration per projection {best / 1e3:.3f} ms; dequant+cublas {per['dequant+cublas'] / 1e3:.3f} ms; HF2Q_QUANT_MM=mmq "
              f"{per['mmq path'] / 1e3:.3f} ms (with quantization {per['mmq+quantize path'] / 1e3:.3f} ms); "
              f"HF2Q_QUANT_MM=packed {per['packed path'] / 1e3:.3f} ms"
              + (f"; int8 mat-vec {per['int8 mat-vec'] / 1e3:.3f} ms" if "int8 mat-vec" in per else "")
              + (f"; gemlite path {per['gemlite path'] / 1e3:.3f} ms" if args.gemlite else "")
              + (f"; int4pack path {per['int4pack path'] / 1e3:.3f} ms" if args.int4pack else ""), flush=True)
        print(f"9B step, m={m}, each configuration everywhere: " + ", ".join(
            f"{'/'.join(map(str, c))} {v / 1e3:.3f}" for c, v in sorted(per.items(), key=lambda kv: kv[1])
            if isinstance(c, tuple)) + " ms", flush=True)


if __name__ == "__main__":
    main()
