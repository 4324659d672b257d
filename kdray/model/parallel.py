"""The tensor-parallel group a model shard computes in.

Layers only need ``rank``, ``size``, ``all_reduce``, ``all_gather`` and :class:`Collectives`'
``all_reduce_rmsnorm``; the actors package supplies NCCL (GPU) and gloo (CPU) groups with this shape.
``SINGLE`` is the one-shard group used in-process.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kdray.kernels.rmsnorm import rmsnorm


class Collectives:
    """The collective a decoder layer's norms begin with, built from ``all_reduce``; a group with a fused kernel
    overrides it."""

    def all_reduce_rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                           out_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, dim]`` (this rank's partial sum) -> (``rmsnorm(s)``, ``s``), ``s = sum(x)`` over the group; the
        norm also into ``out_k`` in the experts' k order when given (``rmsnorm``'s)."""
        s = self.all_reduce(x)
        return rmsnorm(s, weight, eps, out_k), s


@dataclass(frozen=True)
class SingleGroup(Collectives):
    """A group of one shard: collectives are identities."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return t


SINGLE = SingleGroup()


def vocab_range(vocab: int, group) -> tuple[int, int]:
    """The ``[start, end)`` rows of a vocabulary padded up to a multiple of the group's width (as vLLM pads it)
    owned by ``group.rank``; rows at or past ``vocab`` are padding."""
    n = -(-vocab // group.size)
    return group.rank * n, (group.rank + 1) * n


def shard_range(total: int, group, what: str) -> tuple[int, int]:
    """The ``[start, end)`` slice of ``total`` owned by ``group.rank``; ``total`` must divide evenly."""
    if total % group.size:
        raise ValueError(f"{what}={total} is not divisible by the tensor-parallel width {group.size}")
    n = total // group.size
    return group.rank * n, (group.rank + 1) * n
