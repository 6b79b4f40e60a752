"""Triton mat-vec for GGUF blocks on 8-bit integer dot products (dp4a), for decode's few rows.

A float mat-vec spends a dozen instructions per weight unpacking, converting and multiplying. Here the
activation rows are first quantized to int8 in 32-value groups (scale dx = max|x| / 127, as llama.cpp's
q8_1), then each 32-bit word of weights is unpacked to four bytes with a mask and a shift and
multiplied against four activation bytes by one dp4a instruction; the words of a (sub-)block's part
are chained through dp4a's accumulator, so no sum crosses threads inside the loop. Each part's integer
sum is scaled once (d · scale · dx). Values are centred on their range's middle (Q4_K 8, Q5_K 16,
Q6_K 32, Q4_0 8) through the quantized group's sum, and K-quant mins and the centring of K-quants use
the activations' exact float sums. The only rounding beyond fp32 accumulation is the activations'
int8 quantization (about 0.5% relative per dot product; tests/quant/test_kernels.py states the
tolerances).

K-quants (Q4_K, Q5_K, Q6_K): a thread owns whole (activation row, weight row, block) units and walks
its block in static loops, so every shift that picks a scale, a min or a bit field is a constant.
Neighbouring threads own neighbouring blocks, and the GPU keeps K-quant rows interleaved by 16-byte
quads (hf2q.quant.to_gpu_rows), with the activations in the same order (BLOCKED, store_int8_groups):
each 16-byte load of a warp then reads consecutive bytes, where ggml's order would spread it over 32
cache lines and stall on L1 throughput. Those units repeat a block's loads and unpacking (masks, shifts,
scale bytes) for every activation row in the code Triton emits: ptxas merges the repeats where one thread
holds all of a unit's rows, not where they sit in different threads, and the registers they hold stay (a
4-row verify step cost 4.35 one-row steps on an H100, 9B Q4_K_M, with the first candidates, whose 4-row
one spilled before the K constants). So at 2-4 rows the kernel's shared-rows form (SHARED, the first
candidates) gives a thread (weight row, block) units instead, as llama.cpp's mul_mat_vec_q does for several
destination columns: each word is loaded and unpacked once, then dotted with every row's activations, each
row's sums in variables of their own. On the H200, 9B Q4_K_M's qkv, gate+up and down projections at their
first candidates: 4 rows cost 1.77 one-row steps, 4.36 before the shared rows and K constants (BENCHMARKS.md).
Q8_0 and Q4_0: a thread owns 16-value parts, and BLOCK_M activation rows share each unpacked weight
word; their blocks follow ggml's structs byte for byte and are only 2-byte aligned, so their words
are joined from two 16-bit halves. With `experts`, every row m has its own expert's weight (MoE
token-expert pairs) and BLOCK_M is 1.
The activations' int8 form is int8_rows'; the per-type block readers are dp4a_blocks'.
"""
from __future__ import annotations

import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hf2q import envs
from hf2q.kernels.tuning import pdl, cache as tune_cache
from hf2q.kernels.quant.dequant_triton import QTYPE_ID, check_layout
from hf2q.kernels.quant import dp4a_blocks, int8_rows
from hf2q.kernels.quant.dp4a_blocks import below, row_products
from hf2q.kernels.quant.int8_rows import blocked_for, quantize_rows
from hf2q.kernels.tuning.parallel_compile import compile_side_by_side
from hf2q.kernels.tuning.late_compiles import WATCH
from hf2q.kernels.tuning.timing import SPENT, clock, cold_copies, graph_time_us
from hf2q.quant import KQUANTS, block_layout, gpu_row_words

EMULATE = envs.triton_interpret()  # the interpreter runs no PTX: dp4a in plain integer ops


