"""The synchronous engine behind asyncio: one thread steps it while requests exist.

Only the engine thread touches the engine. Callers hand it commands (add, abort) through a
condition variable and receive outputs on a per-submission stream; the waiting queue is bounded, so a
full server refuses work (:class:`QueueFull`) instead of queueing without limit.

Failures stay as small as they can: a failed step fails the requests it ran (a request that had sent
nothing yet runs once more, so a shard that died while the engine was idle costs no request); an error
in the thread itself fails the requests in flight and restarts the thread on the same engine. Only an
engine that cannot be reset, or that keeps failing, is :class:`EngineDead` (Serve then replaces the
replica).
"""
from __future__ import annotations

import asyncio
import gc
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kdray.engine.engine import RunnerFailure
from kdray.engine.request import RequestOutput, SamplingParams
from kdray.serve.metrics import Metrics

logger = logging.getLogger("kdray.serve")
MAX_RESTARTS = 5  # thread restarts within RESTART_WINDOW_S before the engine counts as dead
RESTART_WINDOW_S = 60.0
WAIT_SMOOTHING = 0.2  # weight of the newest wait in the estimate behind Retry-After
MAX_RETRY_AFTER_S = 60


class QueueFull(Exception):
    """The engine's waiting queue is at its bound; retry after ``retry_after`` seconds."""

    def __init__(self, capacity: int, retry_after: int = 1):
        super().__init__(f"the server is at capacity ({capacity} requests running or queued); "
                         f"retry after {retry_after} s")
        self.retry_after = retry_after


class EngineDead(RuntimeError):
    """The engine failed and could not be restarted; the replica must be replaced."""


class EngineRestarted(RuntimeError):
    """The engine thread failed while this request was in flight; it restarted, and a retry will be served."""


class RequestStream:
    """Outputs of one submission (one or more engine requests), in the order the engine emits them.

    Iterate it with ``async for``; :meth:`abort` stops every request still running and frees its pages.
    Each output holds what its request added since its previous one (:meth:`RequestOutput.add` joins them); a slow
    reader gets a request's outputs that arrived meanwhile joined into one.
    """

    def __init__(self, owner: AsyncEngine, request_ids: list[str]):
        self._owner, self._unfinished = owner, set(request_ids)
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self.admitted: asyncio.Future = asyncio.get_running_loop().create_future()

    def _put(self, item: RequestOutput | BaseException):
        self._items.append(item)
        self._ready.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        while (isinstance(item, RequestOutput) and not item.finished and self._items
               and getattr(self._items[0], "request_id", None) == item.request_id):
            item.add(self._items.popleft())
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def abort(self):
        """Stop what is still running (no-op once everything finished)."""
        if self._unfinished:
            self._owner._submit(("abort", sorted(self._unfinished)))
            self._unfinished.clear()


@dataclass
class _Live:
    """Engine-thread bookkeeping of one running engine request."""

    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    submitted: float
    prompt: list[int]
    params: SamplingParams
    first_token: float | None = None
    retried: bool = False  # it ran again after a failed step that it had sent nothing from


