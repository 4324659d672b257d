"""skinny_linear on K2 TP8-shard projections at 1-32 tokens (1: the FMA kernel; 8, 17, 32: on an sm_90 GPU the
tensor-core kernel) against cuBLAS (F.linear; for the router's fp32 logits
torch.mm with an fp32 output), and skinny_bmm on MLA's W_UV product per head against torch.bmm, all graph-replayed.

Floor: the weight's bytes at the measured copy rate (x and y are a few KB). Several copies of each weight rotate
so that no replay reads it from the 50 MB L2 a previous one left behind.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import Ceilings, Row, time_us  # noqa: E402
from kdray.kernels.skinny_linear import (skinny_bmm, skinny_bmm_reference, skinny_linear,  # noqa: E402
                                        skinny_linear_reference)

# (name, N, K, output dtype): one K2 TP8 shard's projections per layer
SHAPES = [("a_proj (q_a + kv_a)", 2112, 7168, None), ("q_b", 1536, 1536, None),
          ("o_proj", 7168, 1024, None), ("shared gate_up", 512, 7168, None), ("shared down", 7168, 256, None),
          ("router (fp32 out)", 384, 7168, torch.float32)]
TOKENS = (1, 8, 17, 32)
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
    heads, nope, v, L = 8, 128, 128, 512  # W_UV: rows [nope, nope + v) of each head's block of kv_b_proj
    ws = [(torch.randn(heads * (nope + v), L, device="cuda") / L ** 0.5).to(torch.bfloat16).view(heads, nope + v, L)
          [:, nope:] for _ in range(COPIES * 4)]  # 0.5 MB each: 32 copies leave the L2 behind
    x = torch.randn(1, heads, L, device="cuda").to(torch.bfloat16)
    out = torch.empty(1, heads, v, device="cuda", dtype=torch.bfloat16)
    t = time_us(lambda: [skinny_bmm(x, w, out) for w in ws], graph=True) / len(ws)
    t_base = time_us(lambda: [skinny_bmm_reference(x, w, out) for w in ws], graph=True) / len(ws)
    moved = heads * v * L * 2
    rows.append(Row("skinny_bmm", f"W_UV M=1 heads={heads} R={v} K={L}", t, ceil.floor_us(moved),
                    f"{moved / (t * 1e-6) / 1e12:.2f} TB/s", "torch.bmm", t_base, "-"))
    return rows
