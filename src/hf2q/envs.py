"""Every environment variable hf2q reads or sets, in one place: its name, default, values and why it exists.

No other module touches `os.environ` (tests/test_structure.py checks). Each accessor reads the environment
when it is called: a module that reads a setting at import keeps the value it found then, and a function
that reads per call sees a later change. A malformed value raises ValueError naming the variable. The
README's "Environment variables" table lists the same variables.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    """One environment variable: its default (None: unset), the values it takes and why it exists."""
    name: str
    default: str | None
    values: str
    why: str

    def raw(self) -> str | None:
        """The value set now (an empty string counts as set), or None."""
        return os.environ.get(self.name)


PDL = Variable("HF2Q_PDL", "1", "0 or 1", "1 launches the decode step's Triton kernels with programmatic dependent "
               "launch on Hopper and later GPUs; 0 launches them one after another (read at import)")
GEMV_TUNE = Variable("HF2Q_GEMV_TUNE", "1", "0 or 1", "1 times a few mat-vec configurations per quantized shape "
                     "on first use; 0 keeps the defaults (read at import)")
GEMV = Variable("HF2Q_GEMV", "measured", "measured or 0..4", "which dense bf16 products go to the Triton GEMV: "
                "the shapes its table measured faster than cuBLAS, or every product of up to N rows (read at import)")
PAGED_DECODE = Variable("HF2Q_PAGED_DECODE", None, "S,N,W (powers of two, N >= 16)", "the paged decode "
                        "attention kernel's splits, keys a step and warps at every batch size and K/V format; "
                        "unset: 32,64,8 for one sequence, 4,32,4 for 8 or more (4,64,4 over a compressed pool; "
                        "16, 8 splits for 2, 4) (read at import)")
GDN_VERIFY = Variable("HF2Q_GDN_VERIFY", None, "P,W (powers of two)", "the DeltaNet verify walk's columns kernel "
                      "(prefill-graph, prefix-hit and speculative verify steps): column parts a value head and warps; "
                      "unset: 4,2 (read at import)")
QUANT_MM = Variable("HF2Q_QUANT_MM", "tile", "tile, packed or mmq", "which kernel multiplies 5-64 rows by Q8_0, "
                    "Q4_K, Q5_K and Q6_K weights: the bf16 tile kernel; the same with bf16 activations making each "
                    "K-quant value by one bf16 fma (scale and min rounded to bf16, fewer instructions); or int8 "
                    "tensor-core dots on int8-quantized activations (llama.cpp's MMQ; the int8 mat-vec's numerics) "
                    "(read at import)")
TUNE_CACHE = Variable("HF2Q_TUNE_CACHE", None, "a file path, or empty", "where the timed mat-vec choices are kept "
                      "across starts; unset: hf2q/matvec_configs.json under the cache directory; empty: nowhere")
XDG_CACHE_HOME = Variable("XDG_CACHE_HOME", None, "a directory", "the cache directory (unset: ~/.cache) for the "
                          "tune cache and the built-in demo model")
TRITON_INTERPRET = Variable("TRITON_INTERPRET", None, "1 or unset", "Triton's interpreter: the Triton kernels run on "
                            "CPU tensors (the tests use it), dp4a is emulated and PDL is off")
NCCL_NVLS_ENABLE = Variable("NCCL_NVLS_ENABLE", None, "set to 0 by hf2q", "NVLink multicast off for a CUDA tensor-"
                            "parallel group: set before the ranks are spawned, which inherit it")
TRITON_CACHE_AUTOTUNING = Variable("TRITON_CACHE_AUTOTUNING", None, "0 or 1 (unset: 1 in hf2q serve)",
                                   "Triton keeps autotuning results in its cache directory, so a second start does not "
                                   "time fla's kernel configurations again")
STEP_TRACE = Variable("HF2Q_STEP_TRACE", "0", "0 or 1", "1 logs every engine step (its sequences, tokens, the "
                      "path it took: a decode, prefill or verify graph, or eager) with its host and device time, "
                      "waiting for the device after each step: where a served request's time goes, at the cost of "
                      "the overlap between steps (read when the engine is built)")
BURST_GRAPHS = Variable("HF2Q_BURST_GRAPHS", "1", "0 or 1", "1 replays steps of many short prompts (bursts of "
                        "requests arriving together, up to 2,048 rows) in CUDA graphs of their own, beside the short "
                        "prefill graphs; 0 runs them eagerly (read when the runner is built)")
MOE_BLOCKS = Variable("HF2Q_MOE_BLOCKS", "0", "a pair count (0: never)", "from how many token-expert pairs of "
                      "K-quant experts a step reads each chosen expert once for up to four of its pairs (pairs grouped "
                      "by expert) instead of once a pair; slower below 1,024 pairs on an H100, so off (read at import)")
VARIABLES = (PDL, GEMV_TUNE, GEMV, QUANT_MM, PAGED_DECODE, GDN_VERIFY, TUNE_CACHE, XDG_CACHE_HOME, TRITON_INTERPRET,
             NCCL_NVLS_ENABLE, TRITON_CACHE_AUTOTUNING, STEP_TRACE, BURST_GRAPHS, MOE_BLOCKS)


def _switch(var: Variable) -> bool:
    setting = var.raw() or var.default
    if setting not in ("0", "1"):
        raise ValueError(f"{var.name} must be 0 or 1, not {setting!r}")
    return setting == "1"


def pdl() -> bool:
    """HF2Q_PDL: whether programmatic dependent launch may be used."""
    return _switch(PDL)


def step_trace() -> bool:
    """HF2Q_STEP_TRACE: whether the engine logs each step's path and times."""
    return _switch(STEP_TRACE)


