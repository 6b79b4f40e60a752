"""Programmatic dependent launch (kernels/tuning/pdl.py): the decode kernels launched with it read and write
nothing before they wait for the previous kernel, on the sm_90 code Triton builds (checked here without a
GPU, in the PTX; the GPU tests run the same kernels launched so inside CUDA graphs)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.support.triton_targets import compile_for_hopper

# pointers whose element type the kernel relies on; every other pointer is fp32, every other scalar i32
_POINTERS = {"slot_ptr": "*i64", "map_ptr": "*i64", "bt_ptr": "*i32", "len_ptr": "*i32", "xq_ptr": "*i8",
             "w16": "*i16", "w16b": "*i16", "w32": "*i32", "w32b": "*i32", "expert_ptr": "*i32",
             "kstore_ptr": "*u8", "vstore_ptr": "*u8"}
_FLOATS = {"eps", "scale", "sqrt_d", "inv_sqrt_d"}
_CODED_ROWS = {"k_ptr": "*u8", "v_ptr": "*u8", "q_ptr": "*bf16"}  # the paged attention over a compressed pool


def _kernels():
    from hf2q.kernels.gdn import decode_triton as gdn_decode_triton
    from hf2q.kernels.linear import gemv_triton
    from hf2q.kernels.moe import route_triton as moe_triton
    from hf2q.kernels.norm import add_rms_triton as norm_triton
    from hf2q.kernels.attention import compressed_triton, paged_triton as paged_attention_triton
    from hf2q.kernels.rotary import qk_rope_triton
    from hf2q.kernels.quant import dp4a_triton as quant_dp4a_triton, int8_rows
    from hf2q.kernels.activation import swiglu_triton
    q4k = quant_dp4a_triton._row_units("Q4_K", 4096)  # K = 4096: the sizes that follow from K are constants
    dp4a = dict(QTYPE=2, QTYPE_B=2, BM=1, BN=4, SB=16, STAGES=1, HAS_EXPERTS=False, TWO=False, EVEN=True,
                EMULATE=False, row_units=q4k, row_units_b=q4k, n_units=16, n_g16=256)
    return {
        "dp4a": (quant_dp4a_triton._gemv_dp4a_kernel, dp4a, 1),
        "dp4a_two": (quant_dp4a_triton._gemv_dp4a_kernel,
                     dict(dp4a, TWO=True, QTYPE_B=4, row_units_b=quant_dp4a_triton._row_units("Q6_K", 4096)), 2),
        "dp4a_experts": (quant_dp4a_triton._gemv_dp4a_kernel, dict(dp4a, HAS_EXPERTS=True), 1),
        "quantize": (int8_rows._quantize_kernel, dict(GROUPS=16, BLOCKED=True), 4),
        "norm": (norm_triton._add_rms_norm_kernel, dict(HAS_R=True, BLOCK=4096, SLICE=512, QUANT=True,
                                                        BLOCKED=True), 8),
        "swiglu": (swiglu_triton._silu_mul_kernel, dict(BLOCK=512, QUANT=True, BLOCKED=True), 4),
        "gdn_columns": (gdn_decode_triton._gdn_conv_columns_kernel, dict(DK=128, DV=128, SPLIT=4), 4),
        "gdn_finish": (gdn_decode_triton._gdn_conv_finish_kernel, dict(DK=128, DV=128, SPLIT=4, QUANT=True,
                                                                       BLOCKED=True), 4),
        "attention": (paged_attention_triton._paged_decode_kernel, dict(REP=4, REP_PAD=16, HD=256, BLOCK_SIZE=16,
                                                                        BLOCK_N=32, NSPLIT=16), 4),
        "attention_tq": (paged_attention_triton._paged_decode_kernel, dict(REP=4, REP_PAD=16, HD=256, BLOCK_SIZE=16,
                                                                           BLOCK_N=32, NSPLIT=16, CODED=2), 4, _CODED_ROWS),
        "attention_fp8": (paged_attention_triton._paged_decode_kernel, dict(REP=4, REP_PAD=16, HD=256, BLOCK_SIZE=16,
                                                                            BLOCK_N=64, NSPLIT=8, CODED=1), 4, _CODED_ROWS),
        "store_tq": (compressed_triton._store_kernel, dict(HD=256, LOG2=8, TQ=True), 2),
        "store_fp8": (compressed_triton._store_kernel, dict(HD=256, LOG2=8, TQ=False), 2),
        "merge": (paged_attention_triton._merge_kernel, dict(HD=256, NSPLIT=16, HAS_GATE=True), 2),
        "qk_rope": (qk_rope_triton._qk_norm_rope_kernel, dict(HD=256, RD=64, WRITE_POOL=True), 2),
        "gemv_glu": (gemv_triton._gemv_kernel, dict(BLOCK_N=1, BLOCK_K=2048, K_TILES=1, STAGES=1, EVEN_K=True,
                                                    HAS_EXPERTS=False, GLU=True), 4),
        "gemv_experts": (gemv_triton._gemv_kernel, dict(BLOCK_N=1, BLOCK_K=2048, K_TILES=1, STAGES=1, EVEN_K=True,
                                                        HAS_EXPERTS=True, GLU=True), 1),
        "skinny": (gemv_triton._skinny_kernel, dict(BLOCK_N=64, BLOCK_K=128, K_TILES=16, STAGES=5, EVEN_K=True), 4),
        "down_combine": (gemv_triton._down_combine_kernel, dict(BLOCK_N=4, BLOCK_K=256, K_TILES=2, KS_TILES=2,
                                                                STAGES=1, EVEN_K=True, EVEN_KS=True, TOPK=8,
                                                                HAS_SHARED=True), 2),
        "route": (moe_triton._route_kernel, dict(TOPK=8, TOPK_P2=8, BLOCK_E=256), 1),
        "combine": (moe_triton._combine_kernel, dict(TOPK=8, HAS_SHARED=True, BLOCK=2048), 4),
    }


def _ptx(fn, const: dict, warps: int, pointers: dict | None = None) -> list[str]:
    """The kernel's PTX lines for sm_90: pointers by `pointers`, then _POINTERS (else fp32), scalars i32 (or
    fp32)."""
    sig = {}
    types = {**_POINTERS, **(pointers or {})}
    for p in fn.params:
        if p.is_constexpr:
            continue
        if p.name.endswith("_ptr") or p.name in types:
            sig[p.name] = types.get(p.name, "*fp32")
        else:
            sig[p.name] = "fp32" if p.name in _FLOATS else "i32"
    return compile_for_hopper(fn, sig, const, warps).splitlines()


_MEMORY = re.compile(r"\b(ld\.global|st\.global|cp\.async|atom\.|red\.)")
_LABEL = re.compile(r"^\s*(\$L\w+):")
_BRANCH = re.compile(r"^\s*(@!?%p\d+\s+)?bra(\.uni)?\s+(\$L\w+);")


def _before_wait(lines: list[str], pattern) -> list[str]:
    """Lines matching `pattern` on some path from the kernel's entry that has not passed a
    griddepcontrol.wait (the PTX walked as a control-flow graph: branches, fall-through, returns)."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    found, seen, todo = [], set(), [0]
    while todo:
        i = todo.pop()
        while i < len(lines):
            line = lines[i]
            if (m := _LABEL.match(line)):
                if m.group(1) in seen:
                    break
                seen.add(m.group(1))
            if "griddepcontrol.wait" in line:
                break
            if pattern.search(line):
                found.append(line.strip())
            if (m := _BRANCH.match(line)):
                todo.append(labels[m.group(3)])
                if not m.group(1):  # unconditional
                    break
            if re.match(r"^\s*ret;", line):
                break
            i += 1
    return found


