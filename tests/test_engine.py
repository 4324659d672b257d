"""The engine, its scheduler and page pool against a fake runner (no model): request state, admission by
pages and slots, continuous batching under the step-token bound, exact stops inside multi-token steps,
aborts and runner failures."""
import itertools

import pytest
import torch

import kdray.engine.engine as engine_module
from kdray import SamplingParams
from kdray.config import SpecConfig
from kdray.engine.engine import Engine, RunnerFailure
from kdray.engine.kv_pages import PagePool, extend_keys
from kdray.engine.layout import EngineLayout
from kdray.engine.request import join_output
from kdray.engine.runner import SlotState
from kdray.engine.scheduler import Scheduler
from kdray.engine.step import Pending, PrefillBatch, StepResult, first_tokens

VOCAB = 50


def token_at(position: int) -> int:
    """The fake target's token at ``position`` of every sequence."""
    return (7 * position + 3) % VOCAB


class FakeRunner:
    """Keeps each slot's cached length as the device would: prefill returns the token after each prompt; each
    step accepts ``accept`` tokens (drafts and the bonus) per slot and advances it, ahead of the host."""

    def __init__(self, accept: int = 3, fail_at_step: int | None = None):
        self.accept, self.fail_at_step = accept, fail_at_step
        self.prefills, self.steps = [], []
        self.cached: dict[int, int] = {}  # slot -> cached length, as the device keeps it

    def launch(self, prefill, step):
        return (self.prefill(prefill) if prefill else None), (self.step(step) if step else None)

    def prefill(self, batch):
        self.prefills.append(batch)
        first = []
        for slot, chunk, start, last, root in zip(batch.slots, batch.prompts, batch.starts, batch.last, batch.roots):
            self.cached[slot] = start + len(chunk)
            first.append(root if root is not None else token_at(start + len(chunk)))
        return Pending.ready(first_tokens(first))

    def step(self, batch):
        self.steps.append(batch)
        if len(self.steps) == self.fail_at_step:
            raise RunnerFailure("shard 1 died")
        tokens = []
        for slot in batch.slots:
            tokens.append([token_at(self.cached[slot] + 1 + i) for i in range(self.accept)])
            self.cached[slot] += self.accept
        return Pending.ready(StepResult(tokens, {"verify": 0.01 * len(batch.slots), "draft": 0.002}))


class AngleTokenizer:
    """Token t is the text ``<t>``."""

    eos_token_ids = ()

    def decode(self, ids):
        return "".join(f"<{t}>" for t in ids)


