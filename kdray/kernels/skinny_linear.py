"""``y = x W^T`` for a few tokens: ``skinny_linear``.

At decode and small verify steps a projection is a matrix-vector product bounded by the weight's bytes; cuBLAS
runs K2's shard projections at 1-32 tokens near 1.5 TB/s (few output tiles, split K). The CUDA kernel
(``cuda/skinny_linear.cu``) gives each 16 output rows a block whose 16 warps split K and stream the weight from
HBM into registers, the tokens riding as the columns of a tensor-core mma.

bf16 CUDA inputs with 1 to ``MAX_TOKENS`` tokens, ``N % 16 == 0``, ``K % 32 == 0`` and 16-byte aligned rows run the
kernel (on torch's current stream, no host sync); everything else runs the torch reference below. ``out_dtype``
float32 keeps the fp32 sums unrounded (the router's logits).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kdray.kernels.cuda_module import launch

MAX_TOKENS = 32  # 4 n8 tiles of the mma
THREADS = 512  # SL_WARPS = 16 in the .cu


def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
                            ) -> torch.Tensor:
    """The torch form: ``F.linear``; with an fp32 ``out_dtype`` the product of fp32 operands (on a GPU, of the
    16-bit operands with fp32 accumulation)."""
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, weight)
    if out_dtype != torch.float32:
        raise ValueError(f"out_dtype must be x's dtype or float32, got {out_dtype}")
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and x.dim() == 2:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x ``[T, K]``, weight ``[N, K]`` -> ``[T, N]`` in ``out_dtype`` (default ``x.dtype``)."""
    if not _kernel_ok(x, weight, out_dtype):
        return skinny_linear_reference(x, weight, out_dtype)
    T, K = x.shape
    N = weight.shape[0]
    y = torch.empty(T, N, dtype=out_dtype or x.dtype, device=x.device)  # [T, N]
    launch("skinny_linear", "skinny_linear", (N // 16,), (THREADS,),
           (x, np.int64(x.stride(0)), np.int32(T), weight, y, np.int32(N), np.int32(K)), device=x.device,
           defines=(("NT", (T + 7) // 8), ("OUT_F32", int(y.dtype == torch.float32))))
    return y


def _kernel_ok(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None) -> bool:
    if not (x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == x.dtype and weight.device == x.device
            and x.dim() == 2 and weight.dim() == 2 and out_dtype in (None, x.dtype, torch.float32)):
        return False
    (T, K), N = x.shape, weight.shape[0]
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return (1 <= T <= MAX_TOKENS and weight.shape[1] == K and N % 16 == 0 and K % 32 == 0 and x.stride(1) == 1
            and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 and weight.is_contiguous()
            and weight.data_ptr() % 16 == 0 and not grad)
