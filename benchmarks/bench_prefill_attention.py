"""MLA prefill attention at K2's TP8-shard dims (8 heads, keys 192 = 128 nope + 64 rope, values 128).

Each row is one batch as the layer has it: kv_b's output ``[keys, 8, 256]`` (nope | values) and the cache rows'
rope part ``[keys, 64]``, as strided views. ``mla_prefill_mma`` (our kernel, which reads them where they lie) against
the path it replaces: the keys joined into ``[keys, 8, 192]`` (``torch.cat``, timed) and ``prefill_attention``
(cuDNN for prompts of 2048 tokens or more, else one variable-length FlashAttention call). Both are timed as
CUDA-graph replays; where the kernel cuts a query tile's keys into runs (a CTA each, merged by a second launch),
the shape says so: runs x key tiles a run. FLOPs: 2 x heads x (192 + 128) per visible (query, key) pair, causal;
the floor is FLOPs / the bf16 GEMM rate.
"""
from __future__ import annotations

import torch

from benchmarks.common import Ceilings, Row
from benchmarks.bench_attention import _time
from kdray.kernels import prefill_attention as pa
from kdray.kernels.cuda_module import sm_count

HEADS = 8
CELLS = [([1024], [0]), ([2048], [0]), ([4096], [0]), ([16384], [0]), ([65536], [0]), ([2048] * 8, [0] * 8),
         ([2048], [16384]), ([1024], [16384]), ([512], [1536])]  # (prompt lengths, cached keys before each)


def _case(lens, prefixes):
    """The layer's tensors for prompts of ``lens`` new tokens after ``prefixes`` cached ones (bf16, CUDA)."""
    g = torch.Generator().manual_seed(0)
    k_lens = [p + n for p, n in zip(prefixes, lens)]
    q = torch.randn(sum(lens), HEADS, 192, generator=g).cuda().bfloat16()  # [T, H, 192]
    kv = torch.randn(sum(k_lens), HEADS, 256, generator=g).cuda().bfloat16()  # [Tk, H, nope | v]
    rows = torch.randn(sum(k_lens), 576, generator=g).cuda().bfloat16()  # [Tk, latent | rope]
    cu_q, cu_k = (torch.tensor([0, *n]).cumsum(0).to(torch.int32).cuda() for n in (lens, k_lens))
    return q, kv[..., :128], rows[:, 512:], kv[..., 128:], cu_q, cu_k, k_lens


def bench(ceil: Ceilings) -> list[Row]:
    rows = []
    for lens, prefixes in CELLS:
        q, k_nope, k_pe, v, cu_q, cu_k, k_lens = _case(lens, prefixes)
        cached = any(prefixes)
        keys = (cu_k, k_lens) if cached else ()

        def joined():
            k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, HEADS, -1)], dim=-1)  # [Tk, H, 192]
            return pa.prefill_attention(q, k, v, cu_q, lens, 0.07, *keys)

        kernel = lambda: pa._mla_prefill_cuda(q, k_nope, k_pe, v, cu_q, cu_k, lens, k_lens, 0.07)  # noqa: E731
        t, t_joined = _time(kernel, graph=True), _time(joined, graph=True)
        flops = sum(2 * HEADS * 320 * (n * (n + 1) / 2 + n * p) for n, p in zip(lens, prefixes))
        n_splits, per = pa._key_splits(tuple(lens), tuple(k_lens), HEADS, sm_count(q.device.index))
        shape = (f"{len(lens)} x {lens[0]}" + (f" after {prefixes[0]} cached" if cached else "") + f" H={HEADS}"
                 + (f", runs {n_splits} x {per}" if n_splits > 1 else ""))
        rows.append(Row(kernel="mla_prefill_mma", shape=shape, time_us=t, floor_us=ceil.floor_us(0, flops),
                        achieved=f"{flops / t / 1e6:.0f} TFLOP/s", baseline="joined keys + cuDNN/FA2",
                        baseline_us=t_joined))
        del q, k_nope, k_pe, v
    return rows
