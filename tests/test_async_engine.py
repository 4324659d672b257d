"""The Serve-side engine thread survives a failed Ray step: only the failed requests get the error."""
from __future__ import annotations

import asyncio
import time

import pytest

from kdray import LLM, SamplingParams
from kdray.engine.engine import RunnerFailure
from kdray.serve.async_engine import AsyncEngine
from kdray.serve.metrics import Metrics


class FailOnce:
    """The real engine, except that its first step fails like a dead shard would, losing request ``victim``."""

    def __init__(self, engine, victim: str):
        self.engine, self.victim, self.failed = engine, victim, False

    def step(self):
        if not self.failed:
            self.failed = True
            self.engine.abort_request(self.victim)
            raise RunnerFailure("shard 1 died (its channel closed)", (self.victim,))
        return self.engine.step()

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_worker_failure_fails_its_requests_and_the_engine_keeps_serving():
    llm = LLM(model="k2-tiny", spec="ar")
    engine = FailOnce(llm.engine, victim="a")
    runner = AsyncEngine(engine, max_num_seqs=4, max_queue=4, metrics=Metrics())
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def collect(rid):
        stream = await runner.generate([(rid, [5, 6, 7], params)])
        return [out async for out in stream][-1]

    async def scenario():
        with pytest.raises(RunnerFailure, match="shard 1 died"):
            await asyncio.wait_for(collect("a"), 30)
        return await asyncio.wait_for(collect("b"), 30)

    try:
        last = asyncio.run(scenario())
        assert last.finished and len(last.outputs[0].token_ids) == 4
        runner.check()  # the engine thread is still alive
        deadline = time.monotonic() + 30  # the thread applies the step in flight past b's end, then frees b's pages
        while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert llm.engine.free_pages() == llm.engine.scheduler.pool.num_pages
    finally:
        runner.shutdown()
