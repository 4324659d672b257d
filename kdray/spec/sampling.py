"""The target's choice at every verified node: argmax, or an exact sample keyed on (seed, position).

Sampling uses the Gumbel-max trick with noise from a counter-based hash of the request's seed, the
token's absolute position and the vocabulary index. The noise a position gets never depends on the
tree, the batch or the step, so a seeded request emits the same tokens under DDTree, chain and plain
autoregressive decoding, and ``argmax(logits / T + Gumbel)`` restricted to the top-k / top-p set is an
exact sample from the adjusted distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
_MIX = 0x045D9F3B  # < 2^31, so products of 32-bit values stay inside int64


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors holding values in [0, 2^32)."""
    x = (((x >> 16) ^ x) * _MIX) & _M32
    x = (((x >> 16) ^ x) * _MIX) & _M32
    return (x >> 16) ^ x


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise ``[R, vocab]`` (fp32) determined by ``seeds [R]`` and ``positions [R]`` alone."""
    key = _hash32(_hash32(seeds & _M32) ^ _hash32(((seeds >> 32) & _M32) ^ (positions & _M32)))  # [R]
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _hash32((key[:, None] + v[None, :] * 0x9E3779B1) & _M32)  # [R, V]
    u = (h.double() + 0.5) / 4294967296.0
    return (-torch.log(-torch.log(u))).float()


@dataclass
class RowParams:
    """Per-row sampling settings for a verify pass, one row per tree node (device tensors)."""

    temperature: torch.Tensor  # [R] fp32, 0 = greedy
    top_k: torch.Tensor  # [R] int64, 0 = off
    top_p: torch.Tensor  # [R] fp32, 1 = off
    seeds: torch.Tensor  # [R] int64
    all_greedy: bool  # host flag: skip the sampling path entirely
    min_p: torch.Tensor | None = None  # [R] fp32, 0 = off; None: off for every row


def choose_tokens(logits: torch.Tensor, positions: torch.Tensor, p: RowParams) -> torch.Tensor:
    """logits ``[R, V]`` fp32 (after :func:`kdray.spec.transforms.apply_transforms`), positions ``[R]`` -> chosen
    token ids ``[R]`` int64, with no host sync: in a batch that samples at all, every row is sampled and greedy rows
    keep their argmax."""
    choice = logits.argmax(-1)
    if p.all_greedy:
        return choice
    sampling = p.temperature > 0  # [R]
    x = logits / torch.where(sampling, p.temperature, 1.0)[:, None]  # [R, V]
    if p.min_p is not None:  # vLLM's: after temperature, drop tokens below min_p times the likeliest's probability
        x = x.masked_fill(x < x.max(-1, keepdim=True).values + p.min_p.log()[:, None], float("-inf"))
    x = _filter_top_k_top_p(x, p.top_k, p.top_p)
    sampled = (x + gumbel_noise(p.seeds, positions, x.shape[-1])).argmax(-1)
    return torch.where(sampling, sampled, choice)


def _filter_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p (nucleus) sets to -inf."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(x.shape[-1], device=x.device)[None, :]
    drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
    probs = sorted_x.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= (top_p[:, None] < 1) & ((probs.cumsum(-1) - probs) >= top_p[:, None])  # keep the crossing token
    return x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
