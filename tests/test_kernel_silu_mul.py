"""silu_mul: the reference equals the unfused SwiGLU gate (CPU), the CUDA kernel the reference (GPU)."""
import pytest
import torch
import torch.nn.functional as F
from gpu_checks import poison_allocator

from kdray.kernels.silu_mul import silu_mul


def unfused(x):
    """GatedMLP's gate as written before the fused op."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_unfused_code(dtype):
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert torch.equal(silu_mul(x), unfused(x))


def test_odd_width_is_an_error():
    with pytest.raises(ValueError, match="even"):
        silu_mul(torch.randn(3, 7))


CASES = [  # leading shape, I, dtype
    ((1,), 256, torch.bfloat16),  # K2 TP8 shared expert, decode
    ((2080,), 256, torch.bfloat16),
    ((7, 3), 2304, torch.bfloat16),  # K2 TP8 dense layer
    ((13,), 100, torch.bfloat16),  # 4-element accesses
    ((5,), 7, torch.bfloat16),  # single elements
    ((33,), 96, torch.float32),
    ((4,), 64, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("lead,I,dtype", CASES)
def test_cuda_matches_reference(lead, I, dtype):
    g = torch.Generator("cuda").manual_seed(I)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    for _ in range(2):  # fresh inputs each round
        wide = (3 * torch.randn(*lead, 2 * I + 8, device="cuda", generator=g)).to(dtype)
        for x in (wide[..., :2 * I].contiguous(), wide[..., 8:]):  # contiguous, and rows of a wider tensor
            poison_allocator()
            torch.testing.assert_close(silu_mul(x), unfused(x), **tol)
