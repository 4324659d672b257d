"""Tree-verify attention: each sequence's queries over its paged prefix plus the tree's own keys.

Shared contract of both forms (one call covers a whole batch of sequences):

- ``cu_q [B+1]`` int32: the queries of sequence ``b`` are rows ``cu_q[b]:cu_q[b+1]`` of ``q``.
- ``prefix_lens [B]`` int32: cache positions ``0 .. prefix_lens[b]-1`` hold the committed prefix and
  are visible to every query of the sequence.
- The key/value of query ``i`` (local index) is already written at cache position
  ``prefix_lens[b] + i``; cache position ``p`` lives at page ``block_table[b, p // S]``, row ``p % S``.
- ``tree_mask [B, Qmax, W]`` int32: bit ``j % 32`` of word ``j // 32`` of row ``i`` says that query ``i``
  sees the tree token ``j`` (its ancestors and itself).

MLA latent form (absorbed DeepSeek-V3 attention, one KV head):
``q [T, H, Dk]`` (``Dk`` = kv_lora_rank + rope dims, 576 for K2), ``kv_cache [P, S, Dk]``; keys are the
whole cached row, values its first ``Dv`` = kv_lora_rank entries; output ``[T, H, Dv]``.

GQA form (Llama family): ``q [T, Hq, D]``, ``kv_cache [P, S, 2, Hkv, D]`` (keys then values);
output ``[T, Hq, D]``; query head ``h`` reads KV head ``h // (Hq / Hkv)``.

CUDA tensors run the kernels in ``cuda/tree_verify_attention.cu`` (tensor cores for bf16 with the head dims
in ``_MMA``, a CUDA-core fallback for fp32 and other dims); one launch (two with key splits merged by
``tva_combine``), no host sync, one allocation (the output), so a verify step can be captured in a CUDA graph. CPU
tensors run the torch reference below.

Key splits (flash-decoding, tensor-core path). With few 64-row tiles (one query of K2: 8 heads, 1 tile) the grid
gives each tile up to ``n_splits`` CTAs, as many as fill the GPU once, and with a few waves of tiles as many as fill
the last wave (``_num_splits``; MLA at one query a sequence, no fewer than two key tiles a split), each streaming an
equal run of the sequence's key tiles and writing a partial;
``tva_combine`` then merges each row's partials, a warp per (row, 32-256 value columns). Both halves are spread over
the GPU because one SM moves only tens of GB/s. On sm_90 the MLA kernel's splits merge inside it instead
(``_CLUSTER_KERNELS``) wherever the grid's splits make whole clusters of one of ``CLUSTER_SIZES`` blocks that are all
resident at once (the largest such size) and few enough a tile (``MERGE_BLOCK_BYTES``): the blocks of a cluster merge
its splits through distributed shared memory, each block its share of the value columns, and with several clusters
the one that takes the last of a per-tile ticket merges their partials, so no second launch follows; or, with
``unmerged`` (a token or two: K2's W_UV product then runs on ``skinny_bmm``), the clusters leave their partials to that
product, which merges them as it loads them, and the kernel ends without the fence, the ticket and that merge (H100,
K2 TP8 at one query after 4096 keys: its in-kernel timeline spent 1.5 us in the ticket and 1.4 in the last merge;
one query 4.860 -> 4.750 ms a graphed pass, two sequences 5.92 -> 5.82). Measured on the
H200 at one K2 query after 4096 keys, an earlier form, where the tile's last CTA merged 22 partials alone after each
split had streamed 3 key tiles, spent 6.3 us in those tiles and 5.7 us in that merge, and trees spent 4-7 us writing
their partials 4 bytes at a time; the partials leave through shared memory as 16-byte stores
(``benchmarks/results/tree-attention-2026-12-02-h200-session16.txt``).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kdray.kernels.cuda_module import launch, max_active_clusters, sm90_or_later, sm_count


def _visible(tree_mask_b: torch.Tensor, prefix: int, q_len: int) -> torch.Tensor:
    """``[q_len, prefix + q_len]`` bool visibility of cache positions for one sequence."""
    j = torch.arange(q_len, device=tree_mask_b.device)
    words = tree_mask_b[:q_len, j // 32]  # [q_len, q_len]
    tree = ((words >> (j % 32).to(words.dtype)) & 1).bool()
    return torch.cat([torch.ones(q_len, prefix, dtype=torch.bool, device=tree.device), tree], dim=1)


def _gather_rows(cache: torch.Tensor, pages: torch.Tensor, n: int) -> torch.Tensor:
    """Rows ``0..n-1`` of one sequence from a paged ``[P, S, ...]`` cache -> ``[n, ...]``."""
    page_size = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    return cache[pages[pos // page_size].long(), pos % page_size]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """q ``[Q, Hkv, G, Dk]``, k ``[K, Hkv, Dk]``, v ``[K, Hkv, Dv]``, visible ``[Q, K]`` -> ``[Q, Hkv, G, Dv]`` (fp32)."""
    scores = torch.einsum("qhgd,khd->hgqk", q.float(), k.float()) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hgqk,khd->qhgd", scores.softmax(-1), v.float())


def _check(q, block_table, prefix_lens, cu_q, tree_mask):
    B = prefix_lens.shape[0]
    if cu_q.shape != (B + 1,) or block_table.shape[0] != B or tree_mask.shape[0] != B:
        raise ValueError(f"batch mismatch: prefix_lens {tuple(prefix_lens.shape)}, cu_q {tuple(cu_q.shape)}, "
                         f"block_table {tuple(block_table.shape)}, tree_mask {tuple(tree_mask.shape)}")
    if tree_mask.dtype != torch.int32 or tree_mask.shape[2] * 32 < tree_mask.shape[1]:
        raise ValueError(f"tree_mask must be int32 [B, Qmax, ceil(Qmax/32)], got {tree_mask.dtype} "
                         f"{tuple(tree_mask.shape)}")


class SplitPartials(NamedTuple):
    """An attention output left as the unmerged partials of its key splits (``mla_tree_attention(unmerged=True)``):
    ``o [P, T, H, Dv]``, each partial normalised by its own sum, and ``ml [P, T, H, 2]`` fp32, each partial's (max of
    its scaled scores in log2 units, sum); a partial of sum 0 holds no key and its ``o`` is not written. The output is
    ``sum_p w_p o_p / sum_p w_p`` with ``w_p = l_p 2^(max_p - the largest max)``, ``l_p`` partial p's sum
    (``merge_split_partials``)."""
    o: torch.Tensor
    ml: torch.Tensor


def merge_split_partials(p: SplitPartials) -> torch.Tensor:
    """The output ``[T, H, Dv]`` (o's dtype) of split partials, in fp32 (the reference of the kernels' merges)."""
    m, l = p.ml.unbind(-1)  # [P, T, H] each
    top = m.amax(0)
    w = torch.where(l > 0, l * torch.exp2(m - torch.where(top == float("-inf"), 0.0, top)), 0.0)  # [P, T, H]
    acc = torch.where(w[..., None] > 0, w[..., None] * p.o.float(), 0.0).sum(0)
    total = w.sum(0)[..., None]
    return torch.where(total > 0, acc / total, 0.0).to(p.o.dtype)


def tree_attention_reference(q, kv_cache, block_table, prefix_lens, cu_q, tree_mask, scale, kv_split):
    """Plain torch reference for both forms; ``kv_split(rows) -> (k [n, Hkv, Dk], v [n, Hkv, Dv])``."""
    outs = []
    cu = cu_q.tolist()
    prefixes = prefix_lens.tolist()
    for b in range(len(prefixes)):
        q_len, prefix = cu[b + 1] - cu[b], prefixes[b]
        if q_len == 0:
            continue
        k, v = kv_split(_gather_rows(kv_cache, block_table[b], prefix + q_len))
        qb = q[cu[b]:cu[b + 1]]
        qb = qb.reshape(q_len, k.shape[1], qb.shape[1] // k.shape[1], qb.shape[2])
        out = _attend(qb, k, v, _visible(tree_mask[b], prefix, q_len), scale)
        outs.append(out.reshape(q_len, -1, v.shape[-1]))
    return torch.cat(outs).to(q.dtype) if outs else q.new_empty(0, q.shape[1], 0)


def mla_tree_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                       prefix_lens: torch.Tensor, cu_q: torch.Tensor, tree_mask: torch.Tensor,
                       scale: float, kv_lora_rank: int, out: torch.Tensor | None = None,
                       early_prefix: bool = False, longest: int | None = None,
                       unmerged: bool = False) -> torch.Tensor | SplitPartials:
    """MLA latent tree attention: q ``[T, H, Dk]``, kv_cache ``[P, S, Dk]`` -> ``[T, H, kv_lora_rank]``.

    ``out`` (CUDA only, optional): a contiguous ``[T, H, kv_lora_rank]`` tensor of q's dtype to write into.
    ``early_prefix`` (CUDA only): the caller promises that ``block_table``, ``prefix_lens``, ``cu_q`` and the
    prefix rows of ``kv_cache`` were final before the kernel ahead on the stream began (true inside a model pass,
    where only the tree's own rows are written); the kernel's CTAs then start copying prefix rows while that
    kernel still runs (programmatic dependent launch, in a CUDA graph). q and the tree's rows are read after it.
    ``longest`` (CUDA only, optional): the most queries one sequence has, which spreads a ragged batch's keys better
    (:func:`_grid_splits`).
    ``unmerged`` (CUDA only): where the launch merges its key splits inside the kernel in clusters, 2 to
    ``MAX_UNMERGED`` of them a tile, return the clusters' partials (``SplitPartials``) for the next kernel to merge as
    it loads them (``skinny_bmm``), instead of merging them here; else (and where ``out`` is given) the output.
    """
    _check(q, block_table, prefix_lens, cu_q, tree_mask)
    if q.shape[-1] != kv_cache.shape[-1]:
        raise ValueError(f"q head dim {q.shape[-1]} != cached row {kv_cache.shape[-1]}")
    if q.is_cuda:
        if kv_cache.dim() != 3 or not 0 < kv_lora_rank <= kv_cache.shape[-1]:
            raise ValueError(f"kv_cache must be [P, S, Dk] with kv_lora_rank <= Dk, got {tuple(kv_cache.shape)} "
                             f"and kv_lora_rank={kv_lora_rank}")
        return _tree_attention_cuda(q, kv_cache, block_table, prefix_lens, cu_q, tree_mask, scale, kv_heads=1,
                                    dv=kv_lora_rank, row_stride=kv_cache.shape[-1], v_off=0, out=out,
                                    early_prefix=early_prefix, longest=longest, unmerged=unmerged and out is None)
    split = lambda rows: (rows.unsqueeze(1), rows[:, None, :kv_lora_rank])  # noqa: E731
    return tree_attention_reference(q, kv_cache, block_table, prefix_lens, cu_q, tree_mask, scale, split)


def gqa_tree_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                       prefix_lens: torch.Tensor, cu_q: torch.Tensor, tree_mask: torch.Tensor,
                       scale: float, out: torch.Tensor | None = None, longest: int | None = None) -> torch.Tensor:
    """GQA tree attention: q ``[T, Hq, D]``, kv_cache ``[P, S, 2, Hkv, D]`` -> ``[T, Hq, D]``.

    ``out``, ``longest``: as :func:`mla_tree_attention` takes them.
    """
    _check(q, block_table, prefix_lens, cu_q, tree_mask)
    if q.shape[1] % kv_cache.shape[3]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {kv_cache.shape[3]} KV heads")
    if q.is_cuda:
        if kv_cache.dim() != 5 or kv_cache.shape[2] != 2 or kv_cache.shape[4] != q.shape[2]:
            raise ValueError(f"kv_cache must be [P, S, 2, Hkv, {q.shape[2]}], got {tuple(kv_cache.shape)}")
        hkv, d = kv_cache.shape[3], kv_cache.shape[4]
        return _tree_attention_cuda(q, kv_cache, block_table, prefix_lens, cu_q, tree_mask, scale, kv_heads=hkv,
                                    dv=d, row_stride=2 * hkv * d, v_off=hkv * d, out=out, longest=longest)
    split = lambda rows: (rows[:, 0], rows[:, 1])  # noqa: E731
    return tree_attention_reference(q, kv_cache, block_table, prefix_lens, cu_q, tree_mask, scale, split)


# --- CUDA launch (kernels in cuda/tree_verify_attention.cu) -------------------------------------------------
#
# bf16 with a head-dim pair below runs the tensor-core kernel: grid (64-row tiles, key splits, KV heads); a
# sequence's ceil(q_len * G / 64) tiles are numbered consecutively, so ceil(T * G / 64) + min(B, T) - 1 tiles
# always suffice and the surplus CTAs return at once. With n_splits > 1 the partials (bf16 [n_splits, T*Hq, Dv]
# normalised by their own row sums, plus fp32 [n_splits, T*Hq] (max, sum) pairs) share the output's single
# allocation and tva_combine merges them. Everything else (fp32; other head dims) runs the CUDA-core kernel
# tva_simt_*, one CTA per output row.

_MODULE = "tree_verify_attention"
_TILE = 64  # rows per CTA and keys per tile (BM, BN in the .cu)
DECODE_SPLIT_TILES = 2  # key tiles an MLA split streams at least at one query a sequence (_grid_splits)
_MMA = {  # (Dk, Dv, values inside the key row) -> (kernel, warpgroups, CTAs that fit on one SM,
    #                                            key tiles a split streams at least at one query a sequence)
    (576, 512, True): ("tva_mma_mla576", 2, 1, DECODE_SPLIT_TILES),
    (64, 64, False): ("tva_mma_gqa64", 1, 4, 1),
    (128, 128, False): ("tva_mma_gqa128", 1, 2, 1),
}


def _mma_smem_bytes(dk: int, dv: int, v_in_k: bool, warpgroups: int) -> int:
    """Dynamic shared memory of tva_mma_*: Q tile, two K(/V) stages, P + factor exchange (MmaCfg in the .cu)."""
    stage = _TILE * dk * 2 + (0 if v_in_k else _TILE * dv * 2)
    return _TILE * dk * 2 + 2 * stage + (128 * 16 * 4 + 128 * 2 * 4 if warpgroups > 1 else 0)


WAVE_FILL = 0.85  # past one wave of CTAs, key splits until the last wave is at least this full ...
MAX_WAVE_SPLITS = 4  # ... with at most this many


def _num_splits(tiles: int, key_tiles: int, slots: int) -> int:
    """Key splits in the grid, at most one per key tile of the block table (the kernel uses as many of them as its
    cost model asks). Up to ``slots`` (SMs x CTAs per SM) ``tiles`` fill the GPU once; past it, the fewest splits
    up to ``MAX_WAVE_SPLITS`` whose last wave of CTAs is ``WAVE_FILL`` full (else the fullest), since a grid of a
    few waves takes as long as its last one (H200, K2 TP8, 32 sequences x 65 queries: 288 tiles, 3 waves, the last
    of 24 CTAs; 2 splits, 5 waves: the attention 30.7 -> 26.8 ms a pass, plus 2.0 ms of tva_combine)."""
    if tiles <= slots:
        return max(1, min(slots // max(tiles, 1), key_tiles))
    fill = {s: tiles * s / (slots * -(-tiles * s // slots)) for s in range(1, min(MAX_WAVE_SPLITS, key_tiles) + 1)}
    return next((s for s, f in fill.items() if f >= WAVE_FILL), max(fill, key=fill.get))


# Blocks a cluster of key splits merges in distributed shared memory (_CLUSTER_KERNELS on sm_90), largest first: a
# grid takes the largest whose clusters are all resident at once (an H100 holds 15 of 8 blocks, 30 of 4, 66 of 2).
CLUSTER_SIZES = (8, 4, 2)
# ... and where, with several clusters a tile, each block of the last one reads at most this many bytes of the
# clusters' partials: they merge there, where tva_combine spreads them over the GPU. H100, K2 TP8 graphed, clusters
# of 2 against tva_combine: 8 sequences at one query (8 partials of 8 rows, 32 KiB a block) 10.34 -> 10.11 ms, a
# 257-node tree (2 of 64 rows, 64 KiB) 42.63 -> 42.37, a 65-node tree (7 of 64 rows, 224 KiB) 23.52 -> 24.01.
MERGE_BLOCK_BYTES = 64 * 1024
_CLUSTER_KERNELS = {"tva_mma_mla576"}
MAX_TICKETS = 1 << 14  # (tile, KV head) pairs of one launch that can merge in the kernel
# Clusters a tile whose partials an unmerged launch leaves to the next kernel: the most skinny_bmm merges as it loads x
# (more are merged in the kernel, by the cluster that takes a tile's last ticket).
MAX_UNMERGED = 8
_TICKETS: dict[int, torch.Tensor] = {}


def _merge_in_kernel(dev: torch.device, kernel: str, warpgroups: int, smem: int, tiles: int, n_splits: int,
                     key_tiles: int, slots: int, tile_bytes: int) -> tuple[int, int, torch.Tensor] | None:
    """(blocks a cluster, the grid's splits as whole clusters, the device's tickets) where the key splits of
    ``tiles`` (tile, KV head) pairs, each of at most ``tile_bytes`` of output, merge inside ``kernel``: one in
    ``_CLUSTER_KERNELS`` on sm_90, with clusters of the largest of ``CLUSTER_SIZES`` that the splits fill, whose
    clusters are all resident at once (H100, K2 TP8, 8 sequences at one query: 16 clusters of 8, not all resident,
    7% slower than tva_combine) and whose last cluster a tile merges at most ``MERGE_BLOCK_BYTES`` a block. Else None
    (tva_combine merges)."""
    if kernel not in _CLUSTER_KERNELS or not sm90_or_later(dev.index):
        return None
    for size in CLUSTER_SIZES:
        clustered = _cluster_splits(n_splits, tiles, key_tiles, slots, size) if n_splits >= size else None
        if clustered is None or clustered > size and clustered // size * tile_bytes > size * MERGE_BLOCK_BYTES:
            continue
        if tiles * clustered // size <= max_active_clusters(
                _MODULE, kernel, dev.index, (("TVA_CLUSTER", size),), (1, size, 1), 128 * warpgroups, smem):
            tickets = _split_tickets(dev, tiles)
            return None if tickets is None else (size, clustered, tickets)
    return None


def _split_tickets(dev: torch.device, n: int) -> torch.Tensor | None:
    """The device's split-merge tickets (int32 zeros, which every launch leaves zero), or None where ``n`` (tile, KV
    head) pairs are more than ``MAX_TICKETS``, or the tickets would first be made inside a CUDA graph capture (made
    outside one, they outlive every graph)."""
    tickets = _TICKETS.get(dev.index)
    if tickets is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        tickets = _TICKETS[dev.index] = torch.zeros(MAX_TICKETS, dtype=torch.int32, device=dev)
    return tickets if n <= MAX_TICKETS else None


def _cluster_splits(n_splits: int, tiles: int, key_tiles: int, slots: int, size: int) -> int | None:
    """``n_splits`` (at least ``size``) as whole clusters of ``size``: the multiple of ``size`` below it if its
    splits take as many key tiles each, else the one above it if ``tiles`` x that still fill the GPU at most once
    (``slots``), else None (one query after 4096 keys, 33 splits of 2 key tiles, clusters of 8: 40, not 32 of 3)."""
    per = -(-key_tiles // n_splits)
    down = n_splits - n_splits % size
    if -(-key_tiles // down) == per:
        return down
    up = down + size
    return up if tiles * up <= slots else None


def split_k_outputs(T: int, heads: int, dv: int, dtype: torch.dtype, n_splits: int, device: torch.device,
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | int, torch.Tensor | int]:
    """(the output ``[T, heads, dv]`` in ``dtype``, or ``out``; the split-K partials ``ws_o`` and ``ws_ml``) for a
    kernel whose key splits a combine merges (``combine_cols`` in ``attention_tile.cuh``): with ``n_splits`` > 1
    the partials' bytes, bf16 ``[n_splits, T * heads, dv]`` then (max, sum) float pairs ``[n_splits, T * heads]``, in
    one allocation with the output; else 0 for both (null pointers)."""
    rows = T * heads
    out_bytes = 0 if out is not None else rows * dv * dtype.itemsize
    o_bytes = n_splits * rows * dv * 2
    ws_bytes = o_bytes + n_splits * rows * 8 if n_splits > 1 else 0
    buf = torch.empty(out_bytes + ws_bytes, dtype=torch.uint8, device=device)  # output | [n_splits] partials
    if out is None:
        out = buf[:out_bytes].view(dtype).view(T, heads, dv)
    ws = buf[out_bytes:]
    return (out, ws[:o_bytes], ws[o_bytes:]) if ws_bytes else (out, 0, 0)


def combine_cols(rows: int, dv: int, sms: int) -> int:
    """Value columns per warp of a split-K combine (``tva_combine``, ``mla_prefill_combine``): the widest that still
    gives every SM ~8 warps, at least 32."""
    return next((vw for vw in (256, 128, 64) if dv % vw == 0 and rows * (dv // vw) >= 8 * sms), 32)


def _query_tiles(T: int, B: int, group: int) -> int:
    """The grid's query tiles for ``T`` queries of ``B`` sequences, ``group`` query heads a KV head: at least the sum
    over the sequences of ceil(q_len * group / 64)."""
    return -(-T * group // _TILE) + min(B, T) - 1


def _grid_splits(T: int, B: int, longest: int | None, group: int, kv_heads: int, key_tiles: int, slots: int,
                 decode_tiles: int = 1) -> int:
    """The grid's key splits for ``T`` queries of ``B`` sequences (``longest``: the most queries one has, where the
    caller knows). Sequences of T / B queries each (a verify step's trees) are counted as they are; a ragged batch (a
    prompt chunk riding after a step's trees, whose keys are often many more) gets at least the splits its longest
    sequence would have alone: counted with the short sequences' tiles as equals, a 128-token chunk after 16k cached
    keys had one split instead of 4, and its step took 14.6 ms instead of 10.4 (H200, Llama-3.1-8B, 8 decoding
    sequences). At one query a sequence the splits stream at least ``decode_tiles`` key tiles each
    (``DECODE_SPLIT_TILES`` for MLA: H100, K2 TP8 at one query after 4096 keys, graphed, 33 splits of 2 tiles against
    65 of one took 1x0 -1.0%, 2x0 -2.0%; 3 tiles +0.9%, 5 +8%)."""
    likely = B * -(-(T // B) * group // _TILE) if T % B == 0 else _query_tiles(T, B, group)
    splits = _num_splits(kv_heads * likely, key_tiles, slots)
    if T == B:  # one query a sequence
        splits = max(1, min(splits, -(-key_tiles // decode_tiles)))
    if longest is None or longest * B <= T:
        return splits
    return max(splits, _num_splits(kv_heads * -(-longest * group // _TILE), key_tiles, slots))


def _tree_attention_cuda(q, kv_cache, block_table, prefix_lens, cu_q, tree_mask, scale, *, kv_heads, dv,
                         row_stride, v_off, out=None, mma_sync=False, early_prefix=False, longest=None,
                         unmerged=False):
    """Check and launch one batch on q's device and torch's current stream; ``mma_sync`` forces the sm_80 path;
    ``unmerged``: as :func:`mla_tree_attention` takes it."""
    T, hq, dk = q.shape
    B, max_pages = block_table.shape
    page_size = kv_cache.shape[1]
    dev = q.device
    for name, t in (("kv_cache", kv_cache), ("block_table", block_table), ("prefix_lens", prefix_lens),
                    ("cu_q", cu_q), ("tree_mask", tree_mask)) + ((("out", out),) if out is not None else ()):
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, q on {dev}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if not q.is_contiguous():
        raise ValueError("q must be contiguous")
    if q.dtype not in (torch.bfloat16, torch.float32) or kv_cache.dtype != q.dtype:
        raise TypeError(f"q and kv_cache must both be bfloat16 or float32, got {q.dtype} and {kv_cache.dtype}")
    for name, t in (("block_table", block_table), ("prefix_lens", prefix_lens), ("cu_q", cu_q)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page size {page_size} is not supported: it must be a power of two")
    if out is not None and (out.shape != (T, hq, dv) or out.dtype != q.dtype):
        raise ValueError(f"out must be {q.dtype} [{T}, {hq}, {dv}], got {out.dtype} {tuple(out.shape)}")
    mma = _MMA.get((dk, dv, v_off == 0)) if q.dtype == torch.bfloat16 else None
    if mma is None and dv > 512:
        raise ValueError(f"value head dim {dv} is not supported by the CUDA-core kernel: it takes 1 to 512 "
                         f"(the tensor-core kernel takes bf16 (Dk, Dv) in {sorted(k[:2] for k in _MMA)})")
    if mma is not None and any(t.data_ptr() % 16 for t in (q, kv_cache) + ((out,) if out is not None else ())):
        raise ValueError("q, kv_cache and out must be 16-byte aligned for the tensor-core kernel")

    group = hq // kv_heads
    tiles = _query_tiles(T, B, group)
    n_splits, smem, cluster, tickets = 1, 0, 1, None
    if mma is not None and tiles > 0:
        slots, key_tiles = sm_count(dev.index) * mma[2], -(-max_pages * page_size // _TILE)
        smem = _mma_smem_bytes(dk, dv, v_off == 0, mma[1])
        n_splits = _grid_splits(T, B, longest, group, kv_heads, key_tiles, slots, mma[3])
        tile_rows = min(_TILE, (longest or T - B + 1) * group)  # the most rows one tile has
        merge = None if mma_sync else _merge_in_kernel(dev, mma[0], mma[1], smem, tiles * kv_heads, n_splits,
                                                       key_tiles, slots, tile_rows * dv * 2)
        if merge is not None:
            cluster, n_splits, tickets = merge
    partials = n_splits // cluster  # with clusters, cluster c's partial at split c
    unmerged = unmerged and tickets is not None and 2 <= partials <= MAX_UNMERGED
    out, ws_o, ws_ml = split_k_outputs(T, hq, dv, q.dtype, partials, dev, out)
    if T == 0 or B == 0:
        return out

    i32 = np.int32
    shape_args = (i32(B), i32(T), i32(hq), i32(kv_heads))
    geo_args = (i32(page_size.bit_length() - 1), i32(max_pages), i32(tree_mask.shape[1]), i32(tree_mask.shape[2]),
                i32(row_stride), i32(v_off), np.float32(scale * 1.4426950408889634))  # scale * log2(e)
    inputs = (q, kv_cache, block_table, prefix_lens, cu_q, tree_mask)
    if mma is None:
        kernel = "tva_simt_f32" if q.dtype == torch.float32 else "tva_simt_bf16"
        launch(_MODULE, kernel, (T * hq,), (128,), inputs + (out, i32(B), i32(hq), i32(kv_heads), i32(dk), i32(dv))
               + geo_args, shared_mem=(dk + 4 * (dv + 2)) * 4, device=dev)
        return out
    kernel, warpgroups, _, _ = mma
    defines = (("ATTN_MMA_SYNC", 1),) if mma_sync else ()
    if tickets is not None:
        defines += (("TVA_CLUSTER", cluster),) + ((("TVA_UNMERGED", 1),) if unmerged else ())
    launch(_MODULE, kernel, (tiles, n_splits, kv_heads), (128 * warpgroups,),
           inputs + (out, ws_o, ws_ml, 0 if tickets is None else tickets) + shape_args + geo_args
           + (i32(n_splits), i32(early_prefix)),
           shared_mem=smem, device=dev, defines=defines)
    if unmerged:  # [partials, T, hq, dv] bf16, [partials, T, hq, 2] fp32
        o = ws_o.view(q.dtype).view(partials, T, hq, dv)
        return SplitPartials(o, ws_ml.view(torch.float32).view(partials, T, hq, 2))
    if n_splits > 1 and tickets is None:
        vw = combine_cols(T * hq, dv, sm_count(dev.index))
        launch(_MODULE, "tva_combine", (-(-T * hq * (dv // vw) // 4),), (128,),
               (ws_o, ws_ml, out, cu_q, prefix_lens, i32(B), i32(T), i32(hq), i32(dv), i32(n_splits), i32(vw)),
               shared_mem=4 * 2 * n_splits * 4, device=dev, defines=defines)
    return out
