"""Llama-family attention inputs in one pass: ``gqa_rope_cache``.

Ropes the queries ``q [T, H, D]`` and keys ``k [T, Hkv, D]`` in place (NeoX / Llama rope: the two halves of each
head rotated; ``kdray.model.layers.Rotary`` with ``interleaved=False``) and writes each token's cache row,
``cache_rows[slot_mapping[t]] = [k[t], v[t]]`` (the paged KV cache ``[P, S, 2, Hkv, D]`` of one layer, flattened to
``[rows, 2, Hkv, D]``). ``cos`` / ``sin`` ``[T, D/2]`` come from ``Rotary.cos_sin`` in the activations' dtype.

CUDA tensors of float32 / bfloat16 / float16 with a cache of the same dtype run ``cuda/gqa_rope_cache.cu`` (one
block per token, torch's current stream, no allocation, no host sync), rounding as the unfused torch code does, so
that both give the same bits; others run the reference below, that code.
"""
from __future__ import annotations

import numpy as np
import torch

from kdray.kernels.cuda_module import launch
from kdray.kernels.rmsnorm import DTYPES
from kdray.kernels.rope import rope_reference


def gqa_rope_cache_reference(q, k, v, cos, sin, cache_rows, slot_mapping) -> None:
    """The unfused torch form of :func:`gqa_rope_cache` (same arguments)."""
    q.copy_(rope_reference(q, cos, sin, interleaved=False))
    k.copy_(rope_reference(k, cos, sin, interleaved=False))
    cache_rows[slot_mapping] = torch.stack([k, v], dim=1).to(cache_rows.dtype)


def gqa_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache_rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Rope ``q`` ``[T, H, D]`` and ``k`` ``[T, Hkv, D]`` in place; write ``[k, v]`` into ``cache_rows``
    ``[rows, 2, Hkv, D]`` at ``slot_mapping`` ``[T]`` (int64). q, k, v need unit stride along D. On CUDA a slot
    outside ``[0, rows)`` writes nothing (torch would wrap a negative one)."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"gqa_rope_cache needs q [T, H, D] and k, v [T, Hkv, D]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    T, _, D = q.shape
    Hkv = k.shape[1]
    if D % 2 or cos.shape != (T, D // 2) or sin.shape != cos.shape or slot_mapping.shape != (T,):
        raise ValueError(f"gqa_rope_cache needs an even head dim D={D}, cos / sin [T={T}, D/2] and slot_mapping [T]; "
                         f"got {tuple(cos.shape)}, {tuple(sin.shape)}, {tuple(slot_mapping.shape)}")
    if cache_rows.dim() != 4 or cache_rows.shape[1:] != (2, Hkv, D):
        raise ValueError(f"cache_rows must be [rows, 2, Hkv={Hkv}, D={D}], got {tuple(cache_rows.shape)}")
    fused = (q.is_cuda and q.dtype in DTYPES and all(t.dtype == q.dtype for t in (k, v, cos, sin, cache_rows))
             and cache_rows.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
             and slot_mapping.dtype == torch.int64 and all(t.stride(2) == 1 for t in (q, k, v)))
    if not fused:
        return gqa_rope_cache_reference(q, k, v, cos, sin, cache_rows, slot_mapping)
    if T:
        launch("gqa_rope_cache", "gqa_rope_cache", (T,), (128,),
               (q, np.int64(q.stride(0)), np.int64(q.stride(1)), k, np.int64(k.stride(0)), np.int64(k.stride(1)),
                v, np.int64(v.stride(0)), np.int64(v.stride(1)), cos, sin, cache_rows, np.int64(cache_rows.shape[0]),
                slot_mapping, np.int32(q.shape[1]), np.int32(Hkv), np.int32(D)),
               device=q.device, defines=(("DTYPE", DTYPES[q.dtype]),))