class AsyncEngine:
    """Owns the engine thread. ``await generate(...)`` admits requests and returns their stream.

    At most ``max_num_seqs + max_queue`` engine requests are in flight (running or waiting); more
    raise :class:`QueueFull`.
    """

    def __init__(self, engine, max_num_seqs: int, max_queue: int, metrics: Metrics):
        if max_queue < 0:
            raise ValueError(f"max_queue={max_queue} must be >= 0")
        self.engine, self.metrics = engine, metrics
        self.capacity = max_num_seqs + max_queue
        self.error: BaseException | None = None
        self.restarts = 0
        self._cond = threading.Condition()
        self._commands: list[tuple] = []
        self._pending = 0  # requests handed over but not yet added to the engine
        self._live: dict[str, _Live] = {}  # the engine thread's (generate() reads its size, under the lock)
        self._waiting = 0  # engine.num_waiting() after the engine thread's last step
        self._wait_s = 0.0  # recent time from submission to first token (smoothed): the Retry-After estimate
        self._stopped = False
        self._published: tuple = ()
        # What start-up built (the model, the graphs, the imports) lives as long as the server: moved out of the
        # collector's generations, a full collection no longer walks it and stalls every stream (as in vLLM).
        gc.collect()
        gc.freeze()
        self._thread = threading.Thread(target=self._main, name="kdray-engine", daemon=True)
        self._thread.start()

    @property
    def retry_after(self) -> int:
        """Seconds a refused client should wait: about as long as admitted requests recently waited."""
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self._wait_s)))

    async def generate(self, requests: Sequence[tuple[str, list[int], SamplingParams]]) -> RequestStream:
        """Admit ``(request_id, prompt_token_ids, params)`` requests together and return their stream.

        The engine's ``ValueError`` (a bad prompt), :class:`QueueFull` and :class:`EngineDead` are raised
        here, before any output; cancelling the caller aborts the requests.
        """
        self.check()
        stream = RequestStream(self, [r[0] for r in requests])
        with self._cond:
            if self._pending + len(self._live) + len(requests) > self.capacity:
                raise QueueFull(self.capacity, self.retry_after)
            self._pending += len(requests)
            self._commands.append(("add", stream, asyncio.get_running_loop(), list(requests), time.perf_counter()))
            self._cond.notify()
        try:
            await asyncio.shield(stream.admitted)
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    def check(self):
        """Raise :class:`EngineDead` if the engine thread is gone for good."""
        if self.error is not None or not self._thread.is_alive():
            raise self.error or EngineDead("the engine thread is not running")

    def shutdown(self):
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _submit(self, command: tuple):
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # ---- engine thread -------------------------------------------------------------------------

    def _main(self):
        """Run the loop; after an error, fail what was in flight, reset the engine and run it again."""
        failures: deque[float] = deque()
        while True:
            try:
                self._loop()
                return
            except Exception:  # noqa: BLE001 - a bug or a broken engine: the replica itself recovers
                logger.exception("the engine thread failed; failing the requests in flight and restarting it")
                now = time.monotonic()
                failures.append(now)
                while now - failures[0] > RESTART_WINDOW_S:
                    failures.popleft()
                lost = self._fail_live(EngineRestarted("the engine failed while serving this request and has "
                                                       "restarted; send it again"))
                if len(failures) > MAX_RESTARTS:
                    self._die(EngineDead(f"the engine failed {len(failures)} times within {RESTART_WINDOW_S:.0f} s; "
                                         "the replica needs replacing (see its log)"))
                    return
                if not self._reset(lost):
                    self._die(EngineDead("the engine failed and could not be reset; the replica needs replacing "
                                         "(see its log)"))
                    return
                self.restarts += 1
                self.metrics.restarts.inc()
            except BaseException:
                self._die(EngineDead("the engine thread stopped; the replica needs replacing (see its log)"))
                raise

    def _loop(self):
        while True:
            with self._cond:
                while not self._commands and not self.engine.has_unfinished_requests() and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                commands, self._commands = self._commands, []
            for command in commands:
                self._apply(command)
            if self.engine.has_unfinished_requests():
                self._step()
            self._waiting = self.engine.num_waiting()
            self._publish()

    def _publish(self):
        """Set the gauges when what they show has changed."""
        state = (max(0, len(self._live) - self._waiting), self._pending + self._waiting, self.engine.free_pages())
        if state != self._published:
            self._published = state
            self.metrics.engine_state(*state, self.engine.scheduler.pool.num_pages)
            sched, policy = self.engine.scheduler, self.engine.policy
            self.metrics.scheduler(sched.prefix_lookups, sched.prefix_hits, sched.preemptions,
                                   policy.calibration if policy is not None else [])

    def _fail_live(self, error: BaseException) -> list[str]:
        """Hand ``error`` to every request in flight; return their ids."""
        lost = list(self._live)
        for live in self._live.values():
            _deliver(live.loop, live.stream._put, error)
        self._live.clear()
        return lost

    def _reset(self, request_ids: list[str]) -> bool:
        """Abort ``request_ids`` in the engine and apply its step in flight (freeing their pages); whether it then
        holds no request."""
        try:
            for rid in request_ids:
                self.engine.abort_request(rid)
            self.engine.drain()
            return not self.engine.has_unfinished_requests()
        except Exception:  # noqa: BLE001 - logged; the engine is beyond repair
            logger.exception("resetting the engine failed")
            return False

    def _die(self, error: EngineDead):
        """The engine is beyond repair: every request in flight or handed over gets ``error``."""
        self.error = error
        self._fail_live(error)
        with self._cond:
            for command in self._commands:
                if command[0] == "add":
                    _deliver(command[2], _settle, command[1].admitted, error)
            self._commands.clear()

    def _apply(self, command: tuple):
        if command[0] == "abort":
            for rid in command[1]:
                if self._live.pop(rid, None) is not None:
                    self.engine.abort_request(rid)
            return
        _, stream, loop, requests, submitted = command
        added, error = [], None
        try:
            for rid, ids, params in requests:
                self.engine.add_request(rid, ids, params)
                added.append(rid)
        except Exception as e:  # noqa: BLE001 - handed to the caller (ValueError: a bad request)
            for rid in added:
                self.engine.abort_request(rid)
            error = e
        finally:
            with self._cond:  # from pending to live at once: generate() never counts a request twice
                if error is None and len(added) == len(requests):
                    for rid, ids, params in requests:
                        self._live[rid] = _Live(stream, loop, submitted, ids, params)
                self._pending -= len(requests)
        _deliver(loop, _settle, stream.admitted, error)

    def _step(self):
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except RunnerFailure as e:  # the step's requests failed (an actor died: the runner rebuilds)
            logger.warning("%s", e)
            for rid in e.request_ids:
                self._fail_or_retry(rid, e)
            return
        now = time.perf_counter()
        handed: dict[asyncio.AbstractEventLoop, list] = {}  # per loop, its streams' outputs: one wake-up a step
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            if live.first_token is None and out.outputs[0].token_ids:
                live.first_token = now
                self.metrics.first_token(now - live.submitted, out.metrics["scheduled_at"] - live.submitted)
                self._wait_s += WAIT_SMOOTHING * (now - live.submitted - self._wait_s)
            if out.finished:
                del self._live[out.request_id]
                self.metrics.finished(out, now - live.first_token if live.first_token else 0.0, now - live.submitted)
            handed.setdefault(live.loop, []).append((live.stream, out))
        for loop, items in handed.items():
            _deliver(loop, _put_all, items)
        self.metrics.step(now - t0, self.engine.report.seconds, self.engine.report.drafts)

    def _fail_or_retry(self, rid: str, error: RunnerFailure):
        """A request of a failed step: once, if it has sent nothing yet, it runs again; else it gets ``error``."""
        live = self._live.get(rid)
        if live is None:
            return
        if live.first_token is None and not live.retried:
            live.retried = True
            try:
                self.engine.add_request(rid, live.prompt, live.params)
                return
            except ValueError:
                pass
        del self._live[rid]
        _deliver(live.loop, live.stream._put, error)


def _deliver(loop: asyncio.AbstractEventLoop, fn, *args):
    """Run ``fn(*args)`` on ``loop``; a closed loop (replica shutting down) has nobody left to tell."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _put_all(items: list[tuple[RequestStream, RequestOutput]]):
    """Hand each stream its output (one call per loop and step: every ``call_soon_threadsafe`` wakes the loop
    through a system call, ~2-8 us of the engine thread's time each)."""
    for stream, out in items:
        stream._put(out)


def _settle(future: asyncio.Future, error: BaseException | None):
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