def burst_graphs() -> bool:
    """HF2Q_BURST_GRAPHS: whether bursts of short prompts replay graphs of their own."""
    return _switch(BURST_GRAPHS)


def gemv_tune() -> bool:
    """HF2Q_GEMV_TUNE: whether the quantized mat-vec times its candidate configurations."""
    return _switch(GEMV_TUNE)


def gemv_rows() -> str | int:
    """HF2Q_GEMV: "measured", or the row count (0..4) up to which every bf16 product goes to the Triton GEMV."""
    setting = GEMV.raw() or GEMV.default
    if setting == "measured":
        return setting
    if setting not in ("0", "1", "2", "3", "4"):
        raise ValueError(f"HF2Q_GEMV must be measured or a row count 0..4, not {setting!r}")
    return int(setting)


def quant_mm() -> str:
    """HF2Q_QUANT_MM: "tile", "packed" or "mmq", the kernel for 5-64 rows of Q8_0, Q4_K, Q5_K and Q6_K weights."""
    setting = QUANT_MM.raw() or QUANT_MM.default
    if setting not in ("tile", "packed", "mmq"):
        raise ValueError(f"HF2Q_QUANT_MM must be tile, packed or mmq, not {setting!r}")
    return setting


def moe_blocks() -> int | None:
    """HF2Q_MOE_BLOCKS: the token-expert pairs from which K-quant experts are read once a block of pairs (None:
    never)."""
    setting = MOE_BLOCKS.raw() or MOE_BLOCKS.default
    if not setting.isdigit():
        raise ValueError(f"HF2Q_MOE_BLOCKS must be a pair count, not {setting!r}")
    return int(setting) or None


def _powers_of_two(var: Variable, form: str) -> tuple[int, ...] | None:
    """`var` as comma-separated powers of two in `form` (e.g. S,N,W), or None where unset or empty."""
    setting = var.raw()
    if not setting:
        return None
    count = form.count(",") + 1
    try:
        values = tuple(int(v) for v in setting.split(","))
    except ValueError:
        values = ()
    if len(values) != count:
        raise ValueError(f"{var.name} must be {count} integers {form}, not {setting!r}")
    if any(v < 1 or v & (v - 1) for v in values):
        raise ValueError(f"{var.name}: powers of two, not {setting!r}")
    return values


def paged_decode() -> tuple[int, int, int] | None:
    """HF2Q_PAGED_DECODE: (splits, keys a step, warps), or None where unset or empty."""
    values = _powers_of_two(PAGED_DECODE, "S,N,W")
    if values and values[1] < 16:
        raise ValueError(f"HF2Q_PAGED_DECODE: N >= 16 (the tensor cores' width), not {PAGED_DECODE.raw()!r}")
    return values


def gdn_verify() -> tuple[int, int] | None:
    """HF2Q_GDN_VERIFY: (column parts a value head, warps), or None where unset or empty."""
    return _powers_of_two(GDN_VERIFY, "P,W")


def cache_home() -> Path:
    """XDG_CACHE_HOME, or ~/.cache where it is unset or empty."""
    return Path(XDG_CACHE_HOME.raw() or os.path.join(os.path.expanduser("~"), ".cache"))


def tune_cache() -> Path | None:
    """HF2Q_TUNE_CACHE: the tune cache file, or None (set empty) to keep nothing on disk."""
    setting = TUNE_CACHE.raw()
    if setting == "":
        return None
    if setting:
        return Path(setting)
    return cache_home() / "hf2q" / "matvec_configs.json"


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton's interpreter is on (Triton reads it when it is imported)."""
    return TRITON_INTERPRET.raw() == "1"


def keep_autotuning() -> None:
    """Keep Triton's autotuning results across starts unless the user chose otherwise: the autotuned
    kernels (fla's chunked delta rule and its helpers) otherwise time their configurations on every start,
    before /health can say ready. Triton reads the variable when an autotuned kernel first runs."""
    if TRITON_CACHE_AUTOTUNING.raw() is None:
        os.environ[TRITON_CACHE_AUTOTUNING.name] = "1"


def disable_nccl_nvls() -> None:
    """Set NCCL_NVLS_ENABLE=0 for the processes spawned after this call."""
    os.environ[NCCL_NVLS_ENABLE.name] = "0"
