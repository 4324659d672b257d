"""The scheduler for real traffic on a real (tiny) model, fp32: identical outputs with the prefix cache on and
off, under forced preemption, and with every chunk size of chunked prefill down to one page, for AR, chain and
DDTree, greedy and seeded sampling, and under the fields that change the distribution."""
import json

import pytest
import torch
from test_engine import join

import kdray.engine.runner as runner_module
import kdray.model.k2 as k2
from kdray import LLM, SamplingParams
from kdray.engine.runner import ModelRunner
from kdray.engine.sequence import Sequence
from kdray.model.presets import K2_TINY

GEN = torch.Generator().manual_seed(5)
SYSTEM = torch.randint(2, 1000, (37,), generator=GEN).tolist()  # a shared prefix: 2 full pages of 16 and more
PROMPTS = [SYSTEM + torch.randint(2, 1000, (n,), generator=GEN).tolist() for n in (3, 11, 20, 6)]
MODES = {"ar": {"spec": "ar"}, "chain": {"drafter": "random", "spec": "chain", "block_size": 4},
         "ddtree": {"drafter": "random", "spec": "ddtree", "budget": 8, "block_size": 4}}
PARAMS = {"greedy": SamplingParams(max_tokens=24, ignore_eos=True),
          "seeded": SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.95, seed=17),
          # per-slot state rebuilt from the context after a preemption, at the last chunk, past cached pages
          "fields": SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=17, presence_penalty=-2.0,
                                   frequency_penalty=-2.0, repetition_penalty=0.8, logit_bias={5: 3.0}, min_p=0.05,
                                   min_tokens=3, logprobs=1)}


def tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]


