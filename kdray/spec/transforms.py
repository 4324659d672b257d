"""A request's changes to the target's logits before the choice: ``logit_bias``, ``min_tokens`` and the penalties.

Each verified node gets exactly what autoregressive decoding would apply at its position: the changes depend
only on the request's settings and on the tokens generated before the node (the output so far, then the
node's path in the tree: :func:`add_path_tokens`), so DDTree and chain stay lossless under them. Applied in
vLLM's order on the raw logits: the ``min_tokens`` ban, ``logit_bias``, then the repetition, frequency and
presence penalties (temperature, ``min_p``, top-k and top-p follow in :func:`kdray.spec.sampling.choose_tokens`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Penalties:
    """Per row: the output's token counts, the prompt's tokens and the three penalties (neutral: 0, 0, 1)."""

    counts: torch.Tensor  # [R, V] fp32: each token's count among the tokens generated before the row's choice
    prompt: torch.Tensor  # [R, V] bool: the token is in the prompt
    presence: torch.Tensor  # [R] fp32
    frequency: torch.Tensor  # [R] fp32
    repetition: torch.Tensor  # [R] fp32


@dataclass
class RowTransforms:
    """Per-row changes; a field left None is off for the whole batch (no row uses it)."""

    bias_ids: torch.Tensor | None = None  # [R, MAX_LOGIT_BIAS] int64 (padding: id 0 with bias 0)
    bias_values: torch.Tensor | None = None  # [R, MAX_LOGIT_BIAS] fp32
    ban_ids: torch.Tensor | None = None  # [R, MAX_BAN] int64: masked while banned (padding: -1)
    banned: torch.Tensor | None = None  # [R] bool: fewer than min_tokens tokens generated before the choice
    penalties: Penalties | None = None


def apply_transforms(logits: torch.Tensor, t: RowTransforms) -> torch.Tensor:
    """logits ``[R, V]`` fp32 -> the changed logits (a new tensor; ``logits`` is left as it is)."""
    x = logits
    if t.ban_ids is not None:
        on = (t.ban_ids >= 0) & t.banned[:, None]  # [R, MAX_BAN]
        hit = torch.zeros_like(x).scatter_add_(1, t.ban_ids.clamp(min=0), on.float())  # [R, V]
        x = x.masked_fill(hit > 0, float("-inf"))
    if t.bias_ids is not None:
        x = x + torch.zeros_like(x).scatter_add_(1, t.bias_ids, t.bias_values)
    if t.penalties is not None:
        x = penalise(x, t.penalties)
    return x


def penalise(x: torch.Tensor, p: Penalties) -> torch.Tensor:
    """Repetition (HF / vLLM: over the prompt and the output, positive logits divided by it, negative ones
    multiplied), then frequency and presence (OpenAI: over the output, ``count * f + (count > 0) * p`` subtracted)."""
    seen = p.counts > 0  # [R, V]
    rep = p.repetition[:, None]
    x = torch.where(seen | p.prompt, torch.where(x > 0, x / rep, x * rep), x)
    return x - p.counts * p.frequency[:, None] - seen.float() * p.presence[:, None]


def add_path_tokens(counts: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, steps: int) -> torch.Tensor:
    """Add to each node's row of ``counts [B * (1+N), V]`` its path's tokens (the node and its ancestors, the root
    excluded: it is counted already), walking up ``steps`` (the trees' depth) parents. tokens ``[B, 1+N]`` int64,
    parents ``[B, 1+N]`` int32 (-1 above the root). Returns ``counts``, changed in place."""
    B, width = tokens.shape
    node = torch.arange(width, device=tokens.device).expand(B, width)  # [B, 1+N]
    for _ in range(min(steps, width - 1)):
        up = node.clamp(min=0)
        counts.scatter_add_(1, tokens.gather(1, up).reshape(-1, 1), (node > 0).float().reshape(-1, 1))
        node = parents.gather(1, up).long()
    return counts
