"""The GPU path: same tokens as the CPU reference, and verify passes replayed from CUDA graphs."""
from __future__ import annotations

import gc
import warnings

import pytest
import torch
from test_scheduler import record_riding_rows, staggered

from kdray import LLM, SamplingParams
from kdray.config import K2Config
from kdray.engine.cuda_graphs import GraphedFn
from kdray.engine.step import STAGES
from kdray.kernels.tree_build import tree_build
from kdray.model.batch import ForwardBatch
from kdray.model.k2 import K2Model
from kdray.model.layers import LMHead
from kdray.model.presets import K2_TINY

pytestmark = pytest.mark.gpu
GEN = torch.Generator().manual_seed(21)
PROMPTS = [torch.randint(2, 1000, (n,), generator=GEN).tolist() for n in (4, 19, 33, 8)]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_ddtree_on_gpu_equals_cpu_reference():
    """fp32 on both devices (the references name their device: LLM() picks the GPU, in bf16, when one is there)."""
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    cpu = LLM(model="k2-tiny", device="cpu", spec="ar").generate(prompt_token_ids=PROMPTS, sampling_params=params)
    gpu = LLM(model="k2-tiny", device="cuda", dtype="float32", drafter="random", spec="ddtree", budget=32,
              block_size=8)
    assert tokens(gpu.generate(prompt_token_ids=PROMPTS, sampling_params=params)) == tokens(cpu)


def test_bf16_ddtree_with_cuda_graphs_equals_ar():
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    ar = LLM(model="k2-tiny", device="cuda", dtype="bfloat16", spec="ar", cuda_graphs=True)
    dd = LLM(model="k2-tiny", device="cuda", dtype="bfloat16", drafter="random", spec="ddtree", budget=64,
             block_size=16, cuda_graphs=True)
    outs = dd.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert tokens(outs) == tokens(ar.generate(prompt_token_ids=PROMPTS, sampling_params=params))
    # the whole step replays from one graph per batch bucket, its stages timed by the graph's event nodes
    assert all(outs[0].metrics["seconds"][stage] > 0 for stage in STAGES)


@pytest.mark.parametrize("spec", ["ar", "ddtree"])
def test_prefill_replayed_from_graphs_equals_eager(spec):
    """Requests one at a time: each prompt is a lone chunk, prefilled from a graph padded to its bucket, the later
    ones after their cached shared prefix (the verify form), up to 600 tokens (the 768 bucket, both forms); a
    600-token prompt and one after the cached prefix, admitted together, are prefilled in one eager pass. fp32: the
    same tokens and drafter context as the engine without graphs."""
    kw = dict(model="k2-tiny", device="cuda", dtype="float32", spec=spec, max_num_seqs=4, num_pages=128)
    if spec == "ddtree":
        kw.update(drafter="random", budget=16, block_size=4)
    system = torch.randint(2, 1000, (40,), generator=GEN).tolist()  # two full pages, cached after the first
    long = torch.randint(2, 1000, (600,), generator=GEN).tolist()
    prompts = [long] + [system + [50 + i] * (1 + 7 * i) for i in range(4)] + [system + long]
    pair = [long[::-1], system + [7] * 9]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    results, draft_kv = [], []
    for graphs in (True, False):
        llm = LLM(**kw, cuda_graphs=graphs)
        results.append([tokens(llm.generate(prompt_token_ids=[p], sampling_params=params)) for p in prompts]
                       + [tokens(llm.generate(prompt_token_ids=pair, sampling_params=params))])
        if spec == "ddtree":  # the drafter's context, which the prompt graphs write themselves (lossless without it)
            draft_kv.append(llm.engine.runner.draft_kv[:, :-1].clone())  # the scratch page left out
        if graphs:
            captured = {key[0] for key in llm.engine.runner._prompt_graphs._captures}
            assert captured == {(("cached", False),), (("cached", True),)}
            assert llm.engine.scheduler.prefix_hits >= 2 * 3  # the later prompts found the shared pages
    assert results[0] == results[1]
    if draft_kv:
        torch.testing.assert_close(draft_kv[0], draft_kv[1], rtol=1e-4, atol=1e-4)


