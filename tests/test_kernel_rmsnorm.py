"""rmsnorm: the reference equals the unfused layer code (CPU), the CUDA kernel the reference (GPU); the module with a
group reduces before it normalises."""
import pytest
import torch
from gpu_checks import poison_allocator

from kdray.kernels.rmsnorm import rmsnorm
from kdray.kernels.w4a16_moe import expert_k_order
from kdray.model.layers import RMSNorm
from kdray.model.parallel import Collectives


def unfused_norm(x, weight, eps):
    """RMSNorm.forward as it was before the fused op."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_unfused_code(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    assert torch.equal(rmsnorm(x, w, 1e-6), unfused_norm(x, w, 1e-6))


class Tripling(Collectives):
    """A stand-in group of three ranks holding the same partial sum."""

    rank, size = 0, 3

    def all_reduce(self, t):
        return 3 * t


def test_module_with_a_group_reduces_then_returns_norm_and_sum():
    norm = RMSNorm(32, 1e-6, torch.float32)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(5, 32)
    y, s = norm(x, Tripling())
    assert torch.equal(s, 3 * x) and torch.equal(y, norm(3 * x))


def test_out_k_is_the_norm_in_the_experts_k_order():
    """out_k gets the same rows in the INT4 experts' k order, through the module and a group's reduction too; it
    takes 16-bit rows of a multiple of 128 only."""
    x = torch.randn(2, 5, 256).bfloat16()
    w = (1 + 0.1 * torch.randn(256)).bfloat16()
    out_k = torch.empty_like(x)
    out = rmsnorm(x, w, 1e-6, out_k)
    assert torch.equal(out, rmsnorm(x, w, 1e-6)) and torch.equal(out_k, out[..., expert_k_order(256)])
    norm = RMSNorm(256, 1e-6, torch.bfloat16)
    norm.weight.data.copy_(w)
    out_k.zero_()
    y, s = norm(x[0], Tripling(), out_k=out_k[0])
    assert torch.equal(out_k[0], y[:, expert_k_order(256)]) and torch.equal(y, norm(3 * x[0]))
    for bad_x, bad_k in ((x, out_k[:, :4]), (x.float(), out_k.float()), (x[..., :192], out_k[..., :192])):
        with pytest.raises(ValueError, match="out_k"):
            rmsnorm(bad_x, w[:bad_x.shape[-1]], 1e-6, bad_k.contiguous())


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="weight"):
        rmsnorm(torch.randn(3, 8), torch.ones(4), 1e-6)


CASES = [  # leading shape, dim, dtype: ragged rows, odd dims (narrower accesses), K2's norms
    ((1,), 7168, torch.bfloat16),
    ((33,), 7168, torch.bfloat16),
    ((2080,), 512, torch.bfloat16),
    ((5, 8), 1536, torch.bfloat16),
    ((17,), 100, torch.bfloat16),  # 4-element accesses
    ((9,), 7, torch.bfloat16),  # single elements
    ((3,), 30000, torch.bfloat16),  # several accesses per thread
    ((257,), 7168, torch.float32),
    ((6,), 96, torch.float16),
    ((2080,), 7168, torch.bfloat16),  # more rows than SMs: NV accesses per thread
    ((140,), 100, torch.bfloat16),
]


def _tol(dtype):
    # 16-bit: the normalised value is rounded before the weight multiplies it, and the kernel sums the squares in
    # another order than torch; where that flips the first rounding the output moves by up to ~1.5 of its ulps
    # (a 2080 x 7168 case saw 0.87% once in 15M values), so one 2^-6 step, not 2^-7
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("lead,dim,dtype", CASES)
def test_cuda_matches_reference(lead, dim, dtype):
    g = torch.Generator("cuda").manual_seed(dim + len(lead))
    for _ in range(2):  # fresh inputs each round
        x = (3 * torch.randn(*lead, dim, device="cuda", generator=g)).to(dtype)
        w = (1 + 0.1 * torch.randn(dim, device="cuda", generator=g)).to(dtype)
        poison_allocator()
        out = rmsnorm(x, w, 1e-6)
        torch.testing.assert_close(out, unfused_norm(x, w, 1e-6), **_tol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("lead,dim", [((1,), 7168), ((33,), 7168), ((2080,), 7168), ((5, 8), 1536)])
def test_cuda_out_k_is_the_norm_in_the_experts_k_order(lead, dim):
    """The kernel's second output: its own normalised rows, permuted as the MoE's prep permutes x (bit for bit)."""
    g = torch.Generator("cuda").manual_seed(dim + len(lead))
    x = (3 * torch.randn(*lead, dim, device="cuda", generator=g)).bfloat16()
    w = (1 + 0.1 * torch.randn(dim, device="cuda", generator=g)).bfloat16()
    poison_allocator()
    out_k = torch.empty_like(x)
    out = rmsnorm(x, w, 1e-6, out_k)
    assert torch.equal(out, rmsnorm(x, w, 1e-6))
    assert torch.equal(out_k, out[..., expert_k_order(dim).cuda()])


@pytest.mark.gpu
def test_cuda_strided_rows():
    """Rows of a wider tensor (the latent slice of kv_a, say) are read in place."""
    g = torch.Generator("cuda").manual_seed(4)
    wide = torch.randn(19, 576, device="cuda", generator=g).bfloat16()
    x = wide[:, :512]
    w = torch.rand(512, device="cuda", generator=g).bfloat16() + 0.5
    poison_allocator()
    torch.testing.assert_close(rmsnorm(x, w, 1e-6), unfused_norm(x, w, 1e-6), rtol=2 ** -7, atol=1e-3)
