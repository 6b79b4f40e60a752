"""`hf2q serve --batched-weights`: whether a quantized file's projections get dense copies (and, with `columns`, a
column layout of the Q4_K ones) for batched steps.

The copies (hf2q.kernels.linear.ops.keep_dense) cost two bytes a weight of GPU memory, taken from the K/V pool, and
make steps of many rows run on cuBLAS instead of dequantizing every block in the tile kernels on every step.
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("hf2q.serve")

# --batched-weights auto keeps the dense copies where they take at most this share of the memory free beyond the
# serving reserve: the rest stays K/V pool. The copies read 4x the bytes of 4-bit blocks but run on cuBLAS, which
# at 64 rows beats the tile kernels by more than that (served on an H100: 64 streams 5,519 against 4,092 tok/s).
AUTO_DENSE_SHARE = 0.25


def keep_dense_weights(net, device, dtype, asked: bool = True) -> None:
    """--batched-weights dense (asked) or auto: a dense copy of every quantized projection beside its blocks
    (before the K/V pool is sized from what is left). Asked for, it is refused by name where there is nothing to
    copy or no room for the copies; auto keeps them only on CUDA within AUTO_DENSE_SHARE of the free memory and
    logs why not otherwise."""
    import torch

    from hf2q.kernels.linear.ops import DENSE_ROWS
    from hf2q.layers.linear import Linear
    from hf2q.server.sizing import serving_reserve

    need = sum(m.out_features * m.in_features for m in net.modules() if isinstance(m, Linear) and m.quantized) \
        * dtype.itemsize
    if need == 0:
        if asked:
            raise ValueError("--batched-weights dense: this model keeps no quantized projection to copy (a dense "
                             "file, or --dequantize)")
        return
    if device.type != "cuda" and not asked:
        return
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        room = free - serving_reserve(total)
        if asked and need > room:
            raise ValueError(f"--batched-weights dense needs {need / 2**30:.1f} GiB for the dense copies; "
                             f"{max(room, 0) / 2**30:.1f} GiB is free beyond the reserve")
        if not asked and need > AUTO_DENSE_SHARE * room:
            log.info("--batched-weights auto: steps of %d+ rows read the quantized blocks (dense copies would take "
                     "%.1f GiB, over %d%% of the %.1f GiB free beyond the reserve)", DENSE_ROWS, need / 2**30,
                     round(100 * AUTO_DENSE_SHARE), max(room, 0) / 2**30)
            return
    t0 = time.monotonic()
    kept = net.keep_dense_weights(dtype)
    log.info("kept dense copies of the quantized projections for steps of %d+ rows: %.1f GiB in %.1f s%s", DENSE_ROWS,
             kept / 2**30, time.monotonic() - t0, "" if asked else " (--batched-weights auto: within a quarter of "
             "the free memory; --batched-weights quantized keeps it for the K/V pool)")


def keep_column_weights(net) -> None:
    """--batched-weights columns: every Q4_K projection laid out once more by column (quant/q4k_columns) for steps
    of 5-16 rows, before the dense copies and the K/V pool take their share; refused by name where the model keeps
    no Q4_K projection."""
    t0 = time.monotonic()
    kept = net.keep_column_weights()
    if kept == 0:
        raise ValueError("--batched-weights columns: this model keeps no Q4_K projection to lay out (another type, "
                         "a dense file, or --dequantize)")
    log.info("laid out the Q4_K projections by column for steps of 5-16 rows: %.1f GiB in %.1f s", kept / 2**30,
             time.monotonic() - t0)
