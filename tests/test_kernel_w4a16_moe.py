"""w4a16_moe: the torch reference against a plain dense loop (CPU) and the CUDA kernels against it (GPU)."""
import pytest
import torch
import torch.nn.functional as F
from gpu_checks import poison_allocator, rel_err

import kdray.kernels.w4a16_moe as w4a16_moe_module
from kdray.kernels.int4 import dequantize_int4, pack_int4, quantize_int4
from kdray.kernels.moe_route import moe_route, moe_route_reference
from kdray.kernels.w4a16_moe import (ROUTE_PREP_MAX_E, ROUTE_PREP_MAX_T, SKINNY, SKINNY_UP_FORMS,
                                     VARIANTS, WGMMA_VARIANTS, _choose_variant, _skinny_up_form, _w4a16_moe_cuda,
                                     _wgmma_ok, expert_k_order, random_int4_experts,
                                     repack_int4_experts, routed_w4a16_moe, unpack_int4_experts, w4a16_moe,
                                     w4a16_moe_reference)


def _routing(T, E, k, device="cpu", experts=None, skip=0.0, gen=None):
    """``[T, k]`` distinct expert ids drawn from ``experts`` (default all), a ``skip`` share set to -1; fp32 weights."""
    pool = torch.arange(E, device=device) if experts is None else experts.to(device)
    scores = torch.rand(T, pool.numel(), device=device, generator=gen)
    ids = pool[scores.topk(k, dim=1).indices]
    ids = torch.where(torch.rand(T, k, device=device, generator=gen) < skip, -1, ids)
    return ids, torch.rand(T, k, device=device, generator=gen)


def _dense_loop(x, w13, w2, ids, weights):
    """Plain per-token, per-slot computation on dense fp32 weights ``w13 [E, 2I, H]``, ``w2 [E, H, I]``."""
    I = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            gu = w13[e] @ x[t].float()
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gu[:I]) * gu[I:]))
    return out


def _quantized_experts(E, H, I, group=32, device="cpu"):
    w13p, w13s = quantize_int4(torch.randn(E, 2 * I, H, device=device) / H ** 0.5, group)
    w2p, w2s = quantize_int4(torch.randn(E, H, I, device=device) / I ** 0.5, group)
    return w13p, w13s, w2p, w2s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,I,E,k,group", [(5, 64, 32, 6, 2, 32), (9, 128, 64, 8, 3, 32), (4, 96, 64, 5, 2, 16)])
def test_reference_matches_dense_loop(T, H, I, E, k, group, dtype):
    torch.manual_seed(T * 131 + H)
    w13p, w13s, w2p, w2s = _quantized_experts(E, H, I, group)
    x = torch.randn(T, H).to(dtype)
    ids, weights = _routing(T, E, k, experts=torch.arange(E - 2), skip=0.2)  # two experts unused, some -1
    out = w4a16_moe(x, w13p, w13s, w2p, w2s, ids, weights)
    assert out.dtype == dtype and out.shape == (T, H)
    ref = _dense_loop(x, dequantize_int4(w13p, w13s, H), dequantize_int4(w2p, w2s, I), ids, weights)
    torch.testing.assert_close(out.float(), ref.to(dtype).float(), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-5 if dtype == torch.float32 else 1e-2)


def test_skipped_ids_contribute_nothing():
    torch.manual_seed(1)
    T, H, I, E, k = 6, 64, 32, 4, 2
    w13p, w13s, w2p, w2s = _quantized_experts(E, H, I)
    x = torch.randn(T, H)
    ids, weights = _routing(T, E, k)
    ids[2] = -1  # token 2 has no expert on this rank
    ids[4, 1] = -1
    out = w4a16_moe(x, w13p, w13s, w2p, w2s, ids, weights)
    assert torch.equal(out[2], torch.zeros(H))
    alone = w4a16_moe(x[4:5], w13p, w13s, w2p, w2s, ids[4:5, :1], weights[4:5, :1])
    torch.testing.assert_close(out[4:5], alone)


