"""RMSNorm: ``rmsnorm(x) = weight * (x * rsqrt(mean(x^2) + eps))``, normalised in fp32 and cast to ``x.dtype`` before
the weight multiplies it (as HF computes it).

A decoder layer's residual add is not here: each sublayer's last GEMM adds the stream into its output
(``model/layers.py``), so the norm after it reads one tensor and writes one (vLLM's and SGLang's fused add-RMSNorm
read two and write two: at 4096 K2 tokens 235 MB a norm against 118).

``out_k`` (optional): a second output, the normalised rows in the order of k the INT4 expert kernels read
(:func:`~kdray.kernels.w4a16_moe.expert_k_order`), which the MoE after the norm would otherwise write with a pass of
its own over x; 16-bit rows of a multiple of 128.

CUDA tensors of float32 / bfloat16 / float16 (weight of the same dtype) run ``cuda/rmsnorm.cu``: one block per
row, 16-byte accesses (with many rows up to ``NV`` per thread: a K2 row of 7168 bf16 in 224 threads), on torch's
current stream, no host sync (CUDA-graph capturable). Other inputs, CPU tensors and anything autograd must
differentiate (drafter training) run the torch reference below.
"""
from __future__ import annotations

import numpy as np
import torch

from kdray.kernels.cuda_module import as_rows, launch, sm_count, vector_elems

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NV = 4  # vectors per thread at most (NV in cuda/rmsnorm.cuh)
MAX_VECS = NV * 1024  # vectors per row: 1024 threads x NV


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, out_k: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """``[..., dim]`` -> ``[..., dim]``: the unfused torch form (``out_k`` filled by indexing)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(x.dtype)
    if out_k is not None:
        from kdray.kernels.w4a16_moe import expert_k_order

        out_k.copy_(out[..., expert_k_order(x.shape[-1]).to(x.device)])
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_k: torch.Tensor | None = None) -> torch.Tensor:
    """x ``[..., dim]``, weight ``[dim]`` -> ``[..., dim]``; also written into ``out_k`` (contiguous, x's shape and
    dtype) in the experts' k order when given."""
    _check(x, weight, out_k)
    if not _cuda_ok(x, weight):
        return rmsnorm_reference(x, weight, eps, out_k)
    return _launch(x, weight, eps, out_k)


def norm_threads(nvec: int, rows: int, device: torch.device) -> int:
    """Threads of a block normalising one row of ``nvec`` vectors (``cuda/rmsnorm.cuh``; the peer all-reduce's fused
    norm takes the same, so its block reduction, and its bits, are the same). Fewer rows than SMs (decode, small
    verify passes): a thread per access, the shortest path per row; more rows: the fewest warps that cover a row in
    NV accesses, more rows in flight per SM (a 16k-token K2 prefill's norms: 67% of the copy rate with 896-thread
    blocks; 1x0 K2 decode 3% slower with 224)."""
    per_thread = 1 if rows < sm_count(device.index) else NV
    return min(1024, (-(-nvec // per_thread) + 31) // 32 * 32)


def _check(x: torch.Tensor, weight: torch.Tensor, out_k: torch.Tensor | None = None):
    if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"x [..., dim] and weight [dim] disagree: {tuple(x.shape)} vs {tuple(weight.shape)}")
    if out_k is not None and (out_k.shape != x.shape or out_k.dtype != x.dtype or out_k.device != x.device
                              or not out_k.is_contiguous() or x.element_size() != 2 or x.shape[-1] % 128):
        raise ValueError(f"rmsnorm's out_k (the rows in the experts' k order) must be a contiguous {x.dtype} tensor "
                         f"of x's shape {tuple(x.shape)} on {x.device}, for 16-bit rows of a multiple of 128; got "
                         f"{out_k.dtype} {tuple(out_k.shape)} on {out_k.device}, contiguous {out_k.is_contiguous()}")


def _cuda_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype in DTYPES and weight.dtype == x.dtype and weight.device == x.device
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def _launch(x, weight, eps, out_k):
    dim = x.shape[-1]
    x2 = as_rows(x)
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [..., dim]
    vec = vector_elems(dim, [x2, weight, out.view(-1, dim)] + ([] if out_k is None else [out_k.view(-1, dim)]))
    if out_k is not None and vec != 8:
        raise ValueError(f"rmsnorm's out_k needs 16-byte aligned rows of x (got address % 16 = {x2.data_ptr() % 16}, "
                         f"row stride {x2.stride(0)})")
    nvec = dim // vec
    if nvec > MAX_VECS:
        raise ValueError(f"rmsnorm rows of {dim} elements exceed the kernel's {MAX_VECS * vec} (1024 threads x {NV} "
                         f"accesses of {vec}); normalise in chunks or extend NV in cuda/rmsnorm.cuh")
    rows = x2.shape[0]
    if rows:
        launch("rmsnorm", "rmsnorm", (rows,), (norm_threads(nvec, rows, x.device),),
               (x2, np.int64(x2.stride(0)), weight, out, 0 if out_k is None else out_k, np.int32(dim),
                np.float32(eps)),
               device=x.device, defines=(("DTYPE", DTYPES[x.dtype]), ("VEC", vec)))
    return out