def make_engine(runner, num_pages=64, page_size=4, max_num_seqs=4, max_model_len=64, nodes=3,
                max_tokens_per_step=8192, tokenizer=None, eos=(), prefix_caching=False, prefill_chunk=None) -> Engine:
    spec = SpecConfig("ddtree", budget=nodes, block_size=4)
    layout = EngineLayout(spec=spec, max_model_len=max_model_len, num_pages=num_pages, page_size=page_size,
                          num_slots=max_num_seqs, max_pages_per_seq=-(-(max_model_len + spec.cache_slack) // page_size),
                          target_layer_ids=(), cuda_graphs=False)
    scheduler = Scheduler(PagePool(num_pages, page_size, prefix_caching), layout, max_tokens_per_step,
                          prefill_chunk or max_tokens_per_step)
    return Engine(runner, scheduler, tokenizer, max_model_len, VOCAB, eos, "fake", spec.nodes)


def join(whole: dict, outputs: list) -> list:
    """Join each streamed output onto its request's in ``whole`` (request id -> output so far) -> the whole
    outputs of the requests that finished."""
    return [o for o in (join_output(whole, out) for out in outputs) if o.finished]


def run(engine, prompts, params):
    """Add the requests, step until they finish -> their outputs (each the join of its streamed ones)."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    whole, done = {}, {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert not any(o.request_id in done for o in outs), "an output after the request finished"
        done.update({o.request_id: o for o in join(whole, outs)})
    return [done[f"r{i}"] for i in range(len(prompts))]


def expected(prompt, n):
    return [token_at(len(prompt) + j) for j in range(n)]


@pytest.mark.parametrize("accept", [1, 3, 5])
def test_output_is_the_targets_sequence_whatever_each_step_accepts(accept):
    engine = make_engine(FakeRunner(accept))
    prompts = [[1, 2, 3], [4] * 9, [5, 6]]
    outs = run(engine, prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in (7, 12, 1)])
    assert [o.outputs[0].token_ids for o in outs] == [expected(p, n) for p, n in zip(prompts, (7, 12, 1))]
    assert outs[1].metrics["steps"] == -(-11 // accept) and outs[2].metrics["steps"] == 0
    assert engine.free_pages() == 64 and not engine.scheduler.running


def test_eos_inside_a_multi_token_step_stops_exactly_there():
    prompt = [1, 2, 3]
    seq = expected(prompt, 20)
    eos = seq[5]  # emitted in the middle of the second step's tokens
    outs = run(make_engine(FakeRunner(accept=4), eos=(eos,)), [prompt], [SamplingParams(max_tokens=20)])
    assert outs[0].outputs[0].token_ids == seq[:seq.index(eos) + 1]
    assert outs[0].outputs[0].finish_reason == "stop"


def test_max_tokens_and_the_context_limit_cut_mid_step():
    prompt = [9] * 10
    outs = run(make_engine(FakeRunner(accept=4)), [prompt], [SamplingParams(max_tokens=6, ignore_eos=True)])
    assert outs[0].outputs[0].token_ids == expected(prompt, 6) and outs[0].outputs[0].finish_reason == "length"
    outs = run(make_engine(FakeRunner(accept=4), max_model_len=16), [prompt],
               [SamplingParams(max_tokens=40, ignore_eos=True)])
    assert len(outs[0].outputs[0].token_ids) == 6 and outs[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_no_step_is_launched_past_a_length_limit_that_the_work_in_flight_reaches(max_tokens):
    """One token per step: the prefill gives the first token and max_tokens - 1 steps the rest; a step launched
    after those would run (the host is a step behind) only to have its token discarded."""
    runner = FakeRunner(accept=1)
    outs = run(make_engine(runner), [[1, 2, 3]], [SamplingParams(max_tokens=max_tokens, ignore_eos=True)])
    assert outs[0].outputs[0].token_ids == expected([1, 2, 3], max_tokens)
    assert len(runner.steps) == max_tokens - 1
    near_limit = FakeRunner(accept=1)  # the context limit: 16 - 10 prompt tokens = 6 tokens out
    outs = run(make_engine(near_limit, max_model_len=16), [[9] * 10], [SamplingParams(max_tokens=40, ignore_eos=True)])
    assert len(outs[0].outputs[0].token_ids) == 6 and len(near_limit.steps) == 5


def test_a_step_that_may_not_reach_the_limit_is_still_launched():
    """Steps emit at least one token but may emit more: only the sure end stops the launches (a request that
    could still emit is never held back)."""
    runner = FakeRunner(accept=3)  # prefill 1 token, then 3 per step: 1, 4, 7 -> max_tokens 7 after two steps
    outs = run(make_engine(runner), [[1, 2]], [SamplingParams(max_tokens=7, ignore_eos=True)])
    assert outs[0].outputs[0].token_ids == expected([1, 2], 7)
    assert len(runner.steps) == 3  # the third ran before the second's 3 tokens were known


def test_stop_string_across_a_step_is_cut_and_its_tokens_kept_up_to_it():
    prompt = [1]
    seq = expected(prompt, 12)
    stop = f"<{seq[3]}><{seq[4]}>"  # spans the first and second step (accept 3: tokens 1-3, 4-6)
    outs = run(make_engine(FakeRunner(accept=3), tokenizer=AngleTokenizer()), [prompt],
               [SamplingParams(max_tokens=12, stop=stop, ignore_eos=True)])
    c = outs[0].outputs[0]
    assert c.finish_reason == "stop" and c.token_ids == seq[:5]
    assert c.text == "".join(f"<{t}>" for t in seq[:3])


def test_stop_token_ids_stop_like_eos_even_when_eos_is_ignored():
    prompt = [1, 2, 3]
    seq = expected(prompt, 20)
    stop = seq[6]  # emitted in the middle of the second step's tokens
    outs = run(make_engine(FakeRunner(accept=4)), [prompt],
               [SamplingParams(max_tokens=20, stop_token_ids=[stop], ignore_eos=True)])
    assert outs[0].outputs[0].token_ids == seq[:seq.index(stop) + 1]
    assert outs[0].outputs[0].finish_reason == "stop"


def test_include_stop_str_in_output_keeps_the_first_stop_string():
    prompt = [1]
    seq = expected(prompt, 12)
    first, later = f"<{seq[3]}>", f"<{seq[2]}><{seq[3]}><{seq[4]}>"
    params = SamplingParams(max_tokens=12, stop=[later, first], include_stop_str_in_output=True, ignore_eos=True)
    c = run(make_engine(FakeRunner(accept=3), tokenizer=AngleTokenizer()), [prompt], [params])[0].outputs[0]
    assert c.finish_reason == "stop" and c.token_ids == seq[:4]
    assert c.text == "".join(f"<{t}>" for t in seq[:4])


@pytest.mark.parametrize("stop", ["string", "token id", "eos"])
def test_min_tokens_holds_off_every_stop_until_that_many_tokens_are_out(stop):
    """The third token stops the request with min_tokens=3; with min_tokens=5 it does not (the runner masks EOS and
    stop_token_ids before then; the engine does not stop on them, nor on a stop string, either)."""
    prompt = [1]
    seq = expected(prompt, 12)
    fields = {"string": dict(stop=f"<{seq[2]}>", ignore_eos=True), "token id": dict(stop_token_ids=[seq[2]],
                                                                                   ignore_eos=True), "eos": {}}[stop]
    for min_tokens, tokens, reason in ((3, seq[:3], "stop"), (5, seq, "length")):
        engine = make_engine(FakeRunner(accept=4), tokenizer=AngleTokenizer(), eos=(seq[2],) if stop == "eos" else ())
        c = run(engine, [prompt], [SamplingParams(max_tokens=12, min_tokens=min_tokens, **fields)])[0].outputs[0]
        assert (c.token_ids, c.finish_reason) == (tokens, reason)


def test_a_logit_bias_outside_the_vocabulary_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"logit_bias: token id 50 is outside the vocabulary \[0, 50\)"):
        make_engine(FakeRunner()).add_request("a", [1, 2], SamplingParams(logit_bias={VOCAB: 1.0}))


def test_stop_strings_without_a_tokenizer_are_refused_not_ignored():
    with pytest.raises(ValueError, match="stop: model 'fake' has no tokenizer"):
        make_engine(FakeRunner()).add_request("a", [1, 2], SamplingParams(stop="."))


@pytest.mark.parametrize("prompt,message", [([], "prompt is empty"), ([1, VOCAB], r"must lie in \[0, 50\)"),
                                            ([1] * 64, "context limit is 64")])
def test_bad_prompts_are_refused_naming_the_problem(prompt, message):
    with pytest.raises(ValueError, match=message):
        make_engine(FakeRunner()).add_request("a", prompt, SamplingParams())


def test_admission_takes_current_need_not_the_whole_context():
    """Pages for the prompt and one step's look-ahead admit a request, however long it may grow: a burst of long
    requests all run at once (a full reservation would have admitted one)."""
    runner = FakeRunner(accept=2)
    engine = make_engine(runner, num_pages=1100, max_num_seqs=16, max_model_len=4096)
    for i in range(16):
        engine.add_request(f"r{i}", [1, 2, 3, 4], SamplingParams(max_tokens=4000, ignore_eos=True))
    engine.step()
    assert len(engine.scheduler.running) == 16 and not engine.scheduler.waiting
    assert engine.scheduler.pages_to_start(engine.scheduler.running[0]) * 16 <= 1100 < 2 * (4004 // 4)


def test_a_request_the_pool_cannot_hold_alone_is_refused_and_the_rest_run():
    """Grown to max_tokens it would outgrow every page: admitted, it would wait for pages forever and hold up every
    request behind it. It is refused up front, naming the fix."""
    engine = make_engine(FakeRunner(accept=2), num_pages=16, max_model_len=64)
    refused = r"may need 18 KV pages \(prompt and max_tokens\); the pool has 16: lower max_tokens"
    with pytest.raises(ValueError, match=refused):
        engine.add_request("big", [5] * 20, SamplingParams(max_tokens=40, ignore_eos=True))
    outs = run(engine, [[5] * 20], [SamplingParams(max_tokens=20, ignore_eos=True)])
    assert outs[0].outputs[0].token_ids == expected([5] * 20, 20)


def test_a_preempted_request_resumes_with_exactly_its_output():
    """Too few pages for every sequence to grow: the most recently admitted ones are preempted (their pages back,
    their KV recomputed from prompt and output later), and every output is the one it would have been."""
    runner = FakeRunner(accept=3)
    engine = make_engine(runner, num_pages=16, max_num_seqs=4, max_model_len=64)
    prompts = [[i + 1] * (3 + i) for i in range(4)]
    outs = run(engine, prompts, [SamplingParams(max_tokens=30, ignore_eos=True)] * 4)
    assert [o.outputs[0].token_ids for o in outs] == [expected(p, 30) for p in prompts]
    assert engine.scheduler.preemptions > 0
    resumed = [b for b in runner.prefills if any(r is not None for r in b.roots)]
    assert resumed  # a resumed context was prefilled again, its known bonus token given
    assert engine.free_pages() == 16 and not engine.scheduler.running


def test_slots_bound_the_running_set_and_come_back():
    runner = FakeRunner(accept=2)
    engine = make_engine(runner, max_num_seqs=2)
    run(engine, [[1, 2]] * 4, [SamplingParams(max_tokens=3, ignore_eos=True)] * 4)
    assert max(len(b.slots) for b in runner.steps) == 2
    assert {s for b in runner.prefills for s in b.slots} == {0, 1}  # freed slots are handed out again
    assert sorted(engine.scheduler._free_slots) == [0, 1]  # every slot back once all finished


@pytest.mark.parametrize("chunk", [4, 8, 12])
def test_chunked_prefill_shares_steps_with_decoding(chunk):
    """A long prompt is prefilled a chunk per step while the running sequence keeps decoding."""
    runner = FakeRunner(accept=1)
    engine = make_engine(runner, num_pages=64, max_num_seqs=4, max_model_len=128, prefill_chunk=chunk)
    engine.add_request("short", [1, 2], SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    engine.add_request("long", list(range(3, 45)), SamplingParams(max_tokens=5, ignore_eos=True))
    whole, done = {}, {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in join(whole, engine.step())})
    assert done["long"].outputs[0].token_ids == expected(list(range(3, 45)), 5)
    assert done["short"].outputs[0].token_ids == expected([1, 2], 40)
    long_chunks = [(b.starts[i], len(b.prompts[i])) for b in runner.prefills for i in range(len(b.slots))
                   if b.starts[i] or len(b.prompts[i]) > 2]
    assert sum(n for _, n in long_chunks) == 42 and max(n for _, n in long_chunks) <= chunk
    assert [a for a, _ in long_chunks] == list(range(0, 42, chunk))[:len(long_chunks)]
    stepped_while_prefilling = [b for b in runner.steps if len(b.slots) == 1]
    assert len(stepped_while_prefilling) >= len(long_chunks) - 1  # the short one never waited for the prompt


def test_prefix_cache_shares_full_pages_and_prefills_only_the_rest():
    runner = FakeRunner(accept=2)
    engine = make_engine(runner, num_pages=64, prefix_caching=True)
    system = list(range(1, 14))  # 13 tokens: 3 full pages of 4
    first = run(engine, [system + [20]], [SamplingParams(max_tokens=3, ignore_eos=True)])
    outs = run(engine, [system + [30, 31]], [SamplingParams(max_tokens=3, ignore_eos=True)])
    assert outs[0].outputs[0].token_ids == expected(system + [30, 31], 3)
    assert (first[0].num_cached_tokens, outs[0].num_cached_tokens) == (0, 12)  # what usage reports
    second = runner.prefills[-1]
    assert second.starts == [12] and second.prompts == [[13, 30, 31]]  # 3 cached pages, the rest prefilled
    assert engine.scheduler.prefix_hits == 3


def test_prefix_cache_counts_each_admitted_request_once():
    """A request that waits for pages is looked up in the cache at every try; the hit rate counts it once, when it
    is admitted."""
    runner = FakeRunner(accept=2)
    engine = make_engine(runner, num_pages=18, prefix_caching=True)
    system = list(range(1, 14))  # 3 full pages of 4, held by "a" while "c" waits
    engine.add_request("a", system + [20], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("big", [45] * 24, SamplingParams(max_tokens=4, ignore_eos=True))  # the rest of the pool
    engine.step()
    engine.add_request("c", system + [30, 31], SamplingParams(max_tokens=3, ignore_eos=True))
    waited, cached = 0, {}
    while engine.has_unfinished_requests():
        waited += any(s.request_id == "c" for s in engine.scheduler.waiting)
        cached |= {out.request_id: out.num_cached_tokens for out in engine.step()}
    assert waited >= 2 and cached == {"a": 0, "big": 0, "c": 12}
    # a's 3 pages, big's 5 (a prompt's last token is never cached), c's 3 found once
    assert (engine.scheduler.prefix_lookups, engine.scheduler.prefix_hits) == (3 + 23 // 4 + 3, 3)


def test_a_runner_failure_empties_the_prefix_cache():
    """The KV behind cached prefixes is gone with the runner that held it (new actors start empty)."""
    runner = FakeRunner(accept=2)
    engine = make_engine(runner, num_pages=64, prefix_caching=True)
    run(engine, [list(range(1, 14))], [SamplingParams(max_tokens=3, ignore_eos=True)])
    runner.fail_at_step = len(runner.steps) + 2
    engine.add_request("b", list(range(1, 14)) + [7], SamplingParams(max_tokens=20, ignore_eos=True))
    with pytest.raises(RunnerFailure):
        for _ in range(5):
            engine.step()
    run(engine, [list(range(1, 14)) + [8]], [SamplingParams(max_tokens=3, ignore_eos=True)])
    assert runner.prefills[-1].starts == [0]  # prefilled from scratch, not from pages the failure emptied
    assert engine.free_pages() == 64


def test_prefix_keys_made_page_by_page_equal_those_of_the_whole_context():
    """The scheduler keys a growing sequence's pages from the first page not keyed yet (no copy of its context per
    page): the keys, over a prompt and an output crossing many pages, equal the whole context's keyed at once."""
    engine = make_engine(FakeRunner(), page_size=4, max_model_len=64, prefix_caching=True)
    prompt = list(range(1, 19))  # 4 full pages and 2 tokens
    engine.add_request("r", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    seq = engine._seqs["r"]
    while engine.has_unfinished_requests():
        engine.step()
    whole: list = []
    extend_keys(whole, prompt + seq.output_ids, 4, seq.registered)
    assert seq.registered >= 11 and seq.keys[:seq.registered] == whole
    assert seq.tokens_between(16, 21) == [17, 18] + seq.output_ids[:3] and seq.tokens_between(20, 22) == \
        seq.output_ids[2:4] and seq.tokens_between(3, 5) == [4, 5]


def test_eviction_takes_idle_cached_pages_never_held_ones():
    pool = PagePool(4, 2, prefix_caching=True)
    held, idle = pool.allocate(2), pool.allocate(2)
    keys: list = []
    extend_keys(keys, [1, 2, 3, 4], 2, 2)
    pool.register(idle, keys)
    pool.register(held, [b"x", b"y"])
    pool.release(list(idle))  # cached, nobody holds them
    assert pool.free_pages() == 2
    got = pool.allocate(2)
    assert sorted(got) == sorted(idle) and pool.match(keys) == []  # evicted: the cache forgets them
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(1)  # the held pages are never taken


def test_step_token_bound_rotates_through_the_running_sequences():
    runner = FakeRunner(accept=1)
    engine = make_engine(runner, max_num_seqs=6, nodes=3, max_tokens_per_step=8)  # 8 // (1 + 3) = 2 per step
    prompts = [[i + 1] for i in range(5)]
    outs = run(engine, prompts, [SamplingParams(max_tokens=4, ignore_eos=True)] * 5)
    assert [o.outputs[0].token_ids for o in outs] == [expected(p, 4) for p in prompts]
    assert max(len(b.slots) for b in runner.steps) == 2


def test_abort_frees_pages_and_slot_once_nothing_in_flight_writes_them():
    engine = make_engine(FakeRunner(), num_pages=64, max_num_seqs=1)
    engine.add_request("run", [1, 2], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("wait", [3], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    held = engine.free_pages()
    assert held < 64 and engine.num_waiting() == 1
    engine.abort_request("run")
    engine.abort_request("wait")
    engine.abort_request("never-seen")
    assert engine.free_pages() == held and engine.has_unfinished_requests()  # a step of "run" is in flight
    assert engine.drain() == []  # its tokens are discarded, not reported
    assert engine.free_pages() == 64 and not engine.has_unfinished_requests()


def test_a_runner_failure_fails_the_running_requests_and_the_waiting_ones_run_next():
    engine = make_engine(FakeRunner(accept=2, fail_at_step=2), max_num_seqs=1)
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=9, ignore_eos=True))
    engine.add_request("b", [3, 4], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()  # prefill of a
    engine.step()  # its first step
    with pytest.raises(RunnerFailure, match=r"shard 1 died\n-> request\(s\) \['a'\] failed") as failure:
        engine.step()
    assert failure.value.request_ids == ("a",) and engine.free_pages() == 64
    whole, outs = {}, {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in join(whole, engine.step())})
    assert list(outs) == ["b"] and outs["b"].outputs[0].token_ids == expected([3, 4], 5)


def test_stage_seconds_are_shared_over_the_batch():
    engine = make_engine(FakeRunner(accept=10))
    outs = run(engine, [[1], [2]], [SamplingParams(max_tokens=11, ignore_eos=True)] * 2)
    for o in outs:
        assert o.metrics["steps"] == 1 and o.metrics["seconds"]["verify"] == pytest.approx(0.01)
        assert o.metrics["tau"] == 10


class CountingTokenizer(AngleTokenizer):
    """Counts the token ids it is asked to decode."""

    def __init__(self):
        self.decoded = 0

    def decode(self, ids):
        self.decoded += len(ids)
        return super().decode(ids)


class CallCountingTokenizer(AngleTokenizer):
    """Counts its decode calls."""

    def __init__(self):
        self.calls = 0

    def decode(self, ids):
        self.calls += 1
        return super().decode(ids)


def run_final_only(engine, prompts, params):
    """``run`` with ``step(stream=False)``: each output is a finished request's, reported once."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step(stream=False):
            assert out.finished and out.request_id not in done
            done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_a_streamed_output_holds_only_what_its_request_added():
    """Each streamed output carries the tokens, log-probabilities and text of its step alone (a long output's
    outputs cost what they add, not its length); a running request's text stops short of what a stop string may
    still cut, and the outputs join into what a final-only step reports."""
    seq = expected([1], 30)
    params = [SamplingParams(max_tokens=30, ignore_eos=True),
              SamplingParams(max_tokens=30, stop=f"<{seq[29]}>!", ignore_eos=True)]  # never matches: held 4 chars
    engine = make_engine(FakeRunner(accept=4), tokenizer=AngleTokenizer())
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [1], p)
    streamed = {"r0": [], "r1": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id].append(out)
    final = run_final_only(make_engine(FakeRunner(accept=4), tokenizer=AngleTokenizer()), [[1], [1]], params)
    for outs, whole, p in zip(streamed.values(), final, params):
        sizes = [len(o.outputs[0].token_ids) for o in outs]
        assert sizes == [1] + [4] * 7 + [1]  # the prefill's token, then each step's (the last one cut by length)
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        text = "".join(o.outputs[0].text for o in outs)
        assert ids == whole.outputs[0].token_ids == seq
        assert text == whole.outputs[0].text == AngleTokenizer().decode(seq)
        hold = len(p.stop[0]) - 1 if p.stop else 0
        made = [len(AngleTokenizer().decode(seq[:n])) for n in itertools.accumulate(sizes)]
        shown = list(itertools.accumulate(len(o.outputs[0].text) for o in outs))
        assert shown == [n - hold for n in made[:-1]] + made[-1:]


def test_final_only_steps_report_the_finished_requests_text_made_once():
    prompts = [[1, 2, 3], [4] * 9, [5, 6], [7]]
    eos = expected(prompts[3], 9)[8]
    params = [SamplingParams(max_tokens=n, ignore_eos=i < 3) for i, n in enumerate((7, 12, 1, 30))]
    streamed = run(make_engine(FakeRunner(accept=3), tokenizer=AngleTokenizer(), eos=(eos,)), prompts, params)
    tok = CallCountingTokenizer()
    final = run_final_only(make_engine(FakeRunner(accept=3), tokenizer=tok, eos=(eos,)), prompts, params)
    key = lambda o: (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)  # noqa: E731
    assert [key(o) for o in final] == [key(o) for o in streamed]
    assert final[3].outputs[0].finish_reason == "stop" and final[3].outputs[0].text
    assert tok.calls <= 4 * len(prompts)  # the window, the context and the flush once per request, not per step


@pytest.mark.parametrize("pieces", [2, 1024])
def test_text_is_the_outputs_decode_cut_at_the_first_stop_string_streamed_or_not(monkeypatch, pieces):
    """With stop strings or without, streamed or reported once, the text is the output tokens' decode cut at the first
    stop string (kept with include_stop_str_in_output), also when a request's unreported text pieces are joined
    every ``pieces``."""
    monkeypatch.setattr(engine_module, "TEXT_PIECES", pieces)
    seq = expected([1], 40)
    text = AngleTokenizer().decode(seq)
    stop = f"<{seq[30]}><{seq[31]}>"  # in the 31st and 32nd tokens (both in one step, or across two)
    cases = [({}, text), ({"stop": "no such text"}, text),
             ({"stop": ["<none>", stop]}, AngleTokenizer().decode(seq[:30])),
             ({"stop": stop, "include_stop_str_in_output": True}, AngleTokenizer().decode(seq[:32])),
             ({"stop": stop, "min_tokens": 33}, text)]  # the stop string ended before min_tokens: not a stop
    params = [SamplingParams(max_tokens=40, ignore_eos=True, **fields) for fields, _ in cases]
    for accept in (1, 3):
        tok = AngleTokenizer()
        streamed = run(make_engine(FakeRunner(accept), tokenizer=tok, max_num_seqs=8), [[1]] * len(cases), params)
        final = run_final_only(make_engine(FakeRunner(accept), tokenizer=tok, max_num_seqs=8), [[1]] * len(cases),
                               params)
        for (_, want), a, b in zip(cases, streamed, final):
            assert a.outputs[0].text == b.outputs[0].text == want


def test_host_work_per_token_does_not_grow_with_the_output_length():
    """Text grows by incremental detokenization and stop strings are looked for in the new text only, so the
    decoding work per token is the same for a long output as for a short one (not quadratic)."""
    per_token = []
    for n in (100, 1000):
        tok = CountingTokenizer()
        engine = make_engine(FakeRunner(accept=3), num_pages=1100, max_model_len=2048, tokenizer=tok)
        outs = run(engine, [[1]], [SamplingParams(max_tokens=n, stop=["no such text"], ignore_eos=True)])
        assert outs[0].outputs[0].text == AngleTokenizer().decode(expected([1], n))
        per_token.append(tok.decoded / n)
    assert per_token[1] <= 1.1 * per_token[0] and per_token[1] < 20


def test_slot_settings_tell_which_batches_sample_or_pay_for_features():
    """A batch is greedy and plain unless a slot's current request samples or uses a costly feature; a slot's
    settings are replaced when another request takes it."""
    slots = SlotState(4, 2, 8, torch.device("cpu"), vocab=VOCAB)

    def admit(slot: int, params: SamplingParams):
        slots.admit(PrefillBatch(slots=[slot], prompts=[[1]], starts=[0], pages=[[slot]], params=[params], seeds=[0],
                                 last=[True], roots=[None], prompt_lens=[1], bans=[[]], histories=[None], scored=[[]]))

    admit(0, SamplingParams())
    admit(1, SamplingParams())
    assert slots.all_greedy([0, 1]) and slots.extras([0, 1]) == ()
    admit(2, SamplingParams(temperature=0.7))
    admit(3, SamplingParams(logit_bias={1: 2.0}))
    assert not slots.all_greedy([1, 2]) and slots.all_greedy([0, 1, 3])
    assert slots.extras([0, 3]) == ("bias",) and slots.extras([0, 2]) == ()
    admit(2, SamplingParams())
    admit(3, SamplingParams())
    assert slots.special == 0 and slots.all_greedy([0, 1, 2, 3]) and slots.extras([2, 3]) == ()
