"""w4a16_moe on K2 shard shapes (hidden 7168, 384 experts, top-8, random routing) against the INT4 floor
and the best bf16 torch path over the same routing.

Floor: the packed weights and scales of the distinct experts the batch touches, read once at the measured
copy bandwidth. Baseline: ``torch._grouped_mm`` over bf16 experts (a per-expert loop of matmuls where
grouped_mm is unavailable), graph-captured when it can be; the INT4 op is timed as a graph replay (as a
verify step runs it); the per-kernel device times and each GEMM variant's time are printed above the table.
The experts are in the tiled layout (``repack_int4_experts``, as ``MoE.load`` leaves them on a GPU), which every
family reads; the wgmma family (``WGMMA_VARIANTS``) joins the sweeps on sm_90.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import Ceilings, Row, print_table, time_us  # noqa: E402
from kdray.kernels.w4a16_moe import (SKINNY, VARIANTS, WGMMA_VARIANTS, _capability, _choose_variant,  # noqa: E402
                                     _w4a16_moe_cuda, _wgmma_ok, random_int4_experts, repack_int4_experts, w4a16_moe)

H, E, K = 7168, 384, 8
WIDTHS = (256, 2048)  # expert width per shard: TP8, TP1
TOKENS = (16, 64, 256, 1024)


def _sorted_routing(ids: torch.Tensor):
    """Slots sorted by expert, their tokens and the grouped_mm offsets (cumulative row ends), all on device."""
    flat = ids.flatten()
    order = flat.argsort()
    counts = torch.zeros(E, dtype=torch.int32, device=ids.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, order // ids.shape[1], counts.cumsum(0, dtype=torch.int32)


def _grouped_bf16(x, w13, w2, ids, weights):
    """bf16 MoE through torch._grouped_mm: w13 [E, 2I, H], w2 [E, H, I] (Linear layout)."""
    I = w2.shape[2]
    order, tok, offs = _sorted_routing(ids)
    gu = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)  # [T*k, 2I]
    y = torch._grouped_mm(F.silu(gu[:, :I]) * gu[:, I:], w2.transpose(1, 2), offs=offs)  # [T*k, H]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, tok, y.float() * weights.flatten()[order, None]).to(x.dtype)


def _loop_bf16(x, w13, w2, ids, weights):
    """bf16 MoE as a per-expert loop of matmuls (host sync for the expert list)."""
    I = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = x[tok] @ w13[e].T
        y = (F.silu(gu[:, :I]) * gu[:, I:]) @ w2[e].T
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return out.to(x.dtype)


def _baseline(x, w13, w2, ids, weights):
    """(name, microseconds) of the best bf16 torch path: grouped_mm (graph-captured if that works) when it runs
    and agrees with the per-expert loop, else the loop."""
    ref = _loop_bf16(x, w13, w2, ids, weights).float()
    run = lambda: _grouped_bf16(x, w13, w2, ids, weights)  # noqa: E731
    try:
        err = ((run().float() - ref).norm() / ref.norm()).item()
        if err > 3e-2:
            raise RuntimeError(f"relative error {err:.1e} against the per-expert loop")
        t = time_us(run)
    except Exception as exc:
        print(f"# torch._grouped_mm unavailable ({type(exc).__name__}: {exc}); per-expert loop instead")
        return "per-expert bf16 matmul loop", time_us(lambda: _loop_bf16(x, w13, w2, ids, weights))
    try:
        t = min(t, time_us(run, graph=True))
    except Exception as exc:
        print(f"# torch._grouped_mm not graph-capturable ({type(exc).__name__}: {exc}); eager time")
    return "torch._grouped_mm bf16", t


def _kernel_breakdown(fn) -> str:
    """Average device time of each CUDA kernel ``fn`` launches (torch profiler, 5 calls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    stats = [(ev.key, ev.device_time_total / 5) for ev in prof.key_averages() if ev.device_time_total > 0]
    return ", ".join(f"{name} {t:.1f}" for name, t in sorted(stats, key=lambda s: -s[1]))


def bench(ceil: Ceilings) -> list[Row]:
    rows = []
    for I in WIDTHS:
        int4 = repack_int4_experts(*random_int4_experts(E, H, I))
        expert_bytes = sum(t[0].numel() * t.element_size() for t in int4)  # one expert: packed + scales
        # bf16 experts for the baseline: the same shapes (values need not match the INT4 ones).
        w13 = torch.empty(E, 2 * I, H, device="cuda", dtype=torch.bfloat16).normal_(0, H ** -0.5)
        w2 = torch.empty(E, H, I, device="cuda", dtype=torch.bfloat16).normal_(0, I ** -0.5)
        for T in TOKENS:
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            ids = torch.rand(T, E, device="cuda").topk(K, dim=1).indices  # random routing, distinct experts
            weights = torch.rand(T, K, device="cuda")
            touched = ids.unique().numel()
            run = lambda: w4a16_moe(x, *int4, ids, weights)  # noqa: E731
            t = time_us(run, graph=True)
            sweep = {v: time_us(lambda v=v: _w4a16_moe_cuda(x, *int4, ids, weights, variant=v), graph=True)
                     for v in _families(I)}
            print(f"# I={I} T={T}: {touched} experts, graph {t:.1f} us, eager {time_us(run):.1f} us; "
                  f"kernels (us): {_kernel_breakdown(run)}; variants (us): "
                  + ", ".join(f"{v} {tv:.1f}" for v, tv in sweep.items()))
            name, t_base = _baseline(x, w13, w2, ids, weights)
            moved = touched * expert_bytes
            rows.append(Row("w4a16_moe", f"T={T} H={H} I={I} E={E} k={K} ({touched} experts)", t,
                            ceil.floor_us(moved), f"{moved / (t * 1e-6) / 1e9:.0f} GB/s", name, t_base,
                            "<=1.4x floor, >=2.5x bf16"))
        del int4, w13, w2
        torch.cuda.empty_cache()
    return rows


def _families(I: int) -> tuple[str, ...]:
    """The GEMM families this GPU runs at H, I (the wgmma ones on sm_90 only)."""
    wgmma = _wgmma_ok(_capability(torch.device("cuda", torch.cuda.current_device())), H, I, True) is None
    return (SKINNY, *VARIANTS, *(WGMMA_VARIANTS if wgmma else ()))


SWEEP_TOKENS = (1, 17, 65, 257, 385, 513, 1024, 2080, 4096, 16384)  # decode, verify and prefill; 385 and 513 sit
# on either side of SKINNY_MAX_ROWS_PER_EXPERT (8 route slots per expert at 384 experts)


def sweep_families(tokens=SWEEP_TOKENS, I: int = 256):
    """Every GEMM family at K2 TP8 shapes over ``tokens``: graph-replayed time, touched-expert bytes per second (the
    floor's rate) and the experts' TFLOP/s (2 x 3 x H x I per routed slot), and the family ``w4a16_moe`` picks."""
    ceil = Ceilings.measure()
    int4 = repack_int4_experts(*random_int4_experts(E, H, I))
    expert_bytes = sum(t[0].numel() * t.element_size() for t in int4)
    families = _families(I)
    rows = []
    for T in tokens:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
        weights = torch.rand(T, K, device="cuda")
        moved = ids.unique().numel() * expert_bytes
        flops = 2 * 3 * H * I * T * K
        cells = [f"T={T} ({ids.unique().numel()} experts)", f"{ceil.floor_us(moved):.1f}"]
        for v in families:
            t = time_us(lambda v=v: _w4a16_moe_cuda(x, *int4, ids, weights, variant=v), graph=True)
            cells.append(f"{t:.1f} ({moved / (t * 1e-6) / 1e9:.0f} GB/s, {flops / (t * 1e-6) / 1e12:.0f} TFLOP/s)")
        cells.append(_choose_variant(E, H, I, T * K, wgmma=len(families) > 1 + len(VARIANTS)))
        for v in (SKINNY, *(f for f in families if f in WGMMA_VARIANTS)):
            print(f"# T={T} {v} kernels (us): "
                  f"{_kernel_breakdown(lambda v=v: _w4a16_moe_cuda(x, *int4, ids, weights, variant=v))}", flush=True)
        rows.append(cells)
    print_table(rows, ["tokens", "floor us", *(f"{v} us" for v in families), "chosen"])


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="every w4a16_moe GEMM family at K2 TP8 shapes, by token count")
    ap.add_argument("--tokens", type=int, nargs="+", default=SWEEP_TOKENS, help="token counts to sweep")
    sweep_families(tuple(ap.parse_args().tokens))