@triton.jit
def _first_piece(m, M, rows_per_x, n_g16):
    """The first 16-value piece of output row m's activation row (row M - 1's for m >= M), a scalar."""
    return (tl.minimum(m, M - 1) // rows_per_x).to(tl.int64) * n_g16


@triton.jit
def _gemv_dp4a_kernel(xq_ptr, act_ptr, w16, w32, w16b, w32b, out_ptr, expert_ptr, M, N, n_first,
                      row_units: tl.constexpr, row_units_b: tl.constexpr, n_units: tl.constexpr, expert_units,
                      n_g16: tl.constexpr, rows_per_x, out_stride, QTYPE: tl.constexpr,
                      QTYPE_B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr,
                      STAGES: tl.constexpr, HAS_EXPERTS: tl.constexpr, TWO: tl.constexpr, EVEN: tl.constexpr,
                      EMULATE: tl.constexpr, SHARED: tl.constexpr = False, PDL: tl.constexpr = False):
    """out[m, n] = Σ_k x[m, k] · W[n, k] for BM activation rows and BN weight rows per program. Row strides come in
    the unit the type's blocks are read in (16-byte quads for the interleaved K-quant rows, else halves), so that
    the compiler sees their alignment. The sizes that follow from K (row strides, blocks a row, activation pieces a
    row) are compile-time constants: a model has two or three K, and constant strides take the address arithmetic
    of most loads off (sm_90 machine code of a Q4_K program at K = 4096: 552 instructions at one row, 384 with the
    constants; four shared rows 1344, 912). Parts are summed elementwise; one reduction at the end. STAGES > 1 lets
    the compiler copy the next steps' weights asynchronously while this one computes (more bytes in flight per SM,
    paid for in registers and shared memory). TWO: output columns from n_first on come from a second weight (an
    MoE's gate and up stacks, or a layer's projections of one input kept in two types, in one launch; n_first is a
    multiple of BN), of type QTYPE_B and row stride row_units_b. Output row m multiplies activation row m //
    rows_per_x. EVEN: M, N and the blocks a row are multiples of BM, BN and SB, so nothing is masked. SHARED
    (K-quants, BM <= 4): a thread reads and unpacks its (weight row, block) units once for all BM activation rows,
    whose first pieces it takes as scalars; a row past M reads row M - 1's activations, and its output is masked.
    PDL (kernels/tuning/pdl.py): the program waits for the previous kernel before its first read, and lets the next
    kernel start once its loop is done."""
    ms = tl.program_id(1) * BM + tl.arange(0, BM)
    m_ok = below(ms, M, EVEN)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)  # axis 0: a vocabulary's rows outnumber axis 1's limit
    row_ok = below(cols, N, EVEN)
    if SHARED:  # four rows' first pieces as scalars
        m0 = tl.program_id(1) * BM
        x_g16 = (_first_piece(m0, M, rows_per_x, n_g16), _first_piece(m0 + 1, M, rows_per_x, n_g16),
                 _first_piece(m0 + 2, M, rows_per_x, n_g16), _first_piece(m0 + 3, M, rows_per_x, n_g16))
    else:
        x_g16 = (ms // rows_per_x).to(tl.int64) * n_g16  # first 16-value piece of each activation row
    pdl.wait_prior(PDL)
    expert_base = 0
    if HAS_EXPERTS:
        expert_base = tl.load(expert_ptr + tl.program_id(1)).to(tl.int64) * expert_units
    second = TWO and tl.program_id(0) * BN >= n_first
    if QTYPE_B == QTYPE:  # one body: the second weight's programs only swap pointers (same type and K: same stride)
        rows = cols
        if second:
            w16, w32, rows = w16b, w32b, cols - n_first
        row_base = rows.to(tl.int64) * row_units + expert_base
        acc = row_products(w16, w32, xq_ptr, act_ptr, x_g16, m_ok, row_base, row_ok, n_units, QTYPE, BM, BN, SB,
                           STAGES, SHARED, EVEN, EMULATE)
    elif second:
        row_base = (cols - n_first).to(tl.int64) * row_units_b + expert_base
        acc = row_products(w16b, w32b, xq_ptr, act_ptr, x_g16, m_ok, row_base, row_ok, n_units, QTYPE_B, BM, BN,
                           SB, STAGES, SHARED, EVEN, EMULATE)
    else:
        row_base = cols.to(tl.int64) * row_units + expert_base
        acc = row_products(w16, w32, xq_ptr, act_ptr, x_g16, m_ok, row_base, row_ok, n_units, QTYPE, BM, BN, SB,
                           STAGES, SHARED, EVEN, EMULATE)
    pdl.release_next(PDL)
    out = out_ptr + ms.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out, tl.sum(acc, axis=2).to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & row_ok[None, :])


# (BLOCK_N, blocks per step, warps, stages[, shared]) candidates, most work per thread first: a mat-vec is fed
# by the bytes each thread has in flight.
# Q8_0 / Q4_0: those that would give a thread more than MAX_PARTS (row, part) sums of BLOCK_M activation
# rows spill registers and are left out (see candidates).
_B_CANDIDATES = [(4, 16, 1, 1), (8, 16, 2, 1), (4, 32, 1, 1), (8, 32, 2, 1), (4, 16, 4, 1), (16, 16, 4, 1),
                 (8, 4, 4, 1), (4, 8, 4, 1), (4, 4, 4, 1), (1, 64, 2, 1), (1, 128, 4, 1), (2, 64, 4, 1),
                 (4, 16, 1, 3), (8, 16, 2, 3), (8, 4, 4, 3)]
