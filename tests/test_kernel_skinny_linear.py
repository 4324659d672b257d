"""skinny_linear: which inputs take the kernel (CPU), the kernel against an fp32 reference (GPU), with 16-bit and
fp32 outputs, in and out of CUDA graphs, with the K split's tickets reused across launches."""
import pytest
import torch
from gpu_checks import poison_allocator

from kdray.kernels.skinny_linear import MAX_ROWS, fits, k_splits, skinny_linear


def test_cpu_and_unsupported_inputs_run_f_linear():
    x, w = torch.randn(3, 256), torch.randn(40, 256)
    assert torch.equal(skinny_linear(x, w), torch.nn.functional.linear(x, w))
    xb, wb = x.bfloat16(), w.bfloat16()
    out = skinny_linear(xb, wb, out_dtype=torch.float32)  # 16-bit operands, fp32 sums and output
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.nn.functional.linear(xb.float(), wb.float()))


def test_out_dtype_is_x_dtype_or_fp32():
    x, w = torch.randn(2, 256).bfloat16(), torch.randn(8, 256).bfloat16()
    with pytest.raises(ValueError, match="out_dtype"):
        skinny_linear(x, w, out_dtype=torch.float16)


def test_the_k_split_divides_k_and_fills_the_gpu_without_exceeding_its_waves():
    assert k_splits(groups=24, steps=28, sm_count=132) == 14  # router: 384 rows of 16 a block, K 7168
    assert k_splits(groups=132, steps=28, sm_count=132) == 4  # a_proj: q_a and kv_a, 2112 rows
    assert k_splits(groups=96, steps=6, sm_count=132) == 3  # q_b: 1536 rows, K 1536
    assert k_splits(groups=448, steps=4, sm_count=132) == 1  # o_proj: 7168 rows, K 1024
    assert k_splits(groups=10_000, steps=28, sm_count=132) == 1


SHAPES = [  # (N, K): K2 TP8 shard projections, then odd row counts
    (1536, 7168), (576, 7168), (1536, 1536), (7168, 1024), (512, 7168), (7168, 256), (33, 512), (1, 256), (100, 768),
]


def reference(x, w):
    return (x.float() @ w.float().t()).to(x.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,K", SHAPES)
def test_cuda_matches_fp32_reference(N, K, dtype):
    g = torch.Generator("cuda").manual_seed(N * 7 + K)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(dtype)
    for M in range(1, MAX_ROWS + 1):
        for _ in range(2):  # twice: the tickets the first launch took are back at zero
            x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
            poison_allocator()
            torch.testing.assert_close(skinny_linear(x, w), reference(x, w), rtol=2 ** -7, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(384, 7168), (33, 512), (100, 768)])  # the K2 shard's router, odd row counts
def test_cuda_fp32_output_matches_fp32_reference(N, K):
    g = torch.Generator("cuda").manual_seed(N + K)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    for M in range(1, MAX_ROWS + 2):  # the kernel, then cuBLAS
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        assert fits(x, w) == (M <= MAX_ROWS)
        poison_allocator()
        out = skinny_linear(x, w, out_dtype=torch.float32)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, x.float() @ w.float().t(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("M,out_dtype", [(1, None), (1, torch.float32)])
def test_replayed_from_a_cuda_graph_equals_eager(M, out_dtype):
    w = (torch.randn(576, 7168, device="cuda") / 85).to(torch.bfloat16)  # split across blocks: tickets in the graph
    x = torch.randn(M, 7168, device="cuda").to(torch.bfloat16)
    eager = skinny_linear(x, w, out_dtype)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        skinny_linear(x, w, out_dtype)  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=stream):
            out = skinny_linear(x, w, out_dtype)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)  # the same split and order of sums: bitwise
