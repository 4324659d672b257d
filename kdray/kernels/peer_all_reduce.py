"""One-shot all-reduce over peer buffers, alone or fused with the RMSNorm after it.

A tensor-parallel layer ends in an all-reduce of a few rows (one token's hidden state is 14 KiB for K2): latency,
not bandwidth. Each rank copies its rows into a buffer that every rank has mapped (CUDA IPC; plain loads and stores
over NVLink, never multicast), flags each rank, waits for their flags, and sums the ranks' rows in rank order in
fp32, rounded once: every rank gets the same bits (at two ranks, NCCL's). With a norm weight the kernel also
normalises each row as ``kernels/cuda/rmsnorm.cu`` does, so the norm equals ``rmsnorm(reduced, weight, eps)`` bit
for bit (a decoder layer's residual is already in rank 0's part: ``model/layers.py``). One launch of
``cuda/peer_all_reduce.cu`` on torch's current stream, no host sync (CUDA-graph capturable: the call counts live in
the buffers).

``bases`` holds every rank's buffer address in this process (its own included); each buffer is
:func:`buffer_bytes` long and zeroed before first use (``kdray/actors/peer_memory.py`` makes them).
"""
from __future__ import annotations

import numpy as np
import torch

from kdray.kernels.cuda_module import as_rows, launch, vector_elems
from kdray.kernels.rmsnorm import DTYPES, MAX_VECS, norm_threads, rmsnorm_reference

BLOCKS = 32  # blocks of every launch (BLOCKS in the .cu)
MAX_WORLD = 8  # ranks at most (MAX_WORLD in the .cu)
HEADER = 4096  # bytes of flags and call counts before the rows (HEADER in the .cu)


def buffer_bytes(max_bytes: int) -> int:
    """Bytes of one rank's buffer for messages of up to ``max_bytes``: the header and two halves."""
    return HEADER + 2 * max_bytes


def peer_all_reduce_reference(parts: list[torch.Tensor], weight: torch.Tensor | None = None, eps: float = 0.0):
    """Every rank's ``[rows, dim]`` part summed in rank order in fp32 and rounded once; with ``weight``,
    (``rmsnorm(sum)``, sum)."""
    s = parts[0].float()
    for p in parts[1:]:  # rank order
        s = s + p.float()
    s = s.to(parts[0].dtype)
    if weight is None:
        return s
    return rmsnorm_reference(s, weight, eps), s


def peer_all_reduce(bases: torch.Tensor, rank: int, max_bytes: int, x: torch.Tensor,
                    weight: torch.Tensor | None = None, eps: float = 0.0):
    """x ``[..., dim]`` (this rank's part) -> the sum over the ranks ``[..., dim]``; with ``weight`` ->
    (``rmsnorm(sum)``, sum). Every rank must make the same calls in the same order with the same shapes."""
    world = bases.numel()
    if not 1 <= world <= MAX_WORLD or not 0 <= rank < world:
        raise ValueError(f"peer all-reduce takes 1 to {MAX_WORLD} ranks, got rank {rank} of {world}")
    if not x.is_cuda or x.dtype not in DTYPES or bases.device != x.device or bases.dtype != torch.int64:
        raise ValueError(f"peer all-reduce needs a CUDA float32/bfloat16/float16 x and int64 bases on its device, "
                         f"got x {x.dtype} on {x.device}, bases {bases.dtype} on {bases.device}")
    if x.numel() * x.element_size() > max_bytes:
        raise ValueError(f"peer all-reduce of {tuple(x.shape)} {x.dtype} ({x.numel() * x.element_size()} bytes) "
                         f"exceeds the buffers' {max_bytes} bytes; use the NCCL path for it")
    dim = x.shape[-1]
    x2 = as_rows(x)  # [rows, dim]
    reduced = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [..., dim]: the sum
    tensors = [x2, reduced.view(-1, dim)]
    normed = None
    if weight is not None:
        if weight.shape != (dim,) or weight.dtype != x.dtype:
            raise ValueError(f"peer all-reduce: weight {tuple(weight.shape)} {weight.dtype} must match x's rows "
                             f"({dim} of {x.dtype})")
        normed, weight = torch.empty_like(reduced), weight.contiguous()  # [..., dim]
        tensors += [normed.view(-1, dim), weight.view(1, dim)]
    vec = vector_elems(dim, tensors)
    nvec = dim // vec
    if vec * x.element_size() != 16 or nvec > MAX_VECS:
        raise ValueError(f"peer all-reduce needs rows of a multiple of 16 bytes, 16-byte aligned, of at most "
                         f"{MAX_VECS} vectors; got dim {dim} of {x.dtype}")
    rows = x2.shape[0]
    if rows:
        launch("peer_all_reduce", "peer_all_reduce", (BLOCKS,), (norm_threads(nvec, rows, x.device),),
               (bases, np.int32(rank), np.int32(world), np.int64(max_bytes // x.element_size()),
                x2, np.int64(x2.stride(0)), np.int32(rows), np.int32(dim), reduced,
                0 if weight is None else weight, 0 if normed is None else normed, np.float32(eps)),
               device=x.device, defines=(("DTYPE", DTYPES[x.dtype]), ("VEC", vec)))
    return reduced if weight is None else (normed, reduced)
