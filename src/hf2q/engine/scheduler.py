"""FCFS continuous-batching scheduler.

Each step a request gets `min(need, budget, chunk)` tokens, where need = known tokens - computed tokens:
decode (need 1) and bounded prefill are the same rule. Admission reserves cache room for the whole
request (prompt + max_tokens), so an admitted request is never preempted or lost; the head of the
queue waits for room rather than being overtaken, so long prompts do not starve.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hf2q.cache.block_manager import CacheFull
from hf2q.cache.hybrid import HybridCache, NoFreeSlot
from hf2q.engine.request import Request, RequestStatus


class QueueFull(RuntimeError):
    """The waiting queue is at its limit; the server answers 429."""


class RequestTooLarge(ValueError):
    """The request could never fit in the cache, even alone."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    prefill_chunk: int = 2048
    max_waiting: int = 256


class Scheduler:
    def __init__(self, cache: HybridCache, config: SchedulerConfig):
        self.cache = cache
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        blocks = -(-req.max_total_len // self.cache.block_size)
        if blocks > self.cache.num_blocks:
            raise RequestTooLarge(f"request needs {req.max_total_len} tokens of cache; the server holds "
                                  f"{self.cache.num_blocks * self.cache.block_size}")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"too many waiting requests ({len(self.waiting)})")
        self.waiting.append(req)

    def schedule(self) -> list[tuple[Request, int]]:
        budget = self.config.max_num_batched_tokens
        batch: list[tuple[Request, int]] = []
        for req in self.running:
            n = min(req.num_tokens - req.num_computed, budget, self.config.prefill_chunk)
            if n > 0:
                batch.append((req, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self._admit(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            n = min(req.num_tokens - req.num_computed, budget, self.config.prefill_chunk)
            batch.append((req, n))
            budget -= n
        return batch

    def _admit(self, req: Request) -> bool:
        try:
            slot = self.cache.acquire()
        except NoFreeSlot:
            return False
        try:
            self.cache.reserve(slot, req.max_total_len)
        except CacheFull:
            self.cache.release(slot)
            return False
        req.slot = slot
        req.status = RequestStatus.RUNNING
        return True

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self.cache.release(req.slot)
            req.slot = None
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)