def test_no_automatic_garbage_collection_inside_a_capture():
    """A graph that becomes garbage in a reference cycle (an engine dropped in a cycle) dies whenever the GC
    runs; CUDA forbids destroying a graph while a stream captures, which invalidates the capture. Here the
    captured function makes such a cycle young and then allocates enough to trigger the GC mid-capture."""
    x = torch.ones(8, device="cuda")
    old = torch.cuda.CUDAGraph()
    with torch.cuda.graph(old):
        x.mul_(2)
    doomed = [old]
    del old

    def fn(timer, ids):
        if torch.cuda.is_current_stream_capturing() and doomed:
            cycle = [doomed.pop()]
            cycle.append(cycle)
            del cycle
            junk = [[] for _ in range(20 * gc.get_threshold()[0])]  # live containers: the GC would run now
            del junk
        return (ids * 3,)

    ids = torch.arange(5, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed capture would fall back to eager with a warning
        (out,), _ = GraphedFn(fn, lambda: lambda: None)((ids,))
    torch.cuda.synchronize()
    assert torch.equal(out, ids * 3) and not doomed


def test_a_step_that_cannot_be_captured_runs_eagerly_with_one_warning(monkeypatch):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ar = LLM(model="k2-tiny", device="cuda", dtype="float32", spec="ar", cuda_graphs=False)
    expected = tokens(ar.generate(prompt_token_ids=PROMPTS, sampling_params=params))

    def refuse(*args, **kwargs):
        raise RuntimeError("capture refused by the test")

    monkeypatch.setattr(torch.cuda, "graph", refuse)
    with warnings.catch_warnings(record=True) as caught:  # the engine's warm-up captures every bucket: at build
        warnings.simplefilter("always")
        dd = LLM(model="k2-tiny", device="cuda", dtype="float32", drafter="random", spec="ddtree", budget=16,
                 block_size=4)
        got = tokens(dd.generate(prompt_token_ids=PROMPTS, sampling_params=params))
    assert got == expected
    messages = [str(w.message) for w in caught if "runs eagerly" in str(w.message)]
    assert messages and all("capture refused by the test" in m for m in messages)
    assert len(messages) == len(set(messages))  # one warning per shape, not one per step


def test_bf16_lm_head_keeps_fp32_logits():
    """bf16 hidden states and weights, fp32 accumulation and output: logits within fp32 rounding of an fp32
    product of the same operands, not rounded to bf16 (where near-equal logits would tie)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    with torch.device("cuda"):
        head = LMHead(576, 49152, torch.bfloat16)
        head.proj.weight.data.normal_(0, 576 ** -0.5, generator=g)
        h = torch.randn(37, 576, generator=g, device="cuda").bfloat16()
    logits = head(h)
    exact = h.double() @ head.weight.double().t()
    assert logits.dtype == torch.float32 and logits.shape == (37, 49152)
    torch.testing.assert_close(logits.double(), exact, rtol=1e-5, atol=1e-5)
    assert (logits != logits.bfloat16().float()).float().mean() > 0.9


def k2_shard_config() -> K2Config:
    """Two K2 layers as one TP8 shard sees them: 8 heads, expert width 256, INT4 group 32."""
    return K2Config.from_hf({
        "model_type": "kimi_k2", "vocab_size": 4096, "hidden_size": 7168, "intermediate_size": 18432 // 8,
        "moe_intermediate_size": 256, "num_hidden_layers": 2, "first_k_dense_replace": 1,
        "num_attention_heads": 8, "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "routed_scaling_factor": 2.827, "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
        "max_position_embeddings": 262144,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
            "g": {"weights": {"num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 32}}}}})


def random_model(cfg: K2Config) -> K2Model:
    with torch.device("cuda"):
        model = K2Model(cfg, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.dtype == torch.int32:
                t.copy_(torch.randint(-2 ** 31, 2 ** 31 - 1, t.shape, device="cuda", generator=g, dtype=torch.int64))
            elif "scale" in name:
                t.copy_(torch.rand(t.shape, device="cuda", generator=g) * 0.01)
            elif t.dim() == 1:
                t.copy_(1 + 0.1 * torch.randn(t.shape, device="cuda", generator=g))
            elif t.is_floating_point():
                t.copy_(torch.randn(t.shape, device="cuda", generator=g) / t.shape[-1] ** 0.5)
    return model.eval()


@pytest.mark.parametrize("shape", ["k2-tiny", "k2-tp8-shard"])
def test_verify_pass_replayed_from_cuda_graph_equals_eager(shape):
    cfg = K2Config.from_hf(K2_TINY) if shape == "k2-tiny" else k2_shard_config()
    model = random_model(cfg)
    B, N, page, prefix = 4, 64, 64, [300, 17, 1000, 64]
    pages = (max(prefix) + N + 1 + page - 1) // page
    kv = torch.randn(cfg.num_hidden_layers, B * pages, page, cfg.kv_cache_dim, device="cuda").bfloat16()
    table = torch.arange(B * pages, dtype=torch.int32, device="cuda").view(B, pages)
    logits = torch.randn(B, 15, cfg.vocab_size, device="cuda")
    roots = torch.randint(0, cfg.vocab_size, (B,), device="cuda")
    tree = tree_build(logits, roots, torch.full((B,), N, dtype=torch.int32, device="cuda"), N)
    q_lens = tree.num_nodes.tolist()
    valid = torch.arange(N + 1, device="cuda")[None] < tree.num_nodes[:, None]
    positions = (torch.tensor(prefix, device="cuda")[:, None] + tree.depths).long()[valid]
    batch = ForwardBatch.build(tree.tokens[valid], positions, q_lens, prefix, table, page, tree.mask)

    def verify(timer, input_ids, positions):
        b = ForwardBatch(input_ids, positions, batch.cu_q, batch.q_lens, batch.prefix_lens, batch.block_table,
                         batch.slot_mapping, batch.tree_mask)
        hidden, _ = model(b, kv)
        return (model.logits(hidden),)

    with torch.no_grad():
        kv0 = kv.clone()
        eager = verify(None, batch.input_ids, batch.positions)[0].clone()
        kv.copy_(kv0)
        graphed = GraphedFn(verify, lambda: lambda: kv.copy_(kv0))
        (first,), _ = graphed((batch.input_ids, batch.positions))
        first = first.clone()
        kv.copy_(kv0)
        (again,), _ = graphed((batch.input_ids, batch.positions))
        again = again.clone()
    assert torch.isfinite(eager).all()
    for out in (first, again):  # the same kernels in the same order: the same bits (no atomics in the pass)
        assert torch.equal(out, eager)


FIELDS = dict(presence_penalty=-1.0, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={17: 2.0, 5: -100.0},
              min_p=0.05, min_tokens=6, logprobs=3)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_fields_under_cuda_graphs_equal_the_cpu_reference(sampled):
    """fp32 on the GPU, the step replayed from CUDA graphs (captured with the fields' features): DDTree's tokens and
    log-probabilities equal AR's on the CPU, and a plain request batched with them equals its own run."""
    params = SamplingParams(max_tokens=32, ignore_eos=True, **FIELDS,
                            **(dict(temperature=1.0, seed=5) if sampled else {}))
    cpu = LLM(model="k2-tiny", device="cpu", spec="ar").generate(prompt_token_ids=PROMPTS, sampling_params=params)
    gpu = LLM(model="k2-tiny", device="cuda", dtype="float32", drafter="random", spec="ddtree", budget=32,
              block_size=8, cuda_graphs=True)
    plain = SamplingParams(max_tokens=32, ignore_eos=True)
    outs = gpu.generate(prompt_token_ids=PROMPTS + PROMPTS[:1], sampling_params=[params] * len(PROMPTS) + [plain])
    assert tokens(outs[:-1]) == tokens(cpu)
    assert tokens(outs[-1:]) == tokens(gpu.generate(prompt_token_ids=PROMPTS[:1], sampling_params=plain))
    for g, c in zip(outs, cpu):
        g, c = g.outputs[0], c.outputs[0]
        assert [list(d)[0] for d in g.logprobs] == g.token_ids
        assert [d[t].logprob for t, d in zip(g.token_ids, g.logprobs)] == pytest.approx(
            [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)], abs=1e-4)
    keys = [key for key in gpu.engine.runner._step_graphs._captures if ("extras", ()) not in key[0]]
    assert keys, "no step was captured with the fields' features"
    assert not gpu.engine.runner._step_graphs._eager


def test_bf16_fields_with_cuda_graphs_equal_ar():
    """bf16 and CUDA graphs: DDTree under the fields emits AR's tokens (near-ties of bf16 logits aside, as the
    plain bf16 test)."""
    params = SamplingParams(max_tokens=32, ignore_eos=True, **FIELDS)
    ar = LLM(model="k2-tiny", device="cuda", dtype="bfloat16", spec="ar", cuda_graphs=True)
    dd = LLM(model="k2-tiny", device="cuda", dtype="bfloat16", drafter="random", spec="ddtree", budget=64,
             block_size=16, cuda_graphs=True)
    assert tokens(dd.generate(prompt_token_ids=PROMPTS, sampling_params=params)) == \
        tokens(ar.generate(prompt_token_ids=PROMPTS, sampling_params=params))


def test_prompt_chunks_riding_in_graphed_steps_equal_the_cpu_reference(monkeypatch):
    """fp32: requests that arrive while others decode, their lone prompt chunks riding in the running sequences'
    graphed steps (each padded to its bucket), end as the CPU's unchunked run does."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    cpu = LLM(model="k2-tiny", device="cpu", spec="ar").generate(prompt_token_ids=PROMPTS, sampling_params=params)
    rows = record_riding_rows(monkeypatch)
    engine = LLM(model="k2-tiny", device="cuda", dtype="float32", drafter="random", spec="ddtree", budget=16,
                 block_size=4, cuda_graphs=True, prefill_chunk=16).engine
    rows.clear()  # the warm-up's
    assert staggered(engine, params, PROMPTS) == tokens(cpu)
    assert {n for n in rows if n is not None} == {16}  # they rode, padded: a 19-token prompt's 3-token chunk too


def test_prompt_logprobs_on_the_gpu_equal_the_cpu_reference():
    """fp32: the prompt's scores from the GPU's eager scoring pass (in chunks, a cached prefix recomputed) equal the
    CPU's, and the plain request beside them keeps its graphed prefill's tokens."""
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    cpu = LLM(model="k2-tiny", device="cpu", spec="ar").generate(prompt_token_ids=PROMPTS, sampling_params=params)
    gpu = LLM(model="k2-tiny", device="cuda", dtype="float32", drafter="random", spec="ddtree", budget=16,
              block_size=4, cuda_graphs=True, prefill_chunk=16)
    plain = SamplingParams(max_tokens=4, ignore_eos=True)
    outs = gpu.generate(prompt_token_ids=PROMPTS + PROMPTS[:1], sampling_params=[params] * len(PROMPTS) + [plain])
    assert tokens(outs[:-1]) == tokens(cpu)
    for g, c in zip(outs, cpu):
        assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(c.prompt_logprobs)
        for dg, dc in zip(g.prompt_logprobs[1:], c.prompt_logprobs[1:]):
            assert list(dg) == list(dc)
            assert [v.logprob for v in dg.values()] == pytest.approx([v.logprob for v in dc.values()], abs=1e-4)
    assert outs[-1].prompt_logprobs is None
