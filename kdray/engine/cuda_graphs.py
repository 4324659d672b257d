"""CUDA graphs for the fixed-shape parts of a step (the whole in-process step; each half on Ray).

``GraphedFn`` captures ``fn(timer, *inputs)`` once per key (the inputs' shapes and a caller's key) with static
input buffers; later calls copy the new inputs into those buffers and replay. Everything ``fn`` launches must
read shapes only (no host reads of device values), which the kdray kernels guarantee. Stage marks made with the
``timer`` during capture become event nodes of the graph, so each replay is timed stage by stage.
"""
from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Hashable

import torch

from kdray.engine.step import StageTimer


class _Capture:
    """One captured graph: its static inputs, its outputs and the timer whose events it records."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: tuple, outputs: tuple, timer: StageTimer):
        self.graph, self.inputs, self.outputs, self.timer = graph, inputs, outputs, timer


class GraphedFn:
    """``fn(timer, *inputs, **options) -> tuple`` replayed from CUDA graphs, captured per (options, input shapes).

    Two captures alternate per key, so a replay never re-records the stage events of the replay before it
    while the host may still read them (the host runs one step behind). ``snapshot()`` returns a function that
    restores the state ``fn`` changes (the per-slot lengths and roots), called after the warm-up runs, which
    execute ``fn`` for real before the capture. A key whose capture fails warns once, naming why, and runs
    eagerly from then on: never wrong results, only slower ones.
    """

    def __init__(self, fn: Callable, snapshot: Callable[[], Callable[[], None]], warmup: int = 2):
        self.fn, self.snapshot, self.warmup = fn, snapshot, warmup
        self._captures: dict[Hashable, list[_Capture]] = {}
        self._turn: dict[Hashable, int] = {}
        self._eager: set[Hashable] = set()
        self._pool = None

    def __call__(self, inputs: tuple[torch.Tensor, ...], **options) -> tuple[tuple, StageTimer]:
        """``fn(timer, *inputs, **options)``'s outputs (static: valid until this key's next-but-one replay) and
        the timer of this replay."""
        key = (tuple(sorted(options.items())), tuple((t.shape, t.dtype) for t in inputs))
        if key not in self._captures and key not in self._eager:
            try:
                self._captures[key] = [self._capture(inputs, options) for _ in range(2)]
            except Exception as e:  # noqa: BLE001 - a capture that fails costs speed, never correctness
                self._eager.add(key)
                warnings.warn(f"CUDA graph capture failed for {options} with inputs {[tuple(s) for s, _ in key[1]]};"
                              f" this shape runs eagerly: {e!r}", stacklevel=2)
        if key in self._eager:
            timer = StageTimer(cuda=True)
            return self.fn(timer, *inputs, **options), timer
        turn = self._turn[key] = 1 - self._turn.get(key, 1)
        capture = self._captures[key][turn]
        for dst, src in zip(capture.inputs, inputs):
            dst.copy_(src)
        capture.graph.replay()
        return capture.outputs, capture.timer

    def _capture(self, inputs: tuple, options: dict) -> _Capture:
        static = tuple(t.clone() for t in inputs)
        restore = self.snapshot()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):  # loads kernels and settles the allocator outside the capture
                self.fn(StageTimer(cuda=True), *static, **options)
        torch.cuda.current_stream().wait_stream(stream)
        restore()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, timer = torch.cuda.CUDAGraph(), StageTimer(cuda=True, in_graph=True)
        # No garbage collection inside the capture: collecting an unreachable engine would destroy its graphs,
        # which CUDA forbids while a stream captures (the capture is then invalidated).
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                timer.start()
                outputs = self.fn(timer, *static, **options)
        finally:
            if collecting:
                gc.enable()
        return _Capture(graph, static, outputs, timer)