# K-quants: a thread holds whole (activation row, weight row, block) units (_kquant_q45, _q6k), at least
# one (no thread repeats another's work) and at most MAX_UNITS. Steps of 16 blocks cover a 4096-wide row,
# of 8 a 2048-wide one, of 2 an expert's 512-wide down projection.
_K_CANDIDATES = [(2, 16, 1, 1), (4, 8, 1, 1), (4, 16, 2, 1), (8, 8, 2, 1), (8, 16, 4, 1), (16, 8, 4, 1),
                 (4, 16, 1, 1), (8, 8, 1, 1), (16, 2, 1, 1), (32, 2, 2, 1), (16, 4, 2, 1),
                 (2, 4, 1, 1), (4, 2, 1, 1), (2, 8, 2, 1), (4, 8, 4, 1), (2, 16, 1, 3), (4, 8, 1, 3)]
# K-quants at 2-4 activation rows, shared rows (the kernel's SHARED), first: a thread holds whole (weight row,
# block) units and dots each with every activation row. A thread keeps at most MAX_UNITS (row, unit) sums
# here too: one unit at 4 rows, two at 2. The first spills no registers on sm_90.
_K_SHARED = [(4, 16, 2, 1, True), (8, 16, 4, 1, True), (2, 16, 1, 1, True), (4, 8, 1, 1, True), (16, 8, 4, 1, True),
             (4, 16, 1, 1, True)]
MAX_PARTS = 16
MAX_UNITS = 4


class TuneKey(NamedTuple):
    """What a timed configuration is picked for: type, output rows (and a second weight's), K, activation
    rows or token-expert pairs rounded up to a power of two, and whether the weight is an expert stack."""
    qtype: str
    n: int
    n2: int
    k: int
    rows: int
    experts: bool


_TUNED: dict[TuneKey, tuple] = {}
_TUNE = envs.gemv_tune()


def candidates(qtype: str, rows: int = 1) -> list[tuple]:
    """Configurations for `rows` activation rows (their BLOCK_M), default first; for K-quants at 2-4 rows the
    shared-rows ones only. The units of one row each, which they replaced, cost 1.28x (2 rows) and 2.5x
    (4 rows) at the first candidates; timing them too made a first start compile and time four times the
    candidates at 4 rows (on an H100, the 2- and 4-sequence decode graphs of 9B Q4_K_M took 141 s and 187 s)."""
    bm = _block_m(rows, None)
    if qtype in ("Q8_0", "Q4_0"):
        fit = [c for c in _B_CANDIDATES if bm * c[0] * c[1] * 2 <= MAX_PARTS * 32 * c[2]]
        return fit or [min(_B_CANDIDATES, key=lambda c: c[0] * c[1] / c[2])]
    fit = [c for c in _K_CANDIDATES if 32 * c[2] <= bm * c[0] * c[1] <= MAX_UNITS * 32 * c[2]]
    fit = fit or [min(_K_CANDIDATES, key=lambda c: c[0] * c[1] / c[2])]
    if not 2 <= bm <= 4:
        return fit
    shared = [c for c in _K_SHARED if 32 * c[2] <= c[0] * c[1] and bm * c[0] * c[1] <= MAX_UNITS * 32 * c[2]]
    return shared or fit


def _block_m(m: int, experts) -> int:
    return 1 if experts is not None else min(16, 1 << (m - 1).bit_length())