def staggered(engine, params: SamplingParams, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    """``prompts`` arriving one every 6 steps while the earlier ones decode, so that each one's chunks are alone in
    their steps -> their outputs' tokens."""
    whole, done, i = {}, {}, 0
    while i < 6 * len(prompts) or engine.has_unfinished_requests():
        if i % 6 == 0 and i // 6 < len(prompts):
            engine.add_request(f"r{i // 6}", prompts[i // 6], params)
        done.update({o.request_id: o.outputs[0].token_ids for o in join(whole, engine.step())})
        i += 1
    return [done[f"r{i}"] for i in range(len(prompts))]


def record_riding_rows(monkeypatch) -> list:
    """From now on, every ``riding_rows`` decision (a riding chunk's rows, or None for a pass of its own) in the
    returned list."""
    rows, decide = [], runner_module.riding_rows
    monkeypatch.setattr(runner_module, "riding_rows", lambda *a: rows.append(n := decide(*a)) or n)
    return rows


@pytest.fixture(scope="module")
def reference() -> dict:
    """Each mode's outputs with nothing shared, nothing chunked and room for everything."""
    return {(m, p): tokens(LLM(model="k2-tiny", prefix_caching=False, **kw), PARAMS[p])
            for m, kw in MODES.items() for p in PARAMS}


@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("mode", list(MODES))
def test_prefix_cache_hits_and_changes_nothing(reference, mode, params):
    llm = LLM(model="k2-tiny", **MODES[mode])
    assert tokens(llm, PARAMS[params]) == reference[(mode, params)]  # the first pass fills the cache
    scheduler = llm.engine.scheduler
    hits = scheduler.prefix_hits
    assert tokens(llm, PARAMS[params]) == reference[(mode, params)]  # the second pass reads it
    assert scheduler.prefix_hits - hits >= 2 * len(PROMPTS)  # the shared system prompt's full pages, for every prompt


@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("mode", list(MODES))
def test_preempted_requests_end_exactly_as_they_would_have(reference, mode, params):
    pages = {"ar": 8, "chain": 10, "ddtree": 10}[mode]  # two requests fit at their start, not as they grow
    llm = LLM(model="k2-tiny", num_pages=pages, max_num_seqs=4, prefix_caching=False, **MODES[mode])
    assert tokens(llm, PARAMS[params]) == reference[(mode, params)]
    assert llm.engine.scheduler.preemptions > 0
    assert llm.engine.free_pages() == pages


@pytest.mark.parametrize("chunk", [16, 32, 48])
@pytest.mark.parametrize("mode", list(MODES))
def test_chunked_prefill_of_any_size_changes_nothing(reference, mode, chunk):
    for params in PARAMS:
        llm = LLM(model="k2-tiny", prefill_chunk=chunk, prefix_caching=False, **MODES[mode])
        assert tokens(llm, PARAMS[params]) == reference[(mode, params)]


@pytest.mark.parametrize("chunk,padded", [(16, False), (32, True)])
@pytest.mark.parametrize("mode", list(MODES))
def test_prompt_chunks_riding_in_the_running_step_change_nothing(reference, mode, chunk, padded, monkeypatch):
    """Requests that arrive while others decode: each lone prompt chunk runs inside the running sequences' verify
    pass (one target pass for both) and every output is the reference's; the drafts are those of chunks in passes of
    their own (the riding chunks gave the drafter the same context). ``padded``: the batch and the chunk padded to
    their buckets, as under CUDA graphs (here run eagerly)."""
    rode, drafts = [], []
    verify, draft = ModelRunner.verify, ModelRunner.draft
    monkeypatch.setattr(ModelRunner, "verify", lambda self, tree, inputs, chunk=None:
                        rode.append(chunk is not None) or verify(self, tree, inputs, chunk))
    monkeypatch.setattr(ModelRunner, "draft", lambda self, inputs: drafts.append(out := draft(self, inputs)) or out)

    def run(params: SamplingParams, riding: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
        engine = LLM(model="k2-tiny", prefill_chunk=chunk, prefix_caching=False, **MODES[mode]).engine
        engine.runner.graphs = padded  # no graphs were made: the padded shapes run eagerly
        rode.clear()
        drafts.clear()
        with monkeypatch.context() as m:
            if not riding:
                m.setattr(runner_module, "riding_rows", lambda *a: None)
            outs = staggered(engine, params)
        return outs, [d.logits for d in drafts if d is not None]

    for params in PARAMS:
        outs, riding_drafts = run(PARAMS[params], riding=True)
        assert outs == reference[(mode, params)]
        assert any(rode) and not all(rode)
        _, own_pass_drafts = run(PARAMS[params], riding=False)
        assert len(riding_drafts) == len(own_pass_drafts)
        assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(riding_drafts, own_pass_drafts))


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_chunks_in_the_plain_form_change_nothing(reference, mode, monkeypatch):
    """Prompt chunks after cached tokens with attention in the plain form (``PLAIN_CHUNK_TOKENS`` lowered to one
    token: the cached rows expanded by kv_b) give every output of the unchunked run."""
    plain = []
    attend = k2.mla_prefill_attention
    monkeypatch.setattr(k2, "mla_prefill_attention", lambda *a: plain.append(len(a) == 9) or attend(*a))
    monkeypatch.setattr(k2, "PLAIN_CHUNK_TOKENS", 1)
    for params in PARAMS:
        llm = LLM(model="k2-tiny", prefill_chunk=16, prefix_caching=False, **MODES[mode])
        assert tokens(llm, PARAMS[params]) == reference[(mode, params)]
    assert any(plain)  # chunks after cached tokens took the plain form


def test_a_sequence_preempted_for_one_before_it_in_the_batch_does_not_step():
    """reserve() preempts for the batch's first sequence the most recently admitted one, later in the same batch and
    with nothing in flight (as after a grammar step, whose result is applied before the next launch): it goes back to
    waiting with its pages, and neither steps nor takes pages now. (It did both, from the waiting queue: its step's
    tokens were applied to a request waiting to be prefilled again, and its pages leaked at its next admission.)"""
    scheduler = LLM(model="k2-tiny", spec="ar", num_pages=12, prefix_caching=False).engine.scheduler
    first, last = (Sequence(name, list(range(2, 34)), SamplingParams(max_tokens=64), 0) for name in ("first", "last"))
    scheduler.waiting.extend([first, last])
    assert scheduler.admit() == [first, last]
    for seq in (first, last):
        seq.prefilled = seq.prefill_len
    first.cached_len = 9 * scheduler.page_size  # it now needs the pages the other holds
    assert scheduler.reserve([first, last]) == [first]
    assert list(scheduler.waiting) == [last] and last.pages == [] and scheduler.running == [first]
    assert scheduler.pool.free_pages() == scheduler.pool.num_pages - len(first.pages)


def test_long_context_burst_is_admitted_by_use_not_by_reservation(tmp_path):
    """64 requests asking for the whole rest of a 32k context, as a chat without max_tokens does (k2-tiny's
    architecture, its context raised, random weights): each would reserve its whole context before, so a pool of a
    sixteenth of 64 full contexts held 4; now it holds all 64 at once, since each holds only what it uses."""
    (tmp_path / "config.json").write_text(json.dumps({**K2_TINY, "max_position_embeddings": 32768}))
    pages = 64 * 32768 // 16 // 16
    llm = LLM(model=str(tmp_path), load_format="dummy", num_pages=pages, max_num_seqs=64)
    assert llm.engine.max_model_len == 32768
    for i in range(64):
        llm.engine.add_request(f"r{i}", PROMPTS[i % 4], SamplingParams(max_tokens=32768 - len(PROMPTS[i % 4]) - 1))
    llm.engine.step()
    assert len(llm.engine.scheduler.running) == 64
