"""What a first request would otherwise pay for, done during the start, before `/health` says 200: the import
that Starlette's streaming response makes on first use, and on CUDA the grammar compiler for the vocabulary.

The compiler is built on a thread of its own beside the warm-up, which on CUDA is seconds of compiling and
capturing anyway; that thread does host work only (a CUDA call from another thread can break a graph capture), and
the mask's kernel is compiled after the warm-up. On the CPU the warm-up is next to nothing and the start would wait
for the build, so there a first constrained request builds it, as before."""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("hf2q.serve")


def import_streaming() -> None:
    """A streamed response opens an anyio task group, whose first use imports anyio's asyncio backend: 12-14 ms of
    a first streamed request's time to first token on a 2-core host. (A private module: should anyio move it, the
    start goes on and tests/e2e/test_startup.py says so.)"""
    try:
        import anyio._backends._asyncio  # noqa: F401
    except ImportError:
        log.debug("anyio's asyncio backend not imported ahead")


class GrammarAhead:
    """The grammar compiler of a model's vocabulary and the request-independent formats
    (`hf2q.engine.grammar.prepare`), built on a thread from construction; `finish` waits for it and masks one logits
    row on the device. A failure is a log line, left for the first constrained request, which reports it."""

    def __init__(self, model, device):
        self.device = device
        self.compiler = None
        self._thread = threading.Thread(target=self._build, args=(model,), name="grammar-ahead", daemon=True)
        self._thread.start()

    def _build(self, model) -> None:
        t0 = time.monotonic()
        try:
            from hf2q.engine import grammar
            self.compiler = grammar.prepare(model.tokenizer, model.config.vocab_size)
        except Exception as err:  # noqa: BLE001 - reported by the first request that needs a grammar
            log.warning("grammar compiler not built ahead (%s): the first constrained request builds it", err)
            return
        log.info("grammar compiler built beside the warm-up in %.1f s", time.monotonic() - t0)

    def finish(self) -> None:
        self._thread.join()
        if self.compiler is None:
            return
        from hf2q.engine import grammar
        try:
            grammar.mask_once(self.compiler, self.device)
        except Exception as err:  # noqa: BLE001 - the first constrained request meets it again and reports it
            log.warning("grammar mask not run ahead (%s): the first constrained request compiles it", err)


def grammar_in_background(model, device) -> GrammarAhead | None:
    """On CUDA, the grammar compiler's build, begun (finished by `settle` before `/health` says 200); None
    elsewhere."""
    return GrammarAhead(model, device) if device.type == "cuda" else None
