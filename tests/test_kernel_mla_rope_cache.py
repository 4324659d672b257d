"""mla_rope_cache: the reference equals the unfused MLA code (CPU), the CUDA kernel the reference (GPU)."""
import pytest
import torch
from gpu_checks import poison_allocator

from kdray.config import YarnScaling
from kdray.kernels.mla_rope_cache import ABSORB_MAX_T, mla_rope_cache, mla_rope_cache_reference
from kdray.model.layers import RMSNorm, Rotary


def inputs(T, H, L, R, rows, dtype, device="cpu", seed=0):
    g = torch.Generator(device).manual_seed(seed)
    rotary = Rotary(R, 50000.0, YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0,
                                            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0), interleaved=True).to(device)
    positions = torch.randint(0, 100000, (T,), device=device, generator=g)
    cos, sin = rotary.cos_sin(positions, dtype)
    wide = torch.randn(T, L + R + 24, device=device, generator=g).to(dtype)  # kv_a as a strided view
    kv_a = wide[:, 3:3 + L + R]
    weight = (1 + 0.1 * torch.randn(L, device=device, generator=g)).to(dtype)
    q = torch.randn(T, H, 128 + R, device=device, generator=g).to(dtype)  # [T, H, nope + rope]
    slots = torch.randperm(rows, device=device, generator=g)[:T]
    return rotary, cos, sin, kv_a, weight, q, slots


def test_launch_sizes_are_the_cu_defines():
    """The launch's block and absorb-token count are the .cu's #defines (the kernel indexes by its ROPE_THREADS, not
    by blockDim: a launch of another size would leave latent values unwritten)."""
    import re
    from pathlib import Path

    import kdray.kernels.mla_rope_cache as mod

    src = (Path(mod.__file__).parent / "cuda" / "mla_rope_cache.cu").read_text()
    found = re.findall(r"^#define (ROPE_THREADS|ABSORB_TOKENS) (\d+)", src, re.M)
    defines = {name: int(value) for name, value in found}
    assert defines == {"ROPE_THREADS": mod.ROPE_THREADS, "ABSORB_TOKENS": mod.ABSORB_TOKENS}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_unfused_code(dtype):
    T, H, L, R, rows = 9, 4, 32, 8, 64
    rotary, cos, sin, kv_a, weight, q, slots = inputs(T, H, L, R, rows, dtype)
    norm = RMSNorm(L, 1e-6, dtype)
    norm.weight.data.copy_(weight)
    # The MLA code this op replaces.
    latent, k_pe = kv_a.split([L, R], dim=-1)
    latent = norm(latent)
    q_pe = rotary(q[..., 128:], cos, sin)
    k_pe = rotary(k_pe.unsqueeze(1), cos, sin).squeeze(1)
    cache = torch.zeros(rows, L + R, dtype=dtype)
    cache[slots] = torch.cat([latent, k_pe], dim=-1).to(cache.dtype)

    ours = torch.zeros(rows, L + R, dtype=dtype)
    q_out = torch.empty(T, H, R, dtype=dtype)
    own = torch.empty(T, L + R, dtype=dtype)
    mla_rope_cache(kv_a, weight, 1e-6, cos, sin, q[..., 128:], q_out, ours, slots, rows_out=own)
    assert torch.equal(ours, cache) and torch.equal(q_out, q_pe) and torch.equal(own, cache[slots])
    mla_rope_cache(kv_a, weight, 1e-6, cos, sin, q[..., 128:], q[..., 128:], ours, slots)  # in place
    assert torch.equal(q[..., 128:], q_pe)


def test_shape_errors_are_clear():
    _, cos, sin, kv_a, weight, q, slots = inputs(3, 2, 32, 8, 16, torch.float32)
    cache = torch.zeros(16, 40)
    with pytest.raises(ValueError, match="q_pe and q_out"):
        mla_rope_cache(kv_a, weight, 1e-6, cos, sin, q[..., 120:], q[..., 120:], cache, slots)
    with pytest.raises(ValueError, match="cache_rows"):
        mla_rope_cache(kv_a, weight, 1e-6, cos, sin, q[..., 128:], q[..., 128:], cache[:, :39], slots)
    with pytest.raises(ValueError, match="cos"):
        mla_rope_cache(kv_a, weight, 1e-6, cos[:2], sin, q[..., 128:], q[..., 128:], cache, slots)
    with pytest.raises(ValueError, match="rows_out"):
        mla_rope_cache(kv_a, weight, 1e-6, cos, sin, q[..., 128:], q[..., 128:], cache, slots,
                       rows_out=torch.empty(3, 39))
    w_uk = torch.zeros(2, 128, 32)
    q_latent = torch.zeros(3, 2, 32)
    with pytest.raises(ValueError, match="together"):
        mla_rope_cache(kv_a, weight, 1e-6, cos, sin, q[..., 128:], q[..., 128:], cache, slots, w_uk=w_uk)
    with pytest.raises(ValueError, match="w_uk"):
        mla_rope_cache(kv_a, weight, 1e-6, cos, sin, q[..., 128:], q[..., 128:], cache, slots, q_nope=q[..., :128],
                       w_uk=w_uk[:, :64], q_latent=q_latent)


