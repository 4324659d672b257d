"""Two K2 TP8-shard layers on the GPU: the fused ops (rmsnorm, mla_rope_cache, moe_route and its fold into the
MoE's prep, silu_mul) give the logits of the unfused torch code they replace, in a verify pass and a prefill pass."""
import pytest
import torch
from gpu_checks import rel_err
from test_gpu_engine import k2_shard_config, random_model

import kdray.model.k2 as k2
import kdray.model.layers as layers
import kdray.model.parallel as parallel
from kdray.kernels.mla_rope_cache import mla_rope_cache_reference
from kdray.kernels.moe_route import moe_route_reference
from kdray.kernels.rmsnorm import rmsnorm_reference
from kdray.kernels.silu_mul import silu_mul_reference
from kdray.kernels.w4a16_moe import ROUTE_PREP_MAX_T, w4a16_moe
from kdray.model.batch import ForwardBatch, causal_tree_mask, prompt_chunks

pytestmark = pytest.mark.gpu


def unfused(monkeypatch):
    """Route the model's fused ops to their torch references."""
    monkeypatch.setattr(layers, "rmsnorm", rmsnorm_reference)
    monkeypatch.setattr(parallel, "rmsnorm", rmsnorm_reference)  # the layers' norm after a reduction
    monkeypatch.setattr(k2, "mla_rope_cache", mla_rope_cache_reference)
    monkeypatch.setattr(k2, "moe_route", moe_route_reference)

    def route_then_moe(x, w13p, w13s, w2p, w2s, logits, bias, *routing, add=None, add_stream=None, x_k=None):
        ids, weights = moe_route_reference(logits, bias, *routing)
        if add_stream is not None:  # the shared experts' stream
            torch.cuda.current_stream().wait_stream(add_stream)
        return w4a16_moe(x, w13p, w13s, w2p, w2s, ids, weights, add, x_k=x_k), ids, weights

    monkeypatch.setattr(k2, "routed_w4a16_moe", route_then_moe)
    monkeypatch.setattr(k2, "silu_mul", silu_mul_reference)


