"""``y = x W^T`` for one or two tokens (decode): ``skinny_linear``; and per group, ``skinny_bmm``.

At a token or two a projection is a weight stream: cuBLAS picks split-K GEMMs plus a reduce kernel for K2's shard
projections (issue 12). ``cuda/skinny_linear.cu`` streams the weights at 16 bytes per lane, two rows per warp,
with K split across the blocks of a thread-block cluster so that even 576 output rows fill the GPU, and the
cluster's first block adding the partial sums from the others' shared memory (one launch, no host sync, no global
scratch, capturable in a CUDA graph). fp32 accumulation, one rounding, as cuBLAS's bf16 GEMM does. Clusters need
sm_90; on earlier GPUs a projection whose K would be split runs on cuBLAS (``kernel_splits``).

The output is x's dtype, or fp32 (the MoE router's logits: 16-bit operands, fp32 sums); ``accumulate`` adds the
product into ``out`` instead (a decoder layer's residual stream: see ``model/layers.py``). The kernel compiles for up
to 8 rows of ``x`` (``M_ROWS``), but beats cuBLAS at 1-2 rows only: alone on the H200 (``benchmarks/bench_linear.py``
with more rows allowed, 2026-12-03) 1.0-1.6x at 2 rows, 0.6-1.1x at 8; in K2's graphed TP8-shard pass on an H100
(2026-12-06, alternated) 2 tokens 6.50 -> 6.17 ms, 3 tokens -0.9% in one call and +0.2% in another, 4 tokens 7.44
-> 7.75, and 8 tokens 9.7 -> 11.0 on the H200 (2026-12-03); so ``MAX_ROWS`` is 2. CUDA bf16 / fp16 inputs with at
most ``MAX_ROWS`` rows, ``K % 256 == 0`` and 16-byte aligned rows take the kernel; everything else (and the
reference) is ``F.linear``, or cuBLAS's fp32-output GEMM.

``skinny_bmm`` is the same kernel over groups: output rows of group g read x's row g and weight group g, as
``torch.bmm`` of ``[G, T, K]`` by ``[G, K, R]``: MLA's W_UV product per head at a token or two (one: 2.2 us on K2's
shard against torch.bmm's 4.8, a cuBLAS kernel, which the next one cannot start behind).
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kdray.kernels.cuda_module import launch, sm90_or_later, sm_count

MAX_ROWS = 2  # rows of x that take the kernel (see above)
ROWS_PER_BLOCK = 16  # WARPS * RPW in the .cu
RPW = 2  # weight rows per warp in the .cu: a group of skinny_bmm holds whole warps
THREADS = 256  # 32 * WARPS in the .cu
K_STEP = 256  # elements of K one warp covers per step
WAVES = 4  # blocks per SM the K split aims for
MAX_SPLIT = 8  # blocks of a cluster (the portable limit): the K split's largest
DTYPES = {torch.bfloat16: 1, torch.float16: 2}


def skinny_linear_reference(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, w)
    if x.is_cuda:  # 16-bit operands, fp32 sums and output
        return torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=out_dtype).view(*x.shape[:-1], w.shape[0])
    return F.linear(x.to(out_dtype), w.to(out_dtype))


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``x [..., K] @ w [N, K]^T`` takes the kernel."""
    K = w.shape[-1]
    rows = x.numel() // K if K else 0
    return (x.is_cuda and x.dtype in DTYPES and w.dtype == x.dtype and 0 < rows <= MAX_ROWS and K % K_STEP == 0
            and x.shape[-1] == K and w.is_contiguous() and w.data_ptr() % 16 == 0
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def skinny_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
                  out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """x ``[..., K]``, w ``[N, K]`` -> ``[..., N]`` in ``out_dtype``: x's dtype (None) or float32; written into
    ``out`` (contiguous, x's dtype) when given, else into a new tensor. With ``accumulate``, ``out += x W^T``:
    out's values join the fp32 sums before their one rounding (a GEMM's beta = 1; in place, no copy)."""
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"skinny_linear's out_dtype is x's dtype ({x.dtype}) or torch.float32, got {out_dtype}")
    N, K = w.shape
    if out is not None and (out_dtype not in (None, x.dtype) or out.dtype != x.dtype or not out.is_contiguous()
                            or out.shape != (*x.shape[:-1], N) or out.device != x.device):
        raise ValueError(f"skinny_linear's out must be a contiguous {x.dtype} tensor of shape "
                         f"{(*x.shape[:-1], N)} on {x.device}, got {out.dtype} {tuple(out.shape)} on {out.device} "
                         f"(contiguous: {out.is_contiguous()}), with out_dtype None")
    if accumulate and out is None:
        raise ValueError("skinny_linear's accumulate adds into out: give out")
    splits = kernel_splits(*w.shape, x.device) if fits(x, w) and (out is None or out.data_ptr() % 16 == 0) else 0
    if not splits:
        if out is None:
            return skinny_linear_reference(x, w, out_dtype)
        if accumulate:
            out.view(-1, N).addmm_(x.reshape(-1, K), w.t())
        else:
            torch.mm(x.reshape(-1, K), w.t(), out=out.view(-1, N))
        return out
    x2 = x.reshape(-1, K)
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    fp32_out = out_dtype == torch.float32
    y = torch.empty(x2.shape[0], N, dtype=torch.float32 if fp32_out else x.dtype, device=x.device) \
        if out is None else out.view(-1, N)  # [M, N]
    _launch(x2, w, y, N, K, splits, group_rows=N, w_pitch=N, fp32_out=fp32_out, accumulate=accumulate)
    return y.view(*x.shape[:-1], N) if out is None else out


