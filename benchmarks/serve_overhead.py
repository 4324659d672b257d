"""Host time the Serve side adds to every engine step, with the engine's own work taken away.

A stand-in engine runs ``--batch`` requests for ``--steps`` steps: each step waits ``--step-ms`` (as for the GPU,
the GIL released) and returns one output a request (one token, its text and the engine's metrics: a 16-node tree a
step, made before the run). The real :class:`~kdray.serve.async_engine.AsyncEngine` steps it and hands the outputs
to the requests' streams; each stream is read by the real SSE path (``OpenAIServing``'s chat chunks, no tools) on
the event loop, as the replica serves it. Printed per step: the CPU time of the engine thread (the AsyncEngine's
bookkeeping and hand-over) and of the event loop (the streams' chunks), and the wall time over the wait (what the
host adds to the step).

    python benchmarks/serve_overhead.py --batch 64 256 1024
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table  # noqa: E402
from kdray.engine.engine import StepReport  # noqa: E402
from kdray.engine.request import CompletionOutput, RequestOutput  # noqa: E402
from kdray.engine.step import STAGES  # noqa: E402
from kdray.serve.async_engine import AsyncEngine  # noqa: E402
from kdray.serve.metrics import Metrics  # noqa: E402
from kdray.serve.protocol import ChatCompletionRequest  # noqa: E402
from kdray.serve.serving import OpenAIResponse  # noqa: E402


class _Pool:
    num_pages = 1


class _Scheduler:
    pool, prefix_lookups, prefix_hits, preemptions = _Pool(), 0, 0, 0


class StandInEngine:
    """What the AsyncEngine calls of an engine: requests that each emit one token a step for ``steps`` steps."""

    def __init__(self, batch: int, steps: int, step_s: float):
        self.scheduler, self.policy, self.step_s = _Scheduler(), None, step_s
        self.pending: list[str] = []
        self.outputs: list[list[RequestOutput]] = []  # per step still to come
        self.batch, self.steps, self.cpu = batch, steps, 0.0
        self.report = StepReport(dict.fromkeys(STAGES, step_s / len(STAGES)), [(NODES, 0)] * batch)

    def add_request(self, rid: str, ids: list[int], params):
        self.pending.append(rid)
        if len(self.pending) == self.batch:  # the whole batch in: its outputs, made before the clock starts
            self.outputs = [[_output(rid, s, self.steps) for rid in self.pending] for s in range(self.steps)]
            self.cpu = time.thread_time()

    def abort_request(self, rid: str):
        pass

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs)

    def num_waiting(self) -> int:
        return 0

    def free_pages(self) -> int:
        return 1

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        outs = self.outputs.pop(0)
        if not self.outputs:
            self.cpu = time.thread_time() - self.cpu
        return outs


NODES = 16  # draft nodes a step


def _output(rid: str, step: int, steps: int) -> RequestOutput:
    last = step == steps - 1
    metrics = {"steps": step, "tau": 1.0, "accepted_tokens": step, "prompt_tokens": 3, "generated_tokens": step + 1,
               "ttft": 0.0, "scheduled_at": 0.0, "seconds": dict.fromkeys(STAGES, 1e-3 * step),
               "tree_sizes": {NODES: step}}
    return RequestOutput(rid, [1, 2, 3], [CompletionOutput(0, " word", [100 + step], "length" if last else None)],
                         last, metrics)


async def serve(batch: int, steps: int, step_s: float) -> dict:
    engine = StandInEngine(batch, steps, step_s)
    runner = AsyncEngine(engine, max_num_seqs=batch, max_queue=batch, metrics=Metrics())
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    rid = "chatcmpl-x"

    async def client(i: int) -> int:
        stream = await runner.generate([(f"{rid}{i}-0", [1, 2, 3], None)])
        response = OpenAIResponse(f"{rid}{i}", "m", True, req, 1, 3)
        return sum([1 async for _ in response.sse(stream, None)])

    try:
        loop_cpu, wall = time.thread_time(), time.perf_counter()
        chunks = await asyncio.gather(*(client(i) for i in range(batch)))
        loop_cpu, wall = time.thread_time() - loop_cpu, time.perf_counter() - wall
    finally:
        runner.shutdown()
    return {"engine_ms": 1e3 * engine.cpu / steps, "loop_ms": 1e3 * loop_cpu / steps,
            "added_ms": 1e3 * (wall / steps - step_s), "chunks": sum(chunks) / batch}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=5.0, help="the stand-in engine's wait per step")
    args = ap.parse_args()
    rows = []
    for b in args.batch:
        r = asyncio.run(serve(b, args.steps, args.step_ms / 1e3))
        rows.append([str(b), f"{r['engine_ms']:.3f}", f"{1e3 * r['engine_ms'] / b:.2f}", f"{r['loop_ms']:.3f}",
                     f"{1e3 * r['loop_ms'] / b:.2f}", f"{r['added_ms']:.3f}", f"{r['chunks']:.0f}"])
    print(f"\n# {datetime.date.today()} serve_overhead: {args.steps} steps of {args.step_ms} ms, one token a request a "
          "step")
    print_table(rows, ["batch", "engine thread CPU ms / step", "us / output", "event loop CPU ms / step",
                       "us / output", "wall over the wait ms / step", "chunks / stream"])


if __name__ == "__main__":
    main()
