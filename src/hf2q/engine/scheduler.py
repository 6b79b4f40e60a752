"""FCFS continuous-batching scheduler.

Each step a request gets `min(need, budget, chunk)` tokens, where need = known tokens - computed tokens:
decode (need 1) and bounded prefill are the same rule. Choices of one request (n > 1) share their prompt:
the first prefills up to its last prompt token, the others fork its cache there and run only that token. Admission reserves cache room for the whole
request (prompt + max_tokens), so an admitted request is never preempted or lost; the head of the
queue waits for room rather than being overtaken, so long prompts do not starve.

With a prefix cache, admission resumes a request from the longest retained prefix of its prompt, and a
prefill chunk ends exactly at each `stride` boundary so the state there is retained without an extra
forward pass. The request's anchor (a chat turn's, a few tokens before its prompt's end) does not cut the
chunk: the forward keeps the DeltaNet state there as well (`hf2q.cache.state_at`), so the turn's first
token comes a step sooner; a cache that cannot keep such states (tensor parallelism) has the chunk cut.

Background prefills (a conversation re-rendered as its next turn will see it, `Engine.prefill_in_background`)
are the lowest priority: they start only in steps with no user request running or waiting. A user request
at the head of the queue that extends a started one waits for its checkpoint, as for a running prefill's;
one that extends a queued one takes its place and computes those tokens itself, a step sooner than waiting
would give its first token. A user request that lacks a slot or room cancels them. Their only product is
the checkpoint at their end.
"""
from __future__ import annotations

from collections import deque

from hf2q.cache.block_manager import CacheFull
from hf2q.cache.hybrid import HybridCache, NoFreeSlot
from hf2q.cache.prefix_cache import Checkpoint, PrefixCache
from hf2q.config import SchedulerConfig
from hf2q.engine.request import Request, RequestStatus


class QueueFull(RuntimeError):
    """The waiting queue is at its limit; the server answers 429."""


class RequestTooLarge(ValueError):
    """The request could never fit in the cache, even alone."""


