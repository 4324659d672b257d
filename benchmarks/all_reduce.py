"""The TP all-reduce a K2 layer's norms begin with (the residual rides in rank 0's part), with the RMSNorm: NCCL +
``rmsnorm`` against the one-shot peer kernel (``kernels/peer_all_reduce.py``), fused, from CUDA graphs.

    python -m benchmarks.all_reduce [--tokens 1 8 65 257] [--dim 7168]

With two or more GPUs, one process per GPU (``--gpus``, default all): each call of a row is a graph of ``CALLS``
layer ends replayed together by every rank, time per call = the replay's time / CALLS (median of ``REPEATS``).
With one GPU only the kernel itself can be timed: ``--gpus 1`` runs two ranks as two streams of that GPU (their
"peer" reads are local memory), against ``rmsnorm`` alone; NCCL cannot run two ranks on one GPU.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
from datetime import timedelta
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))
from kdray.kernels.peer_all_reduce import buffer_bytes, peer_all_reduce  # noqa: E402
from kdray.kernels.rmsnorm import rmsnorm  # noqa: E402

CALLS, REPEATS = 20, 7


def graph_time_us(run, streams: list[torch.cuda.Stream]) -> float:
    """Per call: ``run(rank)`` CALLS times captured once per stream, the graphs replayed together."""
    main = torch.cuda.current_stream()
    for r, s in enumerate(streams):  # warm-up (compiles, counts): the ranks' calls meet, so all are issued first
        s.wait_stream(main)
        with torch.cuda.stream(s):
            run(r)
    torch.cuda.synchronize()
    graphs = []
    for r, s in enumerate(streams):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(CALLS):
                run(r)
        graphs.append(g)
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        for g, s in zip(graphs, streams):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                g.replay()
        for s in streams:
            main.wait_stream(s)
        end.record(main)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return statistics.median(times)


def one_gpu(tokens: list[int], dim: int):
    """Two ranks as two streams of one GPU: the peer kernel's own time against rmsnorm's."""
    world, dtype = 2, torch.bfloat16
    max_bytes = max(tokens) * dim * 2
    bufs = [torch.zeros(buffer_bytes(max_bytes), dtype=torch.uint8, device="cuda") for _ in range(world)]
    bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device="cuda")
    w = torch.ones(dim, dtype=dtype, device="cuda")
    print(f"# one {torch.cuda.get_device_name()}: 2 ranks as streams, hidden {dim} bf16, us per call from graphs")
    print("| tokens | rmsnorm alone | peer all-reduce + norm (2 ranks, one GPU) |")
    print("|---|---|---|")
    for t in tokens:
        xs = [torch.randn(t, dim, device="cuda").to(dtype) for _ in range(world)]
        alone = graph_time_us(lambda r: rmsnorm(xs[r], w, 1e-6), [torch.cuda.Stream()])
        peer = graph_time_us(lambda r: peer_all_reduce(bases, r, max_bytes, xs[r], w, 1e-6),
                             [torch.cuda.Stream() for _ in range(world)])
        print(f"| {t} | {alone:.1f} | {peer:.1f} |")


def _rank(rank: int, world: int, port: int, tokens: list[int], dim: int, out):
    from kdray.actors.communicator import NcclGroup

    torch.cuda.set_device(rank)
    store = torch.distributed.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    group = NcclGroup(store, "tp", rank, world, 120.0, peer=True)
    peer, dtype = group.peer, torch.bfloat16
    w = torch.ones(dim, dtype=dtype, device="cuda")
    stream = torch.cuda.Stream()
    rows = []
    for t in tokens:
        x = torch.randn(t, dim, device="cuda").to(dtype)
        group.peer = None  # NCCL, then the norm
        nccl = graph_time_us(lambda r: group.all_reduce_rmsnorm(x, w, 1e-6), [stream])
        group.peer = peer
        fused = (graph_time_us(lambda r: group.all_reduce_rmsnorm(x, w, 1e-6), [stream])
                 if peer.fits(x) else float("nan"))
        rows.append((t, t * dim * 2, nccl, fused))
    torch.cuda.synchronize()
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{r}" for r in range(world)])
    if rank == 0:
        out.put((torch.cuda.get_device_name(), rows))


def gpus(world: int, tokens: list[int], dim: int):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, tokens, dim, out)) for r in range(world)]
    for p in procs:
        p.start()
    name, rows = out.get(timeout=600)
    for p in procs:
        p.join()
    print(f"# {world} x {name}, hidden {dim} bf16, us per norm (all-reduce + RMSNorm) from graphs")
    print("| tokens | bytes | NCCL + rmsnorm | peer, fused | peer / NCCL |")
    print("|---|---|---|---|---|")
    for t, nbytes, nccl, fused in rows:
        print(f"| {t} | {nbytes} | {nccl:.1f} | {fused:.1f} | {fused / nccl:.2f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 65, 257])
    ap.add_argument("--dim", type=int, default=7168, help="hidden size (K2's)")
    ap.add_argument("--gpus", type=int, default=None, help="ranks, one GPU each (default: every visible GPU)")
    a = ap.parse_args()
    world = a.gpus or torch.cuda.device_count()
    if world < 1:
        sys.exit("all_reduce.py needs a CUDA GPU")
    one_gpu(a.tokens, a.dim) if world == 1 else gpus(world, a.tokens, a.dim)


if __name__ == "__main__":
    main()
