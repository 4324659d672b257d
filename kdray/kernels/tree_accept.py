"""Walk a verified draft tree with the target's per-node choices (DDTree acceptance).

Per sequence: ``cur = 0``; repeat ``t = choices[cur]``; if a node ``c < num_nodes`` has
``parents[c] == cur`` and ``tokens[c] == t`` (siblings carry distinct tokens), accept it and move there;
otherwise ``t`` is the next bonus token and the walk stops. The root always counts as accepted. With ``stop``, a
sequence's walk also stops where ``t`` is its stop token, which becomes the bonus (nothing after it is accepted: a
thought's end marker, after which a grammar masks the choices again).
"""
from __future__ import annotations

import numpy as np
import torch

from kdray.kernels.cuda_module import launch

BLOCK = 256  # threads per sequence in the CUDA kernel


def tree_accept_reference(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                          choices: torch.Tensor, max_depth: int, stop: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch reference of :func:`tree_accept` (returns tensors on the inputs' device)."""
    B = tokens.shape[0]
    accepted = torch.full((B, max_depth + 1), -1, dtype=torch.int32)
    accept_len = torch.ones(B, dtype=torch.int32)
    next_token = torch.zeros(B, dtype=torch.int64)
    tok, par, cho = tokens.cpu(), parents.cpu(), choices.cpu()
    stops = [-1] * B if stop is None else stop.tolist()
    for b, n in enumerate(num_nodes.tolist()):
        cur, path = 0, [0]
        while True:
            t = int(cho[b, cur])
            hit = ((par[b, :n] == cur) & (tok[b, :n] == t)).nonzero()
            if len(hit) == 0 or len(path) > max_depth or t == stops[b] >= 0:
                break
            cur = int(hit[0])
            path.append(cur)
        accepted[b, :len(path)] = torch.tensor(path, dtype=torch.int32)
        accept_len[b] = len(path)
        next_token[b] = t
    dev = tokens.device
    return accepted.to(dev), accept_len.to(dev), next_token.to(dev)


def _check(tokens, parents, num_nodes, choices, max_depth, stop):
    B, n1 = tokens.shape
    if tokens.dtype != torch.int64 or choices.dtype != torch.int64 or choices.shape != (B, n1):
        raise ValueError(f"tokens and choices must be int64 [B, 1+N], got {tokens.dtype} {tuple(tokens.shape)} "
                         f"and {choices.dtype} {tuple(choices.shape)}")
    if parents.dtype != torch.int32 or parents.shape != (B, n1):
        raise ValueError(f"parents must be int32 [{B}, {n1}], got {parents.dtype} {tuple(parents.shape)}")
    if num_nodes.dtype != torch.int32 or num_nodes.shape != (B,):
        raise ValueError(f"num_nodes must be int32 [{B}], got {num_nodes.dtype} {tuple(num_nodes.shape)}")
    if stop is not None and (stop.dtype != torch.int64 or stop.shape != (B,)):
        raise ValueError(f"stop must be int64 [{B}], got {stop.dtype} {tuple(stop.shape)}")
    given = (tokens, parents, num_nodes, choices) + (() if stop is None else (stop,))
    if len({t.device for t in given}) != 1:
        raise ValueError("tokens, parents, num_nodes, choices and stop must be on one device")
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")


def tree_accept(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor, choices: torch.Tensor,
                max_depth: int, stop: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accepted path of every sequence.

    tokens ``[B, 1+N]`` int64, parents ``[B, 1+N]`` int32, num_nodes ``[B]`` int32, choices ``[B, 1+N]``
    int64 (the target's token at every node), stop ``[B]`` int64 or None (-1: none) -> accepted
    ``[B, 1+max_depth]`` int32 (node indices from the root 0, padded with -1), accept_len ``[B]`` int32 (>= 1,
    counts the root), next_token ``[B]`` int64.
    """
    _check(tokens, parents, num_nodes, choices, max_depth, stop)
    if not tokens.is_cuda:
        return tree_accept_reference(tokens, parents, num_nodes, choices, max_depth, stop)
    if not all(t.is_contiguous() for t in (tokens, parents, num_nodes, choices)) or not (
            stop is None or stop.is_contiguous()):
        raise ValueError("tree_accept's CUDA path needs contiguous tensors")
    B, n1 = tokens.shape
    accepted = torch.empty(B, max_depth + 1, dtype=torch.int32, device=tokens.device)  # [B, 1+max_depth]
    accept_len = torch.empty(B, dtype=torch.int32, device=tokens.device)  # [B]
    next_token = torch.empty(B, dtype=torch.int64, device=tokens.device)  # [B]
    if B:
        launch("tree_accept", "tree_accept", grid=(B,), block=(BLOCK,),
               args=(tokens, parents, num_nodes, choices, 0 if stop is None else stop, accepted, accept_len,
                     next_token, np.int32(n1), np.int32(max_depth)),
               device=tokens.device)
    return accepted, accept_len, next_token
