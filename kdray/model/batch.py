"""Per-forward metadata: where each token of a pass sits in its sequence and in the paged KV cache.

One ``ForwardBatch`` describes one target (or drafter) forward over several sequences. Tokens are
flattened ``[T]``; sequence ``b`` owns rows ``cu_q[b]:cu_q[b+1]``. Two kinds of pass exist:

- prefill (``tree_mask`` None): a prompt with nothing cached yet, causal inside the chunk;
- verify (``tree_mask`` set): the tokens follow a cached prefix of ``prefix_lens[b]`` positions and see
  each other through the tree's ancestor bitmask (a chain's mask is lower-triangular, one token's is 1). A chunk of
  a prompt after cached tokens is this kind with a causal mask (:func:`prompt_chunks`), and carries its
  ``context`` (cached and new positions) for an attention that reads them as a prompt's keys.

The KV of token ``i`` of sequence ``b`` is written at cache position ``prefix_lens[b] + i``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch


def device_array(values, device: torch.device | str, dtype: type = np.int64) -> torch.Tensor:
    """``values`` (a list or an array) as a tensor on ``device``: made through numpy (``torch.tensor`` parses a list
    of ints several times slower) and, for a GPU, copied from pinned memory, so the copy queues behind the stream's
    work instead of the host waiting for it."""
    host = torch.from_numpy(np.asarray(values, dtype=dtype))
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class ChunkContext:
    """The positions a batch of prompt chunks after cached tokens attends to: each sequence's cached and new ones."""
    lens: list[int]  # host: prefix_lens[b] + q_lens[b]
    cu: torch.Tensor  # [B+1] int32, their row offsets
    block_table: torch.Tensor  # [B, max_pages] int32
    page_size: int

    @cached_property
    def slots(self) -> torch.Tensor:
        """Flat cache rows ``[sum(lens)]`` of positions 0 .. lens[b] - 1 of every sequence."""
        zeros = torch.zeros(len(self.lens), dtype=torch.int32, device=self.cu.device)
        return ForwardBatch.slots(self.block_table, zeros, self.cu, self.page_size, sum(self.lens))


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 (RoPE positions: prefix + depth inside a tree)
    cu_q: torch.Tensor  # [B+1] int32
    q_lens: list[int]  # host copy of the per-sequence token counts
    prefix_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_pages] int32
    slot_mapping: torch.Tensor  # [T] int64: flat cache row (page * page_size + offset) of each token's KV
    tree_mask: torch.Tensor | None  # [B, Qmax, ceil(Qmax/32)] int32, None for prefill
    context: ChunkContext | None = None  # set by prompt_chunks(): prompt chunks after cached tokens

    @property
    def is_prefill(self) -> bool:
        return self.tree_mask is None

    @staticmethod
    def slots(block_table: torch.Tensor, prefix_lens: torch.Tensor, cu_q: torch.Tensor, page_size: int,
              total: int) -> torch.Tensor:
        """Flat cache rows ``[T]`` for positions ``prefix_lens[b] + i`` of every sequence's tokens."""
        seq = torch.repeat_interleave(torch.arange(len(prefix_lens), device=cu_q.device),
                                      (cu_q[1:] - cu_q[:-1]).long(), output_size=total)  # [T]
        local = torch.arange(total, device=cu_q.device) - cu_q[:-1].long()[seq]
        pos = prefix_lens.long()[seq] + local
        return block_table.long()[seq, pos // page_size] * page_size + pos % page_size

    @classmethod
    def build(cls, input_ids: torch.Tensor, positions: torch.Tensor, q_lens: list[int], prefix_lens: list[int],
              block_table: torch.Tensor, page_size: int, tree_mask: torch.Tensor | None) -> "ForwardBatch":
        """Assemble a batch on ``input_ids.device`` from host lists and device tensors."""
        dev = input_ids.device
        cu_q = device_array(np.cumsum([0, *q_lens]), dev, np.int32)  # [B+1]
        prefix = device_array(prefix_lens, dev, np.int32)  # [B]
        block_table = block_table.to(dev)
        return cls(input_ids=input_ids, positions=positions, cu_q=cu_q, q_lens=list(q_lens), prefix_lens=prefix,
                   block_table=block_table,
                   slot_mapping=cls.slots(block_table, prefix, cu_q, page_size, int(sum(q_lens))),
                   tree_mask=tree_mask)


def join(first: ForwardBatch, second: ForwardBatch) -> ForwardBatch:
    """One verify-form pass over the sequences of two verify-form batches (``first``'s rows, then ``second``'s), made
    on the device: their masks zero-padded to the wider shape. A step's trees and a prompt chunk after them run so,
    reading the weights once."""
    if first.is_prefill or second.is_prefill or first.context is not None or second.context is not None:
        raise ValueError("join() takes verify-form batches without a chunk context")
    q, w = (max(first.tree_mask.shape[i], second.tree_mask.shape[i]) for i in (1, 2))
    masks = [torch.nn.functional.pad(b.tree_mask, (0, w - b.tree_mask.shape[2], 0, q - b.tree_mask.shape[1]))
             for b in (first, second)]  # [B_i, Qmax, W] each
    return ForwardBatch(input_ids=torch.cat([first.input_ids, second.input_ids]),
                        positions=torch.cat([first.positions, second.positions]),
                        cu_q=torch.cat([first.cu_q, second.cu_q[1:] + first.cu_q[-1]]),
                        q_lens=first.q_lens + second.q_lens,
                        prefix_lens=torch.cat([first.prefix_lens, second.prefix_lens]),
                        block_table=torch.cat([first.block_table, second.block_table]),
                        slot_mapping=torch.cat([first.slot_mapping, second.slot_mapping]),
                        tree_mask=torch.cat(masks))


def prompt_chunks(input_ids: torch.Tensor, positions: torch.Tensor, q_lens: list[int], prefix_lens: list[int],
                  block_table: torch.Tensor, page_size: int) -> ForwardBatch:
    """Prompt chunks of ``q_lens`` tokens after ``prefix_lens`` cached ones: the verify form with a causal mask over
    each chunk, and the chunks' :class:`ChunkContext`; with nothing cached, the prefill form."""
    if not any(prefix_lens):
        return ForwardBatch.build(input_ids, positions, q_lens, prefix_lens, block_table, page_size, None)
    fb = ForwardBatch.build(input_ids, positions, q_lens, prefix_lens, block_table, page_size,
                            causal_tree_mask(q_lens, input_ids.device))
    lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    fb.context = ChunkContext(lens, device_array(np.cumsum([0, *lens]), input_ids.device, np.int32), fb.block_table,
                              page_size)
    return fb


def uniform_batch(input_ids: torch.Tensor, positions: torch.Tensor, width: int, prefix_lens: torch.Tensor,
                  block_table: torch.Tensor, page_size: int, tree_mask: torch.Tensor) -> ForwardBatch:
    """A verify-shaped batch built on the device with no host values: ``width`` tokens per sequence (a tree or a
    draft block) after each sequence's cached ``prefix_lens [B]`` (int32, on the device)."""
    B, dev = prefix_lens.shape[0], input_ids.device
    cu_q = torch.arange(0, (B + 1) * width, width, dtype=torch.int32, device=dev)  # [B+1]
    return ForwardBatch(input_ids=input_ids, positions=positions, cu_q=cu_q, q_lens=[width] * B,
                        prefix_lens=prefix_lens, block_table=block_table,
                        slot_mapping=ForwardBatch.slots(block_table, prefix_lens, cu_q, page_size, B * width),
                        tree_mask=tree_mask)


def causal_tree_mask(q_lens: list[int], device: torch.device) -> torch.Tensor:
    """Lower-triangular bitmask ``[B, Qmax, W]``: token i sees tokens 0..i of its own chunk. Made on ``device``
    (word w of row i has its low ``clamp(i + 1 - 32 w, 0, 32)`` bits set): no host work that grows with Qmax (the
    host-built mask took 0.1-2.5 ms for 16-512 tokens on a cached prompt's path)."""
    qmax = max(q_lens)
    i = torch.arange(qmax, device=device)[:, None]  # [Qmax, 1]
    n = (i + 1 - 32 * torch.arange((qmax + 31) // 32, device=device)[None, :]).clamp(0, 32)  # [Qmax, W] bits set
    words = (torch.ones_like(n) << n) - 1  # int64 in [0, 2^32)
    mask = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # [Qmax, W] as int32 bits
    return mask.unsqueeze(0).expand(len(q_lens), -1, -1).contiguous()  # [B, Qmax, W]


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bool -> ``[..., ceil(n/32)]`` int32, bit j%32 of word j//32 set where ``bits[..., j]``."""
    n = bits.shape[-1]
    words = (n + 31) // 32
    padded = torch.zeros(*bits.shape[:-1], words * 32, dtype=torch.int64, device=bits.device)
    padded[..., :n] = bits.long()
    weights = (torch.ones(32, dtype=torch.int64, device=bits.device) << torch.arange(32, device=bits.device))
    w = (padded.view(*bits.shape[:-1], words, 32) * weights).sum(-1)  # [..., W] in [0, 2^32)
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)
