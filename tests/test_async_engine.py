"""The Serve-side engine thread survives every failure it can: a failed step fails only its requests (one
that had sent nothing runs once more), and an error in the thread itself fails the requests in flight and
restarts it on the same engine, its pages all free again."""
from __future__ import annotations

import asyncio
import time

import pytest

from kdray import LLM, SamplingParams
from kdray.engine.engine import RunnerFailure
from kdray.engine.request import join_output
from kdray.serve import async_engine
from kdray.serve.async_engine import AsyncEngine, EngineDead, EngineRestarted
from kdray.serve.metrics import Metrics

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


class FailOnce:
    """The real engine, except that its step number ``at`` fails like a dead shard would, losing ``victim``."""

    def __init__(self, engine, victim: str, at: int):
        self.engine, self.victim, self.at = engine, victim, at

    def step(self):
        self.at -= 1
        if self.at == 0:
            self.engine.abort_request(self.victim)
            raise RunnerFailure("shard 1 died (its channel closed)", (self.victim,))
        return self.engine.step()

    def __getattr__(self, name):
        return getattr(self.engine, name)


class FlakyRunner:
    """The engine's runner, whose first ``failures`` launches with prompt chunks raise a plain error (a bug, a bad
    tensor)."""

    def __init__(self, runner, failures: int):
        self.runner, self.failures = runner, failures

    def launch(self, prefill, step):
        if prefill is not None and self.failures:
            self.failures -= 1
            raise ValueError("Overflow when unpacking long long")
        return self.runner.launch(prefill, step)

    def __getattr__(self, name):
        return getattr(self.runner, name)


class BrokenThread:
    """The real engine, except that ``num_waiting`` (called by the engine thread after each step) raises once
    after ``after`` steps: a failure outside any step, as a bug in the thread would be."""

    def __init__(self, engine, after: int):
        self.engine, self.after = engine, after

    def num_waiting(self):
        self.after -= 1
        if self.after == 0:
            raise RuntimeError("a bug in the engine thread")
        return self.engine.num_waiting()

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture(scope="module")
def llm():
    return LLM(model="k2-tiny", spec="ar", device="cpu")


def collect(runner: AsyncEngine, rid: str, params: SamplingParams = PARAMS):
    async def go():
        stream = await runner.generate([(rid, [5, 6, 7], params)])
        whole = {}
        async for out in stream:
            join_output(whole, out)
        return whole[rid]

    return asyncio.wait_for(go(), 30)


def run(engine, scenario):
    runner = AsyncEngine(engine, max_num_seqs=4, max_queue=4, metrics=Metrics())
    try:
        return runner, asyncio.run(scenario(runner))
    finally:
        runner.shutdown()


def all_pages_free(llm) -> bool:
    llm.engine.drain()  # the step launched past the last request's end (the engine thread has stopped)
    return llm.engine.free_pages() == llm.engine.scheduler.pool.num_pages


def test_worker_failure_fails_its_requests_and_the_engine_keeps_serving(llm):
    async def scenario(runner):
        with pytest.raises(RunnerFailure, match="shard 1 died"):
            await collect(runner, "a")  # its first token came with step 2 (one step late): step 3's failure loses it
        return await collect(runner, "b")

    _, last = run(FailOnce(llm.engine, victim="a", at=3), scenario)
    assert last.finished and len(last.outputs[0].token_ids) == 4
    assert all_pages_free(llm)


def test_a_failed_step_reruns_a_request_that_sent_nothing(llm):
    """A shard that died while the engine idled is found by the next request's first step: that request runs
    again on the rebuilt runner instead of failing."""
    _, last = run(FailOnce(llm.engine, victim="a", at=1), lambda runner: collect(runner, "a"))
    assert last.finished and len(last.outputs[0].token_ids) == 4
    assert all_pages_free(llm)


def test_a_slow_reader_gets_the_outputs_that_arrived_meanwhile_joined_into_one(llm):
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    async def scenario(runner):
        stream = await runner.generate([("a", [5, 6, 7], params)])
        while not any(getattr(item, "finished", False) for item in stream._items):  # the reader sleeps meanwhile
            await asyncio.sleep(0.01)
        return [out async for out in stream]

    _, outs = run(llm.engine, scenario)
    alone = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params)[0].outputs[0].token_ids
    assert len(outs) == 1 and outs[0].finished and outs[0].outputs[0].token_ids == alone
    assert all_pages_free(llm)


def test_a_request_being_admitted_counts_once_against_the_capacity(llm, monkeypatch):
    """While the engine thread admits a request (its admission slowed here), a second one still fits a capacity of
    two: the first is counted as handed over or as running, never as both."""
    deliver = async_engine._deliver

    def slow_admission(loop, fn, *args):
        if fn is async_engine._settle:
            time.sleep(0.3)
        deliver(loop, fn, *args)

    monkeypatch.setattr(async_engine, "_deliver", slow_admission)

    async def scenario(runner):
        first = asyncio.create_task(runner.generate([("a", [5, 6, 7], PARAMS)]))
        await asyncio.sleep(0.1)  # the engine thread is admitting "a"
        second = await runner.generate([("b", [5, 6, 7], PARAMS)])
        outs = []
        for stream in (await first, second):
            outs.append([out async for out in stream])
        return outs

    runner = AsyncEngine(llm.engine, max_num_seqs=1, max_queue=1, metrics=Metrics())
    try:
        outs = asyncio.run(scenario(runner))
    finally:
        runner.shutdown()
    assert [o[-1].finished for o in outs] == [True, True]
    assert all_pages_free(llm)


