"""Benchmark rows for the speculative-step kernels: tree_build, tree_accept, kv_compact (bench_kernels.py's section)."""
from __future__ import annotations

import torch

from benchmarks.common import Ceilings, Row, time_us
from kdray.kernels.kv_compact import kv_compact
from kdray.kernels.tree_accept import tree_accept
from kdray.kernels.tree_build import _topk_cuda, ancestor_mask, best_first, tree_build

L, V = 15, 163840  # K2: block 16, vocabulary 163840


def cpu_tree_path(logits: torch.Tensor, budget: int) -> None:
    """The path tree_build replaces: GPU log_softmax + top-k, copy to the host, Python heap, mask."""
    logp, _ = torch.log_softmax(logits.float(), -1).topk(budget, -1)  # [B, L, budget]
    logp = logp.cpu()
    parents = torch.full((logits.shape[0], budget + 1), -1, dtype=torch.int32)
    num_nodes = torch.ones(logits.shape[0], dtype=torch.int32)
    for b in range(logits.shape[0]):
        _, _, par = best_first(logp[b].numpy(), budget)
        parents[b, 1:len(par) + 1] = torch.tensor(par, dtype=torch.int32)
        num_nodes[b] = len(par) + 1
    ancestor_mask(parents, num_nodes, budget)


def _tree_rows(ceil: Ceilings) -> list[Row]:
    rows = []
    for B, budget in ((32, 256), (1, 64), (1, 1024)):
        logits = (torch.randn(B, L, V, device="cuda") * 3).bfloat16()  # [B, L, V]
        roots = torch.randint(V, (B,), device="cuda")
        budgets = torch.full((B,), budget, dtype=torch.int32, device="cuda")
        t = time_us(lambda: tree_build(logits, roots, budgets, budget), graph=True)
        base = time_us(lambda: cpu_tree_path(logits, budget), warmup=1, iters=5)
        nbytes = logits.numel() * logits.element_size()  # the logits, read once
        rows.append(Row("tree_build", f"B={B} L={L} V={V} N={budget} bf16", t, ceil.floor_us(nbytes),
                        f"{nbytes / t / 1e3:.0f} GB/s", "CPU heap path", base,
                        "<= 100 us, >= 50x" if B == 32 else ""))
        if B == 32:  # the first kernel alone: one pass over the logits
            t1 = time_us(lambda: _topk_cuda(logits, budgets, budget, None), graph=True)
            rows.append(Row("  stage 1: tree_topk", "same", t1, ceil.floor_us(nbytes), f"{nbytes / t1 / 1e3:.0f} GB/s"))
    return rows


def _accept_row(ceil: Ceilings) -> Row:
    B, N = 32, 256
    logits = (torch.randn(B, L, 4096, device="cuda") * 3).bfloat16()
    tree = tree_build(logits, torch.zeros(B, dtype=torch.int64, device="cuda"),
                      torch.full((B,), N, dtype=torch.int32, device="cuda"), N)
    choices = tree.tokens[:, (torch.arange(N + 1, device="cuda") + 1).clamp(max=N)]  # walks part-way down
    t = time_us(lambda: tree_accept(tree.tokens, tree.parents, tree.num_nodes, choices, L), graph=True)
    nbytes = B * (N + 1) * (8 + 4 + 8)  # tokens, parents, choices
    return Row("tree_accept", f"B={B} N={N} L={L}", t, ceil.floor_us(nbytes), f"{nbytes / t / 1e3:.0f} GB/s",
               target="<= 10 us")


def _compact_row(ceil: Ceilings) -> Row:
    B, layers, S, R, A, prefix = 32, 61, 64, 576, 16, 1000
    pages = (prefix + 257 + S - 1) // S
    caches = [torch.randn(layers, B * pages, S, R, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    table = torch.randperm(B * pages, device="cuda").view(B, pages).to(torch.int32)
    prefix_lens = torch.full((B,), prefix, dtype=torch.int32, device="cuda")
    picks = torch.stack([torch.randperm(256)[:A - 1].sort().values + 1 for _ in range(B)])  # [B, A-1]
    accepted = torch.cat([torch.zeros(B, 1, dtype=torch.int64), picks], 1).to(torch.int32).cuda()  # [B, A]
    accept_len = torch.full((B,), A, dtype=torch.int32, device="cuda")
    def three_calls():  # a different cache each call, so the moved rows are not still in L2
        for cache in caches:
            kv_compact(cache, table, prefix_lens, accepted, accept_len)

    t = time_us(three_calls, graph=True) / len(caches)
    nbytes = 2 * layers * B * (A - 1) * R * 2  # every moved row read and written
    return Row("kv_compact", f"B={B} layers={layers} R={R} bf16 accepted={A}", t, ceil.floor_us(nbytes),
               f"{nbytes / t / 1e3:.0f} GB/s", target="<= 10 us")


def bench(ceil: Ceilings) -> list[Row]:
    """tree_build at the K2 step shape (and B=1 budgets 64 / 1024), tree_accept and kv_compact at B=32."""
    return _tree_rows(ceil) + [_accept_row(ceil), _compact_row(ceil)]
