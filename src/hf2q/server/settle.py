"""What `hf2q serve` does once warmed up, before `/health` says 200: it finishes what a first request would
otherwise pay for (hf2q.server.first_use), takes what the start left alive out of the garbage collector's scans,
and on CUDA starts watching for kernels Triton still builds (each one a wait some request would pay:
hf2q.kernels.tuning.late_compiles)."""
from __future__ import annotations

import gc
import logging

from hf2q.server.first_use import GrammarAhead, import_streaming

log = logging.getLogger("hf2q.serve")


def settle(device, ahead: GrammarAhead | None = None) -> None:
    """The server's last start-up step (see the module's docstring); `ahead`: the grammar compiler's build
    (first_use.grammar_in_background), finished here."""
    import_streaming()
    if ahead is not None:
        ahead.finish()
    log.info("froze %d objects out of the garbage collector's scans", freeze_startup_heap())
    if device.type == "cuda":
        from hf2q.kernels.tuning.late_compiles import WATCH
        if WATCH.install():
            log.info("watching for kernels built after the warm-up (each one is logged and counted in /metrics)")


def freeze_startup_heap() -> int:
    """Take what the load and the warm-up left alive (modules, the model, the tokenizer's vocabulary: hundreds of
    thousands of objects) out of the garbage collector's scans, and return how many. A full collection over them
    takes about 135 ms on a 2-core host (the start itself runs several), and one falling inside a served step stalls
    every stream in it. (It was suspected of an H100 server's slow first speculative request; with the freeze that
    request was still about 150 ms slower than the first without speculation, so it was not the cause.) They stay
    alive for the server's life anyway; what requests allocate later is collected as before."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