def test_the_step_metrics_count_what_the_engine_steps_did():
    """Drafts, draft tokens and accepted tokens, and the stages' seconds, summed over the steps, are the requests'
    own totals."""
    ddtree = LLM(model="k2-tiny", device="cpu", drafter="random", spec="ddtree", budget=8, block_size=4)

    async def scenario(runner):
        return [out.metrics for out in await asyncio.gather(collect(runner, "a"), collect(runner, "b"))]

    runner, metrics = run(ddtree.engine, scenario)
    value = lambda name, **labels: runner.metrics.registry.get_sample_value(name, labels)  # noqa: E731
    steps = sum(m["steps"] for m in metrics)
    assert steps > 2 and value("kdray_spec_decode_num_drafts_total") == steps
    assert value("kdray_spec_decode_num_draft_tokens_total") == sum(w * n for m in metrics
                                                                    for w, n in m["tree_sizes"].items())
    assert value("kdray_spec_decode_num_accepted_tokens_total") == sum(m["accepted_tokens"] - m["steps"]
                                                                       for m in metrics)
    assert value("kdray_step_seconds_sum", stage="verify") == pytest.approx(sum(m["seconds"]["verify"]
                                                                                for m in metrics))


def test_time_to_first_token_is_its_queue_and_prefill_parts(llm):
    async def scenario(runner):
        await collect(runner, "a")
        return await collect(runner, "b")

    runner, _ = run(llm.engine, scenario)
    value = lambda name: runner.metrics.registry.get_sample_value(name)  # noqa: E731
    assert value("kdray_request_queue_time_seconds_count") == value("kdray_time_to_first_token_seconds_count") == 2
    queued, prefill = value("kdray_request_queue_time_seconds_sum"), value("kdray_request_prefill_time_seconds_sum")
    assert queued > 0 and prefill > 0
    assert queued + prefill == pytest.approx(value("kdray_time_to_first_token_seconds_sum"))
    assert all_pages_free(llm)


def test_a_plain_error_in_a_step_is_a_runner_failure_and_reruns_too(llm):
    llm.engine.runner = FlakyRunner(llm.engine.runner, failures=1)
    try:
        _, last = run(llm.engine, lambda runner: collect(runner, "a"))
    finally:
        llm.engine.runner = llm.engine.runner.runner
    assert last.finished and len(last.outputs[0].token_ids) == 4
    assert all_pages_free(llm)


def test_a_step_that_keeps_failing_fails_its_request_alone(llm):
    async def scenario(runner):
        with pytest.raises(RunnerFailure, match=r"step failed \(ValueError: Overflow"):
            await collect(runner, "a")
        return await collect(runner, "b")

    llm.engine.runner = FlakyRunner(llm.engine.runner, failures=2)
    try:
        runner, last = run(llm.engine, scenario)
    finally:
        llm.engine.runner = llm.engine.runner.runner
    assert last.finished and runner.restarts == 0
    assert all_pages_free(llm)


def test_an_error_in_the_engine_thread_restarts_it_and_fails_only_what_was_in_flight(llm):
    async def scenario(runner):
        with pytest.raises(EngineRestarted, match="send it again"):
            await collect(runner, "a", SamplingParams(max_tokens=50, ignore_eos=True))
        runner.check()  # alive: Serve's health check passes
        return await collect(runner, "b")

    runner, last = run(BrokenThread(llm.engine, after=3), scenario)
    assert last.finished and len(last.outputs[0].token_ids) == 4
    assert runner.restarts == 1 and runner.metrics.restarts.local._value.get() == 1
    assert all_pages_free(llm)


def test_an_engine_that_keeps_failing_is_dead(llm):
    class AlwaysBroken(BrokenThread):
        def num_waiting(self):
            raise RuntimeError("a bug in the engine thread")

    async def scenario(runner):
        for i in range(10):
            try:
                await collect(runner, f"r{i}")
            except EngineRestarted:
                continue
            except EngineDead as e:
                return e
        raise AssertionError("the engine never gave up")

    runner, dead = run(AlwaysBroken(llm.engine, after=0), scenario)
    assert "failed 6 times" in str(dead)
    with pytest.raises(EngineDead):
        runner.check()


def test_retry_after_follows_how_long_requests_waited(llm):
    runner = AsyncEngine(llm.engine, max_num_seqs=4, max_queue=4, metrics=Metrics())
    try:
        assert runner.retry_after == 1
        runner._wait_s = 9.2  # what the engine thread measures from submission to first token
        assert runner.retry_after == 10
        runner._wait_s = 1e6
        assert runner.retry_after == 60
    finally:
        runner.shutdown()
