"""``y = x W^T`` for a single token (decode): ``skinny_linear``.

At one token a projection is a weight stream: cuBLAS picks split-K GEMMs plus a reduce kernel for K2's shard
projections (issue 12). ``cuda/skinny_linear.cu`` streams the weights at 16 bytes per lane, two rows per warp,
with K split across blocks so that even 576 output rows fill the GPU, and the last block of each row group adding
the partial sums (one launch, no host sync, capturable in a CUDA graph). fp32 accumulation, one rounding, as
cuBLAS's bf16 GEMM does.

The output is x's dtype, or fp32 (the MoE router's logits: 16-bit operands, fp32 sums). The kernel compiles for up
to 8 rows of ``x`` (``M_ROWS``), but on the H200 it beats cuBLAS at one row only (``benchmarks/bench_linear.py``: at
8 rows cuBLAS is 1.4-2x faster, and with an fp32 output 1.25x), so ``MAX_ROWS`` is 1. CUDA bf16 / fp16 inputs with
at most ``MAX_ROWS`` rows, ``K % 256 == 0`` and 16-byte aligned rows take the kernel; everything else (and the
reference) is ``F.linear``, or cuBLAS's fp32-output GEMM.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kdray.kernels.cuda_module import launch, sm_count

MAX_ROWS = 1  # rows of x that take the kernel (H200: cuBLAS wins at 8)
ROWS_PER_BLOCK = 16  # WARPS * RPW in the .cu
THREADS = 256  # 32 * WARPS in the .cu
K_STEP = 256  # elements of K one warp covers per step
WAVES = 4  # blocks per SM the K split aims for
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


def skinny_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x ``[..., K]``, w ``[N, K]`` -> ``[..., N]`` in ``out_dtype``: x's dtype (None) or float32."""
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"skinny_linear's out_dtype is x's dtype ({x.dtype}) or torch.float32, got {out_dtype}")
    if not fits(x, w):
        return skinny_linear_reference(x, w, out_dtype)
    N, K = w.shape
    x2 = x.reshape(-1, K)
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    M, dev = x2.shape[0], x.device
    fp32_out = out_dtype == torch.float32
    y = torch.empty(M, N, dtype=torch.float32 if fp32_out else x.dtype, device=dev)  # [M, N]
    groups = math.ceil(N / ROWS_PER_BLOCK)
    splits = k_splits(groups, K // K_STEP, sm_count(dev.index))
    work = torch.empty(splits, M, N, dtype=torch.float32, device=dev) if splits > 1 else y  # [S, M, N] partials
    tickets = _tickets(w) if splits > 1 else y
    launch("skinny_linear", "skinny_linear", (groups, splits), (THREADS,),
           (x2, w, y, work, tickets, np.int32(N), np.int32(K)), device=dev,
           defines=(("DTYPE", DTYPES[x.dtype]), ("M_ROWS", M)) + ((("OUT_F32", 1),) if fp32_out else ()))
    return y.view(*x.shape[:-1], N)


def k_splits(groups: int, steps: int, sm_count: int) -> int:
    """The K split: the largest divisor of the K steps that keeps the grid within ``WAVES`` blocks per SM."""
    cap = max(1, WAVES * sm_count // groups)
    return max(d for d in range(1, steps + 1) if steps % d == 0 and d <= cap)


_TICKETS: dict[tuple[int, int], torch.Tensor] = {}


def _tickets(w: torch.Tensor) -> torch.Tensor:
    """The weight's row-group tickets (zero between launches; each launch's last blocks zero them again). One set
    per weight: launches over one weight run in stream order. Made at the weight's first (eager) use: memory taken
    inside a graph capture would belong to that graph's pool."""
    key = (w.data_ptr(), w.shape[0])
    t = _TICKETS.get(key)
    if t is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_linear's first use of a weight is inside a CUDA graph capture; run the "
                               "captured function eagerly once first")
        t = _TICKETS[key] = torch.zeros(math.ceil(w.shape[0] / ROWS_PER_BLOCK), dtype=torch.int32, device=w.device)
    return t