def test_packing_matches_compressed_tensors():
    """Weights packed by compressed-tensors' own ``pack_to_int32`` give the same MoE as our packing."""
    from compressed_tensors.compressors import pack_to_int32

    torch.manual_seed(2)
    T, H, I, E, k = 3, 64, 32, 3, 2
    q13 = torch.randint(-8, 8, (E, 2 * I, H), dtype=torch.int8)
    q2 = torch.randint(-8, 8, (E, H, I), dtype=torch.int8)
    s13 = (torch.rand(E, 2 * I, H // 32) * 0.02 + 0.001).to(torch.bfloat16)
    s2 = (torch.rand(E, H, I // 32) * 0.02 + 0.001).to(torch.bfloat16)
    ct13, ct2 = pack_to_int32(q13, 4), pack_to_int32(q2, 4)
    assert torch.equal(ct13, pack_int4(q13)) and torch.equal(ct2, pack_int4(q2))
    x = torch.randn(T, H)
    ids, weights = _routing(T, E, k)
    out = w4a16_moe(x, ct13, s13, ct2, s2, ids, weights)
    w13 = q13.float() * s13.float().repeat_interleave(32, -1)
    w2 = q2.float() * s2.float().repeat_interleave(32, -1)
    torch.testing.assert_close(out, _dense_loop(x, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)


def test_add_is_added_after_rounding():
    """``add`` (the shared expert's output) joins the routed sum as ``routed + add`` does in torch."""
    torch.manual_seed(3)
    w13p, w13s, w2p, w2s = _quantized_experts(4, 64, 32)
    x = torch.randn(5, 64).bfloat16()
    ids, weights = _routing(5, 4, 2)
    add = torch.randn(5, 64).bfloat16()
    routed = w4a16_moe(x, w13p, w13s, w2p, w2s, ids, weights)
    assert torch.equal(w4a16_moe(x, w13p, w13s, w2p, w2s, ids, weights, add), routed + add)
    with pytest.raises(ValueError, match="add must be"):
        w4a16_moe(x, w13p, w13s, w2p, w2s, ids, weights, add.float())


def test_skinny_up_form_by_items():
    """K2 TP8 on 132 SMs: one token's items (9 passes x 16 column tiles at most) take the 16-warp gate/up kernel, four
    tokens' (36 x 16) the 4-warp one, 16 tokens' (144 x 16) the one with two chunks ahead."""
    wide, few, many = (form[1:] for form in SKINNY_UP_FORMS)
    assert _skinny_up_form(9 * 16, 132) == wide == (16, 1, 1)
    assert _skinny_up_form(36 * 16, 132) == few
    assert _skinny_up_form(144 * 16, 132) == many
    assert _skinny_up_form(8 * 132 - 1, 132) == few and _skinny_up_form(8 * 132, 132) == many


def test_skinny_path_serves_few_rows_per_expert():
    """K2 TP8 shapes: decode and trees up to 384 tokens (8 route slots per expert) take the skinny path; larger
    verifies and prefills rs on Hopper, the tiles elsewhere."""
    assert _choose_variant(384, 7168, 256, 8 * 1) == SKINNY
    assert _choose_variant(384, 7168, 256, 8 * 257) == SKINNY
    assert _choose_variant(384, 7168, 256, 8 * 384) == SKINNY
    assert _choose_variant(384, 7168, 256, 8 * 385) == "m32n2"
    assert _choose_variant(384, 7168, 256, 8 * 1024) == "m32n2"
    assert _choose_variant(384, 7168, 256, 8 * 32 * 65) == "m64n2"  # a 32 x 64-node verify, or a prefill
    assert _choose_variant(384, 7168, 384 - 64, 8 * 2080) == "m32n1"  # I % 128 != 0
    assert _choose_variant(32, 320, 64, 8) == "m16n1"  # H, I not multiples of 128


def test_shape_errors_are_clear():
    w13p, w13s, w2p, w2s = _quantized_experts(2, 64, 32)
    ids, weights = _routing(3, 2, 1)
    with pytest.raises(ValueError, match="w13_packed"):
        w4a16_moe(torch.randn(3, 128), w13p, w13s, w2p, w2s, ids, weights)
    with pytest.raises(ValueError, match="topk_ids"):
        w4a16_moe(torch.randn(3, 64), w13p, w13s, w2p, w2s, ids[:2], weights[:2])
    with pytest.raises(TypeError, match="int64"):
        w4a16_moe(torch.randn(3, 64), w13p, w13s, w2p, w2s, ids.int(), weights)


def _router(T, E, device="cpu", gen=None):
    """Router logits ``[T, E]`` and a non-negative correction bias ``[E]`` (fp32; no exact ties among choices)."""
    return (2 * torch.randn(T, E, device=device, generator=gen),
            0.1 * torch.rand(E, device=device, generator=gen))


def test_routed_moe_composes_the_references():
    torch.manual_seed(4)
    T, H, I, E, k = 5, 64, 32, 8, 2
    w13p, w13s, w2p, w2s = _quantized_experts(E // 2, H, I)
    x, add = torch.randn(T, H).bfloat16(), torch.randn(T, H).bfloat16()
    logits, bias = _router(T, E)
    routing = (k, 2, 1, True, 2.827, (4, 4))  # expert parallelism: the second half of the experts
    out, ids, weights = routed_w4a16_moe(x, w13p, w13s, w2p, w2s, logits, bias, *routing, add=add)
    ref_ids, ref_weights = moe_route_reference(logits, bias, *routing)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
    assert torch.equal(out, w4a16_moe_reference(x, w13p, w13s, w2p, w2s, ref_ids, ref_weights, add))


def test_experts_k_order_is_the_kernels_logical_k():
    """expert_k_order (position -> k) inverts the .cu's logical_pos (k -> position in its 128-k chunk), chunk by
    chunk, and the CPU path refuses x_k."""
    H = 384
    order = expert_k_order(H)
    for k in range(H):
        kk = k % 128
        c, q, i, s1, h = kk >> 5, (kk >> 3) & 3, (kk >> 2) & 1, (kk >> 1) & 1, kk & 1
        assert order[k - kk + 16 * (2 * q + s1) + 8 * h + 2 * c + i] == k
    with pytest.raises(ValueError, match="multiple of 128"):
        expert_k_order(192)
    w13p, w13s, w2p, w2s = _quantized_experts(4, 128, 32)
    x = torch.randn(3, 128)
    ids, weights = _routing(3, 4, 2)
    with pytest.raises(ValueError, match="for CUDA tensors"):
        w4a16_moe(x, w13p, w13s, w2p, w2s, ids, weights, x_k=x[:, expert_k_order(128)])


def test_routed_moe_shape_errors_are_clear():
    w13p, w13s, w2p, w2s = _quantized_experts(4, 64, 32)
    x = torch.randn(3, 64)
    logits, bias = _router(3, 8)
    with pytest.raises(ValueError, match="w13_packed hold the 8 experts of local_experts=None"):
        routed_w4a16_moe(x, w13p, w13s, w2p, w2s, logits, bias, 2, 1, 1, True, 1.0, None)
    with pytest.raises(ValueError, match="T = 2 rows"):
        routed_w4a16_moe(x[:2], w13p, w13s, w2p, w2s, logits, bias, 2, 1, 1, True, 1.0, (0, 4))
    with pytest.raises(ValueError, match="n_group"):
        routed_w4a16_moe(x, w13p, w13s, w2p, w2s, logits, bias, 2, 3, 1, True, 1.0, (0, 4))


# ---------------------------------------------------------------- GPU: the CUDA kernels against the reference


GPU_SHAPES = [  # T, H, I, E, k, experts used (None: all), share of -1 ids
    (1, 256, 128, 8, 2, None, 0.0),
    (7, 512, 256, 16, 4, 10, 0.1),
    (9, 192, 64, 4, 2, None, 0.0),  # H % 128 == 64: a half K chunk and a half N tile
    (16, 1024, 192, 64, 8, 40, 0.2),
    (64, 512, 128, 32, 8, 20, 0.1),
    (257, 320, 64, 32, 8, None, 0.1),  # several passes per expert; H % 128 == 64
    (200, 320, 256, 16, 4, None, 0.0),  # wide (256-row) tiles, the last down tile a quarter full
    (1024, 512, 128, 384, 8, 300, 0.05),
    (130, 256, 64, 8, 2, 3, 0.0),  # 3 busy experts: ~87 rows each, several passes
    (16, 7168, 256, 384, 8, None, 0.0),  # K2 TP8 shard
    (64, 7168, 2048, 48, 8, None, 0.1),  # K2 TP1 width (fewer experts to keep memory small)
]


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,I,E,k,used,skip", GPU_SHAPES)
def test_cuda_matches_reference(T, H, I, E, k, used, skip):
    gen = torch.Generator("cuda").manual_seed(T * 7919 + H + I)
    w13p, w13s, w2p, w2s = random_int4_experts(E, H, I, "cuda", gen)
    experts = None if used is None else torch.randperm(E, device="cuda", generator=gen)[:used]
    for _ in range(2):  # fresh inputs each round
        x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
        ids, weights = _routing(T, E, k, "cuda", experts, skip, gen)
        poison_allocator()
        out = w4a16_moe(x, w13p, w13s, w2p, w2s, ids, weights)
        ref = w4a16_moe_reference(x.float(), w13p, w13s, w2p, w2s, ids, weights)
        assert out.dtype == torch.bfloat16 and out.shape == (T, H)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < 1e-2
        skipped = (ids < 0).all(1)
        assert torch.equal(out[skipped], torch.zeros_like(out[skipped]))


SKINNY_SHAPES = [  # T, H, I, E, k, experts used (None: all), share of -1 ids: every GEMM family on each
    (1, 7168, 256, 384, 8, None, 0.0),  # K2 TP8 decode
    (17, 7168, 256, 384, 8, None, 0.0),  # a 16-node tree
    (3, 384, 128, 16, 2, None, 0.3),  # H % 256 == 128: a half down block
    (130, 256, 128, 8, 2, 3, 0.0),  # ~87 rows per expert: 11 skinny passes each
    (40, 1024, 384, 24, 4, None, 0.1),  # 3 chunks of K = I in the down GEMM
    (2000, 1024, 256, 24, 8, None, 0.0),  # a prefill's ~670 rows per expert: several 128-row passes each
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [SKINNY, *VARIANTS])
@pytest.mark.parametrize("T,H,I,E,k,used,skip", SKINNY_SHAPES)
def test_cuda_variants_match_reference(T, H, I, E, k, used, skip, variant):
    """Every GEMM family on shapes the others serve by default, with the shared-expert ``add``."""
    gen = torch.Generator("cuda").manual_seed(T * 31 + I + len(variant))
    w13p, w13s, w2p, w2s = random_int4_experts(E, H, I, "cuda", gen)
    experts = None if used is None else torch.randperm(E, device="cuda", generator=gen)[:used]
    for _ in range(2):
        x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
        add = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16) * 0.05
        ids, weights = _routing(T, E, k, "cuda", experts, skip, gen)
        poison_allocator()
        out = _w4a16_moe_cuda(x, w13p, w13s, w2p, w2s, ids, weights, add, variant=variant)
        ref = w4a16_moe_reference(x.float(), w13p, w13s, w2p, w2s, ids, weights) + add.float()
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < 1e-2
        skipped = (ids < 0).all(1)
        assert torch.equal(out[skipped], add[skipped])


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager():
    gen = torch.Generator("cuda").manual_seed(5)
    T, H, I, E, k = 48, 1024, 256, 64, 8
    w13p, w13s, w2p, w2s = random_int4_experts(E, H, I, "cuda", gen)
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    ids, weights = _routing(T, E, k, "cuda", gen=gen)
    w4a16_moe(x, w13p, w13s, w2p, w2s, ids, weights)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        static_out = w4a16_moe(x, w13p, w13s, w2p, w2s, ids, weights)
    torch.cuda.current_stream().wait_stream(stream)
    for skip in (0.0, 0.3):  # new routing and activations in the captured buffers
        x.copy_(torch.randn(T, H, device="cuda", generator=gen))
        new_ids, new_weights = _routing(T, E, k, "cuda", skip=skip, gen=gen)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        eager = w4a16_moe(x, w13p, w13s, w2p, w2s, ids, weights)
        assert torch.equal(static_out, eager)  # the skinny path (6 slots per expert) sums in slot order
        assert rel_err(static_out, w4a16_moe_reference(x.float(), w13p, w13s, w2p, w2s, ids, weights)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [SKINNY, "m32n2", "rs"])
def test_cuda_results_are_the_same_bits_on_every_call(variant):
    """Every family writes each (token, slot)'s row and sums a token's rows in slot order, so repeated calls give the
    same bits (fp32 atomics from many blocks into one row, as the skinny and tile paths had, flip last bits)."""
    if variant == "rs" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma family needs sm_90")
    gen = torch.Generator("cuda").manual_seed(8)
    T, H, I, E, k = 256, 2048, 256, 16, 8  # 128 slots per expert: 16 passes each for the skinny path
    int4 = repack_int4_experts(*random_int4_experts(E, H, I, "cuda", gen))
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    ids, weights = _routing(T, E, k, "cuda", gen=gen)
    first = _w4a16_moe_cuda(x, *int4, ids, weights, variant=variant)
    assert rel_err(first, w4a16_moe_reference(x.float(), *int4, ids, weights)) < 1e-2
    for _ in range(4):
        assert torch.equal(_w4a16_moe_cuda(x, *int4, ids, weights, variant=variant), first)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["m16n1", "m64n2", "rs"])
def test_cuda_x_in_the_experts_k_order_replaces_the_prep_permutation(variant):
    """The families that read x in the experts' k order take it from the caller (x_k, which the norm before the MoE
    writes) instead of permuting x in the prep: the same bits. The skinny path reads x as it is and refuses x_k."""
    if variant == "rs" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma family needs sm_90")
    gen = torch.Generator("cuda").manual_seed(9)
    T, H, I, E, k = 300, 1024, 256, 16, 8
    int4 = repack_int4_experts(*random_int4_experts(E, H, I, "cuda", gen))
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    ids, weights = _routing(T, E, k, "cuda", gen=gen)
    x_k = x[:, expert_k_order(H).cuda()].contiguous()
    poison_allocator()
    permuted_here = _w4a16_moe_cuda(x, *int4, ids, weights, variant=variant)
    poison_allocator()
    given = _w4a16_moe_cuda(torch.zeros_like(x), *int4, ids, weights, variant=variant, x_k=x_k)  # x itself unread
    assert torch.isfinite(given).all() and torch.equal(given, permuted_here)
    with pytest.raises(ValueError, match="reads that order"):
        _w4a16_moe_cuda(x, *int4, ids, weights, variant=SKINNY, x_k=x_k)
    with pytest.raises(ValueError, match="x_k"):
        _w4a16_moe_cuda(x, *int4, ids, weights, variant=variant, x_k=x_k[:, :512].contiguous())


@pytest.mark.gpu
def test_cuda_rejects_unsupported_shapes():
    w13p, w13s, w2p, w2s = (t.cuda() for t in _quantized_experts(2, 96, 64))
    ids, weights = _routing(3, 2, 1, "cuda")
    with pytest.raises(ValueError, match="multiples of 64"):
        w4a16_moe(torch.randn(3, 96, device="cuda", dtype=torch.bfloat16), w13p, w13s, w2p, w2s, ids, weights)


ROUTED_SHAPES = [  # T, E, k, n_group, topk_group, local experts (e0, n): routing folded into the prep up to the bound
    (1, 384, 8, 1, 1, None),  # K2 decode
    (2, 384, 8, 1, 1, None),
    (3, 256, 8, 8, 4, None),  # up to 32 slots: one warp sorts them
    (4, 8, 8, 1, 1, None),  # ... over fewer experts than slots (the warp's scratch is 32 ints)
    (4, 384, 8, 1, 1, (96, 96)),  # ... with the other ranks' experts dropped
    (7, 256, 8, 8, 4, None),  # DeepSeek-V3 groups
    (10, 384, 8, 1, 1, (96, 96)),  # expert parallelism: rank 1 of 4
    (ROUTE_PREP_MAX_T, 384, 8, 1, 1, None),
    (ROUTE_PREP_MAX_T, ROUTE_PREP_MAX_E, 8, 4, 2, (320, 320)),  # the most experts: group scratch T x E floats
    (ROUTE_PREP_MAX_T, 16, 8, 4, 2, None),  # 16 rows per expert: rs or the tile path (x permuted in the prep)
    (ROUTE_PREP_MAX_T + 1, 384, 8, 1, 1, None),  # above the bound: moe_route, then moe_prep
]


def _route_then_moe(x, int4, logits, bias, routing, add):
    ids, weights = moe_route(logits, bias, *routing)
    return w4a16_moe(x, *int4, ids, weights, add), ids, weights


def _assert_same(fused, unfused):
    """Ids, weights and outputs bit-equal: the same kernels but the prep, and every family sums in slot order."""
    out, ids, weights = fused
    assert torch.equal(ids, unfused[1]) and torch.equal(weights, unfused[2])
    assert torch.isfinite(out).all()
    assert torch.equal(out, unfused[0])


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k,n_group,topk_group,local", ROUTED_SHAPES)
def test_cuda_routed_moe_equals_route_then_moe(T, E, k, n_group, topk_group, local):
    gen = torch.Generator("cuda").manual_seed(T * 131 + E + n_group)
    H, I = 1024, 256
    int4 = random_int4_experts(E if local is None else local[1], H, I, "cuda", gen)
    routing = (k, n_group, topk_group, True, 2.827, local)
    for _ in range(2):  # fresh inputs each round
        x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
        add = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16) * 0.05
        logits, bias = _router(T, E, "cuda", gen)
        poison_allocator()
        fused = routed_w4a16_moe(x, *int4, logits, bias, *routing, add=add)
        poison_allocator()
        _assert_same(fused, _route_then_moe(x, int4, logits, bias, routing, add))
        out, ids, weights = fused
        assert rel_err(out, w4a16_moe_reference(x.float(), *int4, ids, weights) + add.float()) < 1e-2
        skipped = (ids < 0).all(1)  # no expert on this rank
        assert torch.equal(out[skipped], add[skipped])


@pytest.mark.gpu
@pytest.mark.parametrize("T,n_group", [(1, 1), (ROUTE_PREP_MAX_T, 4)])
def test_cuda_routed_moe_graph_replay_equals_route_then_moe(T, n_group):
    gen = torch.Generator("cuda").manual_seed(6 + T)
    H, I, E, k = 1024, 256, 384, 8
    int4 = random_int4_experts(E, H, I, "cuda", gen)
    routing = (k, n_group, min(2, n_group), True, 2.827, None)
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    logits, bias = _router(T, E, "cuda", gen)
    routed_w4a16_moe(x, *int4, logits, bias, *routing)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        static = routed_w4a16_moe(x, *int4, logits, bias, *routing)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):  # new activations and router logits in the captured buffers
        x.copy_(torch.randn(T, H, device="cuda", generator=gen))
        logits.copy_(_router(T, E, "cuda", gen)[0])
        for t in static:
            t.fill_(float("nan") if t.is_floating_point() else -7)
        graph.replay()
        _assert_same(static, _route_then_moe(x, int4, logits, bias, routing, None))


# ---------------------------------------------------------------- the tiled expert layout and the wgmma family


@pytest.mark.parametrize("E,H,I", [(3, 128, 64), (2, 7168 // 8, 256), (5, 192, 320)])
def test_repack_round_trip_and_layout(E, H, I):
    gen = torch.Generator().manual_seed(E * H + I)
    ct = random_int4_experts(E, H, I, "cpu", gen)
    tiled = repack_int4_experts(*ct)
    assert [tuple(t.shape) for t in tiled] == [(E, H // 64, 2 * I, 8), (E, H // 64, 2 * I, 2), (E, I // 64, H, 8),
                                               (E, I // 64, H, 2)]
    assert [t.dtype for t in tiled] == [t.dtype for t in ct]
    assert all(torch.equal(a, b) for a, b in zip(unpack_int4_experts(*tiled), ct))
    # K tile kb of row n: words 8 kb .. 8 kb + 7 and scale groups 2 kb, 2 kb + 1, unchanged
    w13p, w13s = ct[0], ct[1]
    assert torch.equal(tiled[0][1, 0, 5], w13p[1, 5, :8]) and torch.equal(tiled[0][0, -1, 3], w13p[0, 3, -8:])
    assert torch.equal(tiled[1][1, 1, 7], w13s[1, 7, 2:4])
    assert torch.equal(tiled[2][0, -1, H - 1], ct[2][0, H - 1, -8:])


def test_tiled_experts_give_the_same_reference():
    torch.manual_seed(7)
    T, H, I, E, k = 9, 128, 64, 6, 3
    ct = _quantized_experts(E, H, I)
    x = torch.randn(T, H).bfloat16()
    ids, weights = _routing(T, E, k, skip=0.2)
    add = torch.randn(T, H).bfloat16()
    assert torch.equal(w4a16_moe(x, *repack_int4_experts(*ct), ids, weights, add), w4a16_moe(x, *ct, ids, weights, add))


def test_repack_rejects_unsupported_layouts():
    ct = _quantized_experts(2, 64, 32)  # I = 32: w2's K is not a multiple of 64
    with pytest.raises(ValueError, match="multiple of 64"):
        repack_int4_experts(*ct)
    ct16 = _quantized_experts(2, 128, 64, group=16)
    with pytest.raises(ValueError, match="group size 32"):
        repack_int4_experts(*ct16)
    ok = _quantized_experts(2, 128, 64)
    with pytest.raises(ValueError, match="tiled experts"):
        unpack_int4_experts(*ok)
    with pytest.raises(ValueError, match="compressed-tensors experts"):
        repack_int4_experts(*repack_int4_experts(*ok))
    tiled = repack_int4_experts(*ok)
    ids, weights = _routing(3, 2, 1)
    with pytest.raises(ValueError, match="expected tiled experts"):  # x of another H
        w4a16_moe(torch.randn(3, 192), *tiled, ids, weights)


def test_wgmma_family_support_and_choice():
    assert _wgmma_ok((9, 0), 7168, 256, True) is None
    assert "tiled layout" in _wgmma_ok((9, 0), 7168, 256, False)
    assert "sm_90" in _wgmma_ok((8, 0), 7168, 256, True) and "sm_90" in _wgmma_ok((10, 0), 7168, 256, True)
    assert "H % 256 == 0 and I % 128 == 0" in _wgmma_ok((9, 0), 7168 + 64, 256, True)
    assert "got H=7168, I=192" in _wgmma_ok((9, 0), 7168, 192, True)
    E, H, I = 384, 7168, 256
    assert _choose_variant(E, H, I, 8 * 64, wgmma=True) == SKINNY
    assert _choose_variant(E, H, I, 8 * 384, wgmma=True) == SKINNY
    assert _choose_variant(E, H, I, 8 * 385, wgmma=True) == "rs"
    assert _choose_variant(E, H, I, 8 * 512, wgmma=True) == "rs"
    assert _choose_variant(E, H, I, 8 * 1024, wgmma=True) == "rs"
    assert _choose_variant(E, H, I, 8 * 1024, wgmma=False) == "m32n2"
    assert _choose_variant(E, H, I, 8 * 2080, wgmma=True) == "rs"
    assert _choose_variant(E, H, I, 8 * 4096, wgmma=True) == "rs"
    assert _choose_variant(E, H, I, 8 * 4096, wgmma=False) == "m64n2"


def test_swapped_gemms_launch_with_the_sizes_the_cu_defines():
    """The launch's threads, shared memory and I bound for moe_up_rs / moe_down_rs are the .cu's #defines (a kernel
    launched with less shared memory than it addresses would read past its allocation)."""
    import re
    from pathlib import Path

    import kdray.kernels.w4a16_moe as moe

    src = (Path(moe.__file__).parent / "cuda" / "w4a16_moe.cu").read_text()
    defines = {name: expr.split("//")[0] for name, expr in re.findall(r"^#define (RSD?_[A-Z_]+) (.*)$", src, re.M)}
    values: dict[str, int] = {}
    for name, expr in defines.items():  # each refers only to the ones above it
        values[name] = int(eval(re.sub(r"[A-Z_]+", lambda m: str(values[m.group()]), expr)))
    assert values["RS_MT"] == 64 * WGMMA_VARIANTS["rs"][0]  # the pass size of the variant
    assert (values["RS_THREADS"], values["RS_SMEM"]) == (moe.RS_THREADS, moe.RS_SMEM)
    assert (values["RSD_MAX_I"], values["RSD_SMEM"]) == (moe.RSD_MAX_I, moe.RSD_SMEM)
    assert max(values["RS_SMEM"], values["RSD_SMEM"]) <= 227 * 1024  # an H100/H200 block's shared memory


def _ragged_routing(T, E, k, gen, skip=0.05):
    """Distinct ids per token with ragged expert loads: experts 0 and 1 hot (every token that can: > 1 tile of rows
    from T = 257), expert 2 on token 0 only (1 row), the last quarter unused (0 rows), a ``skip`` share of -1."""
    dev = gen.device
    pool = E - E // 4  # experts [pool, E) get no rows
    scores = torch.rand(T, pool, device=dev, generator=gen)
    scores[:, :2] += 10.0  # hot
    scores[:, 2] = -1.0  # never by score
    ids = scores.topk(k, dim=1).indices
    ids[0, -1] = 2
    ids = torch.where(torch.rand(T, k, device=dev, generator=gen) < skip, -1, ids)
    ids[0, -1] = 2
    return ids, torch.rand(T, k, device=dev, generator=gen)


WGMMA_SHAPES = [(T, 1024, 256, E) for T in (64, 257, 1024, 2080, 4096) for E in (8, 384)] + [
    (2080, 7168, 256, 384),  # K2 TP8 shard: a 32 x 65-node verify
    (4096, 7168, 256, 384),  # a K2 TP8 prefill chunk
    (300, 768, 384, 16),  # 3 up tiles, 3 down tiles, K = I = 6 stages: h streamed (I > WG_RES_K)
    (200, 512, 128, 8),  # one up tile, h resident with K = I = 2 stages
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(WGMMA_VARIANTS))
@pytest.mark.parametrize("T,H,I,E", WGMMA_SHAPES)
def test_cuda_wgmma_matches_reference(T, H, I, E, variant):
    """The wgmma family over tiled experts: ragged loads, poisoned outputs, the shared-expert add, and the same bits on
    a repeated call (per-slot rows summed in order: no atomics)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma family needs an sm_90 GPU")
    gen = torch.Generator("cuda").manual_seed(T * 13 + E + H + len(variant))
    tiled = repack_int4_experts(*random_int4_experts(E, H, I, "cuda", gen))
    k = min(8, E // 2)
    for _ in range(2):
        x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
        add = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16) * 0.05
        ids, weights = _ragged_routing(T, E, k, gen)
        counts = torch.bincount(ids[ids >= 0], minlength=E)
        assert counts[2] == 1 and counts[-1] == 0 and (T < 257 or counts[0] > 128)
        poison_allocator()
        out = _w4a16_moe_cuda(x, *tiled, ids, weights, add, variant=variant)
        ref = w4a16_moe_reference(x.float(), *tiled, ids, weights) + add.float()
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < 1e-2
        skipped = (ids < 0).all(1)
        assert torch.equal(out[skipped], add[skipped])
        poison_allocator()
        assert torch.equal(_w4a16_moe_cuda(x, *tiled, ids, weights, add, variant=variant), out)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(WGMMA_VARIANTS))
def test_cuda_wgmma_every_pass_size(variant):
    """Expert e gets e + 1 rows, e < 128: a pass of every size from 1 to 128 rows (every wgmma N of the swapped
    GEMMs, each with padding columns) and, for the 64-row families, the split of a pass."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma family needs an sm_90 GPU")
    E, H, I, k = 128, 1024, 256, 8
    gen = torch.Generator("cuda").manual_seed(128 + len(variant))
    tiled = repack_int4_experts(*random_int4_experts(E, H, I, "cuda", gen))
    slots = torch.repeat_interleave(torch.arange(E, device="cuda"), torch.arange(1, E + 1, device="cuda"))  # [8256]
    ids = slots[torch.randperm(slots.numel(), device="cuda", generator=gen)].view(-1, k)  # [1032, 8]
    x = torch.randn(ids.shape[0], H, device="cuda", generator=gen).to(torch.bfloat16)
    weights = torch.rand(ids.shape, device="cuda", generator=gen)
    poison_allocator()
    out = _w4a16_moe_cuda(x, *tiled, ids, weights, variant=variant)
    ref = w4a16_moe_reference(x.float(), *tiled, ids, weights)
    assert ((out.float() - ref).norm(dim=1) / ref.norm(dim=1)).max() < 2e-2  # every token: every slot's pass is right


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [SKINNY, *VARIANTS])
@pytest.mark.parametrize("T,H,I,E,k", [(17, 7168, 256, 384, 8), (257, 320, 64, 32, 8), (1024, 512, 128, 64, 8)])
def test_cuda_other_families_read_the_tiled_layout(T, H, I, E, k, variant):
    """One copy of the experts serves every family: the mma.sync and skinny kernels read the tiled layout too."""
    if variant == SKINNY and (H % 128 or I % 128):
        pytest.skip("the skinny path needs H and I multiples of 128")
    if VARIANTS.get(variant, (0, 1))[1] == 2 and I % 128:
        pytest.skip("n2 tiles need I % 128 == 0")
    tiled_equals_compressed(T, H, I, E, k, None, 0.1, variant, seed=T + H + len(variant))


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,I,E,k,used,skip", [s for s in SKINNY_SHAPES if s[1] % 128 == 0 and s[2] % 128 == 0])
def test_cuda_skinny_tiled_matches_compressed(T, H, I, E, k, used, skip):
    """The skinny path on the tiled layout equals it on compressed-tensors on every skinny shape (the 2000-token one
    gives each persistent block ~240 items, the 130-token one 11 passes per expert)."""
    tiled_equals_compressed(T, H, I, E, k, used, skip, SKINNY, seed=T + 7 * H + I)


def tiled_equals_compressed(T, H, I, E, k, used, skip, variant, seed):
    """``variant`` on the tiled layout equals it on compressed-tensors (up to rounding) and the reference."""
    gen = torch.Generator("cuda").manual_seed(seed)
    ct = random_int4_experts(E, H, I, "cuda", gen)
    tiled = repack_int4_experts(*ct)
    experts = None if used is None else torch.randperm(E, device="cuda", generator=gen)[:used]
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    ids, weights = _routing(T, E, k, "cuda", experts, skip, gen)
    poison_allocator()
    out = _w4a16_moe_cuda(x, *tiled, ids, weights, variant=variant)
    poison_allocator()
    out_ct = _w4a16_moe_cuda(x, *ct, ids, weights, variant=variant)
    torch.testing.assert_close(out, out_ct, rtol=2 ** -7, atol=2 ** -8 * out_ct.abs().max().item())
    assert rel_err(out, w4a16_moe_reference(x.float(), *ct, ids, weights)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("form", [form[1:] for form in w4a16_moe_module.SKINNY_UP_FORMS])
def test_cuda_skinny_every_up_kernel(form, monkeypatch):
    """Each form of the gate/up kernel is right, with a block's stream running across many items (1000 tokens x 8
    slots over 24 experts: ~1000 passes x 16 items) and H = 1152 (9 chunks: the warps' last positions load and add
    nothing)."""
    T, H, I, E, k = 1000, 1152, 256, 24, 8
    gen = torch.Generator("cuda").manual_seed(form[0])
    tiled = repack_int4_experts(*random_int4_experts(E, H, I, "cuda", gen))
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    ids, weights = _routing(T, E, k, "cuda", skip=0.1, gen=gen)
    monkeypatch.setattr(w4a16_moe_module, "_skinny_up_form", lambda items, sms: form)
    poison_allocator()
    out = _w4a16_moe_cuda(x, *tiled, ids, weights, variant=SKINNY)
    assert rel_err(out, w4a16_moe_reference(x.float(), *tiled, ids, weights)) < 1e-2


@pytest.mark.gpu
def test_cuda_wgmma_graph_replay_equals_eager():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma family needs an sm_90 GPU")
    gen = torch.Generator("cuda").manual_seed(11)
    T, H, I, E, k = 1024, 1024, 256, 64, 8  # 128 slots per expert: rs
    tiled = repack_int4_experts(*random_int4_experts(E, H, I, "cuda", gen))
    assert _choose_variant(E, H, I, T * k, wgmma=True) in WGMMA_VARIANTS
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    ids, weights = _ragged_routing(T, E, k, gen)
    w4a16_moe(x, *tiled, ids, weights)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        static_out = w4a16_moe(x, *tiled, ids, weights)
    torch.cuda.current_stream().wait_stream(stream)
    for skip in (0.0, 0.3):  # new routing and activations in the captured buffers
        x.copy_(torch.randn(T, H, device="cuda", generator=gen))
        new_ids, new_weights = _ragged_routing(T, E, k, gen, skip)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        static_out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(static_out, w4a16_moe(x, *tiled, ids, weights))  # deterministic: bit-equal
        assert rel_err(static_out, w4a16_moe_reference(x.float(), *tiled, ids, weights)) < 1e-2


@pytest.mark.gpu
def test_cuda_wgmma_rejects_unsupported_operands():
    gen = torch.Generator("cuda").manual_seed(12)
    ct = random_int4_experts(8, 320, 128, "cuda", gen)  # H % 256 != 0
    x = torch.randn(64, 320, device="cuda", generator=gen).to(torch.bfloat16)
    ids, weights = _routing(64, 8, 2, "cuda", gen=gen)
    with pytest.raises(ValueError, match="tiled layout"):
        _w4a16_moe_cuda(x, *ct, ids, weights, variant="wg64")
    with pytest.raises(ValueError, match="H % 256 == 0" if torch.cuda.get_device_capability() == (9, 0) else "sm_90"):
        _w4a16_moe_cuda(x, *repack_int4_experts(*ct), ids, weights, variant="wg128")
    with pytest.raises(ValueError, match="H % 256 == 0" if torch.cuda.get_device_capability() == (9, 0) else "sm_90"):
        _w4a16_moe_cuda(x, *repack_int4_experts(*ct), ids, weights, variant="rs")
    with pytest.raises(ValueError, match="unknown variant"):
        _w4a16_moe_cuda(x, *ct, ids, weights, variant="m128n4")
    # the automatic choice falls back to the other families there: still correct
    out = w4a16_moe(x, *repack_int4_experts(*ct), ids, weights)
    assert rel_err(out, w4a16_moe_reference(x.float(), *ct, ids, weights)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [SKINNY, "m32n2", "wg64", "rs"])
def test_cuda_token_chunks_give_the_same_bits(monkeypatch, variant):
    if variant in WGMMA_VARIANTS and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma family needs an sm_90 GPU")
    import kdray.kernels.w4a16_moe as moe

    gen = torch.Generator("cuda").manual_seed(13)
    T, H, I, E, k = 1000, 1024, 256, 32, 8
    tiled = repack_int4_experts(*random_int4_experts(E, H, I, "cuda", gen))
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    add = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    ids, weights = _ragged_routing(T, E, k, gen)
    whole = _w4a16_moe_cuda(x, *tiled, ids, weights, add, variant=variant)
    monkeypatch.setattr(moe, "CHUNK_TOKENS", 300)  # 4 chunks, the last one short
    poison_allocator()
    assert torch.equal(_w4a16_moe_cuda(x, *tiled, ids, weights, add, variant=variant), whole)


@pytest.mark.gpu
def test_cuda_wgmma_routed_in_prep_equals_route_then_moe():
    """routed_w4a16_moe routing inside the prep launch ahead of the wgmma GEMMs (8 experts, top-8: ROUTE_PREP_MAX_T
    rows each)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma family needs an sm_90 GPU")
    gen = torch.Generator("cuda").manual_seed(14)
    T, H, I, E, k = ROUTE_PREP_MAX_T, 1024, 256, 8, 8
    assert _choose_variant(E, H, I, T * k, wgmma=True) in WGMMA_VARIANTS
    int4 = repack_int4_experts(*random_int4_experts(E, H, I, "cuda", gen))
    routing = (k, 1, 1, True, 2.827, None)
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    add = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16) * 0.05
    logits, bias = _router(T, E, "cuda", gen)
    poison_allocator()
    out, ids, weights = routed_w4a16_moe(x, *int4, logits, bias, *routing, add=add)
    unfused = _route_then_moe(x, int4, logits, bias, routing, add)
    assert torch.equal(ids, unfused[1]) and torch.equal(weights, unfused[2])
    assert torch.equal(out, unfused[0])  # the wgmma family's sums are ordered: the same bits
    assert rel_err(out, w4a16_moe_reference(x.float(), *int4, ids, weights) + add.float()) < 1e-2


def _prep_outputs(x, ids, E, mt, split: bool, monkeypatch):
    """(x_perm, sorted_slot, passes) of w4a16_moe's prep, the sort in one block or split over blocks."""
    import kdray.kernels.w4a16_moe as moe
    from kdray.kernels.cuda_module import sm_count

    monkeypatch.setattr(moe, "SORT_SPLIT_SLOTS", 0 if split else 1 << 30)
    T, k = ids.shape
    slots = T * k
    sorted_slot = torch.full((slots,), -7, dtype=torch.int32, device="cuda")
    passes = torch.full((1 + min(E, slots) + slots // mt, 4), -7, dtype=torch.int32, device="cuda")
    x_perm = torch.full_like(x, 7.0)
    moe._prep(x, ids, x_perm, sorted_slot, passes, None, E, x.shape[1], mt, sm_count(0))
    return x_perm, sorted_slot, passes


@pytest.mark.gpu
@pytest.mark.parametrize("T, E, k, skip, mt", [
    (3, 16, 2, 0.0, 128),  # fewer slots than one sort block takes
    (1000, 32, 8, 0.2, 128),  # 8000 slots over 8 sort blocks, a fifth of them skipped
    (4096, 384, 8, 0.0, 128),  # K2 TP8 at 4096 tokens: 32 sort blocks
    (2500, 1030, 6, 0.1, 64),  # more experts than threads: two per thread in the scans
])
def test_cuda_split_sort_equals_one_block(T, E, k, skip, mt, monkeypatch):
    """The split sort gives the one-block sort's passes and x permutation and places each kept slot once, in its
    expert's rows (in any order within the expert, as the one block's atomics do: the GEMMs' rows are independent)."""
    gen = torch.Generator("cuda").manual_seed(15)
    x = torch.randn(T, 256, device="cuda", generator=gen).to(torch.bfloat16)
    ids, _ = _routing(T, E, k, "cuda", skip=skip, gen=gen)
    one = _prep_outputs(x, ids, E, mt, False, monkeypatch)
    split = _prep_outputs(x, ids, E, mt, True, monkeypatch)
    assert torch.equal(split[0], one[0])
    n = int(one[2][0, 0])
    assert n == int(split[2][0, 0]) and torch.equal(split[2][: 1 + n], one[2][: 1 + n])
    flat, kept = ids.flatten(), int((ids >= 0).sum())
    assert torch.equal(split[1][kept:], one[1][kept:])  # rows past the kept slots: untouched
    for e, row0, rows, _ in split[2][1: 1 + n].tolist():
        mine = split[1][row0: row0 + rows].long()
        assert torch.equal(flat[mine], torch.full_like(mine, e))
    assert torch.equal(split[1][:kept].long().sort().values, (flat >= 0).nonzero().flatten())


@pytest.mark.gpu
def test_cuda_split_sort_gives_the_same_bits(monkeypatch):
    """The MoE's output with the split sort equals the one-block sort's, bit for bit."""
    import kdray.kernels.w4a16_moe as moe

    gen = torch.Generator("cuda").manual_seed(16)
    T, H, I, E, k = 1000, 1024, 256, 32, 8
    tiled = repack_int4_experts(*random_int4_experts(E, H, I, "cuda", gen))
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    ids, weights = _ragged_routing(T, E, k, gen)
    monkeypatch.setattr(moe, "SORT_SPLIT_SLOTS", 1 << 30)
    one = w4a16_moe(x, *tiled, ids, weights)
    monkeypatch.setattr(moe, "SORT_SPLIT_SLOTS", 0)
    poison_allocator()
    assert torch.equal(w4a16_moe(x, *tiled, ids, weights), one)