def stable_routing(model, cfg):
    """Routing by the bias alone: an ulp of difference in a layer's input cannot flip a token's experts."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, k2.MoE):
                m.gate.mul_(1e-3)
                m.e_score_correction_bias.copy_(torch.randperm(cfg.n_routed_experts, device="cuda") * 0.01)


def random_batch(cfg, prefill: bool, q_lens: list[int]) -> tuple[ForwardBatch, torch.Tensor]:
    """A prefill of prompts of q_lens tokens, or verify trees after prefixes of 300, 17 and 1000 tokens; and a
    random latent cache ``[layers, pages, 64, kv_cache_dim]`` for them."""
    B = len(q_lens)
    page, prefix = 64, [0] * B if prefill else [300, 17, 1000][:B]
    pages = (max(prefix) + max(q_lens) + page - 1) // page
    g = torch.Generator("cuda").manual_seed(1)
    kv = torch.randn(cfg.num_hidden_layers, B * pages, page, cfg.kv_cache_dim, device="cuda", generator=g).bfloat16()
    table = torch.arange(B * pages, dtype=torch.int32, device="cuda").view(B, pages)
    ids = torch.randint(0, cfg.vocab_size, (sum(q_lens),), device="cuda", generator=g)
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, q_lens)]).cuda()
    mask = None if prefill else causal_tree_mask(q_lens, "cuda")
    return ForwardBatch.build(ids, positions, q_lens, prefix, table, page, mask), kv


@pytest.mark.parametrize("prefill,q_lens", [(False, [65, 40, 65]), (False, [1, 3, 2]), (False, [17, 15]),
                                           (True, [65, 40, 65])])
def test_fused_ops_match_unfused_code(monkeypatch, prefill, q_lens):
    cfg = k2_shard_config()
    model = random_model(cfg)
    stable_routing(model, cfg)
    batch, kv = random_batch(cfg, prefill, q_lens)

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


def test_the_norm_writes_the_moe_input_in_the_experts_k_order(monkeypatch):
    """At a prefill's size the routed experts read x in their k order. The post-attention norm writes that order
    beside x, and the pass equals, bit for bit, one whose MoE permutes x itself."""
    cfg = k2_shard_config()
    model = random_model(cfg)
    batch, kv = random_batch(cfg, True, [700, 324])
    asked = []
    ask = k2.MoE.input_k_order

    def recorded(self, h):
        asked.append(ask(self, h))
        return asked[-1]

    def logits(cache):
        with torch.no_grad():
            hidden, _ = model(batch, cache)
            return model.logits(hidden), cache

    monkeypatch.setattr(k2.MoE, "input_k_order", recorded)
    by_norm, by_norm_kv = logits(kv.clone())
    assert len(asked) == 1 and asked[0] is not None and asked[0].shape == (1024, cfg.hidden_size)
    monkeypatch.setattr(k2.MoE, "input_k_order", lambda self, h: None)
    by_prep, by_prep_kv = logits(kv.clone())
    assert torch.isfinite(by_norm).all()
    assert torch.equal(by_norm, by_prep) and torch.equal(by_norm_kv, by_prep_kv)


# carried: rank 0 carries the residual stream, which the shared experts add into in place. T: 1 and 2 fork the
# shared experts before the router; 5 is routed in the MoE's prep launch, 40 by moe_route before it.
@pytest.mark.parametrize("carried", [False, True])
@pytest.mark.parametrize("T", [1, 2, 5, 40])
def test_shared_experts_beside_the_routing_are_waited_for(monkeypatch, T, carried):
    """The MoE layer runs its shared experts on a side stream beside the router and the routed experts (forked
    before the router up to SHARED_FIRST_TOKENS tokens, after it past that); the finalize waits for them. With the
    side stream held back ~25 ms, the layer still equals one whose shared experts run on the current stream (without
    the wait it would add a buffer the shared experts had not written yet, or on rank 0 the stream before they had
    added into it). The shared experts' projections, and only theirs, tell skinny_linear they run beside others."""
    cfg = k2_shard_config()
    model = random_model(cfg)
    moe = next(m for m in model.modules() if isinstance(m, k2.MoE))
    assert moe.shared is not None and cfg.quantization is not None
    x = torch.randn(T, cfg.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(3)).bfloat16()
    assert (T <= ROUTE_PREP_MAX_T) == (T < 40) and (T <= k2.SHARED_FIRST_TOKENS) == (T <= 2)
    side = torch.cuda.Stream()
    order = []  # the fork and the router, as the layer issues them
    router_logits = k2.MoE._router_logits
    monkeypatch.setattr(k2.MoE, "_router_logits", lambda self, x: order.append("router") or router_logits(self, x))
    shared = {moe.shared.gate_up.weight.data_ptr(), moe.shared.down.weight.data_ptr()}
    projections = []  # (a shared expert's weight, beside) of each skinny_linear call
    linear = k2.skinny_linear
    monkeypatch.setattr(k2, "skinny_linear", lambda x, w, *a, **kw: projections.append(
        (w.data_ptr() in shared, kw.get("beside", False))) or linear(x, w, *a, **kw))

    def held_back(device):
        order.append("fork")
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # cycles
        return side

    def current(device):
        return torch.cuda.current_stream(device)

    with torch.no_grad():
        monkeypatch.setattr(k2, "_side_stream", current)
        alone = moe(x).float()  # no residual: the other ranks' partial sum
    residual = torch.randn(T, cfg.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    residual = (residual * alone.std()).bfloat16()  # as large as the layer's output, so leaving it out shows

    def layer(x):
        """The MoE's output; on rank 0 added in place into a fresh copy of the residual stream."""
        return moe(x, residual.clone()) if carried else moe(x)

    with torch.no_grad():
        layer(-x)  # loads the kernels, whose first-call host time would hide a missing wait; leaves -x's output stale
        monkeypatch.setattr(k2, "_side_stream", held_back)
        order.clear()
        projections.clear()
        beside = layer(x).float()  # before one_stream: a buffer reused from it would already hold the right output
        assert order == (["fork", "router"] if T <= 2 else ["router", "fork"])
        assert sorted(projections) == [(False, False), (True, True), (True, True)]  # router; shared gate/up, down
        monkeypatch.setattr(k2, "_side_stream", current)
        one_stream = layer(x).float()
    torch.cuda.synchronize()
    assert torch.isfinite(beside).all()
    assert torch.equal(beside, one_stream)  # the shared experts' output joins at the finalize either way
    if carried:  # the stream was added once, neither left out nor overwritten
        assert rel_err(beside, alone + residual.float()) < 1e-2


@pytest.mark.gpu
def test_a_captured_pass_reuses_the_shared_experts_output_memory():
    """A block that two streams use is not reused until a CUDA graph's capture ends. The shared experts' output,
    written on the side stream, is allocated on the current one, so capturing the MoE layer six times in a row takes
    about the memory of once (with the output made on the side stream, a 64k-token 61-layer pass held 0.9 GB a
    layer until it ran out of memory)."""
    cfg = k2_shard_config()
    moe = next(m for m in random_model(cfg).modules() if isinstance(m, k2.MoE))
    x = torch.randn(4096, cfg.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(5)).bfloat16()

    def captured_bytes(times: int) -> int:
        """Memory reserved while capturing ``times`` passes (entering the capture empties the cache first)."""
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            moe(x)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                before = torch.cuda.memory_reserved()
                for _ in range(times):
                    moe(x)
                grown = torch.cuda.memory_reserved() - before
        torch.cuda.synchronize()
        return grown

    once, six = captured_bytes(1), captured_bytes(6)
    assert six - once < x.numel() * x.element_size(), (once, six)


def test_long_chunks_after_cached_tokens_take_the_plain_form(monkeypatch):
    """Prompt chunks of PLAIN_CHUNK_TOKENS or more after cached tokens attend in the plain form (the cached latent
    rows expanded by kv_b, FlashAttention aligned to the chunk's end) and give the hidden states of the absorbed form
    (the tree-verify kernel over the latent cache) on the same cache."""
    cfg = k2_shard_config()
    model = random_model(cfg)
    stable_routing(model, cfg)
    q_lens, prefix, page = [k2.PLAIN_CHUNK_TOKENS, k2.PLAIN_CHUNK_TOKENS + 40], [300, 1000], 64
    B, pages = 2, (1000 + k2.PLAIN_CHUNK_TOKENS + 40 + 63) // 64
    g = torch.Generator("cuda").manual_seed(2)
    kv = torch.randn(cfg.num_hidden_layers, B * pages, page, cfg.kv_cache_dim, device="cuda", generator=g).bfloat16()
    table = torch.arange(B * pages, dtype=torch.int32, device="cuda").view(B, pages)
    ids = torch.randint(0, cfg.vocab_size, (sum(q_lens),), device="cuda", generator=g)
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, q_lens)]).cuda()
    batch = prompt_chunks(ids, positions, q_lens, prefix, table, page)
    plain = []
    attend = k2.mla_prefill_attention
    monkeypatch.setattr(k2, "mla_prefill_attention", lambda *a: plain.append(len(a) == 9) or attend(*a))

    def hidden():
        with torch.no_grad():
            return model(batch, kv.clone())[0].float()

    plain_form = hidden()
    assert plain == [True] * cfg.num_hidden_layers
    monkeypatch.setattr(k2, "PLAIN_CHUNK_TOKENS", 10 ** 9)
    absorbed = hidden()
    assert len(plain) == cfg.num_hidden_layers  # the absorbed pass did not call it
    assert torch.isfinite(plain_form).all()
    assert rel_err(plain_form, absorbed) < 3e-2
