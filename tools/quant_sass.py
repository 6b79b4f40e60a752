"""Machine-code cost of the batched-decode kernels on Hopper, without a GPU: each kernel compiled for sm_90a
with Triton's bundled ptxas, its main loop (the longest backward branch) counted in nvdisasm's SASS, and
the count turned into instructions per weight value (loop instructions x threads / weight values a loop
trip reads), with ptxas' registers and spills.

    python tools/quant_sass.py [--types Q4_K Q6_K] [--rows 16 64] [--kernels tile packed mmq] [--launch]

Compares the bf16 tile kernel (mm_triton; "packed": its K-quant values by bf16 fmas, HF2Q_QUANT_MM=packed) with the
int8 tensor-core kernel (mmq_triton) in the configurations each takes for that many activation rows (sizes marked as
multiples of 16, as the launcher finds the 9B shapes). --launch also marks the activations' row stride a multiple of
16, as a real launch specialises it (the address arithmetic, and so the count, differ). ptxas' warnings (such as
C7515, a serialized wgmma) and the loop's tensor-core instructions are printed too: the tile kernel is meant to keep
mma.sync (HMMA).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hf2q.kernels.quant import mm_triton as mm
from hf2q.kernels.quant import mmq_triton as mmq

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SIZES = ("N", "K", "row_stride", "nblk")  # integers the launcher sees as multiples of 16 at 9B shapes


def _compile(fn, sig: dict, const: dict, warps: int, sizes: tuple[str, ...]) -> str:
    names = list(sig) + list(const)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sig if sig[n].startswith("*") or n in sizes}
    src = ASTSource(fn=fn, signature={**sig, **{n: "constexpr" for n in const}}, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]


def _loop(sass: str) -> list[str]:
    """Opcodes of the longest backward branch's body (the loop over 256-value tiles)."""
    ops, labels, best = [], {}, (0, 0)
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ops)
        op = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(.*)", line)
        if op:
            target = re.search(r"\((\.L_x_\d+)\)", op.group(2)) if op.group(1) == "BRA" else None
            if target and labels.get(target.group(1), len(ops)) < len(ops):
                start = labels[target.group(1)]
                best = max(best, (start, len(ops) + 1), key=lambda r: r[1] - r[0])
            ops.append(op.group(1))
    return ops[best[0]:best[1]]


def measure(fn, sig: dict, const: dict, warps: int, block_n: int, sizes: tuple[str, ...] = SIZES,
            ) -> tuple[float, str, collections.Counter]:
    """(instructions per weight value, ptxas' register, spill and warning lines, the loop's opcode counts)."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(_compile(fn, sig, const, warps, sizes))
        done = subprocess.run([os.path.join(BIN, "ptxas-blackwell"), "-arch=sm_90a", "-v", ptx, "-o", cubin],
                              capture_output=True, text=True, check=True)
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
    info = " ".join(line.split(":", 1)[-1].strip() for line in done.stderr.splitlines()
                    if "registers" in line or "spill" in line or "warning" in line)
    ops = _loop(sass)
    return len(ops) * 32 * warps / (block_n * 256), info, collections.Counter(ops)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--types", nargs="+", default=list(mmq.TYPES), choices=list(mmq.TYPES))
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    p.add_argument("--kernels", nargs="+", default=["tile", "packed", "mmq"], choices=["tile", "packed", "mmq"])
    p.add_argument("--launch", action="store_true", help="also mark x_stride a multiple of 16, as launches do")
    args = p.parse_args()
    sizes = SIZES + ("x_stride",) if args.launch else SIZES
    common = {"out_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32"}
    tail = {"row_stride": "i32", "nblk": "i32", "tiles_per_split": "i32", "n_tiles": "i32"}
    tile_sig = {"x_ptr": "*bf16", "w8": "*u8", "w16": "*fp16", "w32": "*i32", **common, "x_stride": "i32", **tail}
    mmq_sig = {"xq8": "*i8", "act": "*fp32", "w8": "*i8", "w32": "*i32", **common, **tail}
    for qtype in args.types:
        for m in args.rows:
            c = mm.chunks(m)
            block_n, warps, _ = mm.config(4096, 4096)
            tile = dict(QTYPE=mm.QTYPE_ID[qtype], CHUNKS=c, BLOCK_N=block_n, IEEE=False, EVEN_K=True, EMULATE=False)
            cases = [("tile", mm._quant_mm_kernel, tile_sig, dict(tile, PACKED=False), warps, block_n)]
            if qtype in mm.PACKED_TYPES:
                cases.append(("packed", mm._quant_mm_kernel, tile_sig, dict(tile, PACKED=True), warps, block_n))
            block_n, warps, _ = mmq.config(4096, 4096, m)
            cases.append(("mmq", mmq._mmq_kernel, mmq_sig, dict(QTYPE=mmq.QTYPE_ID[qtype], CHUNKS=c, BLOCK_N=block_n,
                                                                EMULATE=False), warps, block_n))
            for name, fn, sig, const, warps, block_n in cases:
                if name not in args.kernels:
                    continue
                per_value, info, ops = measure(fn, sig, const, warps, block_n, sizes)
                top = ", ".join(f"{op} {n}" for op, n in ops.most_common(8))
                mma = ", ".join(f"{op} {n}" for op, n in sorted(ops.items()) if "MMA" in op or "GMMA" in op)
                print(f"{qtype} {m:2} rows {name:6} (BLOCK_N {block_n}, {warps} warps): {per_value:5.2f} instructions "
                      f"a weight value; {info}; loop: {top}; tensor cores: {mma}", flush=True)


if __name__ == "__main__":
    main()
