"""The target's log-probabilities of the tokens it emits, as reported to users (vLLM's default: the raw logits'
``log_softmax``, before penalties, bias and temperature), with the likeliest alternatives."""
from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits ``[..., V]`` fp32, the emitted tokens ``[...]`` -> (values ``[..., 1+K]`` fp32: the token's
    log-probability, then the top K = min(k, V) best first; ids ``[..., 1+K]`` int64: the token's rank (1 + the
    tokens strictly likelier), then the top K's ids)."""
    logp = logits.float().log_softmax(-1)
    chosen = logp.gather(-1, tokens[..., None])  # [..., 1]
    rank = (logp > chosen).sum(-1, keepdim=True) + 1  # [..., 1]
    top = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return torch.cat([chosen, top.values], -1), torch.cat([rank, top.indices], -1)
