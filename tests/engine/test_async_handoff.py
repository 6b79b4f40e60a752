"""AsyncEngine hands each step's deltas to the event loop in one callback, and each request still gets its
own deltas in order."""
import asyncio

from hf2q.engine import async_engine
from hf2q.engine.async_engine import AsyncEngine
from hf2q.engine.request import RequestOutput
from hf2q.engine.sampling_params import SamplingParams


class _Engine:
    """Emits token 100*k + i for request k's i-th step; a request finishes after len(prompt) tokens."""

    prefix = None  # no prefix cache, as Engine with --no-prefix-cache

    def __init__(self):
        self.live: dict[str, list] = {}
        self.steps_with_outputs = 0

    def has_work(self) -> bool:
        return bool(self.live)

    def add_request(self, prompt_ids, params, request_id, **kwargs):
        self.live[request_id] = [prompt_ids[0], len(prompt_ids), 0]

    def abort(self, request_id):
        self.live.pop(request_id, None)

    def step(self):
        outs = []
        for rid, state in list(self.live.items()):
            k, n, i = state
            state[2] += 1
            done = state[2] == n
            outs.append(RequestOutput(rid, [100 * k + i], f"<{k}.{i}>", finished=done,
                                      finish_reason="length" if done else None, num_output_tokens=i + 1))
            if done:
                del self.live[rid]
        self.steps_with_outputs += bool(outs)
        return outs


def test_one_callback_per_step_and_deltas_reach_their_requests_in_order(monkeypatch):
    calls = []
    deliver = async_engine._deliver
    monkeypatch.setattr(async_engine, "_deliver", lambda items: (calls.append(len(items)), deliver(items)))
    fake = _Engine()
    aengine = AsyncEngine(fake)

    async def collect(k: int, n: int):
        return [o.new_token_ids[0] async for o in aengine.generate(f"r{k}", [k] * n, SamplingParams())]

    async def main():
        return await asyncio.gather(*(collect(k, 3 + k) for k in range(8)))

    aengine.start()
    try:
        got = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert got == [[100 * k + i for i in range(3 + k)] for k in range(8)]
    assert len(calls) == fake.steps_with_outputs  # one wake-up of the loop per step, whatever the batch
    assert sum(calls) == sum(3 + k for k in range(8))
