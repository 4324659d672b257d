"""Tree-verify attention: MLA latent (K2, 576/512) and GQA rows against the roofline floor and torch SDPA.

Each row is one batch of B equal sequences (prefix + a random tree). Bytes: every cached row read once
(prefix + tree rows, per KV head) plus q and out; FLOPs: 2 x heads x tree x keys x (Dk + Dv), masked tree
entries included. The kernel is timed as a CUDA-graph replay (as a verify step runs). The baseline is SDPA
with a dense boolean mask over K/V already gathered into dense tensors (gather not timed); where the
batched score matrix would not fit comfortably it is timed on one sequence and multiplied by B ("x B").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.common import Ceilings, Row, time_us
from kdray.kernels.tree_verify_attention import _tree_attention_cuda, gqa_tree_attention, mla_tree_attention

MLA_DK, MLA_DV = 576, 512
PAGE = 64
SDPA_MAX_SCORES = 1 << 31  # score elements beyond which the baseline runs one sequence


def _case(B, heads, tree, prefix, kv_heads=None, d=MLA_DK, gen=None):
    """Random paged batch (bf16, CUDA); kv_heads None: the MLA layout. Also returns dense K/V and mask."""
    dev = "cuda"
    keys = prefix + tree
    pages = -(-keys // PAGE)
    row = (d,) if kv_heads is None else (2, kv_heads, d)
    cache = torch.randn((B * pages, PAGE) + row, device=dev, dtype=torch.bfloat16)
    block_table = torch.randperm(B * pages, device=dev, dtype=torch.int32).view(B, pages)
    parents = torch.randint(0, 2 ** 30, (tree,), generator=gen) % torch.arange(1, tree + 1)  # parent < i
    vis = torch.eye(tree, dtype=torch.bool)
    for i in range(1, tree):
        vis[i] |= vis[int(parents[i - 1])]
    words = -(-tree // 32)
    bits = torch.zeros(tree, words * 32, dtype=torch.int64)
    bits[:, :tree] = vis.long()
    packed = (bits.view(tree, words, 32) << torch.arange(32)).sum(-1)
    mask = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    tree_mask = mask.expand(B, -1, -1).contiguous().to(dev)
    cu_q = torch.arange(0, (B + 1) * tree, tree, dtype=torch.int32, device=dev)
    prefix_lens = torch.full((B,), prefix, dtype=torch.int32, device=dev)
    q = torch.randn(B * tree, heads, d, device=dev, dtype=torch.bfloat16)
    dense = torch.cat([torch.ones(tree, prefix, dtype=torch.bool), vis], dim=1).to(dev)  # [tree, keys]
    return (q, cache, block_table, prefix_lens, cu_q, tree_mask), dense


def _dense_kv(cache, block_table, keys, kv_heads):
    """Gather [B, Hkv, keys, D] keys and values of the first keys cache positions."""
    pos = torch.arange(keys, device=cache.device)
    rows = cache[block_table[:, pos // PAGE].long(), pos % PAGE]  # [B, keys, ...]
    if kv_heads is None:
        return rows.unsqueeze(1), rows[..., :MLA_DV].unsqueeze(1)
    return rows[:, :, 0].transpose(1, 2), rows[:, :, 1].transpose(1, 2)


def _time(fn, graph=False) -> float:
    """Median µs with fewer repeats for slow calls (whole section stays within a minute or two)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = start.elapsed_time(end) * 1e3
    iters = int(max(3, min(50, 3e5 / max(once, 1.0))))
    return time_us(fn, warmup=2 if once > 2e4 else 5, iters=iters, graph=graph)


def _sdpa_us(q, cache, block_table, tree, prefix, kv_heads, dense, scale) -> tuple[float, str]:
    B, heads = q.shape[0] // tree, q.shape[1]
    keys = prefix + tree
    n = B if B * heads * tree * keys <= SDPA_MAX_SCORES else 1
    k, v = _dense_kv(cache, block_table[:n], keys, kv_heads)  # [n, Hkv, keys, D]
    group = heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1) if group > 1 and kv_heads is not None else k.expand(-1, heads, -1, -1)
    v = v.repeat_interleave(group, dim=1) if group > 1 and kv_heads is not None else v.expand(-1, heads, -1, -1)
    qd = q[: n * tree].view(n, tree, heads, -1).transpose(1, 2)  # [n, H, tree, D]
    t = _time(lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=dense, scale=scale))
    return t * (B // n), "SDPA dense mask" + (f" (1 seq x {B})" if n < B else "")


def _row(ceil, kernel, label, fn, case, dense, tree, prefix, kv_heads, dk, dv, scale, baseline=True) -> Row:
    q = case[0]
    B, heads = q.shape[0] // tree, q.shape[1]
    keys = prefix + tree
    t = _time(fn, graph=True)
    hkv = 1 if kv_heads is None else kv_heads
    row_bytes = dk * 2 if kv_heads is None else 2 * dk * 2  # MLA: one 576 row; GQA: K and V rows
    bytes_moved = B * (keys * hkv * row_bytes + tree * heads * (dk + dv) * 2)
    flops = 2 * B * heads * tree * keys * (dk + dv)
    base_us, base = _sdpa_us(q, case[1], case[2], tree, prefix, kv_heads, dense, scale) if baseline else (None, "")
    return Row(kernel=kernel, shape=label, time_us=t, floor_us=ceil.floor_us(bytes_moved, flops),
               achieved=f"{flops / t / 1e6:.0f} TFLOP/s, {bytes_moved / t / 1e3:.0f} GB/s", baseline=base,
               baseline_us=base_us, target="<= 2x floor" if kv_heads is None else "")


def bench(ceil: Ceilings) -> list[Row]:
    return list(rows(ceil))


def rows(ceil: Ceilings):
    """Yield the rows one by one (the MLA sweep, two mma.sync rows, two GQA models)."""
    gen = torch.Generator().manual_seed(0)
    scale = 0.1309
    for B in (1, 16):
        for heads in (8, 64):
            for tree in (64, 256):
                for prefix in (4096, 32768):
                    case, dense = _case(B, heads, tree, prefix, gen=gen)
                    label = f"B={B} H={heads} tree={tree} prefix={prefix}"
                    yield (_row(ceil, "mla_tree_attention", label,
                                     lambda c=case: mla_tree_attention(*c, scale, MLA_DV), case, dense, tree, prefix,
                                     None, MLA_DK, MLA_DV, scale))
                    if (B, heads, prefix) in ((1, 64, 4096), (16, 8, 4096)) and tree == 256:
                        sync = lambda c=case: _tree_attention_cuda(*c, scale, kv_heads=1, dv=MLA_DV,  # noqa: E731
                                                                   row_stride=MLA_DK, v_off=0, mma_sync=True)
                        yield (_row(ceil, "mla (mma.sync path)", label, sync, case, dense, tree, prefix, None,
                                         MLA_DK, MLA_DV, scale, baseline=False))
                    del case, dense
    for name, hq, hkv, d in (("SmolLM2 9/3x64", 9, 3, 64), ("Llama-8B 32/8x128", 32, 8, 128)):
        tree, prefix, B = 64, 4096, 16
        case, dense = _case(B, hq, tree, prefix, kv_heads=hkv, d=d, gen=gen)
        yield (_row(ceil, f"gqa_tree_attention {name}", f"B={B} tree={tree} prefix={prefix}",
                         lambda c=case: gqa_tree_attention(*c, d ** -0.5), case, dense, tree, prefix, hkv, d, d,
                         d ** -0.5))
