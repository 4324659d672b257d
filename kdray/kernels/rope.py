"""The rotary embedding in torch: the reference of the fused kernels that rope (``mla_rope_cache``,
``gqa_rope_cache``) and what ``kdray.model.layers.Rotary`` runs."""
from __future__ import annotations

import torch


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x ``[T, heads, D]``, cos/sin ``[T, D/2]`` -> ``[T, heads, D]``. ``interleaved`` (DeepSeek): pairs
    ``(2p, 2p+1)`` rotated, written de-interleaved (as HF does); otherwise (NeoX / Llama) element ``p`` is paired with
    ``D/2 + p``."""
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
