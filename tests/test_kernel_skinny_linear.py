"""skinny_linear and skinny_bmm: which inputs take which kernel (CPU), the kernels against an fp32 reference (GPU),
with 16-bit and fp32 outputs, added into ``out`` or not, K split over clusters of 1 to 8 blocks, in and out of CUDA
graphs."""
import pytest
import torch
from gpu_checks import poison_allocator

import kdray.kernels.skinny_linear as SL
from kdray.kernels.skinny_linear import (MAX_ROWS, MAX_SPLIT, WGMMA_ALL_ROWS, WGMMA_MAX_ROWS, bmm_fits, fits, k_splits,
                                         skinny_bmm, skinny_linear, wgmma_fits, wgmma_smem)
from kdray.kernels.tree_verify_attention import SplitPartials, merge_split_partials

needs_sm90a = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="the tensor-core kernel needs an sm_90 GPU")


def test_cpu_and_unsupported_inputs_run_f_linear():
    x, w = torch.randn(3, 256), torch.randn(40, 256)
    assert torch.equal(skinny_linear(x, w), torch.nn.functional.linear(x, w))
    xb, wb = x.bfloat16(), w.bfloat16()
    out = skinny_linear(xb, wb, out_dtype=torch.float32)  # 16-bit operands, fp32 sums and output
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.nn.functional.linear(xb.float(), wb.float()))


def test_out_is_written_or_refused_naming_what_it_must_be():
    x, w = torch.randn(3, 256), torch.randn(40, 256)
    out = torch.full((3, 40), float("nan"))
    assert skinny_linear(x, w, out=out) is out and torch.allclose(out, torch.nn.functional.linear(x, w))
    for bad in (torch.empty(3, 41), torch.empty(40, 3).t(), torch.empty(3, 40, dtype=torch.float64)):
        with pytest.raises(ValueError, match=r"out must be a contiguous torch.float32 tensor of shape \(3, 40\)"):
            skinny_linear(x, w, out=bad)


def test_accumulate_adds_into_out_in_place():
    x, w = torch.randn(3, 256), torch.randn(40, 256)
    stream = torch.randn(3, 40)
    out = stream.clone()
    assert skinny_linear(x, w, out=out, accumulate=True) is out
    torch.testing.assert_close(out, stream + torch.nn.functional.linear(x, w))
    with pytest.raises(ValueError, match="accumulate adds into out: give out"):
        skinny_linear(x, w, accumulate=True)


def test_out_dtype_is_x_dtype_or_fp32():
    x, w = torch.randn(2, 256).bfloat16(), torch.randn(8, 256).bfloat16()
    with pytest.raises(ValueError, match="out_dtype"):
        skinny_linear(x, w, out_dtype=torch.float16)


def test_the_k_split_divides_k_and_fills_the_gpu_within_its_waves_and_a_cluster():
    assert k_splits(groups=24, steps=28, sm_count=132) == 7  # router: 384 rows of 16 a block, K 7168 (14 > 8)
    assert k_splits(groups=64, steps=2, sm_count=132) == 2  # W_UV per head at one token: 8 x 128 rows, K 512
    assert k_splits(groups=1, steps=64, sm_count=132) == MAX_SPLIT
    assert k_splits(groups=132, steps=28, sm_count=132) == 4  # a_proj: q_a and kv_a, 2112 rows
    assert k_splits(groups=96, steps=6, sm_count=132) == 3  # q_b: 1536 rows, K 1536
    assert k_splits(groups=448, steps=4, sm_count=132) == 1  # o_proj: 7168 rows, K 1024
    assert k_splits(groups=10_000, steps=28, sm_count=132) == 1


