"""skinny_linear: the reference is the torch product it replaces (CPU), the CUDA kernel matches it (GPU)."""
import pytest
import torch
import torch.nn.functional as F
from gpu_checks import poison_allocator, rel_err

from kdray.kernels.skinny_linear import MAX_TOKENS, skinny_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_torch_products(dtype):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=g).to(dtype), torch.randn(48, 64, generator=g).to(dtype)
    assert torch.equal(skinny_linear(x, w), F.linear(x, w))
    assert torch.equal(skinny_linear(x, w, torch.float32), F.linear(x.float(), w.float()))
    with pytest.raises(ValueError, match="out_dtype"):
        skinny_linear(x, w, torch.float16)


CASES = [  # T, N, K: K2 TP8 shard projections at decode and small trees, ragged token counts
    (1, 1536, 7168),  # q_a_proj
    (3, 576, 7168),  # kv_a_proj_with_mqa
    (8, 1536, 1536),  # q_b_proj
    (9, 7168, 1024),  # o_proj
    (17, 512, 7168),  # shared expert gate/up
    (32, 7168, 256),  # shared expert down
    (5, 16, 32),
    (MAX_TOKENS + 1, 64, 64),  # past the kernel: the torch product
]


@pytest.mark.gpu
@pytest.mark.parametrize("T,N,K", CASES)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_cuda_matches_reference(T, N, K, out_dtype):
    g = torch.Generator("cuda").manual_seed(T * N + K)
    for _ in range(2):  # fresh inputs each round
        wide = torch.randn(T, K + 64, device="cuda", generator=g).bfloat16()
        w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
        for x in (wide[:, :K].contiguous(), wide[:, 64:]):  # contiguous, and rows of a wider tensor
            poison_allocator()
            y = skinny_linear(x, w, out_dtype)
            ref = x.double() @ w.double().t()
            assert y.dtype == (out_dtype or torch.bfloat16) and y.shape == (T, N)
            assert torch.isfinite(y).all()
            assert rel_err(y, ref) < (1e-5 if out_dtype == torch.float32 else 4e-3)
