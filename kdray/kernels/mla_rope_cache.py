"""MLA's latent-cache write in one pass: ``mla_rope_cache``.

From ``kv_a = kv_a_proj_with_mqa(x)`` ``[T, L + R]`` (latent ``c``, then the shared rope key ``k_pe``) it writes
the cache row of every token, ``cache_rows[slot_mapping[t]] = [rmsnorm(c), rope(k_pe)]`` (576 values for K2),
and ropes the queries' rope part, ``q_out = rope(q_pe)`` (``q_out`` may be ``q_pe`` itself: in place, or a
slice of the absorbed attention's query buffer). Rope is DeepSeek's: adjacent pairs rotated, output
de-interleaved (``kdray.model.layers.Rotary`` with ``interleaved=True``); ``cos``/``sin`` ``[T, R/2]`` carry
YaRN's attention factor already.

With ``q_nope`` / ``w_uk`` / ``q_latent`` it also writes the absorbed attention's queries,
``q_latent[:, h] = q_nope[:, h] @ w_uk[h]``: up to ``ABSORB_MAX_T`` tokens in the same launch, so that at few tokens no
GEMM launch sits between ``q_b_proj`` and the attention (each costs a few microseconds of a one-token layer's chain,
and cuBLAS's kernels do not start early behind the kernel ahead), beyond that as cuBLAS's batched GEMM.

CUDA tensors of float32 / bfloat16 / float16 run ``cuda/mla_rope_cache.cu`` (one block per token, plus blocks of
(head, 64 latent columns, ``ABSORB_TOKENS`` tokens) for the absorbed queries; on torch's current stream, no
allocation, no host sync); CPU tensors run the reference below, the unfused torch code (RMSNorm, two rotaries, a
concatenation, an indexed write and a batched GEMM).
"""
from __future__ import annotations

import numpy as np
import torch

from kdray.kernels.cuda_module import launch
from kdray.kernels.rmsnorm import DTYPES, rmsnorm_reference
from kdray.kernels.rope import rope_reference

MAX_ROPE_DIM = 64  # a lane per rotated pair of a row: R / 2 pairs <= 32 lanes
# Tokens whose absorbed queries the launch writes (H200, K2 TP8: 4% less at one token, even with cuBLAS's GEMM at
# 17-65 tokens; each absorb block reads its 16 KB of W_UK again, so many more tokens would read it many times).
ABSORB_MAX_T = 64
ABSORB_TOKENS = 8  # tokens per absorb block (ABSORB_TOKENS in the .cu)
ROPE_THREADS = 128  # a token block (ROPE_THREADS in the .cu)


def absorb_queries_reference(q_nope: torch.Tensor, w_uk: torch.Tensor, q_latent: torch.Tensor) -> None:
    """``q_latent[:, h] = q_nope[:, h] @ w_uk[h]``: ``[H, T, nope] x [H, nope, L] -> [H, T, L]``, into the view."""
    torch.bmm(q_nope.transpose(0, 1), w_uk, out=q_latent.transpose(0, 1))


def mla_rope_cache_reference(kv_a, weight, eps, cos, sin, q_pe, q_out, cache_rows, slot_mapping, q_nope=None,
                             w_uk=None, q_latent=None, rows_out=None) -> None:
    """The unfused torch form of :func:`mla_rope_cache` (same arguments)."""
    latent, k_pe = kv_a.split([weight.shape[0], kv_a.shape[-1] - weight.shape[0]], dim=-1)
    latent = rmsnorm_reference(latent, weight, eps)
    q_out.copy_(rope_reference(q_pe, cos, sin, interleaved=True))
    k_pe = rope_reference(k_pe.unsqueeze(1), cos, sin, interleaved=True).squeeze(1)
    rows = torch.cat([latent, k_pe], dim=-1).to(cache_rows.dtype)  # [T, L + R]
    cache_rows[slot_mapping] = rows
    if rows_out is not None:
        rows_out.copy_(rows)
    if w_uk is not None:
        absorb_queries_reference(q_nope, w_uk, q_latent)


