"""MLA's latent-cache write in one pass: ``mla_rope_cache``.

From ``kv_a = kv_a_proj_with_mqa(x)`` ``[T, L + R]`` (latent ``c``, then the shared rope key ``k_pe``) it writes
the cache row of every token, ``cache_rows[slot_mapping[t]] = [rmsnorm(c), rope(k_pe)]`` (576 values for K2),
and ropes the queries' rope part, ``q_out = rope(q_pe)`` (``q_out`` may be ``q_pe`` itself: in place, or a
slice of the absorbed attention's query buffer). Rope is DeepSeek's: adjacent pairs rotated, output
de-interleaved (``kdray.model.layers.Rotary`` with ``interleaved=True``); ``cos``/``sin`` ``[T, R/2]`` carry
YaRN's attention factor already.

CUDA tensors of float32 / bfloat16 / float16 run ``cuda/mla_rope_cache.cu`` (one block per token, on torch's
current stream, no allocation, no host sync); CPU tensors run the reference below, the unfused torch code
(RMSNorm, two rotaries, a concatenation and an indexed write).
"""
from __future__ import annotations

import numpy as np
import torch

from kdray.kernels.cuda_module import launch
from kdray.kernels.rmsnorm import DTYPES, rmsnorm_reference
from kdray.kernels.rope import rope_reference

MAX_ROPE_DIM = 64  # a warp ropes one row: R / 2 pairs <= 32 lanes


def mla_rope_cache_reference(kv_a, weight, eps, cos, sin, q_pe, q_out, cache_rows, slot_mapping) -> None:
    """The unfused torch form of :func:`mla_rope_cache` (same arguments)."""
    latent, k_pe = kv_a.split([weight.shape[0], kv_a.shape[-1] - weight.shape[0]], dim=-1)
    latent = rmsnorm_reference(latent, weight, eps)
    q_out.copy_(rope_reference(q_pe, cos, sin, interleaved=True))
    k_pe = rope_reference(k_pe.unsqueeze(1), cos, sin, interleaved=True).squeeze(1)
    cache_rows[slot_mapping] = torch.cat([latent, k_pe], dim=-1).to(cache_rows.dtype)


def mla_rope_cache(kv_a: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   q_pe: torch.Tensor, q_out: torch.Tensor, cache_rows: torch.Tensor, slot_mapping: torch.Tensor
                   ) -> None:
    """Write the normalised latent and roped key of each token into its cache row; rope the queries.

    kv_a ``[T, L + R]`` (unit stride along the row), weight ``[L]`` (kv_a_layernorm), cos / sin ``[T, R/2]``,
    q_pe / q_out ``[T, H, R]`` (unit stride along R), cache_rows ``[rows, L + R]`` (one layer's pages, flattened),
    slot_mapping ``[T]`` int64. On CUDA a slot outside ``[0, rows)`` writes nothing (torch would wrap a negative one).
    """
    if kv_a.dim() != 2 or weight.dim() != 1:
        raise ValueError(f"kv_a must be [T, L + R] and weight [L], got {tuple(kv_a.shape)} and {tuple(weight.shape)}")
    T, D = kv_a.shape
    L = weight.shape[0]
    R = D - L
    if R <= 0 or R % 2 or cache_rows.dim() != 2 or cache_rows.shape[1] != D:
        raise ValueError(f"expected kv_a [T, L + R] with R even and cache_rows [rows, L + R]; got kv_a "
                         f"{tuple(kv_a.shape)}, weight {tuple(weight.shape)}, cache_rows {tuple(cache_rows.shape)}")
    if q_pe.dim() != 3 or q_pe.shape[0] != T or q_pe.shape[2] != R or q_out.shape != q_pe.shape:
        raise ValueError(f"q_pe and q_out must both be [T={T}, H, R={R}], got {tuple(q_pe.shape)} / "
                         f"{tuple(q_out.shape)}")
    if cos.shape != (T, R // 2) or sin.shape != cos.shape or slot_mapping.shape != (T,):
        raise ValueError(f"cos / sin must be [T={T}, R/2={R // 2}] and slot_mapping [T]; got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}, {tuple(slot_mapping.shape)}")
    if not kv_a.is_cuda:
        return mla_rope_cache_reference(kv_a, weight, eps, cos, sin, q_pe, q_out, cache_rows, slot_mapping)
    _check_cuda(kv_a, weight, cos, sin, q_pe, q_out, cache_rows, slot_mapping, R)
    if T:
        launch("mla_rope_cache", "mla_rope_cache", (T,), (128,),
               (kv_a, np.int64(kv_a.stride(0)), weight, cos, sin, q_pe, np.int64(q_pe.stride(0)),
                np.int64(q_pe.stride(1)), q_out, np.int64(q_out.stride(0)), np.int64(q_out.stride(1)), cache_rows,
                np.int64(cache_rows.shape[0]), slot_mapping, np.int32(q_pe.shape[1]), np.int32(L), np.int32(R),
                np.float32(eps)), device=kv_a.device, defines=(("DTYPE", DTYPES[kv_a.dtype]),))


def _check_cuda(kv_a, weight, cos, sin, q_pe, q_out, cache_rows, slot_mapping, R):
    if R > MAX_ROPE_DIM:
        raise ValueError(f"rope dim {R} > {MAX_ROPE_DIM} is not supported by the CUDA mla_rope_cache (a warp per row)")
    if kv_a.dtype not in DTYPES:
        raise TypeError(f"mla_rope_cache runs float32, bfloat16 or float16 on CUDA, got {kv_a.dtype}")
    for name, t in (("weight", weight), ("cos", cos), ("sin", sin), ("q_pe", q_pe), ("q_out", q_out),
                    ("cache_rows", cache_rows)):
        if t.dtype != kv_a.dtype or t.device != kv_a.device:
            raise TypeError(f"{name} must be {kv_a.dtype} on {kv_a.device}, got {t.dtype} on {t.device}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.device != kv_a.device:
        raise TypeError(f"slot_mapping must be int64 on {kv_a.device}, got {slot_mapping.dtype} on "
                        f"{slot_mapping.device}")
    if kv_a.stride(1) != 1 or q_pe.stride(2) != 1 or q_out.stride(2) != 1:
        raise ValueError("kv_a, q_pe and q_out need unit stride along their last dim")
    for name, t in (("weight", weight), ("cos", cos), ("sin", sin), ("cache_rows", cache_rows),
                    ("slot_mapping", slot_mapping)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