def test_a_k_split_needs_clusters_else_cublas(monkeypatch):
    """The K split's sum runs in a thread-block cluster (sm_90 and later); before that a projection that splits K
    goes to cuBLAS (0), one that fills the GPU unsplit still takes the kernel."""
    import kdray.kernels.skinny_linear as SL

    monkeypatch.setattr(SL, "sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)
    for hopper, router in ((True, 7), (False, 0)):
        monkeypatch.setattr(SL, "sm90_or_later", lambda index, h=hopper: h)
        assert SL.kernel_splits(384, 7168, dev) == router  # K2's router: 24 row groups
        assert SL.kernel_splits(7168, 1024, dev) == 1  # o_proj: 448 row groups


def test_the_tensor_core_split_fills_two_blocks_an_sm_then_one(monkeypatch):
    """skinny_linear_wgmma's K split on 132 SMs for K2's TP8 shard projections: the largest divisor of K / 64 up to
    a cluster of 8 that keeps the grid of 64-row blocks within two blocks an SM up to WGMMA_ALL_ROWS rows of x, one
    past them; and two blocks fit an SM's shared memory at WGMMA_ALL_ROWS rows, one at WGMMA_MAX_ROWS."""
    monkeypatch.setattr(SL, "sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)
    splits = {(2112, 7168): 8, (1536, 1536): 8, (7168, 1024): 2, (384, 7168): 8, (512, 7168): 8, (7168, 256): 2,
              (2560, 7168): 4}  # a_proj, q_b, o_proj, router, shared gate/up, shared down, the vocabulary's shard
    assert {nk: SL.wgmma_splits(*nk, 17, dev) for nk in splits} == splits
    wide = {(2112, 7168): 4, (1536, 1536): 4, (384, 7168): 8}  # a_proj, q_b, router: a 64-node tree and its root
    assert {nk: SL.wgmma_splits(*nk, 65, dev) for nk in wide} == wide
    assert 2 * wgmma_smem(WGMMA_ALL_ROWS) <= 227 * 1024 and wgmma_smem(-(-WGMMA_MAX_ROWS // 8) * 8) <= 227 * 1024


def test_tensor_cores_take_only_cuda_inputs():
    assert not wgmma_fits(torch.randn(8, 256).bfloat16(), torch.randn(64, 256).bfloat16())


@pytest.mark.gpu
@needs_sm90a
def test_small_projections_stay_on_cublas_at_every_row_count():
    """K < 256 (k2-tiny's): cuBLAS at 3-32 rows too, so that a bf16 pass rounds as a verify pass of many rows."""
    w = torch.randn(88, 64, device="cuda").bfloat16()
    assert not wgmma_fits(torch.randn(4, 64, device="cuda").bfloat16(), w)
    assert wgmma_fits(torch.randn(4, 256, device="cuda").bfloat16(), torch.randn(88, 256, device="cuda").bfloat16())


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
        x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
        poison_allocator()
        torch.testing.assert_close(skinny_linear(x, w), reference(x, w), rtol=2 ** -7, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5])  # the kernel, cuBLAS
def test_cuda_out_is_written_as_a_new_tensor_would_be(M):
    g = torch.Generator("cuda").manual_seed(M)
    x = torch.randn(M, 7168, device="cuda", generator=g).bfloat16()
    w = (torch.randn(7168, 512, device="cuda", generator=g) / 512 ** 0.5).bfloat16().t().contiguous()
    out = torch.full((M, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert skinny_linear(x, w, out=out) is out and torch.equal(out, skinny_linear(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(7168, 1024), (7168, 256), (576, 7168), (100, 768)])  # unsplit, split, odd rows
def test_cuda_accumulate_adds_out_before_the_one_rounding(N, K):
    """A decoder layer's o_proj and down projection add into the residual stream: up to MAX_ROWS rows on the kernel
    (its K split or not), and on an sm_90 GPU up to WGMMA_MAX_ROWS on the tensor-core kernel, out + x w^T summed in
    fp32 and rounded once; past them on cuBLAS (beta = 1), whose split-K GEMMs at a few rows may round a partial sum
    first (within an ulp of the stream's values where the sum cancels)."""
    g = torch.Generator("cuda").manual_seed(N + K)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    for M in (1, MAX_ROWS, MAX_ROWS + 1, WGMMA_ALL_ROWS, WGMMA_MAX_ROWS, WGMMA_MAX_ROWS + 1):
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        stream = (4 * torch.randn(M, N, device="cuda", generator=g)).bfloat16()
        kernel = fits(x, w) or wgmma_fits(x, w)
        poison_allocator()
        out = stream.clone()
        assert skinny_linear(x, w, out=out, accumulate=True) is out
        want = (x.float() @ w.float().t() + stream.float()).bfloat16()
        torch.testing.assert_close(out, want, rtol=2 ** -7, atol=2 ** -5)
        if kernel:  # one rounding: nearer the exact sums, over the rows, than rounding the product first
            twice = (skinny_linear(x, w).float() + stream.float()).bfloat16()
            exact = x.double() @ w.double().t() + stream.double()
            assert (out.double() - exact).abs().sum() < (twice.double() - exact).abs().sum()


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(384, 7168), (33, 512), (100, 768), (16, 2048)])  # K2's router, odd rows, 8 splits
def test_cuda_fp32_output_matches_fp32_reference(N, K):
    g = torch.Generator("cuda").manual_seed(N + K)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    for M in (*range(1, MAX_ROWS + 2), WGMMA_ALL_ROWS, WGMMA_MAX_ROWS, WGMMA_MAX_ROWS + 1):  # kernels, then cuBLAS
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        assert fits(x, w) == (M <= MAX_ROWS)
        poison_allocator()
        out = skinny_linear(x, w, out_dtype=torch.float32)
        assert out.dtype == torch.float32
        tol = 1e-4 if wgmma_fits(x, w) else 1e-5  # the tensor cores' fp32 sums, in their own order
        torch.testing.assert_close(out, x.float() @ w.float().t(), rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("M,out_dtype", [(1, None), (1, torch.float32), (17, None), (17, torch.float32)])
def test_replayed_from_a_cuda_graph_equals_eager(M, out_dtype):
    w = (torch.randn(576, 7168, device="cuda") / 85).to(torch.bfloat16)  # K split over a cluster of 7 blocks
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


WGMMA_SHAPES = [  # (N, K): K2 TP8 shard projections (K split over 8, 2 and 1 blocks), odd row counts and K
    (2112, 7168), (1536, 1536), (7168, 1024), (384, 7168), (7168, 256), (100, 768), (4, 256), (36, 4096),
]


@pytest.mark.gpu
@needs_sm90a
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,K", WGMMA_SHAPES)
def test_tensor_core_kernel_matches_fp32_reference(N, K, dtype):
    g = torch.Generator("cuda").manual_seed(N * 5 + K)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(dtype)
    few_blocks = 2 * -(-N // 64) <= torch.cuda.get_device_properties(0).multi_processor_count
    for M in (MAX_ROWS + 1, 8, 17, WGMMA_ALL_ROWS, WGMMA_ALL_ROWS + 1, 65, WGMMA_MAX_ROWS):
        x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
        assert wgmma_fits(x, w) == (M <= WGMMA_ALL_ROWS or few_blocks)
        if not wgmma_fits(x, w):
            continue
        poison_allocator()
        y = skinny_linear(x, w)
        torch.testing.assert_close(y, reference(x, w), rtol=2 ** -7, atol=2e-3)
        assert torch.equal(skinny_linear(x, w), y)  # the same split and order of sums on every call


@pytest.mark.gpu
@needs_sm90a
def test_rows_pick_the_kernel(monkeypatch):
    """One or two rows stream through FMAs, three to WGMMA_ALL_ROWS through the tensor cores; to WGMMA_MAX_ROWS
    only projections of few 64-row blocks (the router, not o_proj) not run beside other kernels; more on cuBLAS."""
    launched = []
    real = SL.launch
    monkeypatch.setattr(SL, "launch", lambda name, *a, **k: (launched.append(name), real(name, *a, **k))[1])
    cases = {(384, 7168, False): ((MAX_ROWS, "skinny_linear"), (MAX_ROWS + 1, "skinny_linear_wgmma"),
                                  (WGMMA_MAX_ROWS, "skinny_linear_wgmma"), (WGMMA_MAX_ROWS + 1, None)),
             (384, 7168, True): ((WGMMA_ALL_ROWS, "skinny_linear_wgmma"), (WGMMA_ALL_ROWS + 1, None)),
             (7168, 1024, False): ((WGMMA_ALL_ROWS, "skinny_linear_wgmma"), (WGMMA_ALL_ROWS + 1, None))}
    for (N, K, beside), rows in cases.items():
        w = torch.randn(N, K, device="cuda").bfloat16()
        for M, kernel in rows:
            launched.clear()
            skinny_linear(torch.randn(M, K, device="cuda").bfloat16(), w, beside=beside)
            assert launched == ([kernel] if kernel else []), (N, beside, M)


def test_bmm_off_the_kernel_is_torch_bmm():
    x, w = torch.randn(1, 3, 256), torch.randn(3, 10, 256)
    out = torch.empty(1, 3, 10)
    assert not bmm_fits(x, w, out)  # a CPU tensor
    assert not bmm_fits(x[0], w, out)  # x not [T, G, K]
    assert skinny_bmm(x, w, out) is out
    assert torch.equal(out, torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1))


def test_bmm_off_the_kernel_merges_split_partials_first():
    """Split partials that the kernel does not take (here on the CPU; on a GPU past MAX_ROWS tokens) are merged in
    torch, then multiplied: an empty partial (sum 0, its values never written) adds nothing."""
    gen = torch.Generator().manual_seed(3)
    o = torch.randn(3, 2, 4, 256, generator=gen)  # [P, T, G, K]
    o[1] = float("nan")
    ml = torch.stack([torch.randn(3, 2, 4, generator=gen), torch.rand(3, 2, 4, generator=gen) + 0.5], -1)
    ml[1] = torch.tensor([float("-inf"), 0.0])
    w = torch.randn(4, 10, 256, generator=gen)
    out = torch.empty(2, 4, 10)
    assert skinny_bmm(SplitPartials(o, ml), w, out) is out
    merged = merge_split_partials(SplitPartials(o, ml))
    assert not merged.isnan().any()
    assert torch.equal(out, torch.bmm(merged.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1))


def _w_uv(heads, nope, v, L, dtype, g):
    """W_UV as K2 reads it: rows [nope, nope + v) of every head's block of kv_b_proj's weight (a strided view)."""
    kv_b = (torch.randn(heads * (nope + v), L, device="cuda", generator=g) / L ** 0.5).to(dtype)
    return kv_b.view(heads, nope + v, L)[:, nope:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,nope,v,L", [(8, 128, 128, 512), (3, 2, 10, 256), (1, 0, 34, 768), (5, 16, 6, 2048)])
def test_cuda_bmm_matches_fp32_reference(heads, nope, v, L, dtype):
    """K2's W_UV product at a token or two (8 heads of 128 rows, K 512), and odd group counts, group sizes and splits;
    past MAX_ROWS tokens torch.bmm."""
    g = torch.Generator("cuda").manual_seed(heads * 31 + v)
    w = _w_uv(heads, nope, v, L, dtype, g)
    for T in range(1, MAX_ROWS + 2):
        x = torch.randn(T, heads, L, device="cuda", generator=g).to(dtype)
        poison_allocator()
        out = torch.full((T, heads, v), float("nan"), device="cuda", dtype=dtype)
        assert bmm_fits(x, w, out) == (T <= MAX_ROWS)
        assert skinny_bmm(x, w, out) is out
        ref = torch.einsum("thk,hrk->thr", x.float(), w.float()).to(dtype)
        torch.testing.assert_close(out, ref, rtol=2 ** -7, atol=2e-3)


@pytest.mark.gpu
def test_bmm_with_an_odd_group_size_takes_torch_bmm():
    g = torch.Generator("cuda").manual_seed(1)
    w = _w_uv(4, 8, 7, 256, torch.bfloat16, g)  # 7 rows a group: a warp's two rows would span two groups
    x = torch.randn(1, 4, 256, device="cuda", generator=g).bfloat16()
    out = torch.empty(1, 4, 7, device="cuda", dtype=torch.bfloat16)
    assert not bmm_fits(x, w, out)
    torch.testing.assert_close(skinny_bmm(x, w, out), torch.einsum("thk,hrk->thr", x.float(), w.float()).bfloat16(),
                               rtol=2 ** -7, atol=2e-3)
