"""DDTree / chain speculative decoding is lossless: the same tokens as autoregressive decoding."""
from __future__ import annotations

import math

import pytest
import torch
from k2_checkpoints import make_hf_k2

from kdray import LLM, SamplingParams
from kdray.config import K2Config
from kdray.engine.step import DraftOutput
from kdray.kernels.tree_build import tree_build
from kdray.model.batch import ForwardBatch, pack_bits
from kdray.model.dflash import DFlashDrafter
from kdray.model.presets import K2_TINY, k2_random_tensors, write_checkpoint

GEN = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(2, 1000, (n,), generator=GEN).tolist() for n in (3, 17, 9, 30)]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def ar_tiny():
    llm = LLM(model="k2-tiny", spec="ar")
    return tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(max_tokens=24,
                                                                                         ignore_eos=True)))


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_greedy_ddtree_equals_ar_random_drafter(ar_tiny, budget, block):
    llm = LLM(model="k2-tiny", drafter="random", spec="ddtree", budget=budget, block_size=block)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(max_tokens=24, ignore_eos=True))
    assert tokens(outs) == ar_tiny
    assert all(o.metrics["steps"] > 0 and o.metrics["tau"] >= 1 for o in outs)


def test_greedy_chain_equals_ar(ar_tiny):
    llm = LLM(model="k2-tiny", drafter="random", spec="chain", block_size=8)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(max_tokens=24, ignore_eos=True))
    assert tokens(outs) == ar_tiny


def oracle(llm: LLM, reference: dict[tuple, list[int]], runner_confuse: bool = True):
    """Replace the drafter's output by logits peaked at the true continuation (second choice: a wrong token)."""
    runner = llm.engine.runner
    V, L = llm.config.vocab_size, runner.spec.depth

    def draft(inputs):
        seqs = {s.slot: s for s in llm.engine.scheduler.running}
        logits = torch.full((inputs.slots.shape[0], L, V), -8.0)
        for i, (slot, prefix) in enumerate(zip(inputs.slots.tolist(), inputs.prefix_lens.tolist())):
            full = reference[tuple(seqs[slot].prompt_ids)]
            for d in range(L):
                pos = prefix + 1 + d
                if pos < len(full):
                    logits[i, d, full[pos]] = 8.0
                    if runner_confuse:
                        logits[i, d, (full[pos] + 1) % V] = 0.0
        return DraftOutput(logits)

    runner.draft = draft


@pytest.mark.parametrize("spec,block,budget", [("ddtree", 4, 16), ("ddtree", 16, 64), ("chain", 16, 0)])
def test_oracle_drafter_accepts_whole_blocks(spec, block, budget):
    max_tokens = 40
    ar = LLM(model="k2-tiny", spec="ar")
    ref_out = tokens(ar.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(
        max_tokens=max_tokens + block, ignore_eos=True)))
    reference = {tuple(p): p + o for p, o in zip(PROMPTS, ref_out)}
    llm = LLM(model="k2-tiny", drafter="random", spec=spec, budget=budget or 64, block_size=block)
    oracle(llm, reference)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(max_tokens=max_tokens,
                                                                                 ignore_eos=True))
    assert tokens(outs) == [o[:max_tokens] for o in ref_out]
    for o in outs:
        assert o.metrics["tau"] == block  # every step accepts the whole block: L drafts plus the bonus


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hfk2")
    make_hf_k2(path, "grouped", seed=3)
    return str(path)


@pytest.mark.parametrize("budget,block", [(4, 4), (64, 16)])
def test_greedy_ddtree_equals_ar_on_transformers_checkpoint(hf_checkpoint, budget, block):
    prompts = [p[:n] for p, n in zip([[t % 320 for t in p] for p in PROMPTS], (3, 12, 7, 25))]
    params = SamplingParams(max_tokens=20)
    ar = tokens(LLM(model=hf_checkpoint, spec="ar").generate(prompt_token_ids=prompts, sampling_params=params))
    dd = LLM(model=hf_checkpoint, drafter="random", spec="ddtree", budget=budget, block_size=block)
    assert tokens(dd.generate(prompt_token_ids=prompts, sampling_params=params)) == ar


