"""CUDA graphs for the fixed-shape passes of a step (the target's verify pass, the drafter's block pass).

A pass is captured once per input shape with static input buffers; later calls copy the new inputs
into those buffers and replay. Everything a pass launches must read shapes only (no host reads of
device values), which the kdray kernels guarantee.
"""
from __future__ import annotations

import gc
from dataclasses import fields
from typing import Callable

import torch

from kdray.model.batch import ForwardBatch


class GraphedPass:
    """``fn(batch, *extra) -> tuple of tensors`` replayed from a CUDA graph per input shape."""

    def __init__(self, fn: Callable, warmup: int = 2):
        self.fn, self.warmup = fn, warmup
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, ForwardBatch, tuple, tuple]] = {}
        self._pool = None

    @staticmethod
    def _key(batch: ForwardBatch, extra: tuple) -> tuple:
        return tuple((f.name, tuple(getattr(batch, f.name).shape)) for f in fields(batch)
                     if isinstance(getattr(batch, f.name), torch.Tensor)) + tuple(tuple(e.shape) for e in extra)

    def __call__(self, batch: ForwardBatch, *extra: torch.Tensor) -> tuple:
        key = self._key(batch, extra)
        if key not in self._graphs:
            self._graphs[key] = self._capture(batch, extra)
        graph, static_batch, static_extra, outputs = self._graphs[key]
        for f in fields(batch):
            value = getattr(batch, f.name)
            if isinstance(value, torch.Tensor):
                getattr(static_batch, f.name).copy_(value)
        static_batch.q_lens = batch.q_lens
        for dst, src in zip(static_extra, extra):
            dst.copy_(src)
        graph.replay()
        return outputs

    def _capture(self, batch: ForwardBatch, extra: tuple):
        static_batch = ForwardBatch(**{f.name: (getattr(batch, f.name).clone()
                                                if isinstance(getattr(batch, f.name), torch.Tensor)
                                                else getattr(batch, f.name)) for f in fields(batch)})
        static_extra = tuple(e.clone() for e in extra)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):  # loads kernels and settles the allocator outside the capture
                self.fn(static_batch, *static_extra)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # No garbage collection inside the capture: collecting an unreachable engine would destroy its graphs,
        # which CUDA forbids while a stream captures (the capture is then invalidated).
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                outputs = self.fn(static_batch, *static_extra)
        finally:
            if collecting:
                gc.enable()
        return graph, static_batch, static_extra, outputs
