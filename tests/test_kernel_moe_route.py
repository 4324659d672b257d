"""moe_route: the reference equals routing written from its definition (CPU), the CUDA kernel the reference
(GPU)."""
import pytest
import torch
from gpu_checks import poison_allocator

from kdray.kernels.moe_route import moe_route, moe_route_reference


def route_token_by_token(logits, bias, k, n_group, topk_group, norm, scale, local):
    """Sigmoid routing from its definition, one token at a time: rank the groups by the sum of their two best
    biased scores, keep the best ``topk_group``, take the ``k`` best biased scores among their experts, weigh
    each by its unbiased score (normalised to sum 1, times ``scale``); with ``local = (e0, n)`` ids outside
    ``[e0, e0 + n)`` become -1 and the rest count from e0."""
    all_ids, all_weights = [], []
    for row in logits:
        score = row.sigmoid()
        biased = score + bias
        size = biased.shape[0] // n_group
        best_two = [biased[g * size:(g + 1) * size].sort(descending=True).values[:2].sum() for g in range(n_group)]
        groups = torch.stack(best_two).sort(descending=True).indices[:topk_group].tolist()
        allowed = torch.tensor([e for e in range(biased.shape[0]) if e // size in groups])
        ids = allowed[biased[allowed].sort(descending=True).indices[:k]]
        weights = score[ids]
        if norm:
            weights = weights / (weights.sum() + 1e-20)
        weights = weights * scale
        if local is not None:
            e0, n = local
            ids = torch.where((ids >= e0) & (ids < e0 + n), ids - e0, -1)
        all_ids.append(ids)
        all_weights.append(weights)
    return torch.stack(all_ids), torch.stack(all_weights)


def logits_and_bias(T, E, device="cpu", seed=0):
    g = torch.Generator(device).manual_seed(seed)
    # Non-negative bias keeps every choice above the 0 a masked group gets, so no exact ties decide the order.
    return 2 * torch.randn(T, E, device=device, generator=g), 0.1 * torch.rand(E, device=device, generator=g)


CASES = [  # T, E, k, n_group, topk_group, renormalize, local experts
    (1, 384, 8, 1, 1, True, None),  # K2
    (17, 384, 8, 1, 1, True, None),
    (2080, 384, 8, 1, 1, True, None),
    (33, 256, 8, 8, 4, True, None),  # DeepSeek-V3
    (9, 8, 2, 2, 1, True, None),  # k2-tiny
    (12, 64, 6, 4, 2, False, None),
    (40, 384, 8, 1, 1, True, (96, 96)),  # expert parallelism: rank 1 of 4
    (5, 1000, 32, 1, 1, True, None),
    (3, 96, 1, 3, 2, True, (0, 50)),
]


@pytest.mark.parametrize("T,E,k,n_group,topk_group,norm,local", CASES)
def test_reference_equals_routing_by_definition(T, E, k, n_group, topk_group, norm, local):
    logits, bias = logits_and_bias(T, E)
    ids, weights = moe_route(logits, bias, k, n_group, topk_group, norm, 2.827, local)
    ref_ids, ref_weights = route_token_by_token(logits, bias, k, n_group, topk_group, norm, 2.827, local)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=0)


def test_errors_are_clear():
    logits, bias = logits_and_bias(3, 8)
    with pytest.raises(ValueError, match="n_group"):
        moe_route(logits, bias, 2, 3, 1)
    with pytest.raises(TypeError, match="fp32"):
        moe_route(logits.bfloat16(), bias, 2)
    with pytest.raises(ValueError, match="bias"):
        moe_route(logits, bias[:4], 2)


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k,n_group,topk_group,norm,local", CASES)
def test_cuda_matches_reference(T, E, k, n_group, topk_group, norm, local):
    for seed in range(2):  # fresh inputs each round
        logits, bias = logits_and_bias(T, E, "cuda", seed)
        poison_allocator()
        ids, weights = moe_route(logits, bias, k, n_group, topk_group, norm, 2.827, local)
        ref_ids, ref_weights = moe_route_reference(logits, bias, k, n_group, topk_group, norm, 2.827, local)
        assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (T, k)
        same = (ids == ref_ids).all(1)
        if not same.all():  # the kernel's fast sigmoid may order choices a few ulps apart otherwise: equal values
            choice = (logits.sigmoid() + bias)[~same]
            mine = moe_route(logits[~same], bias, k, n_group, topk_group, norm, 2.827)[0]
            ref = moe_route_reference(logits[~same], bias, k, n_group, topk_group, norm, 2.827)[0]
            torch.testing.assert_close(choice.gather(1, mine), choice.gather(1, ref), rtol=0, atol=1e-5)
        assert (~same).sum() <= max(1, T // 100)
        torch.testing.assert_close(weights[same], ref_weights[same], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 40])
def test_cuda_ties_go_to_the_lower_id_across_lanes_and_slots(T):
    logits = torch.full((T, 384), -5.0, device="cuda")
    logits[:, [200, 40, 3, 70, 33]] = 3.0  # equal choices held by different lanes and register slots
    ids, weights = moe_route(logits, torch.zeros(384, device="cuda"), 8)
    assert ids.tolist() == [[3, 33, 40, 70, 200, 0, 1, 2]] * T
    s = torch.tensor([3.0] * 5 + [-5.0] * 3).sigmoid()
    torch.testing.assert_close(weights.cpu(), (s / s.sum()).expand(T, 8), rtol=1e-5, atol=1e-6)