def best_config(xs, raw, qtype: str, n: int, experts, second=None, rows_per_x: int = 1) -> tuple:
    """The fastest candidate for this shape, timed once per (type, N, K, rows rounded up to a power of two,
    experts) on CUDA outside graph capture (a capture's warm-up step does it); the first candidate inside
    a capture or with HF2Q_GEMV_TUNE=0; under Triton's interpreter, which pays per program, the one with
    the most rows a program. A choice stored by an earlier start on the same card (kernels/tuning/cache.py)
    is taken without timing. Timed from graph replays over copies of the
    weight that overflow L2 (kernels/tuning/timing.py): eager launches of a 10 µs kernel measure the host's
    launch rate, and a weight left in L2 by the previous call favours configurations that need a warm
    cache. (An expert stack is one copy: its few chosen experts stay warm.)"""
    xq = xs[0]

    def fits(c):  # two weights in one launch: the first's rows are whole programs
        return not second or n % c[0] == 0

    if not xq.is_cuda:  # no registers to spill: any candidate
        every = _B_CANDIDATES if qtype in ("Q8_0", "Q4_0") else _K_CANDIDATES
        return max(filter(fits, every), key=lambda c: (c[0], c[1]))
    ok = list(filter(fits, candidates(qtype, 1 if experts is not None else xq.shape[0] * rows_per_x)))
    if not _TUNE:
        return ok[0]
    pairs = xq.shape[0] * rows_per_x if experts is None else len(experts)
    qtype2 = _second_type(second, qtype)
    key = TuneKey(qtype if qtype2 == qtype else f"{qtype}+{qtype2}", n, second[1] if second else 0, xq.shape[1] * 4,
                  1 << (pairs - 1).bit_length(), experts is not None)
    cfg = _TUNED.get(key)
    if cfg is None:
        scope = _tune_scope(xq.device)
        stored = tune_cache.load(scope).get(_key_text(key))
        if stored is not None and tuple(stored) in ok:
            cfg = _TUNED[key] = tuple(stored)
            return cfg
        if torch.cuda.is_current_stream_capturing():
            return ok[0]
        SPENT.shapes += 1
        started = time.perf_counter()
        with clock("compile_s"):
            _precompile(lambda c: _launch(xs, raw, qtype, n, experts, c, second=second, rows_per_x=rows_per_x,
                                          warmup=True), ok)
        with clock("timing_s"):
            copies = cold_copies(raw, 256e6)
            seconds = [second] + [(second[0].clone(), *second[1:]) for _ in copies[1:]] if second \
                else [None] * len(copies)
            weights = list(zip(copies, seconds))
            timed = [(graph_time_us(lambda w, c=c: _launch(xs, w[0], qtype, n, experts, c, second=w[1],
                                                           rows_per_x=rows_per_x), weights), c) for c in ok]
            del copies, seconds, weights
        cfg = _TUNED[key] = min(timed)[1]
        tune_cache.store(scope, _key_text(key), cfg)
        WATCH.timed_late(f"{_key_text(key)} -> {cfg}", time.perf_counter() - started)
    return cfg


def _precompile(warm, configs) -> None:
    """Compile the kernels of every candidate configuration before they are timed, several at once on the
    host's cores (kernels/tuning/parallel_compile.py; one after another, the first start of a 9B Q4_K_M model
    spent over two minutes compiling). warm(config) compiles without launching. Best effort: on an error the
    launches compile what is missing, one by one."""
    if len(configs) < 2:
        return
    try:
        with ThreadPoolExecutor(min(len(configs), os.cpu_count() or 1)) as pool:
            compile_side_by_side(warm, configs, pool, _gemv_dp4a_kernel)
    except Exception as err:  # noqa: BLE001 - only a speed-up; the launches compile for themselves
        warnings.warn(f"compiling mat-vec candidates in parallel failed ({type(err).__name__}: {err}); "
                      "they compile one by one as they are timed", stacklevel=2)


def _tune_scope(device) -> str:
    """Where stored choices apply: this card, this Triton, the kernel's source (this module's kernel and
    candidates, its block readers and the int8 rows it reads)."""
    return f"{torch.cuda.get_device_name(device)} | triton {triton.__version__} | {_SOURCE_HASH}"


_SOURCE_HASH = tune_cache.code_hash(*(Path(path).read_text() for path in
                                      (__file__, dp4a_blocks.__file__, int8_rows.__file__)))


def _key_text(key: TuneKey) -> str:
    return "|".join(str(v) for v in key)


def tuned_configs(qtype: str, n: int, k: int) -> dict[int, tuple]:
    """The configurations the timing picked for single-weight products of an [n, k] `qtype` weight, by
    activation rows (rounded up to a power of two)."""
    return {key.rows: cfg for key, cfg in _TUNED.items()
            if (key.qtype, key.n, key.n2, key.k, key.experts) == (qtype, n, 0, k, False)}


def _second_type(second, qtype: str) -> str:
    """The type of `second` (raw2, n2[, qtype2]): qtype2, or the first weight's."""
    return second[2] if second and len(second) > 2 else qtype


def _row_units(qtype: str, k: int) -> int:
    """A row's stride in the unit the kernel reads the type in (see _gemv_dp4a_kernel)."""
    if qtype in KQUANTS:  # interleaved rows, in 16-byte quads
        return gpu_row_words(qtype, k) // 4
    elems, nbytes = block_layout(qtype)
    return k // elems * nbytes // 2  # 16-bit halves


