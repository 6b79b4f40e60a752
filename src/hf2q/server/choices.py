"""Run the engine requests of one API request (n choices of each prompt) and merge their deltas.

Every choice is submitted and its first delta awaited before the HTTP response starts, so engine
refusals (prompt too long, queue full) still become proper 4xx answers. Leaving the merged stream
early (client disconnect, parallel_tool_calls=false cut-off) aborts whatever is still generating,
which frees the cache slots.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from hf2q.engine.request import RequestOptions, RequestOutput
from hf2q.engine.sampling_params import SamplingParams
from hf2q.server.errors import APIError
from hf2q.server.metrics import RequestTimer
from hf2q.server.sampling import engine_error
from hf2q.server.state import ServerState

log = logging.getLogger(__name__)


@dataclass
class Generation:
    """One choice: its engine request id and the deltas it produced so far. As OpenAI numbers them, choice j
    of prompt i has index i * n + j."""
    index: int
    prompt: int
    request_id: str
    timer: RequestTimer
    last: Optional[RequestOutput] = None


class Choices:
    def __init__(self, state: ServerState, prompts: list[list[int]], params: SamplingParams, prompt_param: str,
                 options: RequestOptions = RequestOptions()):
        """`options` go to every engine request (each choice adds its fork group and scripted reply)."""
        self.state = state
        self.prompts = prompts
        self.params = params
        self.prompt_param = prompt_param
        self.options = options
        self.arrival = time.monotonic()
        self.gens: list[Generation] = []
        self._iters: list[AsyncIterator[RequestOutput]] = []
        self._firsts: list[RequestOutput] = []

    async def start(self) -> None:
        """Submit every choice; raises APIError (and aborts the others) if the engine refuses one.

        Choices are submitted together as one group, so the engine prefills the prompt once and the
        other choices fork it.
        """
        base, n = uuid.uuid4().hex, self.params.n
        # Prompt logprobs need every prompt row of every choice, which a forked choice does not compute.
        fork = n > 1 and self.options.prompt_logprobs is None
        which = [(p, j) for p in range(len(self.prompts)) for j in range(n)]
        rids = [f"{base}-{p * n + j}" for p, j in which]
        self._iters = [self.state.engine.generate(rid, self.prompts[p], self.params.for_choice(j), self._options(
                           group=f"{base}-p{p}" if fork else None, script=self.state.next_script()))
                       for rid, (p, j) in zip(rids, which)]
        firsts = await asyncio.gather(*(it.__anext__() for it in self._iters), return_exceptions=True)
        failure = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failure is not None:
            await self.close()
            api = engine_error(failure, self.prompt_param) if isinstance(failure, Exception) else None
            if api is not None:
                raise api from None
            raise failure
        self._firsts = list(firsts)
        self.gens = [Generation(i, p, rid, RequestTimer(self.state.metrics, self.arrival))
                     for i, (rid, (p, _)) in enumerate(zip(rids, which))]

    def _options(self, group: Optional[str], script: Optional[list[int]]) -> RequestOptions:
        return dataclasses.replace(self.options, group=group,
                                   scripted_ids=tuple(script) if script is not None else None)

    async def stream(self) -> AsyncIterator[tuple[Generation, RequestOutput]]:
        """(choice, delta) pairs in arrival order, until every choice finished."""
        async with aclosing(self.batches()) as batches:
            async for batch in batches:
                for pair in batch:
                    yield pair

    async def batches(self) -> AsyncIterator[list[tuple[Generation, RequestOutput]]]:
        """Every (choice, delta) pair that has arrived, in arrival order, as one list: a stream that is behind
        the engine sends what piled up in one write (`merge_outputs`) rather than a write per token."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(gen: Generation, it: AsyncIterator[RequestOutput], first: RequestOutput) -> None:
            try:
                await queue.put((gen, first))
                if not first.finished:
                    async for out in it:
                        await queue.put((gen, out))
            except Exception as exc:  # an engine failure mid-generation
                await queue.put((gen, exc))
            finally:
                await queue.put((gen, None))

        tasks = [asyncio.create_task(pump(g, it, f)) for g, it, f in zip(self.gens, self._iters, self._firsts)]
        try:
            remaining = len(tasks)
            while remaining:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                batch = []
                for gen, item in items:
                    if item is None:
                        remaining -= 1
                        continue
                    if isinstance(item, Exception):
                        if batch:
                            yield batch  # what arrived before the failure is sent first
                        raise APIError(500, f"generation failed: {item}", code="generation_error") from item
                    gen.last = item
                    gen.timer.tokens(len(item.new_token_ids))
                    if item.finished:
                        prompt = item.num_prompt_tokens if gen.index % self.params.n == 0 else 0
                        gen.timer.done(prompt, item.num_cached_tokens, item.finish_reason)
                    batch.append((gen, item))
                if batch:
                    yield batch
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()

    async def close(self) -> None:
        """Abort every choice still generating (a finished one is left alone)."""
        for it in self._iters:
            try:
                await it.aclose()
            except RuntimeError:  # still being iterated by a cancelled pump; its own finally aborts
                pass
        self._iters = []

    def usage(self, reasoning_tokens: Optional[int] = None) -> dict:
        """OpenAI usage: each prompt counted once, completions summed over choices."""
        lasts = [g.last for g in self.gens if g.last is not None]
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(o.num_output_tokens for o in lasts)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": max((o.num_cached_tokens for o in lasts), default=0)}}
        if reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage


def by_choice(batch: list[tuple[Generation, RequestOutput]]) -> list[tuple[Generation, list[RequestOutput]]]:
    """A batch's deltas grouped per choice, choices in order of their first delta."""
    groups: dict[int, tuple[Generation, list[RequestOutput]]] = {}
    for gen, out in batch:
        groups.setdefault(gen.index, (gen, []))[1].append(out)
    return list(groups.values())


def logprob_entries(tokenizer, logprobs) -> list[dict]:
    """Chat-API logprobs `content` entries for one delta's tokens."""
    out = []
    for lp in logprobs or []:
        out.append({**_token_entry(tokenizer, lp.token_id, lp.logprob),
                    "top_logprobs": [_token_entry(tokenizer, t, v) for t, v in lp.top]})
    return out


def _token_entry(tokenizer, token_id: int, logprob: float) -> dict:
    raw = tokenizer.token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": max(float(logprob), -9999.0),
            "bytes": list(raw)}