@pytest.mark.parametrize("name", list(_kernels()))
def test_no_memory_access_before_the_wait(name):
    """With PDL, no global read or write is reachable from the kernel's entry before griddepcontrol.wait,
    and the kernel lets its dependents launch."""
    fn, const, warps, *pointers = _kernels()[name]
    lines = _ptx(fn, {**const, "PDL": True}, warps, *pointers)
    assert any("griddepcontrol.wait" in line for line in lines), "no wait for the previous kernel"
    assert _before_wait(lines, _MEMORY) == []
    assert any("griddepcontrol.launch_dependents" in line for line in lines)


def test_plain_launch_has_no_grid_dependency_control():
    """Without PDL the kernels compile as before: no wait, no early launch of the next kernel."""
    fn, const, warps = _kernels()["dp4a_two"]
    assert not any("griddepcontrol" in line for line in _ptx(fn, {**const, "PDL": False}, warps))


def test_off_where_it_cannot_run():
    """CPU tensors (and the interpreter) launch normally: no PDL constexpr set, no launch attribute."""
    from hf2q.kernels.tuning import pdl
    assert pdl.launch_options(torch.device("cpu")) == {}


@pytest.mark.parametrize("value", ["2", "yes"])
def test_setting_is_checked(value):
    """HF2Q_PDL takes 0 or 1; anything else stops the import with the accepted values."""
    env = {**os.environ, "HF2Q_PDL": value}
    run = subprocess.run([sys.executable, "-c", "import hf2q.kernels.tuning.pdl"], env=env, capture_output=True, text=True)
    assert run.returncode != 0 and "HF2Q_PDL must be 0 or 1" in run.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_same_logits_with_and_without_pdl(tmp_path):
    """The launch changes when kernels start, never what they compute: graph-replayed decode logits of a bf16
    dense and MoE model, and the cached decode of a Q4_K_M-style model on the int8 mat-vecs, are bitwise the
    same with HF2Q_PDL=1 (on, where the GPU has it) and HF2Q_PDL=0."""
    runs = {}
    for setting in ("1", "0"):
        path = tmp_path / f"pdl{setting}.pt"
        proc = subprocess.run([sys.executable, "-m", "tests.kernels.pdl_logits_child", str(path)],
                              env={**os.environ, "HF2Q_PDL": setting, "HF2Q_GEMV_TUNE": "0"},
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[setting] = torch.load(path)
    assert runs["1"]["pdl"] == (torch.cuda.get_device_capability()[0] >= 9) and not runs["0"]["pdl"]
    for model in ("dense", "moe", "kept"):
        for step, (a, b) in enumerate(zip(runs["1"][model], runs["0"][model])):
            assert torch.equal(a, b), (model, step, float((a - b).abs().max()))