def _launch(xs, raw, qtype, n, experts, config, out_dtype=torch.float32, second=None, rows_per_x=1,
            warmup: bool = False) -> torch.Tensor:
    xq, act, blocked = xs
    qtype2 = _second_type(second, qtype)
    for t in (qtype, qtype2):
        if blocked != blocked_for(t):
            raise ValueError(f"{t} weights read int8 rows {'in' if blocked_for(t) else 'out of'} BLOCKED "
                             "order: quantize_rows(..., blocked=blocked_for(qtype))")
    k = xq.shape[1] * 4
    m = len(experts) if experts is not None else xq.shape[0] * rows_per_x
    n_units = k // block_layout(qtype)[0]
    check_layout(raw, qtype, k)
    if second:
        check_layout(second[0], qtype2, k)
    row_units = _row_units(qtype, k)
    block_n, sb, warps, stages = config[:4]
    shared = len(config) > 4 and bool(config[4])
    bm = _block_m(m, experts)
    if shared and (experts is not None or bm > 4 or qtype not in KQUANTS or qtype2 not in KQUANTS):
        raise ValueError(f"shared-rows configuration {config} serves K-quants at up to 4 rows without experts, "
                         f"not {qtype}/{qtype2} at {m} rows{' of experts' if experts is not None else ''}")
    n_total = n + (second[1] if second else 0)
    if second and (n % block_n or (experts is not None and second[1] != n)):
        raise ValueError(f"two weights in one launch need the first's rows ({n}) a multiple of BLOCK_N "
                         f"({block_n}) and, for expert stacks, equal row counts (got {second[1]})")
    out = torch.empty(m, n_total, dtype=out_dtype, device=xq.device)
    views = []
    for w, t in ((raw, qtype), (second[0], qtype2) if second else (raw, qtype)):
        flat = w.view(-1)
        w16 = flat.view(torch.int16)
        # interleaved K-quant rows are int32 words; Q8_0 and Q4_0 blocks are read in halves
        views += [w16, flat if t in KQUANTS else w16]
    grid = (triton.cdiv(n_total, block_n), triton.cdiv(m, bm))
    args = (xq, act, *views, out, experts if experts is not None else views[0], m, n_total, n, row_units,
            _row_units(qtype2, k), n_units, n * row_units, k // 16, rows_per_x, out.stride(0))
    meta = dict(QTYPE=QTYPE_ID[qtype], QTYPE_B=QTYPE_ID[qtype2], BM=bm, BN=block_n, SB=sb, STAGES=stages,
                HAS_EXPERTS=experts is not None, TWO=second is not None,
                EVEN=m % bm == 0 and n_total % block_n == 0 and n_units % sb == 0, EMULATE=EMULATE, SHARED=shared,
                num_warps=warps, **pdl.launch_options(xq.device))
    if warmup:  # compile (as this launch would) without running
        _gemv_dp4a_kernel.warmup(*args, grid=grid, **meta)
    else:
        _gemv_dp4a_kernel[grid](*args, **meta)
    return out


def matvec(xs, raw: torch.Tensor, qtype: str, n: int, experts: torch.Tensor | None = None,
           config: tuple | None = None, out_dtype: torch.dtype = torch.float32,
           second: tuple | None = None, rows_per_x: int = 1) -> torch.Tensor:
    """Activations already quantized by quantize_rows (xs) times quantized rows raw [(E,) N, row_bytes].

    With `experts` [P] (int32), output row p multiplies activation row p // rows_per_x by expert experts[p]
    of a stacked [E, N, ...] weight. With `second` (raw2, n2) or (raw2, n2, qtype2) of the same stacking
    (and type, or another type that reads activations in the same order: see blocked_for), the output has
    n + n2 columns, the last n2 from raw2 (one launch for two projections of the same input)."""
    cfg = config or best_config(xs, raw, qtype, n, experts, second, rows_per_x)
    return _launch(xs, raw, qtype, n, experts, cfg, out_dtype, second, rows_per_x)


def gemv(x: torch.Tensor, raw: torch.Tensor, qtype: str, n: int, config: tuple | None = None,
         key: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] times quantized rows raw [N, row_bytes] -> [M, N] in x's dtype (`key`: see quantize_rows)."""
    return matvec(quantize_rows(x, key, blocked_for(qtype)), raw, qtype, n, config=config, out_dtype=x.dtype)
