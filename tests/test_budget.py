"""budget="auto": the tree width chosen each step from the trees' own probabilities, a per-depth calibration
and a measured cost table; the choice never changes the output. The warm-up that measures the table (and
captures the step graphs of fixed budgets too) runs every batch bucket."""
import dataclasses

import pytest
import torch

from kdray import LLM, SamplingParams
from kdray.engine.build import warm_prefill, warm_steps
from kdray.kernels.tree_build import tree_build
from kdray.spec.budget import BudgetPolicy, width_masses

L = 3


def policy(costs: dict[int, float]) -> BudgetPolicy:
    """A policy whose cost table holds one sequence's step at each width."""
    p = BudgetPolicy(max_nodes=64, depth=L)
    p.warm({(1, w): s for w, s in costs.items()})
    return p


def confident(n: int) -> list:
    """Reports of ``n`` sequences whose trees put most mass early: depth masses grow with the width."""
    return [[[min(1.0, 0.02 * w) * 0.9 ** d for d in range(L)] for w in (0, 8, 16, 32, 64)] for _ in range(n)]


def test_verification_that_costs_too_much_is_skipped():
    p = policy({0: 1.0, 8: 50.0, 16: 60.0, 32: 70.0, 64: 80.0})  # any tree costs far more than it can accept
    assert p.choose(confident(4)) == 0


def test_free_verification_takes_the_whole_budget():
    p = policy({w: 1.0 for w in (0, 8, 16, 32, 64)})  # every width costs the same: the biggest tree wins
    assert p.choose(confident(4)) == 64


def test_the_cost_of_a_batch_not_measured_yet_grows_with_its_tokens():
    p = policy({0: 1.0, 64: 1.0 + 64 * 0.01})
    assert p.cost(8, 64) > p.cost(1, 64) and p.cost(8, 0) < p.cost(8, 64)
    p.observe(64, None, [1] * 8, 8, device_seconds=3.0, wall_seconds=3.5)
    assert p.costs[(8, 64)] == 3.0 and p.host_seconds > 0  # refined from what the step took


def test_calibration_follows_the_acceptance_seen():
    p = policy({0: 1.0, 64: 2.0})
    reports = confident(2)
    for _ in range(200):  # the drafter is over-confident: nothing past depth 1 is ever accepted
        p.observe(64, reports, [2, 2], 2, None, None)
    assert p.calibration[0] > 1.5 * p.calibration[1] and p.calibration[2] < 0.05


def test_one_large_batch_does_not_erase_what_many_steps_taught():
    p = policy({0: 1.0, 64: 2.0})
    for _ in range(100):  # every drafted token accepted
        p.observe(64, confident(2), [L + 1] * 2, 2, None, None)
    before = p.calibration[L - 1]
    p.observe(64, confident(32), [1] * 32, 32, None, None)  # one step of 32 sequences accepting nothing
    assert p.calibration[L - 1] > 0.5 * before


def test_nothing_known_and_long_plain_runs_try_a_small_tree():
    p = policy({0: 1.0, 8: 100.0, 16: 100.0, 32: 100.0, 64: 100.0})
    assert p.choose([None, None]) == 8
    runs = [p.choose(confident(2)) for _ in range(40)]
    assert runs[:32] == [0] * 32 and 8 in runs[32:]


def test_width_masses_are_the_path_probabilities_of_the_first_nodes():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, L, 5, generator=g) * 2
    tree = tree_build(logits, torch.tensor([0, 1]), torch.tensor([12, 12], dtype=torch.int32), 12)
    masses = width_masses(logits, tree.tokens, tree.depths, tree.ancestors(), torch.tensor([0, 4, 12]), L)
    probs = logits.softmax(-1)
    for b in range(2):
        for k, w in enumerate((0, 4, 12)):
            expect = [0.0] * L
            for i in range(1, w + 1):
                p, j = 1.0, i
                while j > 0:
                    p *= probs[b, tree.depths[b, j] - 1, tree.tokens[b, j]].item()
                    j = tree.parents[b, j].item()
                expect[tree.depths[b, i] - 1] += p
            assert masses[b, k].tolist() == pytest.approx(expect, rel=1e-5, abs=1e-7)


def test_auto_budget_output_equals_ar():
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [40] * 9]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ar = LLM(model="k2-tiny", spec="ar").generate(prompt_token_ids=prompts, sampling_params=params)
    auto = LLM(model="k2-tiny", drafter="random", spec="ddtree", block_size=4)  # budget="auto" is the default
    outs = auto.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ar]
    assert sum(outs[0].metrics["tree_sizes"].values()) == outs[0].metrics["steps"]
    assert auto.engine.policy.report()["tree_sizes"]


@pytest.mark.parametrize("spec", ["ar", "ddtree"])
def test_warm_up_steps_every_batch_bucket_and_leaves_cached_prefixes_intact(spec):
    """The warm-up (steps and a prefill) between two runs of the same prompts: the second reuses the first's cached
    KV pages and must still give the same tokens (a warm-up writing into those pages would change them)."""
    kw = dict(model="k2-tiny", spec=spec, max_num_seqs=4)
    if spec == "ddtree":
        kw.update(drafter="random", block_size=4, budget=16)
    llm = LLM(**kw)
    prompts = [list(range(5, 45)), list(range(50, 90))]  # two full pages each: cached after the first run
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    runner = llm.engine.runner
    layout = dataclasses.replace(runner.layout, cuda_graphs=True)  # as on a GPU: one step per batch bucket
    nodes = layout.spec.nodes
    assert sorted(warm_steps(runner, layout, [nodes], repeats=1)) == [(1, nodes), (2, nodes), (4, nodes)]
    warm_prefill(runner, layout)
    hits = llm.engine.scheduler.prefix_hits
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert llm.engine.scheduler.prefix_hits > hits
    assert [o.outputs[0].token_ids for o in got] == want


@pytest.mark.slow
def test_auto_budget_on_smollm2_equals_ar(smollm2):
    from kdray.train_drafter import topic_prompts

    prompts = [p[:64] for p in topic_prompts(smollm2.tokenizer, smollm2.config.vocab_size)[1][:2]]
    params = SamplingParams(max_tokens=24)
    ar = LLM(model=smollm2, spec="ar").generate(prompt_token_ids=prompts, sampling_params=params)
    auto = LLM(model=smollm2).generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in auto] == [o.outputs[0].token_ids for o in ar]