def test_requests_finishing_at_different_steps_and_continuous_batching(ar_tiny):
    llm = LLM(model="k2-tiny", drafter="random", spec="ddtree", budget=16, block_size=8, max_num_seqs=2)
    lengths = [5, 24, 1, 13]
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=[
        SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
    assert tokens(outs) == [r[:n] for r, n in zip(ar_tiny, lengths)]
    assert llm.engine.free_pages() == llm.engine.scheduler.pool.num_pages


class AngleTokenizer:
    """Decodes id ``i`` as ``<i>``; enough to test stop strings."""

    eos_token_ids = ()

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def test_stop_string_spanning_a_step_boundary_and_max_tokens_mid_path():
    ref = LLM(model="k2-tiny", spec="ar")
    ref_tokens = tokens(ref.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(max_tokens=30,
                                                                                              ignore_eos=True)))
    for k in (3, 11):  # a stop string made of output tokens k, k+1
        stops = [f"<{r[k]}><{r[k + 1]}>" for r in ref_tokens]
        results = []
        for mode in ("ar", "ddtree"):
            llm = LLM(model="k2-tiny", drafter=None if mode == "ar" else "random", spec=mode, budget=32,
                      block_size=8)
            llm.engine.tokenizer = AngleTokenizer()
            outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=[
                SamplingParams(max_tokens=30, stop=s, ignore_eos=True) for s in stops])
            results.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs])
        assert results[0] == results[1]
        for (toks, text, reason), r in zip(results[1], ref_tokens):
            assert reason == "stop" and toks == r[:len(toks)] and len(toks) <= k + 2
            assert f"<{r[k]}><{r[k + 1]}>" not in text


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory):
    """A K2-architecture model with 6 tokens, so joint distributions of two tokens can be enumerated."""
    cfg = dict(K2_TINY, vocab_size=6, eos_token_id=None)
    path = tmp_path_factory.mktemp("tinyvocab")
    tensors = k2_random_tensors(K2Config.from_hf(cfg), seed=4)
    tensors["lm_head.weight"] *= 0.25  # softer distributions: every pair of tokens has visible mass
    write_checkpoint(path, cfg, tensors)
    return str(path)


def test_trees_smaller_than_their_budget_are_verified_padded_and_stay_lossless(tiny_vocab_model):
    """With 6 tokens and one draft depth a tree holds 6 of its 8 budgeted nodes; the step verifies every
    tree at its full width, and the padded slots must never be accepted nor change a token."""
    tree = tree_build(torch.randn(2, 1, 6), torch.tensor([1, 2]), torch.tensor([8, 8], dtype=torch.int32), 8)
    assert tree.num_nodes.tolist() == [7, 7] and tree.tokens.shape == (2, 9)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 0, 1, 2], [3]]
    ar = LLM(model=tiny_vocab_model, spec="ar").generate(prompt_token_ids=prompts, sampling_params=params)
    dd = LLM(model=tiny_vocab_model, drafter="random", spec="ddtree", budget=8, block_size=2)
    assert tokens(dd.generate(prompt_token_ids=prompts, sampling_params=params)) == tokens(ar)


def adjusted_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Independent float64 implementation of the temperature / top-k / top-p distribution."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep[i] = True
        mass += p[i].item() / p[order[:top_k]].sum().item() if top_k else p[i].item()
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


