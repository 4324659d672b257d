"""skinny_linear on K2 TP8-shard projections at 1-8 tokens against cuBLAS (F.linear; for the router's fp32 logits
torch.mm with an fp32 output), both graph-replayed.

Floor: the weight's bytes at the measured copy rate (x and y are a few KB). Several copies of each weight rotate
so that no replay reads it from the 50 MB L2 a previous one left behind.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import Ceilings, Row, time_us  # noqa: E402
from kdray.kernels.skinny_linear import skinny_linear, skinny_linear_reference  # noqa: E402

# (name, N, K, output dtype): one K2 TP8 shard's projections per layer
SHAPES = [("q_a", 1536, 7168, None), ("kv_a", 576, 7168, None), ("q_b", 1536, 1536, None),
          ("o_proj", 7168, 1024, None), ("shared gate_up", 512, 7168, None), ("shared down", 7168, 256, None),
          ("router (fp32 out)", 384, 7168, torch.float32)]
TOKENS = (1, 8)
COPIES = 8  # weights rotated per replay: 8 x >= 3.5 MB leaves the L2 behind


def bench(ceil: Ceilings) -> list[Row]:
    rows = []
    for name, N, K, out_dtype in SHAPES:
        ws = [torch.randn(N, K, device="cuda").to(torch.bfloat16) for _ in range(COPIES)]
        for M in TOKENS:
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            t = time_us(lambda: [skinny_linear(x, w, out_dtype) for w in ws], graph=True) / COPIES
            t_base = time_us(lambda: [skinny_linear_reference(x, w, out_dtype) for w in ws], graph=True) / COPIES
            moved = N * K * 2
            rows.append(Row("skinny_linear", f"{name} M={M} N={N} K={K}", t, ceil.floor_us(moved),
                            f"{moved / (t * 1e-6) / 1e12:.2f} TB/s", "cuBLAS", t_base, "~3 TB/s"))
    return rows
