"""The target's log-probabilities of the tokens it emits (or of a prompt's tokens), as reported to users (vLLM's
default: the raw logits' ``log_softmax``, before penalties, bias and temperature), with the likeliest alternatives."""
from __future__ import annotations

from collections.abc import Callable

import torch

HEAD_ROWS = 512  # rows whose logits a prompt's scoring makes at once: [512, V] fp32, 320 MiB at K2's 163840 tokens


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits ``[..., V]`` fp32, the emitted tokens ``[...]`` -> (values ``[..., 1+K]`` fp32: the token's
    log-probability, then the top K = min(k, V) best first; ids ``[..., 1+K]`` int64: the token's rank (1 + the
    tokens strictly likelier), then the top K's ids)."""
    logp = logits.float().log_softmax(-1)
    chosen = logp.gather(-1, tokens[..., None])  # [..., 1]
    rank = (logp > chosen).sum(-1, keepdim=True) + 1  # [..., 1]
    top = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return torch.cat([chosen, top.values], -1), torch.cat([rank, top.indices], -1)


def head_logprobs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, tokens: torch.Tensor, k: int,
                  rows: int = HEAD_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs` of ``tokens [S]`` under the logits ``head(hidden)`` of ``hidden [S, H]``, taken
    ``rows`` at a time: a long prompt's logits ``[S, V]`` never exist whole -> (values, ids) ``[S, 1+K]``."""
    parts = [token_logprobs(head(h), t, k) for h, t in zip(hidden.split(rows), tokens.split(rows))]
    return torch.cat([v for v, _ in parts]), torch.cat([i for _, i in parts])