def chi2_critical(dof: int, z: float) -> float:
    """Wilson-Hilferty upper quantile of chi-square with ``dof`` degrees of freedom at normal quantile ``z``."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 4, 0.9)])
def test_sampling_is_lossless_in_distribution(tiny_vocab_model, temperature, top_k, top_p):
    prompt = [2, 3, 4]
    ar = LLM(model=tiny_vocab_model, spec="ar")
    m = ar.engine.runner.target.model

    def next_probs(ids):
        kv = torch.zeros(m.cfg.num_hidden_layers, 4, 16, *m.kv_row_shape)
        b = ForwardBatch.build(torch.tensor(ids), torch.arange(len(ids)), [len(ids)], [0],
                               torch.arange(4, dtype=torch.int32)[None], 16, None)
        h, _ = m(b, kv)
        return adjusted_probs(m.logits(h)[-1], temperature, top_k, top_p)

    p1 = next_probs(prompt)
    exact = torch.stack([p1[a] * next_probs(prompt + [a]) for a in range(6)])  # [6, 6] joint of 2 tokens
    n = 1000
    llm = LLM(model=tiny_vocab_model, drafter="random", spec="ddtree", budget=8, block_size=4, max_num_seqs=n)
    params = [SamplingParams(max_tokens=2, temperature=temperature, top_k=top_k, top_p=top_p, seed=s)
              for s in range(n)]
    outs = llm.generate(prompt_token_ids=[prompt] * n, sampling_params=params)
    counts = torch.zeros(6, 6)
    for o in outs:
        a, b = o.outputs[0].token_ids
        counts[a, b] += 1
    expected = exact * n
    assert counts[expected == 0].sum() == 0  # nothing outside the top-k / top-p support
    big = expected >= 5
    stat = (((counts - expected) ** 2 / expected)[big]).sum().item()
    rest_o, rest_e = counts[~big & (expected > 0)].sum(), expected[~big & (expected > 0)].sum()
    cells = int(big.sum()) + (1 if rest_e > 0 else 0)
    if rest_e > 0:
        stat += ((rest_o - rest_e) ** 2 / rest_e).item()
    # false-alarm rate 1e-3 (normal quantile 3.09)
    assert stat < chi2_critical(cells - 1, 3.09), f"chi2={stat:.1f} over {cells} cells"
    # the noise a position gets depends only on (seed, position): AR with the same seeds emits the same tokens
    same = ar.generate(prompt_token_ids=[prompt] * 50, sampling_params=params[:50])
    assert tokens(same) == tokens(outs[:50])


def test_same_seed_same_output():
    llm = LLM(model="k2-tiny", drafter="random", spec="ddtree", budget=16, block_size=8)
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    a = tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=p))
    b = tokens(llm.generate(prompt_token_ids=PROMPTS[::-1], sampling_params=p))[::-1]
    assert a == b
    c = tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(
        max_tokens=16, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True)))
    assert a != c


def test_drafter_saved_in_dflash_layout_loads_with_same_logits(tmp_path):
    cfg = K2Config.from_hf(K2_TINY)
    drafter = DFlashDrafter.random_for(cfg, 8, torch.float32, "cpu", seed=3, num_layers=2)
    drafter.save(tmp_path / "d")
    loaded = DFlashDrafter.from_pretrained(tmp_path / "d", torch.float32, "cpu")
    assert loaded.cfg == drafter.cfg
    import json

    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["block_size"] == 8 and raw["dflash_config"]["mask_token_id"] == cfg.vocab_size - 1

    def run(d):
        cache = torch.zeros(2, 4, 16, *d.kv_row_shape)
        table = torch.arange(4, dtype=torch.int32)[None]
        feats = torch.randn(10, len(d.cfg.target_layer_ids) * 64, generator=torch.Generator().manual_seed(0))
        d.add_context(feats, torch.arange(10), torch.arange(10), cache)
        mask = pack_bits(torch.ones(8, 8, dtype=torch.bool))[None]
        b = ForwardBatch.build(torch.zeros(8, dtype=torch.long), torch.arange(10, 18), [8], [10], table, 16, mask)
        return d(torch.randn(8, 64, generator=torch.Generator().manual_seed(1)), b, cache)

    assert torch.equal(run(drafter), run(loaded))
