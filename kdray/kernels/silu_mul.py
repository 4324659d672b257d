"""SwiGLU's gate in one pass: ``silu_mul(x) = silu(x[..., :I]) * x[..., I:]`` for ``x [..., 2I]``.

CUDA tensors of float32 / bfloat16 / float16 run ``cuda/silu_mul.cu`` (16-byte accesses, torch's current stream,
no host sync), rounding as the torch form does (SiLU cast to the dtype, then the product); others (and inputs
autograd must differentiate) run the reference below, the unfused torch code.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kdray.kernels.cuda_module import as_rows, launch, vector_elems
from kdray.kernels.rmsnorm import DTYPES


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x ``[..., 2I]`` -> ``[..., I]``."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"silu_mul needs an even last dim (gate and up halves), got {tuple(x.shape)}")
    if not x.is_cuda or x.dtype not in DTYPES or (torch.is_grad_enabled() and x.requires_grad):
        return silu_mul_reference(x)
    I = x.shape[-1] // 2
    x2 = as_rows(x)  # [rows, 2I]
    out = torch.empty(*x.shape[:-1], I, dtype=x.dtype, device=x.device)  # [..., I]
    vec = vector_elems(I, [x2, out.view(-1, I)])
    n = x2.shape[0] * I // vec
    if n:
        launch("silu_mul", "silu_mul", (min(65535, math.ceil(n / 256)),), (256,),
               (x2, np.int64(x2.stride(0)), out, np.int64(x2.shape[0]), np.int32(I)), device=x.device,
               defines=(("DTYPE", DTYPES[x.dtype]), ("VEC", vec)))
    return out
