"""The engine on a background thread, for asyncio callers (the HTTP server).

One worker thread owns the engine and runs `step()` while there is work; callers submit and abort
through a command queue and receive their deltas on per-request asyncio queues.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional

from hf2q.engine.engine import Engine
from hf2q.engine.request import RequestOptions, RequestOutput
from hf2q.engine.sampling_params import SamplingParams
from hf2q.engine.step_profiler import StepProfiler

log = logging.getLogger(__name__)


@dataclass
class _Sink:
    """Where one request's deltas go: its asyncio queue, on the event loop that awaits it."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


def _deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)


@dataclass
class _Submit:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    options: RequestOptions
    sink: _Sink
    accepted: asyncio.Future  # on the sink's loop: None once the engine holds the request, else why not

    def answer(self, error: Optional[BaseException]) -> None:
        """Settle `accepted` from the engine thread; a refusal is its value, raised by `generate`, not here."""
        _settle(self.sink.loop, self.accepted, result=error)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Background:
    prompt_ids: list[int]


@dataclass
class _Stop:
    reason: str


@dataclass
class _Call:
    """A function to run on the engine's thread between steps, and the future (on `loop`) of its outcome."""
    fn: Callable[[], object]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future

    def settle(self, result: object, error: Optional[BaseException]) -> None:
        _settle(self.loop, self.done, result, error)


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: object = None,
            error: Optional[BaseException] = None) -> None:
    """Settle `future`, awaited on `loop`, from the engine thread: with `error` raised, else with `result`. A caller
    that went away meanwhile, or a loop that has closed, is not waiting."""
    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # that loop has closed
        pass


class ShuttingDown(RuntimeError):
    """The server is stopping: running requests end with this error and new ones are refused."""


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: "queue.Queue[object]" = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._stop = threading.Event()
        self._refusal: Optional[str] = None  # set by stop_requests: why new requests are refused
        self._thread = threading.Thread(target=self._loop, name="hf2q-engine", daemon=True)
        self.on_step: Optional[Callable[[Engine, list[RequestOutput]], None]] = None  # metrics hook
        self.failure: Optional[str] = None  # why this engine stopped the server, if it did (exit status 1)
        self.profiler: Optional[StepProfiler] = None  # with --profile-dir: marks and counts each step it records

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=10)
        prefix = self.engine.prefix
        if prefix is not None and prefix.disk is not None:  # checkpoints still queued reach the disk
            prefix.disk.flush()

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       options: RequestOptions = RequestOptions()) -> AsyncIterator[RequestOutput]:
        """Deltas of one request. Validation errors raise before the first yield; leaving early aborts."""
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        # awaited on this loop, settled by the engine thread: no executor thread waits for the engine (a burst of
        # requests would otherwise hold the loop's few executor threads, which tokenization needs too)
        accepted = loop.create_future()
        self._commands.put(_Submit(request_id, prompt_ids, params, options, _Sink(loop, deltas), accepted))
        try:
            error = await accepted
        except asyncio.CancelledError:  # the caller left while the engine took it in: it must not run on
            self._commands.put(_Abort(request_id))
            raise
        if error is not None:
            raise error
        finished = False
        try:
            while True:
                item = await deltas.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[], object]) -> object:
        """fn() run on the engine's thread between two steps: its result, or its exception raised here."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(_Call(fn, loop, done))
        return await done

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def prefill_in_background(self, prompt_ids: list[int]) -> None:
        """Queue a lowest-priority prefill that ends in a checkpoint (`Engine.prefill_in_background`). Commands
        run in order, so a request submitted after this call finds it queued."""
        self._commands.put(_Background(list(prompt_ids)))

    def stop_requests(self, reason: str) -> None:
        """End every running request with `ShuttingDown(reason)` and refuse new ones, so streams close at once."""
        self._commands.put(_Stop(reason))

    # ---- worker thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_commands(block=not self.engine.has_work())
            if self._stop.is_set() or not self.engine.has_work():
                continue
            try:
                if self.profiler is not None and self.profiler.active:
                    with self.profiler.step():
                        outputs = self.engine.step()
                else:
                    outputs = self.engine.step()
            except Exception as exc:  # a broken step fails its requests, never the server
                log.exception("engine step failed")
                self._fail_all(RuntimeError(f"internal error while generating: {exc}"))
                continue
            sends = []
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    # A request that failed on its own ends with an exception; the others go on.
                    sends.append((sink, RuntimeError(out.error) if out.error is not None else out))
                if out.finished:
                    self._sinks.pop(out.request_id, None)
            self._send(sends)
            if self.on_step is not None:
                try:
                    self.on_step(self.engine, outputs)
                except Exception:  # a metrics hook must not stop the engine thread
                    log.exception("engine on_step hook failed")

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: object) -> None:
        if isinstance(cmd, _Submit):
            if self._refusal is not None:
                cmd.answer(ShuttingDown(self._refusal))
                return
            try:
                self.engine.add_request(cmd.prompt_ids, cmd.params, request_id=cmd.request_id, options=cmd.options)
            except Exception as exc:
                cmd.answer(exc)
                return
            self._sinks[cmd.request_id] = cmd.sink
            cmd.answer(None)
        elif isinstance(cmd, _Abort):
            self._sinks.pop(cmd.request_id, None)
            self.engine.abort(cmd.request_id)
        elif isinstance(cmd, _Background):
            if self._refusal is None:
                try:
                    self.engine.prefill_in_background(cmd.prompt_ids)
                except Exception:  # an optimisation: its failure is a log line, never a request's
                    log.exception("background prefill refused")
        elif isinstance(cmd, _Call):
            try:
                result, error = cmd.fn(), None
            except Exception as exc:  # the caller's to handle
                result, error = None, exc
            cmd.settle(result, error)
        elif isinstance(cmd, _Stop):
            self._refusal = cmd.reason
            self._fail_all(ShuttingDown(cmd.reason))

    def _fail_all(self, error: Exception) -> None:
        sends = []
        for request_id, sink in list(self._sinks.items()):
            self.engine.abort(request_id)
            sends.append((sink, error))
        self._sinks.clear()
        self._send(sends)

    @staticmethod
    def _send(sends: list[tuple[_Sink, object]]) -> None:
        """Hand a step's deltas over with one callback per event loop, not one per request: each callback
        wakes the loop, and at 64 streams that was 64 wake-ups per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for sink, item in sends:
            by_loop.setdefault(sink.loop, []).append((sink.queue, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop has closed: nobody is waiting for these deltas
                pass
