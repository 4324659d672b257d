"""vLLM's ``prompt_logprobs``: each prompt token's log-probability given the tokens before it (and the likeliest
there), computed by the prefill: equal to one full pass over the prompt whatever the chunking, never taken from the
prefix cache, kept across a preemption, and at no cost to the plain requests batched with it."""
import pytest
import torch
from test_llama import make_tiny

from kdray import LLM, SamplingParams
from kdray.model.batch import ForwardBatch
from kdray.spec.logprobs import head_logprobs, token_logprobs

GEN = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(2, 96, (n,), generator=GEN).tolist() for n in (1, 2, 17, 40)]  # page_size 16
TOL = 3e-5  # fp32: chunked attention sums in another order than one pass


@pytest.fixture(scope="module", params=["k2-tiny", "llama-tiny"])
def model(request, tmp_path_factory) -> str:
    if request.param == "k2-tiny":
        return "k2-tiny"
    path = tmp_path_factory.mktemp("llama")
    make_tiny(path, tied=False, llama3=False)
    return str(path)


def full_pass(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """``[P, V]``: the log_softmax of the target's logits at every prompt position, from one pass over the whole
    prompt (fresh KV)."""
    m, ps = llm.engine.runner.target.model, 16
    pages = -(-len(prompt) // ps)
    kv = torch.zeros(m.cfg.num_hidden_layers, pages, ps, *m.kv_row_shape, dtype=m.dtype)
    batch = ForwardBatch.build(torch.tensor(prompt), torch.arange(len(prompt)), [len(prompt)], [0],
                               torch.arange(pages, dtype=torch.int32)[None], ps, None)
    hidden, _ = m(batch, kv)
    return m.logits(hidden).log_softmax(-1)


def check(scored: list, prompt: list[int], logp: torch.Tensor, k: int):
    """``RequestOutput.prompt_logprobs`` against the full pass ``logp [P, V]``: None first, then per token its
    log-probability at the position before it (first), its rank there, and the top ``k``."""
    assert len(scored) == len(prompt) and scored[0] is None
    for i in range(1, len(prompt)):
        found, t, row = scored[i], prompt[i], logp[i - 1]
        assert list(found)[0] == t
        assert found[t].logprob == pytest.approx(row[t].item(), abs=TOL)
        assert found[t].rank == int((row > row[t]).sum()) + 1
        top = sorted((lp.rank, u, lp.logprob) for u, lp in found.items() if lp.rank <= k)
        best = row.topk(k)
        assert [u for _, u, _ in top] == best.indices.tolist()
        assert [v for _, _, v in top] == pytest.approx(best.values.tolist(), abs=TOL)


@pytest.mark.parametrize("chunk", [None, 5, 16], ids=["whole", "chunks-of-5", "chunks-of-a-page"])
def test_prompt_logprobs_equal_one_full_pass(model, chunk):
    """Each chunk scores its positions; across a chunk boundary the next chunk's first token is scored by this
    chunk's last position."""
    llm = LLM(model=model, spec="ar", prefill_chunk=chunk)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(max_tokens=2, prompt_logprobs=3))
    for prompt, out in zip(PROMPTS, outs):
        check(out.prompt_logprobs, prompt, full_pass(llm, prompt), 3)


def test_a_cached_prefix_is_not_taken_the_prompt_is_scored_whole():
    llm = LLM(model="k2-tiny", spec="ar")  # prefix caching on
    shared = PROMPTS[3][:33]  # two full pages
    scheduler = llm.engine.scheduler
    llm.generate(prompt_token_ids=[shared + [5]], sampling_params=SamplingParams(max_tokens=1))
    hits = scheduler.prefix_hits
    prompt = shared + [6, 7]
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert scheduler.prefix_hits == hits  # prefilled whole
    check(out[0].prompt_logprobs, prompt, full_pass(llm, prompt), 2)
    llm.generate(prompt_token_ids=[shared + [8]], sampling_params=SamplingParams(max_tokens=1))
    assert scheduler.prefix_hits == hits + 2  # a plain request still takes the cached pages


def test_a_plain_request_batched_with_a_scored_one_is_unchanged():
    """Greedy DDTree (the drafter reads the prefill's context features): the plain request's tokens and
    log-probabilities, and the scored request's tokens, are those they get without prompt_logprobs; a batch of
    plain requests never runs the scoring pass."""
    llm = LLM(model="k2-tiny", drafter="random", spec="ddtree", budget=8, block_size=4)
    runner = llm.engine.runner
    passes = []
    score = runner.score_prompts
    runner.score_prompts = lambda *a: passes.append(len(a[-1])) or score(*a)
    plain = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = PROMPTS[2:]
    alone = llm.generate(prompt_token_ids=prompts, sampling_params=plain)
    assert passes == []
    scored = SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    mixed = llm.generate(prompt_token_ids=prompts, sampling_params=[plain, scored])
    assert passes and mixed[0].prompt_logprobs is None
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone]
    for a, b in zip(alone[0].outputs[0].logprobs, mixed[0].outputs[0].logprobs):
        assert list(a) == list(b) and [x.logprob for x in a.values()] == pytest.approx(
            [x.logprob for x in b.values()], abs=TOL)
    check(mixed[1].prompt_logprobs, prompts[1], full_pass(llm, prompts[1]), 1)


def test_a_request_preempted_while_its_prompt_is_scored_scores_it_again():
    """A running request grows into the pages of a prompt still being prefilled (one token per step): that one is
    preempted, its chunks' scores dropped, and its prompt scored again from the start."""
    llm = LLM(model="k2-tiny", spec="ar", page_size=4, num_pages=19, prefill_chunk=1, max_tokens_per_step=4)
    scheduler, states = llm.engine.scheduler, []
    preempt = scheduler.preempt
    scheduler.preempt = lambda seq: states.append(seq.scores_prompt) or preempt(seq)
    running, scored = PROMPTS[2] + [3, 4, 5], PROMPTS[3]
    outs = llm.generate(prompt_token_ids=[running, scored], sampling_params=[
        SamplingParams(max_tokens=50, ignore_eos=True), SamplingParams(max_tokens=4, prompt_logprobs=1)])
    assert True in states  # preempted mid-prompt
    check(outs[1].prompt_logprobs, scored, full_pass(llm, scored), 1)


@pytest.mark.parametrize("value", [-1, 21, True, 2.0])
def test_prompt_logprobs_out_of_bounds_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match=r"SamplingParams.prompt_logprobs=.* must be None or an integer in \[0, 20\]"):
        SamplingParams(prompt_logprobs=value)


def test_the_head_in_row_blocks_equals_one_block():
    g = torch.Generator().manual_seed(2)
    head = torch.nn.Linear(8, 50)
    hidden, tokens = torch.randn(11, 8, generator=g), torch.randint(0, 50, (11,), generator=g)
    (values, ids), (want_values, want_ids) = head_logprobs(head, hidden, tokens, 4, rows=3), token_logprobs(
        head(hidden), tokens, 4)
    assert values.shape == (11, 5) and torch.allclose(values, want_values, atol=1e-6) and torch.equal(ids, want_ids)
