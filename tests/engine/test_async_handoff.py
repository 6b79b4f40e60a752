"""AsyncEngine hands each step's deltas to the event loop in one callback, and each request still gets its
own deltas in order."""
import asyncio
import concurrent.futures
import threading

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


class _NoThreads(concurrent.futures.ThreadPoolExecutor):
    def submit(self, *args, **kwargs):
        raise AssertionError("a request waited for the engine on an executor thread")


def test_requests_are_taken_in_without_executor_threads():
    """Acceptance is a future the engine thread settles: a burst of requests holds none of the loop's executor
    threads, which tokenization needs meanwhile."""
    fake = _Engine()
    aengine = AsyncEngine(fake)

    async def collect(rid: str):
        return [o async for o in aengine.generate(rid, [1, 2], SamplingParams())]

    async def main():
        asyncio.get_running_loop().set_default_executor(_NoThreads(1))
        return [await collect("alone")] + list(await asyncio.gather(*(collect(f"b{k}") for k in range(16))))

    aengine.start()
    try:
        got = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert [len(o) for o in got] == [2] * 17


def test_a_request_left_before_the_engine_took_it_is_aborted():
    fake = _Engine()
    aengine = AsyncEngine(fake)

    async def main():
        long = [1] * 10**6  # a request that does not end by itself within the test
        task = asyncio.ensure_future(anext(aengine.generate("r0", long, SamplingParams())))
        await asyncio.sleep(0.05)  # submitted; the engine thread has not started, so it is not taken in yet
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        aengine.start()  # now it takes the request in, then the abort that followed it
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not fake.live and aengine._commands.empty():
                break

    try:
        asyncio.run(main())
    finally:
        aengine.shutdown()
    assert fake.live == {}


def test_a_call_runs_on_the_engine_thread_between_steps():
    """`AsyncEngine.call` (how /start_profile and /stop_profile reach the profiler): the function runs on the engine's
    own thread while a request is running, and its result or its exception comes back to the caller."""
    fake = _Engine()
    aengine = AsyncEngine(fake)
    seen = []

    def probe():
        seen.append((threading.current_thread() is aengine._thread, {k: v[2] for k, v in fake.live.items()}))
        return "done"

    def fail():
        raise ValueError("refused")

    async def main():
        stream = aengine.generate("r0", [7] * 10**6, SamplingParams())  # runs until the stream is closed
        await anext(stream)
        result = await aengine.call(probe)
        try:
            await aengine.call(fail)
        except ValueError as exc:
            error = str(exc)
        after = (await anext(stream)).num_output_tokens  # the request went on
        await stream.aclose()
        return result, error, after

    aengine.start()
    try:
        result, error, after = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert (result, error) == ("done", "refused")
    (on_engine_thread, steps), = seen
    assert on_engine_thread and steps["r0"] >= 1 and after > 1
