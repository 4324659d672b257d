"""Sigmoid top-k routing of DeepSeek-V3 / Kimi K2 (``noaux_tc``): ``moe_route``.

Experts are chosen by the biased scores ``sigmoid(logits) + bias``, group-limited when ``n_group > 1`` (only the
``topk_group`` groups with the highest sum of their two best choices stay eligible; the others' choice is 0, as
HF masks them), and weighted by the unbiased scores, renormalised over the chosen k and scaled by
``routed_scaling_factor``. With ``local_experts = (e0, n)`` (expert parallelism) ids are made local: ``id - e0``
for experts on this rank, -1 for the others.

CUDA tensors run ``cuda/moe_route.cu``: one warp per token (``moe_route.cuh``: sigmoid, bias, group mask, k rounds
that each take the warp's best of its lanes' best choices, gather, normalise, scale), on torch's current stream, no
host sync. ``w4a16_moe.routed_w4a16_moe`` runs the same routing inside the MoE's prep launch for a few tokens. CPU
tensors run the reference below, the unfused torch code (a dozen kernels on a GPU).
"""
from __future__ import annotations

import numpy as np
import torch

from kdray.kernels.cuda_module import launch

MAX_EXPERTS = 1024  # 32 per lane of the routing warp
MAX_K = 32  # one lane per chosen expert
WARPS = 4  # tokens per block (WARPS in the .cu)


def moe_route_reference(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1,
                        renormalize: bool = True, scale: float = 1.0,
                        local_experts: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused torch form of :func:`moe_route` (same arguments and results)."""
    scores = logits.sigmoid()
    choice = scores + bias
    if n_group > 1:
        T, E = choice.shape
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1).indices, 1.0)
        choice = grouped.masked_fill(keep.unsqueeze(-1) == 0, 0.0).view(T, E)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * scale
    if local_experts is not None:
        e0, n = local_experts
        ids = torch.where((ids >= e0) & (ids < e0 + n), ids - e0, torch.full_like(ids, -1))
    return ids, weights


def check_routing(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int
                  ) -> tuple[int, int]:
    """Check :func:`moe_route`'s operands (on any device); return ``(T, E)``."""
    if logits.dim() != 2 or bias.shape != (logits.shape[1],):
        raise ValueError(f"logits must be [T, E] and bias [E], got {tuple(logits.shape)} and {tuple(bias.shape)}")
    T, E = logits.shape
    if logits.dtype != torch.float32 or bias.dtype != torch.float32:
        raise TypeError(f"routing takes fp32 logits and bias, got {logits.dtype} and {bias.dtype}")
    if n_group < 1 or E % n_group or not 1 <= topk_group <= n_group or not 1 <= top_k <= E:
        raise ValueError(f"need n_group | E={E}, 1 <= topk_group <= n_group and 1 <= top_k <= E; got "
                         f"n_group={n_group}, topk_group={topk_group}, top_k={top_k}")
    if bias.device != logits.device:
        raise ValueError(f"bias is on {bias.device}, logits on {logits.device}")
    return T, E


def check_cuda_routing(E: int, top_k: int, n_group: int):
    """The limits of ``cuda/moe_route.cuh``'s warp per token."""
    if E > MAX_EXPERTS or top_k > MAX_K or n_group > 32:
        raise ValueError(f"the CUDA moe_route takes E <= {MAX_EXPERTS}, top_k <= {MAX_K} and n_group <= 32; got "
                         f"E={E}, top_k={top_k}, n_group={n_group}")


def route_launch(logits: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, top_k: int,
                 n_group: int, topk_group: int, renormalize: bool, scale: float,
                 local_experts: tuple[int, int] | None) -> tuple[tuple, tuple[tuple[str, int], ...]]:
    """(The routing arguments, the defines) of ``cuda/moe_route.cu``'s kernels for contiguous ``logits [T, E]``,
    ``bias [E]`` and outputs ``ids [T, k]``, ``weights [T, k]``."""
    T, E = logits.shape
    e0, n_local = local_experts if local_experts is not None else (0, E)
    i32 = np.int32
    return ((logits, bias, ids, weights, i32(T), i32(E), i32(top_k), i32(n_group), i32(topk_group),
             i32(renormalize), np.float32(scale), i32(e0), i32(n_local)), (("EPL", (E + 31) // 32),))


def moe_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1,
              renormalize: bool = True, scale: float = 1.0, local_experts: tuple[int, int] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` fp32, correction bias ``[E]`` fp32 -> (ids ``[T, k]`` int64 in descending choice
    order, weights ``[T, k]`` fp32)."""
    T, E = check_routing(logits, bias, top_k, n_group, topk_group)
    if not logits.is_cuda:
        return moe_route_reference(logits, bias, top_k, n_group, topk_group, renormalize, scale, local_experts)
    check_cuda_routing(E, top_k, n_group)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    if T:
        args, defines = route_launch(logits.contiguous(), bias.contiguous(), ids, weights, top_k, n_group, topk_group,
                                     renormalize, scale, local_experts)
        launch("moe_route", "moe_route", ((T + WARPS - 1) // WARPS,), (32 * WARPS,), args, device=logits.device,
               defines=defines)
    return ids, weights
