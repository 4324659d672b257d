"""The one-shot peer all-reduce: its reference (CPU), its kernel with every rank in one process on streams of its own
(GPU: plain and fused, eager and from CUDA graphs), and its IPC buffers across two processes sharing one GPU."""
import multiprocessing as mp
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from gpu_checks import poison_allocator

from kdray.engine.args import EngineArgs
from kdray.kernels.peer_all_reduce import buffer_bytes, peer_all_reduce, peer_all_reduce_reference
from kdray.kernels.rmsnorm import rmsnorm, rmsnorm_reference


def test_reference_sums_in_rank_order_in_fp32_rounded_once():
    a = torch.tensor([[1.0, 3.0]], dtype=torch.bfloat16)
    b = torch.tensor([[2.0 ** -8, 1.0]], dtype=torch.bfloat16)
    got = peer_all_reduce_reference([a, b, b])
    assert got[0, 0].item() == 1 + 2.0 ** -7  # bf16 adds one at a time would drop each 2^-8 against 1.0
    assert ((a + b) + b)[0, 0].item() == 1.0 and got[0, 1].item() == 5.0
    w = torch.full((2,), 0.5, dtype=torch.bfloat16)
    out, s = peer_all_reduce_reference([a, b], w, 1e-6)
    assert torch.equal(s, (a.float() + b.float()).to(torch.bfloat16))
    assert torch.equal(out, rmsnorm_reference(s, w, 1e-6))


def test_bad_calls_are_clear():
    bases = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="1 to 8 ranks, got rank 2 of 2"):
        peer_all_reduce(bases, 2, 1 << 20, torch.zeros(1, 8))
    with pytest.raises(ValueError, match="needs a CUDA"):
        peer_all_reduce(bases, 0, 1 << 20, torch.zeros(1, 8))


def test_engine_args_check_all_reduce():
    with pytest.raises(ValueError, match="all_reduce='ring' must be one of nccl, peer"):
        EngineArgs(all_reduce="ring")
    with pytest.raises(ValueError, match="'nccl' for tp=1"):
        EngineArgs(all_reduce="peer")
    with pytest.raises(ValueError, match="runs on GPUs"):
        EngineArgs(all_reduce="peer", tp=2, device="cpu").resolve()


class Ranks:
    """``world`` ranks of one process: a zeroed buffer and a stream each, every rank's buffer at its address."""

    def __init__(self, world: int, max_bytes: int):
        self.world, self.max_bytes = world, max_bytes
        self.buffers = [torch.zeros(buffer_bytes(max_bytes), dtype=torch.uint8, device="cuda") for _ in range(world)]
        self.bases = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64, device="cuda")
        self.streams = [torch.cuda.Stream() for _ in range(world)]
        torch.cuda.synchronize()

    def call(self, parts, weight=None, eps=1e-6) -> list:
        """Every rank's call on its own stream (they meet on the GPU), its result per rank."""
        outs = []
        main = torch.cuda.current_stream()
        for r, s in enumerate(self.streams):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                outs.append(peer_all_reduce(self.bases, r, self.max_bytes, parts[r], weight, eps))
        for s in self.streams:
            main.wait_stream(s)
        torch.cuda.synchronize()
        return outs


def _parts(world, shape, dtype, seed):
    g = torch.Generator("cuda").manual_seed(seed)
    return [torch.randn(*shape, generator=g, device="cuda").to(dtype) for _ in range(world)]


