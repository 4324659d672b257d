"""gqa_rope_cache: the reference equals the attention code it replaced (CPU); the CUDA kernel gives the reference's
bits (GPU)."""
import pytest
import torch
from gpu_checks import poison_allocator

from kdray.config import Llama3Scaling
from kdray.kernels.gqa_rope_cache import gqa_rope_cache, gqa_rope_cache_reference
from kdray.model.layers import Rotary


def inputs(T, H, Hkv, D, rows, dtype, device="cpu", seed=0):
    """q, k, v as strided views of one wide projection output (as a fused qkv GEMM would give), positions far out."""
    g = torch.Generator(device).manual_seed(seed)
    rotary = Rotary(D, 500000.0, Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                               original_max_position_embeddings=8192)).to(device)
    cos, sin = rotary.cos_sin(torch.randint(0, 100000, (T,), device=device, generator=g), dtype)
    qkv = (3 * torch.randn(T, (H + 2 * Hkv) * D + 8, device=device, generator=g)).to(dtype)
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (H + Hkv) * D:(H + 2 * Hkv) * D].view(T, Hkv, D)
    slots = torch.randperm(rows, device=device, generator=g)[:T]
    return rotary, cos, sin, q, k, v, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_the_attention_code_it_replaced(dtype):
    rows, Hkv, D = 40, 2, 16
    rotary, cos, sin, q, k, v, slots = inputs(9, 6, Hkv, D, rows, dtype)
    x1, x2 = q.chunk(2, dim=-1)  # the rope as written before, halves rotated
    c, s = cos[:, None, :], sin[:, None, :]
    want_q = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    k1, k2 = k.chunk(2, dim=-1)
    want_k = torch.cat([k1 * c - k2 * s, k2 * c + k1 * s], dim=-1)
    want = torch.zeros(rows, 2, Hkv, D, dtype=dtype)
    want[slots] = torch.stack([want_k, v], dim=1)

    assert torch.equal(rotary(q, cos, sin), want_q)  # Rotary (the drafter's rope) is the same math
    cache = torch.zeros(rows, 2, Hkv, D, dtype=dtype)
    gqa_rope_cache(q, k, v, cos, sin, cache, slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(cache, want)


def test_shape_errors_name_the_shapes():
    _, cos, sin, q, k, v, slots = inputs(3, 4, 2, 16, 8, torch.float32)
    cache = torch.zeros(8, 2, 2, 16)
    with pytest.raises(ValueError, match="q \\[T, H, D\\] and k, v"):
        gqa_rope_cache(q, k, v[:, :1], cos, sin, cache, slots)
    with pytest.raises(ValueError, match="cos / sin"):
        gqa_rope_cache(q, k, v, cos[:2], sin, cache, slots)
    with pytest.raises(ValueError, match="cache_rows must be"):
        gqa_rope_cache(q, k, v, cos, sin, cache[:, :, :1], slots)


CASES = [  # T, H, Hkv, D
    (1, 9, 3, 64),  # SmolLM2-135M, one token
    (17, 9, 3, 64),
    (300, 9, 3, 64),
    (5, 32, 8, 128),  # Llama 3 8B
    (33, 4, 4, 32),  # MHA, small head
]


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,Hkv,D", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_gives_the_references_bits(T, H, Hkv, D, dtype):
    """The kernel rounds each product before the sum as torch does: bit-equal, rows not in slot_mapping untouched."""
    rows = 3 * T + 5
    for seed in range(2):
        _, cos, sin, q, k, v, slots = inputs(T, H, Hkv, D, rows, dtype, "cuda", seed)
        ref_q, ref_k = q.clone(), k.clone()
        ref_cache = torch.full((rows, 2, Hkv, D), float("nan"), dtype=dtype, device="cuda")
        cache = ref_cache.clone()
        gqa_rope_cache_reference(ref_q, ref_k, v, cos, sin, ref_cache, slots)
        poison_allocator()
        gqa_rope_cache(q, k, v, cos, sin, cache, slots)
        written = torch.zeros(rows, dtype=torch.bool, device="cuda")
        written[slots] = True
        assert cache[~written].isnan().all()
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k) and torch.equal(cache[slots], ref_cache[slots])


@pytest.mark.gpu
def test_cuda_skips_slots_outside_the_cache():
    _, cos, sin, q, k, v, _ = inputs(4, 9, 3, 64, 8, torch.bfloat16, "cuda")
    cache = torch.zeros(8, 2, 3, 64, dtype=torch.bfloat16, device="cuda")
    gqa_rope_cache(q, k, v, cos, sin, cache, torch.tensor([0, -1, 8, 3], device="cuda"))
    assert cache[0].abs().sum() > 0 and cache[3].abs().sum() > 0
    assert not cache[[1, 2, 4, 5, 6, 7]].any()
