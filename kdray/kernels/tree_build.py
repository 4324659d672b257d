"""Draft-tree construction (DDTree Algorithm 1): the best-first top-``budget`` prefixes under the draft.

Per sequence ``b`` with budget ``n_b``: ``K = min(n_b, V, max_topk)``; per depth ``d`` the draft's
log-probabilities ``logp[d] = log_softmax(draft_logits[b, d])`` and its top-K tokens. A node is a rank
tuple; ``score(node) = score(parent) + logp_topk[depth-1][rank]`` in fp32 (root 0). Starting from
(rank 0 at depth 1), pop the best candidate, append it as the next node, push its next sibling and
then its first child; stop after ``n_b`` pops. Nodes are stored in pop order, so parents precede
children.

Everything that decides the tree is defined bit for bit, so the CUDA kernel equals this reference:

- Top-K order: logit descending, then token id ascending (ties broken by the smaller id).
- The log-softmax normaliser is ``log(sum_i 2^(x_i log2 e))`` with ``2^y`` evaluated as
  ``2^rint(y) * P(y - rint(y))`` (``P`` a fixed degree-5 fp32 polynomial, relative error 2e-7, every
  step one rounded fp32 operation) and the terms summed in fp64: both sides compute identical terms,
  so their fp64 sums agree far below one fp32 ulp of the result. ``logp = fl32(x - lse)``.
- Heap ties (equal fp32 scores) go to the candidate whose parent came first (the heap never holds two
  candidates with one parent).
Logits must be below 690 (the fp64 terms) and not NaN; -inf (masked) logits are fine.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from kdray.kernels.cuda_module import launch

LOG2E = 1.4426950216293335  # fp32(log2 e)
ROUND = 12582912.0  # 1.5 * 2^23: fp32 (y + ROUND) - ROUND = rint(y) for |y| < 2^22
EXP2_POLY = (1.0, 0.6931470036506653, 0.24022242426872253, 0.05550733581185341, 0.009671512991189957,
             0.0013264722656458616)  # fp32 coefficients of 2^f on [-0.5, 0.5], lowest power first
Y_MIN = -1000.0  # x log2 e is clamped from below here (so masked -inf logits add 2^-1000)


@dataclass
class DraftTree:
    """One draft tree per sequence; index 0 is the root (the bonus token), nodes follow in pop order.

    tokens [B, 1+N] int64 (unused slots 0); parents [B, 1+N] int32 (root and unused -1);
    depths [B, 1+N] int32 (root and unused 0); num_nodes [B] int32 (1 + nodes built);
    mask [B, 1+N, W] int32, W = ceil((1+N)/32): row i has bit j%32 of word j//32 set for every
    ancestor j of i (root included) and for i itself; unused rows have only their own bit.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    num_nodes: torch.Tensor
    mask: torch.Tensor

    def pack(self) -> torch.Tensor:
        """All fields in one int32 buffer ``[B, packed_width(N)]`` (one transfer between actors)."""
        return torch.cat([self.tokens.int(), self.parents, self.depths, self.num_nodes[:, None], self.mask.flatten(1)],
                         dim=1)

    def prefix(self, nodes: int) -> DraftTree:
        """The tree of its first ``nodes`` draft nodes: best-first order makes it the tree of that budget (parents
        precede children, so no kept node loses an ancestor)."""
        n1 = nodes + 1
        return DraftTree(tokens=self.tokens[:, :n1].contiguous(), parents=self.parents[:, :n1].contiguous(),
                         depths=self.depths[:, :n1].contiguous(), num_nodes=self.num_nodes.clamp(max=n1),
                         mask=self.mask[:, :n1, :mask_words(nodes)].contiguous())

    def ancestors(self) -> torch.Tensor:
        """``[B, 1+N, 1+N]`` bool: node i's ancestors (the root and itself included), unpacked from the mask."""
        n1 = self.tokens.shape[1]
        j = torch.arange(n1, device=self.mask.device)
        return ((self.mask[:, :, j // 32] >> (j % 32).to(torch.int32)) & 1).bool()

    @classmethod
    def unpack(cls, buf: torch.Tensor, max_nodes: int) -> DraftTree:
        """Inverse of :meth:`pack`."""
        n1, words = 1 + max_nodes, mask_words(max_nodes)
        tokens, parents, depths, num_nodes, mask = buf.split([n1, n1, n1, 1, n1 * words], dim=1)
        return cls(tokens=tokens.long(), parents=parents.contiguous(), depths=depths.contiguous(),
                   num_nodes=num_nodes.squeeze(1).contiguous(), mask=mask.reshape(-1, n1, words).contiguous())


def mask_words(max_nodes: int) -> int:
    """Number of int32 words W in a mask row of a tree with ``max_nodes`` nodes plus the root."""
    return (max_nodes + 1 + 31) // 32


def packed_width(max_nodes: int) -> int:
    """int32 values per sequence of :meth:`DraftTree.pack`."""
    return (1 + max_nodes) * (3 + mask_words(max_nodes)) + 1


def log_normalizer(x: torch.Tensor) -> torch.Tensor:
    """Reproducible log-sum-exp over the last dim: fp32 ``[..., V]`` -> fp32 ``[...]`` (see module doc)."""
    y = (x * LOG2E).clamp(min=Y_MIN)  # fp32, one rounding
    n = (y + ROUND) - ROUND  # rint(y), exact
    f = y - n  # exact, in [-0.5, 0.5]
    p = torch.full_like(f, EXP2_POLY[-1])
    for c in reversed(EXP2_POLY[:-1]):  # Horner without fused multiply-add
        p = p * f
        p = p + c
    pow2 = ((n.long() + 1023) << 52).view(torch.float64)  # exact 2^n
    return torch.log((p.double() * pow2).sum(-1)).float()


def topk_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 sort keys of fp32 ``x [..., V]``: larger key = larger value, then smaller index."""
    bits = x.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # signed order of the floats
    idx = torch.arange(x.shape[-1], dtype=torch.int64, device=x.device)
    return (ordered << 32) | (0xFFFFFFFF - idx)


def topk_logprobs(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, L, V]`` logits -> (logp fp32 ``[B, L, k]``, ids int64 ``[B, L, k]``), best first."""
    x = draft_logits.float()
    lse = log_normalizer(x)  # [B, L]
    keys = topk_keys(x).topk(k, dim=-1).values  # [B, L, k], descending
    ids = 0xFFFFFFFF - (keys & 0xFFFFFFFF)
    return torch.gather(x, -1, ids) - lse.unsqueeze(-1), ids


def ancestor_mask(parents: torch.Tensor, num_nodes: torch.Tensor, max_nodes: int) -> torch.Tensor:
    """Pack the ancestor-or-self relation of ``parents [B, 1+N]`` into ``[B, 1+N, W]`` int32 words."""
    B, n1 = parents.shape
    W = mask_words(max_nodes)
    vis = torch.eye(n1, dtype=torch.bool).repeat(B, 1, 1)  # [B, 1+N, 1+N]
    par = parents.cpu().tolist()
    for b, nn in enumerate(num_nodes.tolist()):
        for i in range(1, nn):
            vis[b, i] |= vis[b, par[b][i]]
    vis = torch.nn.functional.pad(vis, (0, W * 32 - n1)).view(B, n1, W, 32).long()
    words = (vis << torch.arange(32)).sum(-1)  # [B, 1+N, W] as unsigned 32-bit values
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def best_first(logp: np.ndarray, budget: int) -> tuple[list[int], list[int], list[int]]:
    """Algorithm 1 on one sequence's ``logp [L, K]`` (fp32, rows descending).

    Returns per node in pop order: (depth 1..L, rank, parent index; the root is index 0).
    """
    L, K = logp.shape
    scores = [np.float32(0.0)]  # fp32 score per node, root first
    depths, ranks, parents = [], [], []
    heap = [(-float(logp[0, 0]), 0, 1, 0, logp[0, 0])] if budget > 0 and K > 0 and L > 0 else []
    while heap and len(depths) < budget:  # entries: (-score, parent (the tie-break), depth, rank, score)
        _, parent, depth, rank, score = heapq.heappop(heap)
        node = len(depths) + 1
        depths.append(depth)
        ranks.append(rank)
        parents.append(parent)
        scores.append(score)
        if rank + 1 < K:  # next sibling
            s = scores[parent] + logp[depth - 1, rank + 1]
            heapq.heappush(heap, (-float(s), parent, depth, rank + 1, s))
        if depth < L:  # first child
            s = score + logp[depth, 0]
            heapq.heappush(heap, (-float(s), node, depth + 1, 0, s))
    return depths, ranks, parents


def _topk_size(budgets_max: int, vocab: int, max_topk: int | None) -> int:
    return min(budgets_max, vocab, max_topk if max_topk is not None else budgets_max)


def tree_build_reference(draft_logits: torch.Tensor, root_tokens: torch.Tensor, budgets: torch.Tensor,
                         max_nodes: int, max_topk: int | None = None) -> DraftTree:
    """Plain torch / Python reference of :func:`tree_build` (any device; returns tensors on that device)."""
    B, L, V = draft_logits.shape
    budget_list = budgets.tolist()
    if any(n < 0 or n > max_nodes for n in budget_list):
        raise ValueError(f"budgets must lie in [0, max_nodes={max_nodes}], got {budget_list}")
    kmax = _topk_size(max_nodes, V, max_topk)
    tokens = torch.zeros(B, max_nodes + 1, dtype=torch.int64)
    parents = torch.full((B, max_nodes + 1), -1, dtype=torch.int32)
    depths = torch.zeros(B, max_nodes + 1, dtype=torch.int32)
    num_nodes = torch.ones(B, dtype=torch.int32)
    tokens[:, 0] = root_tokens.cpu()
    if kmax > 0:
        logp, ids = topk_logprobs(draft_logits.cpu(), kmax)  # [B, L, kmax]
        for b, n in enumerate(budget_list):
            k = _topk_size(n, V, max_topk)
            d, r, p = best_first(logp[b, :, :k].numpy(), n)
            m = len(d) + 1
            num_nodes[b] = m
            if m == 1:
                continue
            depths[b, 1:m] = torch.tensor(d, dtype=torch.int32)
            parents[b, 1:m] = torch.tensor(p, dtype=torch.int32)
            tokens[b, 1:m] = ids[b, torch.tensor(d) - 1, torch.tensor(r)]
    mask = ancestor_mask(parents, num_nodes, max_nodes)
    dev = draft_logits.device
    return DraftTree(tokens.to(dev), parents.to(dev), depths.to(dev), num_nodes.to(dev), mask.to(dev))


def _check(draft_logits, root_tokens, budgets, max_nodes, max_topk):
    if draft_logits.dim() != 3 or draft_logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"draft_logits must be [B, L, V] fp32/bf16/fp16, got {draft_logits.dtype} "
                         f"{tuple(draft_logits.shape)}")
    B = draft_logits.shape[0]
    if root_tokens.shape != (B,) or root_tokens.dtype != torch.int64:
        raise ValueError(f"root_tokens must be int64 [{B}], got {root_tokens.dtype} {tuple(root_tokens.shape)}")
    if budgets.shape != (B,) or budgets.dtype != torch.int32:
        raise ValueError(f"budgets must be int32 [{B}], got {budgets.dtype} {tuple(budgets.shape)}")
    if root_tokens.device != draft_logits.device or budgets.device != draft_logits.device:
        raise ValueError(f"draft_logits ({draft_logits.device}), root_tokens ({root_tokens.device}) and "
                         f"budgets ({budgets.device}) must be on one device")
    if max_nodes < 0 or (max_topk is not None and max_topk < 1):
        raise ValueError(f"need max_nodes >= 0 and max_topk >= 1 or None, got {max_nodes}, {max_topk}")


def tree_build(draft_logits: torch.Tensor, root_tokens: torch.Tensor, budgets: torch.Tensor, max_nodes: int,
               max_topk: int | None = None) -> DraftTree:
    """Build one draft tree per sequence from raw draft logits ``[B, L, V]`` (see module doc).

    root_tokens ``[B]`` int64, budgets ``[B]`` int32 in ``[0, max_nodes]``; ``max_topk=1`` gives the
    chain (plain DFlash), budget 0 a root-only tree (autoregressive). CUDA tensors run the CUDA kernels
    (budgets are clamped to ``[0, max_nodes]`` there, without a host sync), CPU tensors the reference.
    """
    _check(draft_logits, root_tokens, budgets, max_nodes, max_topk)
    if draft_logits.is_cuda:
        return _tree_build_cuda(draft_logits, root_tokens, budgets, max_nodes, max_topk)
    return tree_build_reference(draft_logits, root_tokens, budgets, max_nodes, max_topk)


TOPK_THREADS, SELECT_THREADS = 512, 256  # block sizes fixed in kernels/cuda/tree_build.cu
MAX_DEPTH = 63  # tree_select keeps a node's ancestors (depth + 1 of them) in a 64-entry array
MAX_TOPK_CUDA = 4096  # tree_topk sorts the survivors in its candidate buffer
MAX_SMEM = 227 * 1024  # opt-in shared memory per block on sm_90
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _topk_cuda(draft_logits: torch.Tensor, budgets: torch.Tensor, max_nodes: int, max_topk: int | None):
    """Stage 1 on the GPU: (logp fp32 ``[B, L, kmax]``, ids int32 ``[B, L, kmax]``); row (b, d) holds K_b entries."""
    B, L, V = draft_logits.shape
    kmax = _topk_size(max_nodes, V, max_topk)
    if kmax > MAX_TOPK_CUDA:
        raise ValueError(f"the CUDA tree_build keeps at most {MAX_TOPK_CUDA} tokens per depth, got {kmax}")
    logp = torch.empty(B, L, max(kmax, 1), dtype=torch.float32, device=draft_logits.device)  # [B, L, kmax]
    ids = torch.empty(B, L, max(kmax, 1), dtype=torch.int32, device=draft_logits.device)  # [B, L, kmax]
    if B * L == 0 or kmax == 0:
        return logp, ids
    vec = 16 // draft_logits.element_size()  # logits per 16-byte load
    aligned = int(V % vec == 0 and draft_logits.data_ptr() % 16 == 0)
    cap = TOPK_THREADS * 2 * vec + max(4096, 2 * kmax)  # one tile of candidates plus the survivors
    id_digits = max(1, ((V - 1).bit_length() + 7) // 8)  # radix digits that separate token ids
    launch("tree_build", "tree_topk", grid=(B * L,), block=(TOPK_THREADS,),
           args=(draft_logits, budgets, logp, ids, np.int32(L), np.int32(V), np.int32(logp.shape[2]),
                 np.int32(max_nodes), np.int32(max_topk or 0), np.int32(id_digits)),
           shared_mem=8 * cap, device=draft_logits.device,
           defines=(("DTYPE", _DTYPE_CODE[draft_logits.dtype]), ("ALIGNED", aligned), ("CAP", cap)))
    return logp, ids


def _tree_build_cuda(draft_logits, root_tokens, budgets, max_nodes, max_topk):
    """Both CUDA stages: per-depth top-K (tree_topk), then best-first selection and the tree tensors (tree_select)."""
    if not draft_logits.is_contiguous():
        raise ValueError("tree_build's CUDA path needs contiguous draft_logits")
    B, L, V = draft_logits.shape
    if L > MAX_DEPTH:
        raise ValueError(f"the CUDA tree_build supports at most {MAX_DEPTH} draft depths, got {L}")
    logp, ids = _topk_cuda(draft_logits, budgets, max_nodes, max_topk)
    n1, W = max_nodes + 1, mask_words(max_nodes)
    nslot = (n1 + 31) // 32  # heap slots per lane
    smem = 8 * 32 * nslot + 4 * L * logp.shape[2] + 20 * n1  # heap keys, the log-probs, five per-node arrays
    if smem > MAX_SMEM:
        raise ValueError(f"tree_select needs {smem} bytes of shared memory (L={L}, max_nodes={max_nodes}); "
                         f"the limit is {MAX_SMEM}")
    dev = draft_logits.device
    tokens = torch.empty(B, n1, dtype=torch.int64, device=dev)  # [B, 1+N]
    parents = torch.empty(B, n1, dtype=torch.int32, device=dev)  # [B, 1+N]
    depths = torch.empty(B, n1, dtype=torch.int32, device=dev)  # [B, 1+N]
    num_nodes = torch.empty(B, dtype=torch.int32, device=dev)  # [B]
    mask = torch.empty(B, n1, W, dtype=torch.int32, device=dev)  # [B, 1+N, W]
    if B:
        launch("tree_build", "tree_select", grid=(B,), block=(SELECT_THREADS,),
               args=(logp, ids, budgets, root_tokens, tokens, parents, depths, num_nodes, mask, np.int32(L),
                     np.int32(V), np.int32(logp.shape[2]), np.int32(max_nodes), np.int32(max_topk or 0),
                     np.int32(W)),
               shared_mem=smem, device=dev, defines=(("NSLOT", nslot),))
    return DraftTree(tokens, parents, depths, num_nodes, mask)