CASES = [  # T, H, L, R, dtype
    (1, 8, 512, 64, torch.bfloat16),  # K2 TP8 decode
    (65, 8, 512, 64, torch.bfloat16),
    (300, 16, 512, 64, torch.bfloat16),
    (7, 1, 512, 64, torch.bfloat16),
    (37, 4, 32, 8, torch.float32),  # k2-tiny
    (11, 3, 96, 16, torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,L,R,dtype", CASES)
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("own_rows", [False, True])
def test_cuda_matches_reference(T, H, L, R, dtype, in_place, own_rows):
    """Against the reference in fp32 on the same inputs: the kernel rounds each output once, while torch in 16 bits
    rounds x1 * cos and x2 * sin before subtracting them (off by several ulps where they nearly cancel). With
    ``rows_out`` the rows are written there too, the same values."""
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    for seed in range(2):  # fresh inputs each round
        _, cos, sin, kv_a, weight, q, slots = inputs(T, H, L, R, 4 * T + 5, dtype, "cuda", seed)
        cache = torch.full((4 * T + 5, L + R), float("nan"), dtype=dtype, device="cuda")
        ref_cache, ref_q = cache.float().clone(), q.float().clone()  # copies in fp32 too, where .float() is a no-op
        q_pe = q[..., 128:]
        poison_allocator()
        q_out = q_pe if in_place else torch.empty(T, H, R, dtype=dtype, device="cuda")
        q_nope = q[..., :128].clone()
        own = torch.full((T, L + R), float("nan"), dtype=dtype, device="cuda") if own_rows else None
        mla_rope_cache(kv_a, weight, 1e-6, cos, sin, q_pe, q_out, cache, slots, rows_out=own)
        mla_rope_cache_reference(kv_a.float(), weight.float(), 1e-6, cos.float(), sin.float(), ref_q[..., 128:],
                                 ref_q[..., 128:], ref_cache, slots)
        written = torch.zeros(cache.shape[0], dtype=torch.bool, device="cuda")
        written[slots] = True
        assert cache[~written].isnan().all()  # rows not in slot_mapping untouched
        torch.testing.assert_close(cache[slots].float(), ref_cache[slots], **tol)
        torch.testing.assert_close(q_out.float(), ref_q[..., 128:], **tol)
        assert torch.equal(q[..., :128], q_nope)  # the nope part untouched
        assert own is None or torch.equal(own, cache[slots])


@pytest.mark.gpu
def test_cuda_skips_slots_outside_the_cache():
    _, cos, sin, kv_a, weight, q, slots = inputs(4, 2, 512, 64, 8, torch.bfloat16, "cuda")
    cache = torch.zeros(8, 576, dtype=torch.bfloat16, device="cuda")
    slots = torch.tensor([0, -1, 8, 3], device="cuda")
    own = torch.zeros(4, 576, dtype=torch.bfloat16, device="cuda")
    mla_rope_cache(kv_a, weight, 1e-6, cos, sin, q[..., 128:], q[..., 128:], cache, slots, rows_out=own)
    assert cache[0].abs().sum() > 0 and cache[3].abs().sum() > 0
    assert torch.equal(cache[[1, 2, 4, 5, 6, 7]], torch.zeros(6, 576, dtype=torch.bfloat16, device="cuda"))
    assert torch.equal(own[[0, 3]], cache[[0, 3]]) and (own[[1, 2]].abs().sum(-1) > 0).all()  # every token's row


def absorb_inputs(T, H, nope, L, dtype, seed):
    """q_nope and w_uk as the K2 layer passes them: views of q_b_proj's output and of kv_b_proj's weight."""
    g = torch.Generator("cuda").manual_seed(seed)
    q = torch.randn(T, H, nope + 64, device="cuda", generator=g).to(dtype)
    kv_b = (torch.randn(H * (nope + 128), L, device="cuda", generator=g) / nope ** 0.5).to(dtype)
    return q[..., :nope], kv_b.view(H, nope + 128, L)[:, :nope]


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,nope,L,dtype", [
    (1, 8, 128, 512, torch.bfloat16),  # K2 TP8 decode
    (9, 8, 128, 512, torch.bfloat16),  # two token groups, the second of one token
    (ABSORB_MAX_T, 8, 128, 512, torch.bfloat16),
    (ABSORB_MAX_T + 1, 8, 128, 512, torch.bfloat16),  # cuBLAS's batched GEMM
    (37, 4, 16, 32, torch.float32),  # k2-tiny: half a column block
    (11, 3, 128, 96, torch.float16),  # a column block's last two warps past L
])
def test_cuda_absorbed_queries(T, H, nope, L, dtype):
    """The absorbed queries written into the attention's query buffer beside the roped ones, against an fp64 GEMM
    (fp32 sums, one rounding: within a rounding step of the output's dtype)."""
    R = 64 if L >= 64 else 8
    _, cos, sin, kv_a, weight, _, slots = inputs(T, H, L, R, 4 * T + 5, dtype, "cuda", T)
    q_nope, w_uk = absorb_inputs(T, H, nope, L, dtype, T)
    q_pe = torch.randn(T, H, R, device="cuda").to(dtype)
    cache = torch.zeros(4 * T + 5, L + R, dtype=dtype, device="cuda")
    poison_allocator()
    q_attn = torch.full((T, H, L + R), float("nan"), dtype=dtype, device="cuda")  # [T, H, latent | rope]
    mla_rope_cache(kv_a, weight, 1e-6, cos, sin, q_pe, q_attn[..., L:], cache, slots, q_nope=q_nope, w_uk=w_uk,
                   q_latent=q_attn[..., :L])
    want = torch.einsum("thn,hnl->thl", q_nope.double(), w_uk.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(q_attn[..., :L].double(), want, **tol)
    ref_q = torch.empty(T, H, R, dtype=torch.float32, device="cuda")
    mla_rope_cache_reference(kv_a.float(), weight.float(), 1e-6, cos.float(), sin.float(), q_pe.float(), ref_q,
                             cache.float().clone(), slots)
    torch.testing.assert_close(q_attn[..., L:].float(), ref_q, rtol=2 ** -7, atol=1e-3)
