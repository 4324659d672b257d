"""Routed-expert MoE with INT4 (W4A16) expert weights: ``w4a16_moe``; with the routing, ``routed_w4a16_moe``.

``out[t] = sum_j topk_weights[t, j] * W2[e] @ (silu(W1[e][:I] @ x[t]) * (W1[e][I:] @ x[t]))`` with
``e = topk_ids[t, j]``; an id of -1 means "expert not on this rank" and is skipped. Weights are
compressed-tensors ``pack-quantized`` INT4 (see ``int4.py``): rows ``[0, I)`` of ``w13`` are gate_proj,
rows ``[I, 2I)`` up_proj; group size ``g = H / w13_scale.shape[-1]``.

``add`` (optional, ``[T, H]`` in ``x.dtype``) is added to the result, rounded as ``routed + add`` rounds in torch
(the MoE layer passes its shared expert's output). ``add_stream`` (optional, CUDA): the stream that writes ``add``
beside this call's routing and GEMMs; the final kernel waits for it (the stream's work joins a graph capture there).

CPU tensors run the torch reference (fp32 math over the dequantized experts that are used). CUDA
tensors run four kernels from ``cuda/w4a16_moe.cu`` on torch's current stream, with no host sync, so a
verify step's MoE can be captured in a CUDA graph:

1. ``moe_prep``: block 0 sorts the (token, slot) pairs by expert (histogram + prefix sum) and cuts each
   expert's rows into passes of at most ``MT`` rows; the other blocks write ``x`` in the k order the GEMMs'
   ldmatrix loads read (see the .cu; the wgmma family's ``rs`` reads it too, the skinny path does not), unless the
   caller gives x in that order as ``x_k`` (:func:`expert_k_order`: K2's post-attention norm writes it beside x).
   ``routed_w4a16_moe`` at few tokens launches ``moe_route_prep`` (``cuda/moe_route.cu``) instead: block 0
   routes the tokens (``moe_route``'s math, a warp per token) before it sorts them. Over ``SORT_SPLIT_SLOTS``
   pairs the sort is split: ``moe_prep_count`` counts slot ranges by expert in up to ``SORT_BLOCKS`` blocks (beside
   the permutation), then ``moe_prep_place`` places each range's slots.
2. ``moe_up_*``: per (pass, N tile) the gate/up GEMM with INT4 dequantized in registers, SiLU(gate) * up
   fused in the epilogue -> ``h [T*k, I]`` bf16 (sorted rows).
3. ``moe_down_*``: the down GEMM over ``h``; each row scaled by its routing weight and written as that (token,
   slot)'s row of ``y [T*k, H]`` (bf16).
4. ``moe_finalize_slots``: each token's rows of ``y`` summed in slot order (+ ``add``) -> ``out`` in bf16. No
   atomics anywhere: a call's result is the same bits every time.

Three families of GEMM kernels: with few rows per expert (decode and small verify trees) the skinny path
(passes of <= 8 rows; weights as the mma's A operand, dequantized in registers from each lane's own pieces, the
pass's rows as its 8 columns; K split across the warps of a block; persistent blocks over (pass, column tile) items,
a wave at most, since the pass count is only known on the device; each lane loads its weights into registers ahead
of their math; ``SKINNY_UP_FORMS`` for the gate/up GEMM) up to ``SKINNY_MAX_ROWS_PER_EXPERT`` rows per expert; past
that the wgmma family (``WGMMA_VARIANTS``) on Hopper (sm_90), and elsewhere, or for shapes neither takes, the tile
path (``VARIANTS``: weights staged through a cp.async pipeline in shared memory, 16 to 64 rows per pass). The wgmma
family's chosen variant, ``rs`` (128-row passes), swaps the GEMMs' operands
(``moe_up_rs``, ``moe_down_rs``): the weights are wgmma's A operand, dequantized into registers in the tile path's k
order, and the pass's rows (x permuted by the prep into that order; h written in it) its N columns, N the rows
rounded up to a multiple of 8 (at least 16); with I > ``RSD_MAX_I`` its down GEMM is ``wg128``'s. ``wg64``
and ``wg128`` (64- or 128-row passes, kept for sweeps) stream N tiles of 256 weight rows, 64 k per stage, the INT4
tile dequantized once per pass into bf16 shared memory and both wgmma operands from there, x and h in natural k
order. Every family runs batches of more than ``CHUNK_TOKENS`` tokens in chunks.

Expert layouts: compressed-tensors (``[E, N, K/8]`` int32 and ``[E, N, K/32]`` scales, as loaded) or the tiled
layout of :func:`repack_int4_experts` (``[E, K/64, N, 8]`` / ``[E, K/64, N, 2]``: one K tile of an N tile's rows is
one contiguous run; the same bytes, so it replaces the loaded copy). Every family reads either; the wgmma family
needs the tiled one. ``MoE.load`` (``model/k2.py``) repacks the experts when they live on a GPU.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

from kdray.kernels.cuda_module import sm_count
from kdray.kernels.int4 import dequantize_int4
from kdray.kernels.moe_route import check_cuda_routing, check_routing, moe_route, route_launch

KC = 256  # k per pipeline stage
THREADS = 256  # 8 warps per GEMM block
MAX_E = 4096  # experts the routing block's shared memory holds
# GEMM variants: (rows per pass MT, n8 tiles per warp half NT, pipeline stages); a tile is 128 * NT weight rows.
VARIANTS = {"m16n1": (16, 1, 4), "m32n1": (32, 1, 3), "m32n2": (32, 2, 2), "m64n2": (64, 2, 2)}
SKINNY = "skinny"  # the swapped-operand path: passes of SKINNY_ROWS rows, H and I multiples of 128
SKINNY_ROWS = 8
# moe_up_skinny_w<warps>_b<blocks>_a<ahead> by items (pass, column tile) per SM: (from items per SM, warps, blocks
# resident per SM, chunks each warp loads ahead). One token's ~one item an SM takes 16 warps a block; from a few, 4;
# from many, 4 in 3 blocks with twice the loads in flight (H200, K2 TP8, alone: 1.31-1.45x -> 1.19-1.30x of the
# bytes' time from 16 to 65 tokens against session 23's cp.async ring; at 4 tokens the second form 1.45x, the
# third 1.73x; at 8 they tie).
SKINNY_UP_FORMS = ((0, 16, 1, 1), (2, 4, 4, 1), (8, 4, 3, 2))
SKINNY_DOWN_THREADS, SKINNY_DOWN_ROWS = 256, 256  # SK_DOWN_WARPS in the .cu
SKINNY_DOWN_BLOCKS = 3  # moe_down_skinny's blocks resident per SM (79 registers)
# Route slots per expert up to which the skinny path is chosen (past it, on Hopper, rs). H200, K2 TP8, 384
# experts, uniform routing, the MoE graph-replayed (2026-12-03; results/moe-families-2026-12-03-h200-session27.txt):
# 5.4 per expert (T=257) skinny 417 us < rs 519 < m16n1 553; 8.0 (T=385) skinny 521 ~ rs 534; 10.7 (T=513) rs 553 <
# m32n2 601 < skinny 639; the sweep of 2026-12-02 (results/moe-rs-2026-12-02-h200.txt) had set 4 and 20 before the
# skinny kernels streamed their weights through registers and rs took passes of 16-24 rows.
SKINNY_MAX_ROWS_PER_EXPERT = 8
PREFILL_ROWS_PER_EXPERT = 32  # from here on 64-row passes win (H200 sweep, K2 TP8: T = 2080 and beyond)
# Hopper (sm_90a) wgmma family over the tiled layout (repack_int4_experts): name -> (warpgroups along M of the down
# GEMM, rows per pass = 64 * that; whether the gate/up GEMM is the swapped one, moe_up_rs); N tiles of WG_BN weight
# rows, 64 k per stage; shared memory per block WG_SMEM (the .cu's WgCfg), RS_SMEM for moe_up_rs.
WGMMA_VARIANTS = {"wg64": (1, False), "wg128": (2, False), "rs": (2, True)}
# moe_up_rs: four warpgroups; 4 stages of x and 4 of weights with their mbarriers, laid out for the larger of its two
# forms: passes of up to 64 rows, whose block takes a pair of output halves (x 64 rows x 128 k; weights 2 K tiles of
# 512 rows and their scales, padded: 37120 bytes), 215072 bytes; larger passes (x 128 rows, weights 18688) 206880.
# moe_down_rs (its partner for I <= RSD_MAX_I, else the wgmma down GEMM): the pass's h rows (128 x RSD_MAX_I), 3
# stages of weights copied by TMA (a tile's K tiles of 256 rows and their scales, padded: 4 x 9344 bytes) with their
# mbarriers, the rows' slots and weights, a y staging tile per warpgroup (32 tokens x 144 bytes): 198192 bytes.
RS_THREADS, RS_SMEM = 512, 1024 + 4 * 2 * 64 * 128 + 4 * 37120 + 4 * 8
RSD_MAX_I, RSD_SMEM = 256, 1024 + 128 * 256 * 2 + 3 * 4 * (8256 + 1088) + 16 * 3 + 128 * 8 + 4 * 32 * 144
WG_BN, WG_THREADS = 256, 256
WG_SMEM = {1: 1024 + 6 * 17408 + 2 * 32768, 2: 1024 + 5 * 25600 + 2 * 32768}  # 171008, 194560 bytes
# The down GEMM with I <= WG_RES_K keeps its pass's h rows in shared memory (moe_down_<variant>_res)
WG_RES_K = 256
WG_SMEM_RES = {1: 1024 + 64 * 512 + 8 * 9216 + 2 * 32768, 2: 1024 + 128 * 512 + 8 * 9216 + 2 * 32768}  # 173056, 205824
# Each slot's output row (bf16 [T * k, H]) is kept for the ordered sum: at most this many tokens per launch sequence
# (K2 TP8: 1.9 GB, the size an fp32 accumulator of 64k tokens had); longer batches run in chunks.
CHUNK_TOKENS = 16384
# Over this many (token, slot) pairs the MoE's sort runs on up to SORT_BLOCKS blocks of 1024 threads instead of one,
# whose shared-memory atomics bound it (H200, K2 TP8, graph-replayed: the one block's sort alone took 45 of moe_prep's
# 56 us at 4096 tokens, 155 of 200 at 16384; split, the prep took 49.5 and 151-154; even at 2080 tokens, and 1 us
# slower at 1024, where the second launch costs more than the sort).
SORT_SPLIT_SLOTS, SORT_BLOCKS = 16384, 32
# Up to this many tokens moe_route_prep routes them in the prep launch, a warp each in its 1024-thread block 0 (it can
# take 32). One SM's warps then route them all, so the launch grows with T, where moe_route spreads its warps over
# SMs: alone on an H100 (K2 TP8 shard, eager) 3.9 us at 1 token, 6.0 at 8, 6.8 at 12, 8.4 at 17, 11.1 at 32, against
# 6.3-6.9 us for moe_route and moe_prep; in the graphed 61-layer pass (alternated) the fold ahead at 9 tokens by 0.2%,
# even at 13, behind at 17 by 0.8%.
ROUTE_PREP_MAX_T = 12
ROUTE_PREP_MAX_E = 640  # its 20 experts per lane fit the 64 registers a 1024-thread block allows (ptxas: 64, no spills)


def _shapes(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_ids, topk_weights, add=None
            ) -> tuple[int, int, int, int]:
    """Check the operands against each other; return ``(E, H, I, group)``."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    if add is not None and (add.shape != x.shape or add.dtype != x.dtype):
        raise ValueError(f"add must be {x.dtype} {tuple(x.shape)} like x, got {add.dtype} {tuple(add.shape)}")
    T, H = x.shape
    if is_tiled(w13_packed):  # repack_int4_experts' layout: group 32
        E, HB, two_i = w13_packed.shape[:3]
        I = two_i // 2
        if (HB * 64 != H or two_i % 2 or I % 64 or w13_packed.shape[3] != 8 or w13_scale.shape != (E, HB, two_i, 2)
                or w2_packed.shape != (E, I // 64, H, 8) or w2_scale.shape != (E, I // 64, H, 2)):
            raise ValueError(f"expected tiled experts w13_packed [E, H/64, 2I, 8], w13_scale [E, H/64, 2I, 2], "
                             f"w2_packed [E, I/64, H, 8], w2_scale [E, I/64, H, 2] for H={H}; got "
                             f"{tuple(w13_packed.shape)}, {tuple(w13_scale.shape)}, {tuple(w2_packed.shape)}, "
                             f"{tuple(w2_scale.shape)}")
        if w13_packed.dtype != torch.int32 or w2_packed.dtype != torch.int32:
            raise TypeError(f"packed weights must be int32, got {w13_packed.dtype} / {w2_packed.dtype}")
        group = 32
    else:
        if w13_packed.dim() != 3 or w2_packed.dim() != 3:
            raise ValueError(f"w13_packed / w2_packed must be [E, out, in/8], got {tuple(w13_packed.shape)} / "
                             f"{tuple(w2_packed.shape)}")
        E, two_i, h8 = w13_packed.shape
        I = two_i // 2
        if two_i % 2 or h8 * 8 != H or w2_packed.shape != (E, H, I // 8) or I % 8:
            raise ValueError(f"expected w13_packed [E, 2I, H/8] and w2_packed [E, H, I/8] for H={H}, got "
                             f"{tuple(w13_packed.shape)} and {tuple(w2_packed.shape)}")
        if w13_packed.dtype != torch.int32 or w2_packed.dtype != torch.int32:
            raise TypeError(f"packed weights must be int32, got {w13_packed.dtype} / {w2_packed.dtype}")
        if w13_scale.dim() != 3 or w13_scale.shape[:2] != (E, two_i) or H % w13_scale.shape[2]:
            raise ValueError(f"w13_scale must be [E, 2I, H/g] = [{E}, {two_i}, H/g], got {tuple(w13_scale.shape)}")
        group = H // w13_scale.shape[2]
        if I % group or w2_scale.shape != (E, H, I // group):
            raise ValueError(f"w2_scale must be [E, H, I/g] = [{E}, {H}, {I}/{group}], got {tuple(w2_scale.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids / topk_weights must both be [T={T}, k], got {tuple(topk_ids.shape)} / "
                         f"{tuple(topk_weights.shape)}")
    if topk_ids.dtype != torch.int64 or topk_weights.dtype != torch.float32:
        raise TypeError(f"topk_ids must be int64 and topk_weights float32, got {topk_ids.dtype} / "
                        f"{topk_weights.dtype}")
    return E, H, I, group


@functools.cache
def expert_k_order(dim: int) -> torch.Tensor:
    """``[dim]`` int64 (CPU), position -> k: the order of k in which the INT4 expert kernels that stage activations
    read them (the .cu's "logical" k, dim a multiple of 128: in each 128-k chunk position 16 s + 8 h + 2 c + i holds
    k = 32 c + 8 (s >> 1) + 2 (s & 1) + h + 4 i). ``x[..., expert_k_order(H)]`` is what moe_prep's permutation
    writes, and what the norm before the MoE can write instead (``rmsnorm``'s ``out_k``)."""
    if dim % 128:
        raise ValueError(f"the experts' k order is defined on rows of a multiple of 128, got {dim}")
    p = torch.arange(128)
    s, h, c, i = p >> 4, (p >> 3) & 1, (p >> 1) & 3, p & 1
    k = 32 * c + 8 * (s >> 1) + 2 * (s & 1) + h + 4 * i  # [128]
    return (torch.arange(0, dim, 128)[:, None] + k).reshape(dim)


def repack_int4_experts(w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                        w2_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors experts -> the tile-contiguous layout every CUDA kernel reads (a pure function).

    ``packed [E, N, K/8]`` int32 -> ``[E, K/64, N, 8]``: the 64 k (8 words) of a K tile of every weight row of an
    expert lie together, so one K tile of any run of rows (an N tile) is one contiguous stream; words and nibbles
    are unchanged. ``scale [E, N, K/32]`` bf16 -> ``[E, K/64, N, 2]`` the same way. Same bytes, no padding: the
    repacked experts replace the loaded ones (one copy in memory). Needs group 32 and K (H for w13, I for w2) a
    multiple of 64. :func:`unpack_int4_experts` inverts it.
    """
    out = []
    for packed, scale in ((w13_packed, w13_scale), (w2_packed, w2_scale)):
        if packed.dim() != 3 or scale.dim() != 3 or packed.dtype != torch.int32:
            raise ValueError(f"repack_int4_experts takes compressed-tensors experts (packed [E, N, K/8] int32, scale "
                             f"[E, N, K/32]); got {packed.dtype} {tuple(packed.shape)} and {tuple(scale.shape)}")
        E, N, K8 = packed.shape
        if K8 % 8 or scale.shape != (E, N, K8 // 4):
            raise ValueError(f"the tiled INT4 layout needs group size 32 and in_features a multiple of 64; got packed "
                             f"{tuple(packed.shape)} (in_features {8 * K8}) with scale {tuple(scale.shape)}")
        out.append(packed.reshape(E, N, K8 // 8, 8).transpose(1, 2).contiguous())
        out.append(scale.reshape(E, N, K8 // 8, 2).transpose(1, 2).contiguous())
    return out[0], out[1], out[2], out[3]


def unpack_int4_experts(w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                        w2_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`repack_int4_experts`: ``[E, K/64, N, 8]`` / ``[E, K/64, N, 2]`` -> compressed-tensors."""
    out = []
    for packed, scale in ((w13_packed, w13_scale), (w2_packed, w2_scale)):
        if packed.dim() != 4 or packed.shape[3] != 8 or scale.dim() != 4 or scale.shape != (*packed.shape[:3], 2):
            raise ValueError(f"expected tiled experts packed [E, K/64, N, 8] and scale [E, K/64, N, 2], got "
                             f"{tuple(packed.shape)} and {tuple(scale.shape)}")
        E, KB, N, _ = packed.shape
        out.append(packed.transpose(1, 2).reshape(E, N, 8 * KB).contiguous())
        out.append(scale.transpose(1, 2).reshape(E, N, 2 * KB).contiguous())
    return out[0], out[1], out[2], out[3]


def is_tiled(w13_packed: torch.Tensor) -> bool:
    """Whether the experts are in :func:`repack_int4_experts`' layout (4-D) rather than compressed-tensors' (3-D)."""
    return w13_packed.dim() == 4


def w4a16_moe_reference(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_ids, topk_weights,
                        add: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference: dequantize each used expert, compute in fp32, cast the sum to ``x.dtype`` (then + add).
    Takes either layout (tiled experts are unpacked first)."""
    E, H, I, _ = _shapes(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_ids, topk_weights, add)
    if is_tiled(w13_packed):
        w13_packed, w13_scale, w2_packed, w2_scale = unpack_int4_experts(w13_packed, w13_scale, w2_packed, w2_scale)
    xf = x.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        w13 = dequantize_int4(w13_packed[e], w13_scale[e], H)  # [2I, H]
        w2 = dequantize_int4(w2_packed[e], w2_scale[e], I)  # [H, I]
        gate_up = xf[tok] @ w13.T  # [n, 2I]
        h = F.silu(gate_up[:, :I]) * gate_up[:, I:]  # [n, I]
        out.index_add_(0, tok, (h @ w2.T) * topk_weights[tok, slot, None])
    return out.to(x.dtype) if add is None else out.to(x.dtype) + add


def random_int4_experts(E: int, H: int, I: int, device="cuda", generator: torch.Generator | None = None):
    """Random ``(w13_packed, w13_scale, w2_packed, w2_scale)`` with group 32 made in place (no quantization
    pass; any int32 is a word of 8 nibbles); scales put each weight near ``1 / sqrt(in_features)``. For tests
    and benchmarks."""
    def packed(*shape):
        return torch.randint(-2 ** 31, 2 ** 31, shape, dtype=torch.int32, device=device, generator=generator)

    def scales(n_out, n_in):
        s = torch.rand(E, n_out, n_in // 32, device=device, generator=generator) + 0.5
        return (s / (5 * n_in ** 0.5)).to(torch.bfloat16)

    return packed(E, 2 * I, H // 8), scales(2 * I, H), packed(E, H, I // 8), scales(H, I)


def w4a16_moe(x: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
              w2_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              add: torch.Tensor | None = None, add_stream: torch.cuda.Stream | None = None,
              x_k: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts over INT4 weights; ``x [T, H]`` -> ``[T, H]`` in ``x.dtype`` (plus ``add [T, H]`` if given).

    ``w13_packed [E, 2I, H/8]`` int32, ``w13_scale [E, 2I, H/g]`` bf16, ``w2_packed [E, H, I/8]`` int32,
    ``w2_scale [E, H, I/g]`` bf16, ``topk_ids [T, k]`` int64 (-1 = skip), ``topk_weights [T, k]`` fp32;
    ``add_stream``: ``add``'s writer (CUDA), waited for just before the finalize. ``x_k`` (CUDA, where
    :func:`reads_expert_k_order` says so): x again in :func:`expert_k_order`, which the GEMMs then read instead of
    the prep's permutation of x.
    """
    if x.is_cuda:
        return _w4a16_moe_cuda(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_ids, topk_weights, add,
                               add_stream=add_stream, x_k=x_k)
    if x_k is not None:
        raise ValueError("w4a16_moe's x_k (x in the experts' k order) is for CUDA tensors; the CPU path reads x")
    return w4a16_moe_reference(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_ids, topk_weights, add)


def routed_w4a16_moe(x: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                     w2_scale: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                     topk_group: int, renormalize: bool, scale: float, local_experts: tuple[int, int] | None,
                     add: torch.Tensor | None = None, add_stream: torch.cuda.Stream | None = None,
                     x_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moe_route` then :func:`w4a16_moe` -> ``(out [T, H], ids [T, k] int64, weights [T, k] fp32)``.

    ``logits [T, E]`` fp32 and ``bias [E]`` fp32 are the router's; the routing arguments are moe_route's (all
    given), the experts ``w13_packed [E_local, 2I, H/8]`` etc. those of ``local_experts`` (all E without it).
    On a GPU, 1 <= T <= ``ROUTE_PREP_MAX_T`` tokens over E <= ``ROUTE_PREP_MAX_E`` experts are routed in the MoE's
    prep launch (``moe_route_prep``: four launches in all); other shapes run moe_route first. ``x_k``: as
    :func:`w4a16_moe`'s.
    """
    T, E = check_routing(logits, bias, top_k, n_group, topk_group)
    n_local = E if local_experts is None else local_experts[1]
    if T != x.shape[0] or w13_packed.shape[0] != n_local or logits.device != x.device:
        raise ValueError(f"logits [T, E] must be on x's device with its T = {x.shape[0]} rows, w13_packed hold the "
                         f"{n_local} experts of local_experts={local_experts} (E = {E}); got logits "
                         f"{tuple(logits.shape)} on {logits.device}, w13_packed {tuple(w13_packed.shape)}")
    if not (x.is_cuda and 1 <= T <= ROUTE_PREP_MAX_T and E <= ROUTE_PREP_MAX_E):
        ids, weights = moe_route(logits, bias, top_k, n_group, topk_group, renormalize, scale, local_experts)
        # add's writer joins just before the finalize: its work runs beside the routing and the GEMMs
        out = w4a16_moe(x, w13_packed, w13_scale, w2_packed, w2_scale, ids, weights, add, add_stream=add_stream,
                        x_k=x_k)
        return out, ids, weights
    check_cuda_routing(E, top_k, n_group)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    args, defines = route_launch(logits.contiguous(), bias.contiguous(), ids, weights, top_k, n_group, topk_group,
                                 renormalize, scale, local_experts)
    group_scratch = 4 * T * E if n_group > 1 else 0  # a warp's E floats per token
    out = _w4a16_moe_cuda(x, w13_packed, w13_scale, w2_packed, w2_scale, ids, weights, add,
                          routing=(args, defines, group_scratch), add_stream=add_stream, x_k=x_k)
    return out, ids, weights


def _check_cuda(x, operands: dict, E: int, H: int, I: int, k: int, group: int):
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the CUDA w4a16_moe takes bf16 activations, got {x.dtype}")
    if group != 32 or H % 64 or I % 64:
        raise ValueError(f"the CUDA w4a16_moe needs group size 32 and H, I multiples of 64; got group={group}, "
                         f"H={H}, I={I} (run these shapes on CPU, or add a kernel variant)")
    if E > MAX_E:
        raise ValueError(f"the CUDA w4a16_moe routes at most {MAX_E} experts per rank, got {E}")
    for name, t in operands.items():
        if t.device != x.device or not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"{name} must be a contiguous, 16-byte aligned tensor on {x.device}; got {t.device}, "
                             f"contiguous={t.is_contiguous()}, address % 16 = {t.data_ptr() % 16}")
    if x.shape[0] * max(_round128(H), k * _round128(I)) >= 2 ** 31:
        raise ValueError(f"T={x.shape[0]} tokens overflow the kernels' 32-bit offsets; split the batch")


def _round128(n: int) -> int:
    return (n + 127) // 128 * 128


def _tiles_per_block(n_tiles: int, k_stages: int, busy_passes: int, sm_count: int, stages: int = 32) -> int:
    """N tiles one GEMM block streams back to back: ~``stages`` stages per block, yet ~4 blocks per SM to run."""
    tpb = max(1, min(math.ceil(stages / k_stages), busy_passes * n_tiles // (4 * sm_count), n_tiles))
    return math.ceil(n_tiles / math.ceil(n_tiles / tpb))  # even out the blocks of a pass


def _wgmma_ok(capability: tuple[int, int], H: int, I: int, tiled: bool) -> str | None:
    """None when the wgmma family can run these operands on a GPU of ``capability``, else why not (the ValueError's
    text): it needs sm_90, the tiled layout, H % 256 == 0 and I % 128 == 0 (group 32 and x bf16 as every kernel)."""
    if not tiled:
        return "it reads the tiled layout of repack_int4_experts (got compressed-tensors [E, N, K/8] experts)"
    if tuple(capability) != (9, 0):
        return f"it needs an sm_90 (Hopper) GPU, got compute capability {tuple(capability)}"
    if H % WG_BN or I % 128:
        return f"it needs H % {WG_BN} == 0 and I % 128 == 0 (H=7168, I=256 for K2 TP8), got H={H}, I={I}"
    return None


def _capability(dev: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(dev)


def _choose_variant(E: int, H: int, I: int, slots: int, wgmma: bool = False) -> str:
    """The GEMM family for the shape (see the module docstring; thresholds from H200 sweeps on K2 shards).
    ``wgmma``: the wgmma family can run (Hopper, tiled experts, H % 256 == 0, I % 128 == 0)."""
    if H % 128 == 0 and I % 128 == 0 and slots <= SKINNY_MAX_ROWS_PER_EXPERT * E:
        return SKINNY
    if wgmma:  # rs beats the other wgmma variants at many rows too (2026-12-02; results/moe-rs-2026-12-02-h200.txt,
        # as rs128): 43 per expert (T=2080) 831 us against wg64's 994; 85 (T=4096) 1154 against wg128's 1332; 341
        # (T=16384) 3913 against 4163. Passes of 64 rows instead (moe-rs-pass-rows-*.txt) tie up to 43 per expert
        # and lose from 64 (985 against 1190 us at T=3072).
        return "rs"
    # Up to ~8 rows per expert on average, 16-row passes (the deepest pipeline) win; with more rows, wider
    # N tiles halve the activation re-reads (each tile stages its rows' activations again); from a prefill's
    # ~32 rows per expert, 64-row passes halve the weight dequantization per MMA (9-14% at 2k-16k tokens).
    if slots <= 8 * E:
        return "m16n1"
    if I % 128:
        return "m32n1"
    return "m64n2" if slots >= PREFILL_ROWS_PER_EXPERT * E else "m32n2"


def _reads_k_order(variant: str) -> bool:
    """Whether the variant's gate/up GEMM reads x in :func:`expert_k_order` (the tile path's and rs's do)."""
    return variant in VARIANTS or (variant in WGMMA_VARIANTS and WGMMA_VARIANTS[variant][1])


def reads_expert_k_order(T: int, k: int, w13_packed: torch.Tensor, H: int) -> bool:
    """Whether the CUDA MoE of ``T`` tokens x top-``k`` over these (local) experts, chosen by shape, reads x in
    :func:`expert_k_order` (so that the norm before it may write that order as ``x_k``)."""
    if T == 0 or H % 128 or not w13_packed.is_cuda:
        return False
    tiled = is_tiled(w13_packed)
    E, two_i = (w13_packed.shape[0], w13_packed.shape[2]) if tiled else w13_packed.shape[:2]
    wgmma = _wgmma_ok(_capability(w13_packed.device), H, two_i // 2, tiled) is None
    return _reads_k_order(_choose_variant(E, H, two_i // 2, T * k, wgmma=wgmma))


def _w4a16_moe_cuda(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_ids, topk_weights, add=None,
                    variant: str | None = None, routing: tuple | None = None,
                    add_stream: torch.cuda.Stream | None = None, x_k: torch.Tensor | None = None) -> torch.Tensor:
    """The CUDA path; ``variant`` (a ``VARIANTS`` or ``WGMMA_VARIANTS`` key, or ``SKINNY``) overrides the choice by
    shape (benchmarks sweep it; a wgmma variant where it cannot run raises ValueError). ``routing`` (from
    :func:`routed_w4a16_moe`: moe_route.cu's arguments and defines, the bytes of group scratch) makes the prep launch
    write ``topk_ids`` and ``topk_weights`` first."""
    E, H, I, group = _shapes(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_ids, topk_weights, add)
    T, k = topk_ids.shape
    x = x if x.is_contiguous() and x.data_ptr() % 16 == 0 else x.clone()
    operands = dict(x=x, w13_packed=w13_packed, w13_scale=w13_scale, w2_packed=w2_packed, w2_scale=w2_scale,
                    topk_ids=topk_ids, topk_weights=topk_weights)
    if add is not None:
        if not add.is_contiguous() or add.data_ptr() % 16:
            _join(add_stream, x.device)  # the copy reads add here
            add = add.clone()
        operands["add"] = add
    _check_cuda(x, operands, E, H, I, k, group)
    dev = x.device
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    if T == 0:
        _join(add_stream, dev)
        return out
    sms, slots = sm_count(dev.index), T * k
    tiled = is_tiled(w13_packed)
    if variant is None:
        variant = _choose_variant(E, H, I, slots, wgmma=_wgmma_ok(_capability(dev), H, I, tiled) is None)
    elif variant in WGMMA_VARIANTS and (why := _wgmma_ok(_capability(dev), H, I, tiled)) is not None:
        raise ValueError(f"variant {variant} cannot run here: {why}")
    elif variant not in WGMMA_VARIANTS and variant not in VARIANTS and variant != SKINNY:
        raise ValueError(f"unknown variant {variant!r}; choose from {[SKINNY, *VARIANTS, *WGMMA_VARIANTS]}")
    if variant in VARIANTS and VARIANTS[variant][1] == 2 and I % 128:
        raise ValueError(f"variant {variant} needs I % 128 == 0, got I={I}")
    if variant == SKINNY and (H % 128 or I % 128):
        raise ValueError(f"the skinny path needs H and I multiples of 128, got H={H}, I={I}")
    if x_k is not None and (not _reads_k_order(variant) or H % 128 or x_k.shape != x.shape or x_k.dtype != x.dtype
                            or x_k.device != dev or not x_k.is_contiguous() or x_k.data_ptr() % 16):
        raise ValueError(f"x_k (x in the experts' k order) must be a contiguous, 16-byte aligned {x.dtype} tensor of "
                         f"x's shape {tuple(x.shape)} on {dev}, H a multiple of 128, for a variant that reads that "
                         f"order (the tile path's or rs; this call runs {variant}); got {x_k.dtype} "
                         f"{tuple(x_k.shape)} on {x_k.device}")
    gemms = _wgmma_gemms if variant in WGMMA_VARIANTS else _mma_gemms
    for t0 in range(0, T, CHUNK_TOKENS):  # tokens are independent: chunks give the same bits
        t1 = min(T, t0 + CHUNK_TOKENS)
        y = gemms(variant, x[t0:t1], w13_packed, w13_scale, w2_packed, w2_scale, topk_ids[t0:t1], topk_weights[t0:t1],
                  routing, E, H, I, k, sms, None if x_k is None else x_k[t0:t1])
        _finalize_slots(y, topk_ids[t0:t1], None if add is None else add[t0:t1], out[t0:t1], E, sms, add_stream)
    return out


def _mma_gemms(variant, x, w13_packed, w13_scale, w2_packed, w2_scale, topk_ids, topk_weights, routing, E, H, I, k,
               sms, x_k=None) -> torch.Tensor:
    """The skinny path and the tile path (``VARIANTS``): prep (the sort; for the tile path x permuted too, unless
    ``x_k`` is that), the gate/up GEMM -> h [T*k, I], the down GEMM -> y [T*k, H] (each slot's weighted row, bf16),
    returned."""
    from kdray.kernels.cuda_module import launch

    dev, i32 = x.device, np.int32
    slots, tiled = x.shape[0] * k, is_tiled(w13_packed)
    mt = SKINNY_ROWS if variant == SKINNY else VARIANTS[variant][0]
    max_passes = min(E, slots) + slots // mt  # sum over experts of ceil(rows_e / mt) never exceeds this
    sorted_slot = torch.empty(slots, dtype=torch.int32, device=dev)  # sorted row -> t * k + j
    passes = torch.empty(1 + max_passes, 4, dtype=torch.int32, device=dev)  # [0, 0]: count; (e, row0, rows, 0)
    y = torch.empty(slots, H, dtype=torch.bfloat16, device=dev)  # skipped ids' rows: unwritten, read and dropped
    if variant == SKINNY:  # persistent blocks over (pass, column tile) items: at most a wave; x and h as they are
        h = torch.empty(slots, I, dtype=torch.bfloat16, device=dev)
        _prep(x, topk_ids, None, sorted_slot, passes, routing, E, H, mt, sms)  # the sort only
        up_items = max_passes * (I // 16)
        warps, blocks, ahead = _skinny_up_form(up_items, sms)
        launch("w4a16_moe", f"moe_up_skinny_w{warps}_b{blocks}_a{ahead}", (min(up_items, blocks * sms),),
               (32 * warps,), (x, w13_packed, w13_scale, sorted_slot, passes, h, i32(k), i32(H), i32(I), i32(tiled)),
               device=dev)
        down_items = max_passes * math.ceil(H / SKINNY_DOWN_ROWS)
        launch("w4a16_moe", "moe_down_skinny", (min(down_items, SKINNY_DOWN_BLOCKS * sms),), (SKINNY_DOWN_THREADS,),
               (h, w2_packed, w2_scale, sorted_slot, passes, topk_weights, y, i32(H), i32(I), i32(tiled)), device=dev)
        return y
    # The tile path reads activations in the GEMMs' k order, rows padded to a multiple of 128 (the padding must
    # read as zero).
    x_perm = torch.empty(x.shape[0], _round128(H), dtype=torch.bfloat16, device=dev) if x_k is None else x_k
    h = (torch.empty if I % 128 == 0 else torch.zeros)(slots, _round128(I), dtype=torch.bfloat16, device=dev)
    _prep(x, topk_ids, x_perm if x_k is None else None, sorted_slot, passes, routing, E, H, mt, sms)
    _tile_gemms(variant, x_perm, h, y, w13_packed, w13_scale, w2_packed, w2_scale, sorted_slot, passes,
                topk_weights, k, H, I, E, slots, max_passes, sms, tiled)
    return y


def _finalize_slots(y, topk_ids, add, out, E, sms, add_stream):
    """``moe_finalize_slots``: out [T, H] = each token's rows of y [T * k, H] summed in slot order (the same bits on
    every call), + add; after ``add_stream``'s work (add's writer) when there is one."""
    from kdray.kernels.cuda_module import launch

    (T, k), H = topk_ids.shape, out.shape[1]
    n8 = T * H // 8
    _join(add_stream, out.device)
    # 16 blocks an SM (H200, K2 shard, in the MoE after moe_down_rs, against 4: 4096 tokens 212 -> 185 us, 8192
    # 390 -> 331 us; alone at 4096 163 -> 143 us, 4.1 TB/s)
    launch("w4a16_moe", "moe_finalize_slots", (min(16 * sms, math.ceil(n8 / 256)),), (256,),
           (y, topk_ids, add if add is not None else 0, out, np.int32(T), np.int32(H), np.int32(k), np.int32(E)),
           device=out.device)


def _join(add_stream: torch.cuda.Stream | None, dev: torch.device):
    """The current stream waits for ``add_stream``'s work so far (``add``'s writer), when there is one."""
    if add_stream is not None:
        torch.cuda.current_stream(dev).wait_stream(add_stream)


def _skinny_up_form(items: int, sms: int) -> tuple[int, int, int]:
    """(warps, blocks per SM, chunks ahead) of the gate/up kernel for at most ``items`` (pass, column tile) items."""
    return next(form[1:] for form in reversed(SKINNY_UP_FORMS) if items >= form[0] * sms)


def _prep(x, topk_ids, x_perm, sorted_slot, passes, routing, E, H, mt, sms):
    """moe_prep: block 0 sorts the slots by expert into passes of at most ``mt`` rows (1024 threads, 2E ints of shared
    memory); the other blocks, when there is an ``x_perm`` to write, permute x into it (a thread per 16-byte piece).
    With ``routing`` (from :func:`routed_w4a16_moe`) moe_route_prep routes the tokens in block 0 first. Over
    ``SORT_SPLIT_SLOTS`` slots the sort is split over blocks: moe_prep_count, then moe_prep_place."""
    from kdray.kernels.cuda_module import launch

    T, k = topk_ids.shape
    i32 = np.int32
    perm_blocks = 0 if x_perm is None else min(4 * sms, math.ceil(T * _round128(H) // 8 / 1024))
    prep = (x, 0 if x_perm is None else x_perm, sorted_slot, passes)
    if routing is None and T * k > SORT_SPLIT_SLOTS:
        S = min(SORT_BLOCKS, math.ceil(T * k / 1024))
        chunk = math.ceil(T * k / S)
        hist = torch.empty(S, E, dtype=torch.int32, device=x.device)  # [S, E]: each sort block's count per expert
        launch("w4a16_moe", "moe_prep_count", (S + perm_blocks,), (1024,),
               (topk_ids, x, prep[1], hist, i32(T), i32(k), i32(E), i32(H), i32(S), i32(chunk)),
               shared_mem=4 * E, device=x.device)
        launch("w4a16_moe", "moe_prep_place", (S,), (1024,),
               (topk_ids, hist, sorted_slot, passes, i32(T), i32(k), i32(E), i32(mt), i32(S), i32(chunk)),
               shared_mem=4 * E, device=x.device)
    elif routing is None:
        launch("w4a16_moe", "moe_prep", (1 + perm_blocks,), (1024,),
               (topk_ids, *prep, i32(T), i32(k), i32(E), i32(H), i32(mt)), shared_mem=8 * E, device=x.device)
    else:
        args, defines, group_scratch = routing
        # shared memory: the routed ids, then the block sort's 2E ints, the warp sort's 32 or the group scratch
        launch("moe_route", "moe_route_prep", (1 + perm_blocks,), (1024,), (*args, *prep, i32(H), i32(mt)),
               shared_mem=4 * T * k + max(8 * E, 128, group_scratch), device=x.device, defines=defines)


def _tile_gemms(variant, x_perm, h, y, w13_packed, w13_scale, w2_packed, w2_scale, sorted_slot, passes,
                topk_weights, k, H, I, E, slots, max_passes, sms, tiled):
    """The tile path's gate/up and down launches (``VARIANTS[variant]``)."""
    from kdray.kernels.cuda_module import launch

    dev, i32 = x_perm.device, np.int32
    mt, nt, stages = VARIANTS[variant]
    bn = 128 * nt
    # GEMMs: grid (pass, group of N tiles), 256 threads, `stages` of weights, scales and activations.
    smem = stages * (bn * KC // 2 + bn * KC // 16 + mt * KC * 2)
    busy = min(E, slots)
    n_up = I // (bn // 2)  # tiles of bn/2 gate + bn/2 up rows over K = H
    tpb = _tiles_per_block(n_up, math.ceil(H / KC), busy, sms)
    launch("w4a16_moe", f"moe_up_{variant}", (max_passes, math.ceil(n_up / tpb)), (THREADS,),
           (x_perm, w13_packed, w13_scale, sorted_slot, passes, h, i32(k), i32(H), i32(I), i32(n_up), i32(tpb),
            i32(tiled)),
           shared_mem=smem, device=dev)
    n_down = math.ceil(H / bn)  # tiles of bn output rows over K = I
    tpb = _tiles_per_block(n_down, math.ceil(I / KC), busy, sms)
    launch("w4a16_moe", f"moe_down_{variant}", (max_passes, math.ceil(n_down / tpb)), (THREADS,),
           (h, w2_packed, w2_scale, sorted_slot, passes, topk_weights, y, i32(k), i32(H), i32(I), i32(n_down),
            i32(tpb), i32(tiled)), shared_mem=smem, device=dev)


def _wgmma_gemms(variant, x, w13_packed, w13_scale, w2_packed, w2_scale, topk_ids, topk_weights, routing,
                 E, H, I, k, sms, x_k=None) -> torch.Tensor:
    """The wgmma family: prep (the sort; for ``rs`` x permuted too, unless ``x_k`` is that), the gate/up GEMM
    (``moe_up_rs`` or ``moe_up_<variant>``) -> h [T*k, I], the down GEMM (``moe_down_rs``, or the ``wg`` one of the
    pass size) -> y [T*k, H] (each slot's weighted row, bf16), returned."""
    from kdray.kernels.cuda_module import launch

    dev, i32 = x.device, np.int32
    T = x.shape[0]
    slots = T * k
    wgm, swapped = WGMMA_VARIANTS[variant]
    mt = 64 * wgm
    max_passes = min(E, slots) + slots // mt
    if max_passes > 65535:  # the grid's y dimension
        raise ValueError(f"{T} tokens x top-{k} over {E} experts make up to {max_passes} passes of {mt} rows, past the "
                         f"65535 one launch takes; lower CHUNK_TOKENS")
    sorted_slot = torch.empty(slots, dtype=torch.int32, device=dev)
    passes = torch.empty(1 + max_passes, 4, dtype=torch.int32, device=dev)
    h = torch.empty(slots, I, dtype=torch.bfloat16, device=dev)
    y = torch.empty(slots, H, dtype=torch.bfloat16, device=dev)  # skipped ids' rows: unwritten, read and dropped
    # The swapped gate/up GEMM reads x in the tile path's k order ([T, H], H % 256 == 0: no padding); the prep's
    # other blocks write it. The other wgmma kernels read x and h as they are: block 0 only.
    x_perm = (torch.empty(T, H, dtype=torch.bfloat16, device=dev) if x_k is None else x_k) if swapped else None
    _prep(x, topk_ids, x_perm if x_k is None else None, sorted_slot, passes, routing, E, H, mt, sms)
    busy = min(E, slots)
    swapped_down = swapped and I <= RSD_MAX_I  # reads h in the logical k order moe_up_rs then writes
    if swapped:  # a block per 128 outputs of h and pass
        launch("w4a16_moe", "moe_up_rs", (I // 128, max_passes), (RS_THREADS,),
               (x_perm, w13_packed, w13_scale, sorted_slot, passes, h, i32(k), i32(H), i32(I), i32(swapped_down)),
               shared_mem=RS_SMEM, device=dev)
    else:
        n_up = I // 128  # tiles of 128 gate + 128 up rows over K = H
        tpb = _tiles_per_block(n_up, H // 64, busy, sms)
        launch("w4a16_moe", f"moe_up_{variant}", (math.ceil(n_up / tpb), max_passes), (WG_THREADS,),
               (x, w13_packed, w13_scale, sorted_slot, passes, h, i32(k), i32(H), i32(I), i32(n_up), i32(tpb)),
               shared_mem=WG_SMEM[wgm], device=dev)
    n_down = H // WG_BN  # tiles of 256 output rows over K = I
    res = I <= WG_RES_K  # h rows resident in shared memory across the block's N tiles (always so for moe_down_rs)
    # resident rows pay their load once per block: ~64 stages each (H200, K2 TP8: 8% less time at 2080 tokens, 2-4%
    # at 4096, the same at 16,384)
    tpb = _tiles_per_block(n_down, I // 64, busy, sms, stages=64 if res else 32)
    if swapped_down:
        name, threads, smem = "moe_down_rs", RS_THREADS, RSD_SMEM
    else:  # the down GEMM of the pass size
        name, threads = f"moe_down_wg{mt}" + ("_res" if res else ""), WG_THREADS
        smem = (WG_SMEM_RES if res else WG_SMEM)[wgm]
    launch("w4a16_moe", name, (math.ceil(n_down / tpb), max_passes), (threads,),
           (h, w2_packed, w2_scale, sorted_slot, passes, topk_weights, y, i32(k), i32(H), i32(I), i32(n_down),
            i32(tpb)), shared_mem=smem, device=dev)
    return y
