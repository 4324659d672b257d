"""Shared pieces of the GPU benchmarks: timing, the machine's measured ceilings and the result table."""
from __future__ import annotations

import gc
import statistics
from dataclasses import dataclass

import torch


def time_us(fn, warmup: int = 5, iters: int = 50, graph: bool = False) -> float:
    """Median microseconds of ``fn()`` on the current CUDA stream (CUDA events; optionally a graph replay)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        fn = g.replay
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


@dataclass(frozen=True)
class Ceilings:
    """Measured in the same run: device copy bandwidth (read + write) and the bf16 GEMM rate."""

    copy_bytes_per_s: float
    bf16_flop_per_s: float

    @classmethod
    def measure(cls) -> "Ceilings":
        n = 1 << 30  # 1 GiB buffers: far beyond the 50 MB L2
        src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        t = time_us(lambda: dst.copy_(src), iters=20)
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        tg = time_us(lambda: a @ b, iters=20)
        return cls(copy_bytes_per_s=2 * n / (t * 1e-6), bf16_flop_per_s=2 * 8192 ** 3 / (tg * 1e-6))

    def floor_us(self, bytes_moved: float, flops: float = 0.0) -> float:
        """Roofline floor: the larger of the memory time and the bf16 compute time."""
        return max(bytes_moved / self.copy_bytes_per_s, flops / self.bf16_flop_per_s) * 1e6


@dataclass
class Row:
    """One benchmark row: what ran, how long, how close to the roofline floor and to the torch baseline."""

    kernel: str
    shape: str
    time_us: float
    floor_us: float
    achieved: str
    baseline: str = ""
    baseline_us: float | None = None
    target: str = ""

    def cells(self) -> list[str]:
        vs_base = f"{self.baseline_us / self.time_us:.1f}x vs {self.baseline}" if self.baseline_us else "-"
        return [self.kernel, self.shape, f"{self.time_us:.1f}", f"{self.time_us / self.floor_us:.2f}x",
                self.achieved, vs_base, self.target]


HEADER = ["kernel", "shape", "time us", "time / floor", "achieved", "speed-up", "target"]


def run_cells(cells: list[str], measure, oom_row) -> list[list[str]]:
    """Each cell's table row, ``measure(cell)``; a cell that does not fit the GPU's memory is printed as such, gets
    ``oom_row(cell)`` and the next cell runs. Each cell's memory (its cache, its graph pool) is freed before the
    next."""
    rows = []
    for cell in cells:
        try:
            rows.append(measure(cell))
        except torch.OutOfMemoryError as e:
            print(f"# {cell}: out of memory ({str(e).splitlines()[0]})", flush=True)
            rows.append(oom_row(cell))
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[list[str]], header: list[str] = HEADER) -> str:
    """Render a Markdown table (also printed) from string cells."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)] if rows else [len(h) for h in header]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])
    print(out)
    return out


def target_and_drafter(args) -> tuple:
    """A benchmark's target (``--model``, ``--device``, ``--dtype``: bfloat16 on cuda, float32 on cpu by default),
    its dtype, and its drafter's path (``--drafter``, else the model's shipped one)."""
    from kdray.model.loader import load_target, parse_dtype
    from kdray.model.presets import builtin_drafter

    dtype = parse_dtype(args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    target = load_target(args.model, dtype, args.device)
    path = args.drafter or builtin_drafter(args.model)
    if path is None:
        raise SystemExit(f"{args.model} has no built-in drafter: pass --drafter <DFlash checkpoint dir>")
    return target, dtype, path