class Scheduler:
    def __init__(self, cache: HybridCache, config: SchedulerConfig, prefix: PrefixCache | None = None,
                 stride: int = 0):
        self.cache = cache
        self.config = config
        self.prefix = prefix
        self.graphed_prefill_rows = 0  # the longest prefill the runner replays in a graph (0: none)
        self._graph_keep_taken = False  # a graphable rest of this step keeps its anchor inside (see _keeps_inside)
        self.stride = stride
        self.waiting: deque[Request] = deque()
        self.background: deque[Request] = deque()  # background prefills not admitted yet, oldest first
        self.running: list[Request] = []
        self.leaders: dict[str, Request] = {}  # group -> the choice whose prompt the others fork

    def add(self, req: Request) -> None:
        blocks = -(-req.max_total_len // self.cache.block_size)
        if blocks > self.cache.num_blocks:
            raise RequestTooLarge(f"request needs {req.max_total_len} tokens of cache; the server holds "
                                  f"{self.cache.num_blocks * self.cache.block_size}")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"too many waiting requests ({len(self.waiting)})")
        leader = self.leaders.get(req.group) if req.group is not None else None
        if leader is not None and leader.prompt_ids == req.prompt_ids and leader.fork_point is not None \
                and leader.num_computed <= leader.fork_point:
            leader.siblings.append(req)
            return
        if req.group is not None and len(req.prompt_ids) > 1:
            req.fork_point = len(req.prompt_ids) - 1
            self.leaders[req.group] = req
        self.waiting.append(req)

    def schedule(self) -> list[tuple[Request, int]]:
        budget = self.config.max_num_batched_tokens
        batch: list[tuple[Request, int]] = []
        self._graph_keep_taken = False
        for req in self.running:
            if not req.background:
                budget = self._take(batch, req, budget)
        while self.waiting and budget > 0:
            req = self.waiting[0]
            awaited = self._awaits_checkpoint(req, budget)
            while any(awaited is r for r in self.background):  # queued, not started: the request computes them
                self.background.remove(awaited)
                self._count_absorbed(awaited)
                awaited = self._awaits_checkpoint(req, budget)
            if awaited is not None:
                awaited.awaited = awaited.background
                break
            if not self._admit_user(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            budget = self._take(batch, req, budget)
        self._schedule_background(batch, budget, idle=not batch and not self.waiting)
        return batch

    def _take(self, batch: list[tuple[Request, int]], req: Request, budget: int) -> int:
        n = self._limit(req, min(self._need(req), budget, self.config.prefill_chunk))
        req.extras.pop("checkpoints_inside", None)
        if n > 0:
            batch.append((req, n))
            budget -= n
            inside = self._checkpoints_inside(req, n)
            if inside:
                req.extras["checkpoints_inside"] = inside  # the runner keeps the states there
                self._graph_keep_taken |= self._rest_fits_a_graph(req)
        return budget

    def _checkpoints_inside(self, req: Request, n: int) -> list[int]:
        """Checkpoint positions strictly inside the chunk of n tokens from the request's next one, whose states
        the forward keeps instead of the chunk being cut there: its anchor (see _keeps_inside) and the stride
        boundaries of its prompt (each one more chunk prefix in the DeltaNet layers' delta-rule call)."""
        start = req.num_computed
        inside = []
        if self._keeps_inside(req) and start < req.anchor < start + n:
            inside.append(req.anchor)
        if self._strides_inside(req):
            end = min(start + n - 1, len(req.prompt_ids))
            inside += range((start // self.stride + 1) * self.stride, end + 1, self.stride)
        return sorted(set(inside))

    def _strides_inside(self, req: Request) -> bool:
        """Whether the request's stride checkpoints come from inside chunks rather than cutting them (two steps
        where one would do: a long prompt's first token came after twice the steps with the prefix cache on);
        not where the rest of the prompt fits a prefill graph, which keeps one checkpoint's states only (the
        anchor's: replays cut at the strides cost less than one eager step)."""
        return self.stride > 0 and self._states_inside(req) and not self._rest_fits_a_graph(req)

    def _keeps_inside(self, req: Request) -> bool:
        """Whether the request's anchor checkpoint comes from inside a chunk rather than cutting it (an eager
        forward keeps it, and so does a prefill graph: a chat follow-up's rest is one replay, not two). A
        prefill graph keeps one row's states, so a second graphable rest in the same step is cut at its anchor:
        two anchors inside would send the step to the eager forward."""
        if req.anchor is None or not self._states_inside(req):
            return False
        return not (self._rest_fits_a_graph(req) and self._graph_keep_taken)

    def _rest_fits_a_graph(self, req: Request) -> bool:
        return req.num_tokens - req.num_computed <= self.graphed_prefill_rows

    def _states_inside(self, req: Request) -> bool:
        """Whether the forward may keep the request's checkpoint states inside its chunk: a prefix cache on a
        cache that can."""
        return self.prefix is not None and self.cache.keeps_states_inside_a_chunk

    def _admit_user(self, req: Request) -> bool:
        """Admit a user request; background prefills holding the slot or room it needs are cancelled."""
        while True:
            if len(self.running) < self.config.max_num_seqs and self._admit(req):
                return True
            if not self._cancel_background():
                return False

    def _schedule_background(self, batch: list[tuple[Request, int]], budget: int, idle: bool) -> None:
        """Background prefills take what is left of the step: all of them when the engine has no user work,
        else only the started ones a waiting user request awaits. Queued ones start only when idle; one that
        finds no room when admitted is dropped."""
        for req in self.running:
            if req.background and (idle or req.awaited) and budget > 0:
                budget = self._take(batch, req, budget)
        for req in list(self.background):
            if budget <= 0 or not idle or len(self.running) >= self.config.max_num_seqs:
                return
            self.background.remove(req)
            if not self._admit(req):
                self._count_cancelled(req)
                continue
            self.running.append(req)
            budget = self._take(batch, req, budget)

    def add_background(self, req: Request) -> None:
        """Queue a background prefill; past `max_waiting` of them the oldest is dropped."""
        if len(self.background) >= self.config.max_waiting:
            self._count_cancelled(self.background.popleft())
        self.background.append(req)

    def has_background(self, tokens: list[int]) -> bool:
        """Whether a background prefill of exactly these tokens is queued or running."""
        return any(r.prompt_ids == tokens for r in (*self.background, *self.running) if r.background)

    def _cancel_background(self) -> bool:
        """Cancel the latest admitted background prefill (its slot and blocks go back); False if there is none."""
        req = next((r for r in reversed(self.running) if r.background), None)
        if req is None:
            return False
        self.finish(req)
        self._count_cancelled(req)
        return True

    def _count_cancelled(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        if self.prefix is not None:
            self.prefix.stats.rerender_cancelled += 1

    def _count_absorbed(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        if self.prefix is not None:
            self.prefix.stats.rerender_absorbed += 1

    def background_done(self, req: Request) -> None:
        """A background prefill reached its end (its checkpoint is retained by then): free its slot."""
        if self.prefix is not None:
            self.prefix.stats.rerenders += 1
            self.prefix.stats.rerender_tokens += len(req.prompt_ids) - req.num_cached
        self.finish(req)

    def _need(self, req: Request) -> int:
        """Tokens left to compute, plus this step's drafts to verify; a leader with siblings to fork stops at
        its fork point first."""
        if req.siblings and req.num_computed < req.fork_point:
            return req.fork_point - req.num_computed
        return req.num_tokens - req.num_computed + len(req.draft_ids)

    def _limit(self, req: Request, n: int) -> int:
        """Cut a prefill chunk at the next checkpoint boundary inside it."""
        if self.prefix is None or n <= 1:
            return n
        start, prompt_len = req.num_computed, len(req.prompt_ids)
        anchor = None if self._keeps_inside(req) else req.anchor
        bounds = [b for b in (anchor,) if b is not None and start < b <= prompt_len]
        if self.stride > 0 and not self._strides_inside(req) and (start // self.stride + 1) * self.stride <= prompt_len:
            bounds.append((start // self.stride + 1) * self.stride)
        return min([n] + [b - start for b in bounds])

    def retain_prefixes(self, scheduled: list[tuple[Request, int]]) -> None:
        """After a step: retain the state of every request whose prefill just reached a checkpoint boundary."""
        if self.prefix is None:
            return
        for req, _ in scheduled:
            for n, at in req.extras.pop("kept_inside", ()):  # inside the chunk just computed
                if req.slot is not None:
                    self.prefix.store(req.slot, req.key(0, n), at.states)
            k = req.num_computed
            if req.slot is not None and k <= len(req.prompt_ids) and (k == req.anchor or (
                    self.stride > 0 and k % self.stride == 0) or (req.background and k == len(req.prompt_ids))):
                self.prefix.store(req.slot, req.key(0, k))

    def fork_siblings(self) -> None:
        """After a step: siblings of a leader at its fork point take a copy of its cache and run on."""
        for group, leader in list(self.leaders.items()):
            if leader.num_computed < leader.fork_point:
                continue
            for sib in leader.siblings:
                if not self._admit_fork(leader, sib):
                    self.waiting.append(sib)  # no room to fork now: it prefills on its own later
            leader.siblings.clear()
            leader.fork_point = None
            del self.leaders[group]

    def _admit_fork(self, leader: Request, sib: Request) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        try:
            slot = self.cache.acquire()
        except NoFreeSlot:
            return False
        try:
            self.cache.fork(leader.slot, slot)
            self.cache.reserve(slot, sib.max_total_len)
        except CacheFull:
            self.cache.release(slot)
            return False
        sib.slot, sib.status = slot, RequestStatus.RUNNING
        sib.num_computed = sib.num_cached = leader.num_computed
        self.running.append(sib)
        return True

    def _awaits_checkpoint(self, req: Request, budget: int) -> Request | None:
        """The running prefill that will soon retain a longer checkpoint of this prompt than any held now
        (requests sharing a document, sent together; a background prefill of this conversation's history),
        or None: admitted later, the request resumes there instead of computing the shared part again. The
        prefill progresses every step (a background one too, once awaited), so the wait is bounded. A request
        that can compute what the held checkpoints leave in this step (`budget` tokens are left in it) never
        waits: that would only delay its first token (the next turn arriving while its history's background
        prefill is in flight)."""
        if self.prefix is None or req.keeps_hidden:
            return None
        mine = req.key(0, len(req.prompt_ids))  # as the prefix cache keys it (images by their hashes)
        held = self.prefix.lookup(mine)
        reuse = len(held.tokens) if held is not None else 0
        if self._one_step(req, reuse, len(mine), budget):  # a wait could only add steps before its first token
            return None
        for other in (*self.running, *self.background):
            done, n = other.num_computed, len(other.prompt_ids)
            if done >= n:
                continue
            prompt = other.key(0, n)
            shared = min(n, len(mine) - 1)
            shared = next((i for i in range(shared) if prompt[i] != mine[i]), shared)
            bounds = [b for b in (other.anchor,) if b is not None and b <= shared]
            if self.stride > 0:
                bounds.append(shared // self.stride * self.stride)
            if other.background and shared == n:
                bounds.append(n)
            if max(bounds, default=0) > max(reuse, done):
                return other
        return None

    def _one_step(self, req: Request, start: int, end: int, budget: int) -> bool:
        """Whether the request's prefill from `start` to `end` fits this step: within a chunk and the step's
        `budget` of tokens, cut at no stride boundary."""
        if end - start > min(self.config.prefill_chunk, budget):
            return False
        return self.stride <= 0 or self._strides_inside(req) or start // self.stride == (end - 1) // self.stride

    def _admit(self, req: Request) -> bool:
        """Give the request a slot and cache room, resuming from the longest retained prefix of its prompt;
        when blocks run short, retained prefixes are evicted for it (never those running requests hold)."""
        try:
            slot = self.cache.acquire()
        except NoFreeSlot:
            return False
        # A request that reads its prompt's hidden rows (prompt logprobs, embeddings) computes every one of them.
        reuse = self.prefix is not None and not req.keeps_hidden
        ckpt = self.prefix.lookup(req.key(0, len(req.prompt_ids))) if reuse else None
        placed = self._place(req, slot, ckpt)
        if not placed and self.prefix is not None:
            need = self.cache.blocks.blocks_for(req.max_total_len) + 1
            placed = self.prefix.make_room(need, keep=ckpt) and self._place(req, slot, ckpt)
        if not placed:
            self.cache.release(slot)
            return False
        if self.prefix is not None and not req.background:
            self.prefix.count(req.num_cached)
        req.slot = slot
        req.status = RequestStatus.RUNNING
        return True

    def _place(self, req: Request, slot: int, ckpt: Checkpoint | None) -> bool:
        try:
            n = self.prefix.adopt(ckpt, slot) if ckpt is not None else 0
            self.cache.reserve(slot, req.max_total_len)
        except CacheFull:
            self.cache.reset(slot)
            return False
        req.num_computed = req.num_cached = n
        return True

    def finish(self, req: Request, retain: bool = False) -> None:
        """Remove a request; with `retain`, first keep its computed tokens (prompt + output but the last
        sampled token, which was never fed) as a checkpoint, for clients that send the output back."""
        if retain and self.prefix is not None and req.slot is not None and req in self.running:
            self.prefix.store(req.slot, req.key(0, req.num_computed))
        if self.leaders.get(req.group) is req:  # its waiting siblings prefill on their own
            del self.leaders[req.group]
            self.waiting.extend(req.siblings)
            req.siblings.clear()
        leader = self.leaders.get(req.group) if req.group is not None else None
        if leader is not None and req in leader.siblings:
            leader.siblings.remove(req)
        if req in self.running:
            self.running.remove(req)
            self.cache.release(req.slot)
            req.slot = None
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED

    @property
    def num_running(self) -> int:
        """User requests holding a slot (background prefills are not requests anyone waits for)."""
        return sum(1 for r in self.running if not r.background)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def admits_waiting(self) -> bool:
        """Whether the next `schedule()` may admit a waiting user request: one waits and a slot is free. (Queued
        background prefills run only when no user request runs or waits, or when a waiting one needs them.)"""
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.background)