def skinny_bmm_reference(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
    return out


def bmm_fits(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``skinny_bmm(x [T, G, K], w [G, R, K], out [T, G, R])`` takes the kernel."""
    if x.dim() != 3 or w.dim() != 3:
        return False
    T, G, K = x.shape
    R = w.shape[1]
    return (x.is_cuda and x.dtype in DTYPES and w.dtype == x.dtype == out.dtype and 0 < T <= MAX_ROWS
            and K % K_STEP == 0 and w.shape == (G, R, K) and R % RPW == 0 and out.shape == (T, G, R)
            and x.is_contiguous() and out.is_contiguous() and w.stride(2) == 1 and w.stride(1) == K
            and w.stride(0) % K == 0 and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def skinny_bmm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[t, g] = w[g] @ x[t, g]``: x ``[T, G, K]``, w ``[G, R, K]`` (rows contiguous; groups any multiple of K
    apart, as a view of a larger weight), out ``[T, G, R]``; returns out."""
    splits = kernel_splits(w.shape[0] * w.shape[1], w.shape[2], x.device) if bmm_fits(x, w, out) else 0
    if not splits:
        return skinny_bmm_reference(x, w, out)
    G, R, K = w.shape
    _launch(x, w, out, G * R, K, splits, group_rows=R, w_pitch=w.stride(0) // K, fp32_out=False, accumulate=False)
    return out


def kernel_splits(N: int, K: int, device: torch.device) -> int:
    """The K split of N x K on ``device`` (a CUDA tensor's, so indexed; ``k_splits``), or 0 where it splits K and the
    device has no thread-block clusters (before sm_90): cuBLAS then."""
    splits = k_splits(math.ceil(N / ROWS_PER_BLOCK), K // K_STEP, sm_count(device.index))
    return splits if splits == 1 or sm90_or_later(device.index) else 0


def _launch(x, w, y, N: int, K: int, splits: int, group_rows: int, w_pitch: int, fp32_out: bool, accumulate: bool):
    """The kernel over output rows N (groups of ``group_rows`` rows, ``w_pitch`` weight rows apart), K split over
    ``splits`` blocks, one cluster a row group; ``accumulate``: y += the product."""
    launch("skinny_linear", "skinny_linear", (math.ceil(N / ROWS_PER_BLOCK), splits), (THREADS,),
           (x, w, y, np.int32(N), np.int32(K), np.int32(group_rows), np.int32(w_pitch)), device=x.device,
           defines=(("DTYPE", DTYPES[x.dtype]), ("M_ROWS", x.shape[0]), ("CLUSTER", splits))
           + ((("OUT_F32", 1),) if fp32_out else ()) + ((("ACCUMULATE", 1),) if accumulate else ()))


def k_splits(groups: int, steps: int, sm_count: int) -> int:
    """The K split: the largest divisor of the K steps that keeps the grid within ``WAVES`` blocks per SM and a
    cluster within ``MAX_SPLIT`` blocks."""
    cap = min(MAX_SPLIT, max(1, WAVES * sm_count // groups))
    return max(d for d in range(1, steps + 1) if steps % d == 0 and d <= cap)
