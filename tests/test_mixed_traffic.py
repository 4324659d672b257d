"""Mixed traffic on a real (tiny) model, fp32: requests of every kind of sampling arrive at random steps, some are
aborted, prompts share prefixes, the pool is small enough to preempt and prompts come in chunks that ride in the
running steps; every request that was not aborted ends exactly as it does alone in an engine of its own (tokens,
finish reason, its log-probabilities), and the engine ends with every page free."""
import random

import pytest
from test_engine import join
from test_scheduler import MODES

from kdray import LLM, SamplingParams


def random_params(rng: random.Random) -> SamplingParams:
    n = rng.randint(1, 30)
    return rng.choice([
        lambda: SamplingParams(max_tokens=n, ignore_eos=True),
        lambda: SamplingParams(max_tokens=n, ignore_eos=True, temperature=rng.choice([0.5, 1.3]), top_p=0.9,
                               top_k=rng.choice([0, 5]), seed=rng.randint(0, 2 ** 31)),
        lambda: SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8, seed=rng.randint(0, 99),
                               stop_token_ids=[rng.randint(2, 999) for _ in range(30)]),
        lambda: SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.9, seed=rng.randint(0, 99),
                               presence_penalty=-2.0, frequency_penalty=-1.0, repetition_penalty=1.2,
                               logit_bias={rng.randint(2, 999): 3.0}, min_p=0.05, min_tokens=min(3, n), logprobs=2),
        lambda: SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.7, seed=rng.randint(0, 99),
                               prompt_logprobs=1, logprobs=1),
    ])()


def chosen_logprobs(out) -> list[float]:
    """The log-probability of each output token (the alternatives' order may differ at ties of ~1e-7)."""
    return [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs or [])]


@pytest.mark.parametrize("seed, preempts", [(0, False), (10, False), (23, False), (27, True), (4, True), (8, True)])
def test_mixed_traffic_ends_every_request_as_it_would_alone(seed, preempts):
    """(AR, chain and DDTree each with and without preemptions; every seed hits the prefix cache.)"""
    rng = random.Random(seed)
    mode = list(MODES)[seed % 3]
    system = [rng.randint(2, 999) for _ in range(rng.randint(20, 50))]
    prompts = [(system if rng.random() < 0.7 else []) + [rng.randint(2, 999) for _ in range(rng.randint(1, 60))]
               for _ in range(8)]
    params = [random_params(rng) for _ in prompts]
    arrive = sorted(rng.randint(0, 30) for _ in prompts)
    aborted = {i: arrive[i] + rng.randint(0, 10) for i in rng.sample(range(8), 2)}
    pages = 14 + 6 * (seed % 2)
    llm = LLM(model="k2-tiny", prefill_chunk=rng.choice([16, 32, 48]), max_num_seqs=rng.choice([3, 4, 8]),
              num_pages=pages, **MODES[mode])
    engine, whole, done, step = llm.engine, {}, {}, 0
    while step <= 40 or engine.has_unfinished_requests():
        for i, t in enumerate(arrive):
            if t == step:
                engine.add_request(f"r{i}", prompts[i], params[i])
        for i, t in aborted.items():
            if t == step:
                engine.abort_request(f"r{i}")
        done.update({int(o.request_id[1:]): o.outputs[0] for o in join(whole, engine.step())})
        step += 1
    alone = LLM(model="k2-tiny", prefix_caching=False, **MODES[mode])
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        if i in aborted:
            continue
        ref = alone.generate(prompt_token_ids=[prompt], sampling_params=p)[0].outputs[0]
        assert (done[i].token_ids, done[i].finish_reason) == (ref.token_ids, ref.finish_reason), (i, p)
        assert chosen_logprobs(done[i]) == pytest.approx(chosen_logprobs(ref), abs=1e-4)
    assert engine.free_pages() == pages
    assert (engine.scheduler.preemptions > 0) == preempts and engine.scheduler.prefix_hits > 0