# (world, rows per call in order, dim, dtype): one token and few-token verify passes at K2's and SmolLM2's widths,
# an odd width, rows past BLOCKS (blocks with several rows), fp32; the rows change between calls (the halves
# alternate by call, whatever the rows)
CASES = [
    (2, [1, 1, 17, 1, 65], 7168, torch.bfloat16),
    (4, [1, 33, 2], 7168, torch.bfloat16),
    (8, [1, 9, 40], 2048, torch.bfloat16),
    (2, [3, 1, 70], 576, torch.bfloat16),
    (3, [5, 2], 1000, torch.bfloat16),
    (2, [1, 4], 4096, torch.float32),
    (2, [2, 1], 96, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("world, calls, dim, dtype", CASES)
def test_kernel_equals_reference_on_every_rank(world, calls, dim, dtype):
    ranks = Ranks(world, max(calls) * dim * torch.tensor([], dtype=dtype).element_size())
    g = torch.Generator("cuda").manual_seed(1)
    w = (1 + 0.1 * torch.randn(dim, generator=g, device="cuda")).to(dtype)
    for i, rows in enumerate(calls):
        parts = _parts(world, (rows, dim), dtype, 10 * i)
        ref = peer_all_reduce_reference(parts)
        poison_allocator()
        for got in ranks.call(parts):  # plain: the reference's bits on every rank
            assert torch.equal(got, ref), (i, rows)
        poison_allocator()
        fused = ranks.call(parts, w, 1e-6)
        want = rmsnorm(ref, w, 1e-6)  # the unfused CUDA kernel on the reduced rows
        for out, s in fused:
            assert torch.equal(s, ref) and torch.equal(out, want), (i, rows)


@pytest.mark.gpu
def test_a_message_past_the_buffers_is_refused():
    ranks = Ranks(2, 4096)
    with pytest.raises(ValueError, match="exceeds the buffers' 4096 bytes"):
        peer_all_reduce(ranks.bases, 0, ranks.max_bytes, torch.zeros(2, 2048, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        peer_all_reduce(ranks.bases, 0, ranks.max_bytes, torch.zeros(1, 12, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_graph_replays_equal_reference(world):
    """Each rank's fused call captured in a graph of its own, replayed many times with new inputs (the call counts
    live in the buffers and advance in the replays), between eager calls."""
    dim, rows, dtype = 7168, 3, torch.bfloat16
    ranks = Ranks(world, rows * dim * 2)
    g = torch.Generator("cuda").manual_seed(2)
    w = (1 + 0.1 * torch.randn(dim, generator=g, device="cuda")).to(dtype)
    xs = [torch.zeros(rows, dim, dtype=dtype, device="cuda") for _ in range(world)]
    ranks.call(_parts(world, (rows, dim), dtype, 0))  # compiled, and the counts past zero
    graphs, outs = [], []
    for r, s in enumerate(ranks.streams):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            outs.append(peer_all_reduce(ranks.bases, r, ranks.max_bytes, xs[r], w, 1e-6))
        graphs.append(graph)
    torch.cuda.synchronize()
    for i in range(6):
        parts = _parts(world, (rows, dim), dtype, 100 + i)
        for x, p in zip(xs, parts):
            x.copy_(p)
        torch.cuda.synchronize()
        for graph, s in zip(graphs, ranks.streams):
            with torch.cuda.stream(s):
                graph.replay()
        torch.cuda.synchronize()
        ref = peer_all_reduce_reference(parts)
        for out, s in outs:
            assert torch.equal(s, ref) and torch.equal(out, rmsnorm(ref, w, 1e-6)), i
        if i % 2:  # an eager call between replays
            assert all(torch.equal(o, peer_all_reduce_reference(parts)) for o in ranks.call(parts))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ipc_rank(rank, port, results):
    """One process of the IPC test: PeerAllReduce over the engine's kind of store, plain and fused calls."""
    from kdray.actors.peer_memory import PeerAllReduce

    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    peer = PeerAllReduce(store, "tp", rank, 2, timeout_s=60)
    got = []
    for i, rows in enumerate([1, 7, 1]):
        x = _parts(2, (rows, 7168), torch.bfloat16, i)[rank]
        assert peer.fits(x)
        got.append(peer.all_reduce(x).float().cpu().numpy())  # numpy: no tensor sharing between processes
        w = torch.full((7168,), 0.75, dtype=torch.bfloat16, device="cuda")
        got.append([t.float().cpu().numpy() for t in peer.all_reduce_rmsnorm(x, w, 1e-6)])
    torch.cuda.synchronize()
    store.set(f"done/{rank}", "1")
    store.wait(["done/0", "done/1"])  # neither frees its buffer while the other may still read it
    peer.close()
    results.put((rank, got, peer.fits(torch.zeros(1 << 20, 8, dtype=torch.bfloat16, device="cuda"))))


@pytest.mark.gpu
def test_two_processes_share_buffers_through_ipc():
    """Two ranks as two processes on one GPU (their kernels take turns on it): each maps the other's buffer through
    CUDA IPC and both get the reference's bits."""
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_ipc_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict((r, (g, big)) for r, g, big in (results.get(timeout=300) for _ in procs))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    w = torch.full((7168,), 0.75, dtype=torch.bfloat16, device="cuda")
    for i, rows in enumerate([1, 7, 1]):
        ref = peer_all_reduce_reference(_parts(2, (rows, 7168), torch.bfloat16, i))
        want = rmsnorm(ref, w, 1e-6)
        for r in range(2):
            plain, (out, s) = got[r][0][2 * i], got[r][0][2 * i + 1]
            assert torch.equal(torch.from_numpy(plain).cuda().bfloat16(), ref)
            assert torch.equal(torch.from_numpy(s).cuda().bfloat16(), ref)
            assert torch.equal(torch.from_numpy(out).cuda().bfloat16(), want)
    assert not got[0][1] and not got[1][1]  # 16 MiB is past the buffers: NCCL's


def test_a_shard_that_sees_the_node_picks_its_own_gpu(monkeypatch):
    """A shard of a peer all-reduce group sees every GPU of the node (to map its peers' buffers) and takes the one
    Ray gave it, by its place among those visible; otherwise Ray shows it only its own, as device 0."""
    import ray

    from kdray.actors.worker import SEE_ALL_GPUS, own_gpu

    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [5])
    monkeypatch.delenv(SEE_ALL_GPUS, raising=False)
    assert own_gpu() == torch.device("cuda", 0)
    monkeypatch.setenv(SEE_ALL_GPUS, "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert own_gpu() == torch.device("cuda", 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert own_gpu() == torch.device("cuda", 5)
