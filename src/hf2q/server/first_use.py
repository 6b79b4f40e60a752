"""What a first request would otherwise pay for, done during the start, before `/health` says 200: the import
that Starlette's streaming response makes on first use, and on CUDA the grammar compiler for the vocabulary.

The compiler is built on a thread of its own beside the warm-up, which on CUDA is seconds of compiling and
capturing anyway. On the CPU the warm-up is next to nothing and the start would wait for the build, so there a
first constrained request builds it, as before."""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("hf2q.serve")


def import_streaming() -> None:
    """A streamed response opens an anyio task group, whose first use imports anyio's asyncio backend: 12-14 ms of
    a first streamed request's time to first token on a 2-core host."""
    import anyio._backends._asyncio  # noqa: F401


def grammar_in_background(model, device) -> threading.Thread | None:
    """On CUDA, start building the grammar compiler of `model`'s vocabulary, the request-independent formats and
    the mask's kernel (`hf2q.engine.grammar.prepare`) on a thread, returned to be joined before `/health` says
    200; None elsewhere. A failure is left for the first constrained request, which reports it."""
    if device.type != "cuda":
        return None

    def run() -> None:
        t0 = time.monotonic()
        try:
            from hf2q.engine import grammar
            grammar.prepare(model.tokenizer, model.config.vocab_size, device)
        except Exception as err:  # noqa: BLE001 - reported by the first request that needs a grammar
            log.warning("grammar compiler not built ahead (%s): the first constrained request builds it", err)
            return
        log.info("grammar compiler built beside the warm-up in %.1f s", time.monotonic() - t0)

    thread = threading.Thread(target=run, name="grammar-ahead", daemon=True)
    thread.start()
    return thread
