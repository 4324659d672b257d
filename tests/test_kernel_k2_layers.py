"""Two K2 TP8-shard layers on the GPU: the fused ops (rmsnorm, mla_rope_cache, moe_route and its fold into the
MoE's prep, silu_mul) give the logits of the unfused torch code they replace, in a verify pass and a prefill pass."""
import pytest
import torch
from gpu_checks import rel_err
from test_gpu_engine import k2_shard_config, random_model

import kdray.model.k2 as k2
import kdray.model.layers as layers
from kdray.kernels.mla_rope_cache import mla_rope_cache_reference
from kdray.kernels.moe_route import moe_route_reference
from kdray.kernels.rmsnorm import rmsnorm_reference
from kdray.kernels.silu_mul import silu_mul_reference
from kdray.kernels.w4a16_moe import w4a16_moe
from kdray.model.batch import ForwardBatch, causal_tree_mask

pytestmark = pytest.mark.gpu


def unfused(monkeypatch):
    """Route the model's fused ops to their torch references."""
    def add_rmsnorm_reference(x, residual, weight, eps):
        s = x + residual
        return rmsnorm_reference(s, weight, eps), s

    monkeypatch.setattr(layers, "rmsnorm", rmsnorm_reference)
    monkeypatch.setattr(layers, "add_rmsnorm", add_rmsnorm_reference)
    monkeypatch.setattr(k2, "mla_rope_cache", mla_rope_cache_reference)
    monkeypatch.setattr(k2, "moe_route", moe_route_reference)

    def route_then_moe(x, w13p, w13s, w2p, w2s, logits, bias, *routing, add=None):
        ids, weights = moe_route_reference(logits, bias, *routing)
        return w4a16_moe(x, w13p, w13s, w2p, w2s, ids, weights, add), ids, weights

    monkeypatch.setattr(k2, "routed_w4a16_moe", route_then_moe)
    monkeypatch.setattr(k2, "silu_mul", silu_mul_reference)


@pytest.mark.parametrize("prefill,q_lens", [(False, [65, 40, 65]), (False, [1, 3, 2]), (False, [17, 15]),
                                           (True, [65, 40, 65])])
def test_fused_ops_match_unfused_code(monkeypatch, prefill, q_lens):
    cfg = k2_shard_config()
    model = random_model(cfg)
    with torch.no_grad():  # routing by the bias alone: an ulp of difference cannot flip a token's experts
        for m in model.modules():
            if isinstance(m, k2.MoE):
                m.gate.mul_(1e-3)
                m.e_score_correction_bias.copy_(torch.randperm(cfg.n_routed_experts, device="cuda") * 0.01)
    B = len(q_lens)
    page, prefix = 64, [0] * B if prefill else [300, 17, 1000][:B]
    pages = (max(prefix) + max(q_lens) + page - 1) // page
    g = torch.Generator("cuda").manual_seed(1)
    kv = torch.randn(cfg.num_hidden_layers, B * pages, page, cfg.kv_cache_dim, device="cuda", generator=g).bfloat16()
    table = torch.arange(B * pages, dtype=torch.int32, device="cuda").view(B, pages)
    ids = torch.randint(0, cfg.vocab_size, (sum(q_lens),), device="cuda", generator=g)
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, q_lens)]).cuda()
    mask = None if prefill else causal_tree_mask(q_lens, "cuda")
    batch = ForwardBatch.build(ids, positions, q_lens, prefix, table, page, mask)

    def logits(cache):
        with torch.no_grad():
            hidden, _ = model(batch, cache)
            return model.logits(hidden), cache

    fused, fused_kv = logits(kv.clone())
    unfused(monkeypatch)
    ref, ref_kv = logits(kv.clone())
    assert torch.isfinite(fused).all()
    # Rounding alone moves these logits by ~1.5%: the random model's attention is sharp, and the fused rope rounds
    # once where torch rounds x1 * cos and x2 * sin apart (on the CPU, only that change moves them 1.5%).
    assert rel_err(fused, ref) < 3e-2
    assert rel_err(fused_kv, ref_kv) < 1e-2
