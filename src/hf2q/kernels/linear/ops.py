"""Dense products and packs of projections of one input: picks the Triton GEMV (a few bf16 rows, where its
table measured it faster or HF2Q_GEMV sends them) or cuBLAS, and routes quantized packs to quant/ops.py."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from hf2q import envs
from hf2q.kernels.activation import ops as activation_ops
from hf2q.kernels.choose import kernels_on, use_fast_path


# The Triton GEMV for few rows of x. By default ("measured") it serves the shapes its table records as
# faster than cuBLAS on the device (2B, one row: 20% faster); HF2Q_GEMV=N sends every product of at most
# N (0..4) rows to it, HF2Q_GEMV=0 none.
_GEMV = {"rows": envs.gemv_rows()}


@contextlib.contextmanager
def gemv_switch(rows):
    """Temporarily send products of at most `rows` rows (0: none; "measured": the table's faster shapes)
    to the Triton GEMV, as HF2Q_GEMV does."""
    old, _GEMV["rows"] = _GEMV["rows"], rows
    try:
        yield
    finally:
        _GEMV["rows"] = old


def gemv_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x Wᵀ goes to the Triton GEMV: a few bf16 rows where Triton runs and the HF2Q_GEMV setting
    sends them."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (1 <= rows <= 4 and kernels_on(x) and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and x.stride(-1) == 1 and weight.stride(-1) == 1):
        return False
    from hf2q.kernels.linear import gemv_triton
    limit = _GEMV["rows"]
    if limit == "measured":
        return gemv_triton.measured_faster(weight.shape[0], x.shape[-1], rows)
    return rows <= limit


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x Wᵀ for a dense weight [N, K], in out_dtype (default x's): the Triton GEMV for a few bf16 rows on
    CUDA where the HF2Q_GEMV setting sends them (one kernel, no split-K reduce), cuBLAS otherwise."""
    if gemv_serves(x, weight):
        from hf2q.kernels.linear.gemv_triton import gemv
        return gemv(x, weight, out_dtype)
    y = F.linear(x, weight)
    return y if out_dtype is None else y.to(out_dtype)


def packed_linear(x: torch.Tensor, linears) -> tuple[torch.Tensor, ...]:
    """Several projections of the same input as one GEMM. Their weights are concatenated once (`pack`,
    after load) and each Linear's weight is a view of the packed matrix (no second copy). Quantized
    projections of one type pack their blocks the same way (rows are whole blocks); a pack mixing
    types packs each type's projections together (llama.cpp's Q4_K_M gives the DeltaNet qkv Q5_K and
    its z, alpha and beta Q4_K), and its dense projections together (a MoE's router and shared-expert
    gate, kept in float: one product instead of two)."""
    if any(lin.quantized for lin in linears):
        return _packed_by_type(x, linears)
    if _trainable(linears):
        return tuple(linear(x, lin.weight) for lin in linears)
    out = linear(x, _dense_pack(linears))
    return torch.split(out, [lin.weight.shape[0] for lin in linears], dim=-1)


def projections(x: torch.Tensor, linears) -> tuple[torch.Tensor, ...]:
    """Several projections of x: one packed GEMM on the vectorised path (`use_fast_path`, packed_linear),
    each Linear's own product on the exact path (the products the exactness tests were written against)."""
    if use_fast_path(x):
        return packed_linear(x, linears)
    return tuple(lin(x) for lin in linears)


def packed_swiglu(x: torch.Tensor, linears, int8_for: str | None = None) -> tuple[torch.Tensor, ...]:
    """packed_linear of `linears` whose last two are a SwiGLU's gate and up -> the other projections'
    outputs, then silu(gate) * up. Where the GEMV serves the pack at one row, the SwiGLU is its epilogue
    (gemv_triton.gemv_glu): one launch, no activation launch after it. Elsewhere the pack's product and
    silu_mul run as two steps; with int8_for (the result feeds the int8 mat-vec of a weight of that type)
    too, since silu_mul also writes the int8 rows."""
    gate, up = linears[-2], linears[-1]
    if (int8_for is None and not any(lin.quantized for lin in linears) and x.numel() == x.shape[-1]
            and gate.weight.shape == up.weight.shape and not _trainable(linears)):
        packed = _dense_pack(linears)
        if gemv_serves(x, packed):
            from hf2q.kernels.linear.gemv_triton import gemv_glu
            sizes = [lin.weight.shape[0] for lin in linears[:-1]]
            return torch.split(gemv_glu(x, packed, sum(sizes[:-1])), sizes, dim=-1)
    *others, g, u = packed_linear(x, linears)
    return (*others, activation_ops.silu_mul(g, u, int8_for))


def _trainable(linears) -> bool:
    """Whether a projection's weight is being trained (tools/train_mtp.py): such weights are never packed, as
    the pack is a copy outside autograd and would replace the Parameters an optimizer holds."""
    return any(lin.weight is not None and lin.weight.requires_grad for lin in linears)


def pack(linears) -> None:
    """Concatenate projections of one input as packed_linear multiplies them: the dense ones together and
    each quantized type's blocks together, each Linear's weight (or blocks) then a view of its pack. Run
    once after load, on the final device (Qwen35Model.pack_weights), so that no forward pays for it; the
    forward makes a pack itself only for a net built by hand or moved since. Trained weights stay apart."""
    if _trainable(linears):
        return
    for qtype, idx in _type_groups(linears).items():
        part = [linears[i] for i in idx]
        if qtype is None:
            _dense_pack(part)
        else:
            _packed_raw(part)


def _type_groups(linears) -> dict[str | None, list[int]]:
    """Indices of `linears` by weight type (None: dense), in order: the parts a mixed pack multiplies apart."""
    groups: dict[str | None, list[int]] = {}
    for i, lin in enumerate(linears):
        groups.setdefault(lin.qtype if lin.quantized else None, []).append(i)
    return groups


def _dense_pack(linears) -> torch.Tensor:
    """The dense projections' weights concatenated (made by `pack`; each weight a view of it); a lone
    projection's own weight."""
    return _concatenated(linears, "weight", "_packed", lambda rows: torch.nn.Parameter(rows, requires_grad=False))


def _concatenated(linears, attr: str, kept_as: str, wrap) -> torch.Tensor:
    """The `attr` tensors of `linears` (rows on dim 0) concatenated once and kept on the first as `kept_as`,
    each Linear's `attr` then `wrap` of its rows of it; made again where the kept one is not, in order, what
    the Linears hold (moved since, or built by hand). A lone Linear's own tensor."""
    parts = [getattr(lin, attr) for lin in linears]
    if len(parts) == 1:
        return parts[0]
    packed = getattr(linears[0], kept_as, None)
    if packed is None or packed.device != parts[0].device or not _views_of(packed, parts):
        packed = torch.cat([part.data for part in parts])
        row = 0
        for lin, part in zip(linears, parts):
            setattr(lin, attr, wrap(packed[row:row + part.shape[0]]))
            row += part.shape[0]
        setattr(linears[0], kept_as, packed)
    return packed


def _views_of(packed: torch.Tensor, parts) -> bool:
    """Whether `parts` are, in order, consecutive row blocks of `packed` (the pack made for exactly these
    projections: a projection shared by two packs, such as a router replicated across tensor-parallel
    shards, must not pick up another pack)."""
    row_bytes = packed.stride(0) * packed.element_size()
    ptr = packed.data_ptr()
    for part in parts:
        if part.data_ptr() != ptr:
            return False
        ptr += part.shape[0] * row_bytes
    return ptr == packed.data_ptr() + packed.shape[0] * row_bytes


def _packed_by_type(x: torch.Tensor, linears) -> tuple[torch.Tensor, ...]:
    groups = _type_groups(linears)
    if len(groups) == 1:  # one quantized type: its column layout, dense copy or blocks
        return _packed_quant_linear(x, linears)
    whole = _dense_copy(linears, sum(lin.out_features for lin in linears))
    if dense_serves(x, whole):  # one copy of the whole pack, whatever its types: one GEMM, as a dense file's pack
        return torch.split(linear(x, whole), [lin.out_features for lin in linears], dim=-1)
    out: list = [None] * len(linears)
    quant = [(qtype, idx) for qtype, idx in groups.items() if qtype is not None]
    if len(quant) == 2:  # two types (a DeltaNet's Q5_K qkv and Q4_K z/a/b): one launch where the mat-vec serves
        from hf2q.kernels.quant.ops import quant_linear_pair

        parts = [[linears[i] for i in idx] for _, idx in quant]
        sizes = [[lin.out_features for lin in part] for part in parts]
        weights = [(_packed_raw(part), qtype, sum(n)) for part, (qtype, _), n in zip(parts, quant, sizes)]
        y = quant_linear_pair(x, *weights)
        if y is not None:
            for i, r in zip(quant[0][1] + quant[1][1], torch.split(y, sizes[0] + sizes[1], dim=-1)):
                out[i] = r
            groups = {None: groups[None]} if None in groups else {}
    for qtype, idx in groups.items():
        if len(idx) == 1:
            results = [linears[idx[0]](x)]
        elif qtype is None:
            results = packed_linear(x, [linears[i] for i in idx])
        else:
            results = _packed_quant_linear(x, [linears[i] for i in idx])
        for i, r in zip(idx, results):
            out[i] = r
    return tuple(out)


def _packed_quant_linear(x: torch.Tensor, linears) -> tuple[torch.Tensor, ...]:
    """packed_linear for projections quantized as one type (see _packed_raw); 5-16 rows multiply the pack's
    column layout where one is kept (`keep_columns`), many rows its dense copy where one is kept (`keep_dense`)."""
    from hf2q.kernels.quant.ops import quant_linear

    sizes = [lin.out_features for lin in linears]
    columns = kept_columns(linears)
    if columns_serve(x, columns):
        return torch.split(columns_linear(x, columns), sizes, dim=-1)
    dense = _dense_copy(linears, sum(sizes))
    if dense_serves(x, dense):
        out = linear(x, dense)
    else:
        out = quant_linear(x, _packed_raw(linears), linears[0].qtype, sum(sizes))
    return torch.split(out, sizes, dim=-1)


# Products of at least this many rows multiply a quantized weight's dense copy where one is kept (`keep_dense`,
# `hf2q serve --batched-weights dense`). Fewer rows read the blocks: at 1-4 rows a step's time is reading
# weights, and 4-bit blocks are a quarter of bf16's bytes.
DENSE_ROWS = 16


def dense_serves(x: torch.Tensor, dense: torch.Tensor | None) -> bool:
    """Whether x multiplies the dense copy `dense` (None: none kept) rather than the quantized blocks."""
    return dense is not None and x.numel() >= DENSE_ROWS * x.shape[-1]


def _dense_copy(linears, rows: int) -> torch.Tensor | None:
    """The dense copy kept for exactly these projections (a lone one's own, or the pack's, whose rows are
    theirs in order), else None."""
    if len(linears) == 1:
        return linears[0].dense
    dense = getattr(linears[0], "_dpacked", None)
    if dense is None or dense.shape[0] != rows or any(lin.dense is None for lin in linears) \
            or not _views_of(dense, [lin.dense for lin in linears]):
        return None
    return dense


def keep_dense(linears, dtype: torch.dtype) -> int:
    """Dequantize the quantized projections among `linears` (one input's, as `pack` groups them) into dense
    copies of `dtype` kept beside their blocks: one copy per pack of one type, each projection's a view of its
    rows. Returns the bytes kept. Products of DENSE_ROWS rows or more then multiply the copies (cuBLAS reading
    them once per step) instead of dequantizing every block in the tile kernels on every step.

    A pack of several quantized types and nothing else (llama.cpp's Q4_K_M gives a DeltaNet's qkv Q5_K beside
    its z, alpha and beta Q4_K, and an attention's v Q6_K beside its q and k Q4_K) gets one copy for all of it,
    so that many rows make the one GEMM a dense file's pack makes, not one a type. A pack with dense weights too
    (a MoE's router, kept in float) keeps its copies by type."""
    from hf2q.kernels.quant.ops import dequantize

    groups = _type_groups(linears)
    if len(groups) > 1 and None not in groups:
        if any(lin.dense is not None for lin in linears):
            return 0
        whole = torch.empty(sum(lin.out_features for lin in linears), linears[0].in_features, dtype=dtype,
                            device=linears[0].qweight.device)
        row = 0
        for lin in linears:
            lin.dense = whole[row:row + lin.out_features]
            lin.dense.copy_(dequantize(lin.qweight, lin.qtype, (lin.out_features, lin.in_features), dtype))
            row += lin.out_features
        linears[0]._dpacked = whole
        return whole.numel() * whole.element_size()
    kept = 0
    for qtype, idx in groups.items():
        part = [linears[i] for i in idx]
        if qtype is None or part[0].dense is not None:
            continue
        raw = _packed_raw(part)
        rows = sum(lin.out_features for lin in part)
        dense = dequantize(raw, qtype, (rows, part[0].in_features), dtype)
        row = 0
        for lin in part:
            lin.dense = dense[row:row + lin.out_features]
            row += lin.out_features
        if len(part) > 1:
            part[0]._dpacked = dense
        kept += dense.numel() * dense.element_size()
    return kept


def keep_columns(linears) -> int:
    """Lay out the Q4_K projections among `linears` by column (quant/q4k_columns), a pack's once (its rows those of
    the projections in order), beside their blocks: products of more rows than the mat-vec takes, up to
    COLUMNS_ROWS, then read the column layout (`columns_serve`). Returns the bytes kept."""
    from hf2q.kernels.quant.q4k_columns import from_blocks
    from hf2q.quant import from_gpu_rows, is_interleaved

    kept = 0
    for qtype, idx in _type_groups(linears).items():
        part = [linears[i] for i in idx]
        if qtype != "Q4_K" or kept_columns(part) is not None:
            continue
        raw = _packed_raw(part)
        rows, k = sum(lin.out_features for lin in part), part[0].in_features
        if is_interleaved(raw, qtype):
            raw = from_gpu_rows(raw, qtype, k)
        columns = from_blocks(raw, rows)
        part[0]._columns = (tuple(id(lin) for lin in part), columns)
        kept += columns.nbytes
    return kept


def kept_columns(linears):
    """The column layout kept for exactly these projections (`keep_columns`), else None."""
    kept = getattr(linears[0], "_columns", None)
    return kept[1] if kept is not None and kept[0] == tuple(id(lin) for lin in linears) else None


# Products of more rows than the int8 mat-vec takes, up to this many, read a Q4_K projection's column layout where
# one is kept (`keep_columns`). On an H100 a 9B token's Q4_K projections took 2.85 ms at 16 rows on the column
# kernel against 4.06 ms on cuBLAS over the dense copies, and 5.32 against 4.04 at 64 rows (BENCHMARKS.md): more
# rows multiply the copies.
COLUMNS_ROWS = 16


def columns_serve(x: torch.Tensor, columns) -> bool:
    """Whether x multiplies the column layout `columns` (None: none kept): more rows than the int8 mat-vec
    takes, up to COLUMNS_ROWS, where Triton runs."""
    if columns is None:  # every quantized product asks: no import until a layout is kept
        return False
    from hf2q.kernels.choose import triton_runs
    from hf2q.kernels.quant.ops import MATVEC_ROWS

    return triton_runs(x) and MATVEC_ROWS < x.numel() // x.shape[-1] <= COLUMNS_ROWS


def columns_linear(x: torch.Tensor, columns) -> torch.Tensor:
    """x [..., K] times a column-laid-out Q4_K weight [N, K] transposed -> [..., N] in x's dtype."""
    from hf2q.kernels.quant.q4k_columns import columns_mm

    y = columns_mm(x.reshape(-1, x.shape[-1]), columns)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _packed_raw(linears) -> torch.Tensor:
    """The block rows of projections quantized as one type, concatenated once (made by `pack`; each
    Linear's qweight then a view of the packed blocks); a lone projection's own blocks."""
    return _concatenated(linears, "qweight", "_qpacked", lambda rows: rows)