def mla_rope_cache(kv_a: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   q_pe: torch.Tensor, q_out: torch.Tensor, cache_rows: torch.Tensor, slot_mapping: torch.Tensor,
                   q_nope: torch.Tensor | None = None, w_uk: torch.Tensor | None = None,
                   q_latent: torch.Tensor | None = None, rows_out: torch.Tensor | None = None) -> None:
    """Write the normalised latent and roped key of each token into its cache row; rope the queries; with
    ``w_uk``, write the absorbed queries too; with ``rows_out``, each token's row there as well.

    kv_a ``[T, L + R]`` (unit stride along the row), weight ``[L]`` (kv_a_layernorm), cos / sin ``[T, R/2]``,
    q_pe / q_out ``[T, H, R]`` (unit stride along R), cache_rows ``[rows, L + R]`` (one layer's pages, flattened),
    slot_mapping ``[T]`` int64. On CUDA a slot outside ``[0, rows)`` writes nothing (torch would wrap a negative one).
    q_nope ``[T, H, nope]``, w_uk ``[H, nope, L]`` (views of q_b_proj's output and kv_b_proj's weight), q_latent
    ``[T, H, L]`` (the attention's query buffer): all three or none. rows_out ``[T, L + R]`` (contiguous, the cache's
    dtype, kv_a's device): the rows again, in token order, whatever their slots (a prompt's keys for the plain prefill,
    with no gather from the cache).
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
    absorb = (q_nope, w_uk, q_latent)
    if any(t is not None for t in absorb):
        _check_absorb(q_nope, w_uk, q_latent, T, q_pe.shape[1], L)
    if rows_out is not None and (rows_out.shape != (T, D) or not rows_out.is_contiguous()
                                 or rows_out.dtype != cache_rows.dtype or rows_out.device != kv_a.device):
        raise ValueError(f"rows_out must be a contiguous {cache_rows.dtype} [T={T}, L + R={D}] on {kv_a.device}, got "
                         f"{rows_out.dtype} {tuple(rows_out.shape)} on {rows_out.device}")
    if not kv_a.is_cuda:
        return mla_rope_cache_reference(kv_a, weight, eps, cos, sin, q_pe, q_out, cache_rows, slot_mapping, *absorb,
                                        rows_out)
    _check_cuda(kv_a, weight, cos, sin, q_pe, q_out, cache_rows, slot_mapping, R)
    fold = w_uk is not None and _absorb_fits(q_nope, w_uk, q_latent, kv_a)
    if w_uk is not None and not fold:
        absorb_queries_reference(q_nope, w_uk, q_latent)
    if not T:
        return
    H, i64 = q_pe.shape[1], np.int64
    if fold:
        absorb_blocks = H * -(-L // 64) * -(-T // ABSORB_TOKENS)
        absorb_args = (q_nope, i64(q_nope.stride(0)), i64(q_nope.stride(1)), w_uk, i64(w_uk.stride(0)), q_latent,
                       i64(q_latent.stride(0)), i64(q_latent.stride(1)))
    else:  # no absorb blocks: null pointers (0), no strides
        absorb_blocks, absorb_args = 0, (0, i64(0), i64(0), 0, i64(0), 0, i64(0), i64(0))
    launch("mla_rope_cache", "mla_rope_cache", (T + absorb_blocks,), (ROPE_THREADS,),
           (kv_a, i64(kv_a.stride(0)), weight, cos, sin, q_pe, i64(q_pe.stride(0)), i64(q_pe.stride(1)), q_out,
            i64(q_out.stride(0)), i64(q_out.stride(1)), cache_rows, i64(cache_rows.shape[0]), slot_mapping,
            0 if rows_out is None else rows_out, np.int32(H), np.int32(L), np.int32(R), np.float32(eps), *absorb_args,
            np.int32(T)),
           device=kv_a.device,
           defines=(("DTYPE", DTYPES[kv_a.dtype]),) + ((("NOPE", q_nope.shape[2]),) if fold else ()))


def _check_absorb(q_nope, w_uk, q_latent, T, H, L):
    if q_nope is None or w_uk is None or q_latent is None:
        raise ValueError("mla_rope_cache's absorbed queries need q_nope, w_uk and q_latent together")
    if (q_nope.dim() != 3 or q_nope.shape[:2] != (T, H) or w_uk.shape != (H, q_nope.shape[2], L)
            or q_latent.shape != (T, H, L)):
        raise ValueError(f"q_nope must be [T={T}, H={H}, nope], w_uk [H, nope, L={L}] and q_latent [T, H, L]; got "
                         f"{tuple(q_nope.shape)}, {tuple(w_uk.shape)}, {tuple(q_latent.shape)}")


def _absorb_fits(q_nope, w_uk, q_latent, kv_a) -> bool:
    """Whether the launch writes the absorbed queries: few tokens, the kernel's dims, kv_a's dtype and device, a
    16-byte layout."""
    size = q_nope.element_size()
    vectors = (w_uk.stride(0), w_uk.stride(1), q_latent.stride(0), q_latent.stride(1))  # in elements
    return (q_nope.shape[0] <= ABSORB_MAX_T and q_nope.shape[2] % 16 == 0 and w_uk.shape[2] % 16 == 0
            and all(t.dtype == kv_a.dtype and t.device == kv_a.device for t in (q_nope, w_uk, q_latent))
            and q_nope.stride(2) == 1 and w_uk.stride(2) == 1 and q_latent.stride(2) == 1
            and w_uk.stride(1) == w_uk.shape[2] and all(v * size % 16 == 0 for v in vectors)
            and w_uk.data_ptr() % 16 == 0 and q_latent.data_ptr() % 16 == 0)


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
