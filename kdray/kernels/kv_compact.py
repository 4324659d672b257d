"""Commit the accepted tree nodes' KV: move each accepted node's row into the sequence's next slot.

For every layer and sequence ``b``, for ``j`` in ``1 .. accept_len[b]-1``: the cache row at position
``prefix_lens[b] + j`` takes the old value of the row at ``prefix_lens[b] + accepted[b, j]`` (all reads
before writes, so a destination may be another entry's source). Position ``p`` of sequence ``b`` is
page ``block_table[b, p // S]``, row ``p % S``. Rows with ``accepted[b, j] == j`` stay where they are.
"""
from __future__ import annotations

import numpy as np
import torch

from kdray.kernels.cuda_module import launch

BLOCK = 256  # threads per (layer, sequence) in the CUDA kernel
MAX_SMEM = 227 * 1024  # opt-in shared memory per block on sm_90 (sm_80: 163 KB)


def kv_compact_reference(cache: torch.Tensor, block_table: torch.Tensor, prefix_lens: torch.Tensor,
                         accepted: torch.Tensor, accept_len: torch.Tensor) -> None:
    """Plain torch reference of :func:`kv_compact` (in place, any device)."""
    S = cache.shape[2]
    table = block_table.long()
    for b, (prefix, n) in enumerate(zip(prefix_lens.tolist(), accept_len.tolist())):
        if n <= 1:
            continue
        src = prefix + accepted[b, 1:n].long()  # [n-1] source positions
        dst = prefix + torch.arange(1, n, device=cache.device)  # [n-1] destination positions
        rows = cache[:, table[b, src // S], src % S].clone()  # [layers, n-1, R]: every read first
        cache[:, table[b, dst // S], dst % S] = rows


def _check(cache, block_table, prefix_lens, accepted, accept_len):
    if cache.dim() != 4:
        raise ValueError(f"cache must be [num_layers, P, S, R], got {tuple(cache.shape)}")
    B = prefix_lens.shape[0]
    for name, t, dims in (("block_table", block_table, 2), ("prefix_lens", prefix_lens, 1),
                          ("accepted", accepted, 2), ("accept_len", accept_len, 1)):
        if t.dtype != torch.int32 or t.dim() != dims or t.shape[0] != B:
            raise ValueError(f"{name} must be int32 with {dims} dims and batch {B}, got {t.dtype} {tuple(t.shape)}")
        if t.device != cache.device:
            raise ValueError(f"{name} is on {t.device} but the cache is on {cache.device}")


def _vector_bytes(row_bytes: int, cache: torch.Tensor) -> int:
    """Widest copy unit (16, 8, 4, 2 or 1 bytes) that divides the row and the cache's alignment."""
    return next(v for v in (16, 8, 4, 2, 1) if row_bytes % v == 0 and cache.data_ptr() % v == 0)


def kv_compact(cache: torch.Tensor, block_table: torch.Tensor, prefix_lens: torch.Tensor, accepted: torch.Tensor,
               accept_len: torch.Tensor) -> None:
    """In place on ``cache [num_layers, P, S, R]`` (any dtype; view GQA caches as ``[layers, P, S, -1]``).

    block_table ``[B, max_pages]`` int32, prefix_lens ``[B]`` int32, accepted ``[B, A]`` int32 (node
    indices, ``accepted[b, j] >= j``), accept_len ``[B]`` int32 (<= A).
    """
    _check(cache, block_table, prefix_lens, accepted, accept_len)
    if not cache.is_cuda:
        return kv_compact_reference(cache, block_table, prefix_lens, accepted, accept_len)
    if not all(t.is_contiguous() for t in (cache, block_table, prefix_lens, accepted, accept_len)):
        raise ValueError("kv_compact's CUDA path needs contiguous tensors")
    layers, P, S, R = cache.shape
    B, A = accepted.shape
    row_bytes = R * cache.element_size()
    vec = _vector_bytes(row_bytes, cache)
    smem = 16 * A + (A - 1) * row_bytes  # row offsets, then every moved row staged before the writes
    if smem > MAX_SMEM:
        raise ValueError(f"{A - 1} rows of {row_bytes} bytes exceed the {MAX_SMEM}-byte staging buffer")
    if B and layers and A > 1:
        launch("kv_compact", "kv_compact", grid=(B, layers), block=(BLOCK,),
               args=(cache, block_table, prefix_lens, accepted, accept_len, np.int64(P * S * row_bytes // vec),
                     np.int32(S), np.int32(row_bytes // vec), np.int32(block_table.shape[1]), np.int32(A)),
               shared_mem=smem, device=cache.device, defines=(("VEC", vec),))
