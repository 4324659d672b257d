"""A lone prompt chunk padded to a prompt bucket, as the graphed prefill runs it (here eagerly, on the CPU): the
chunk's logits, KV and drafter context equal the unpadded pass's, and the padding writes only the scratch page."""
import pytest
import torch
from test_llama import make_tiny

from kdray.engine.runner import PROMPT_BUCKETS
from kdray.llm import LLM
from kdray.model.batch import ForwardBatch, causal_tree_mask


def eager_graphs(runner):
    """Stands in for the runner's GraphedFn: calls the captured function itself."""
    return lambda inputs, **options: (runner._prompt_fn(None, *inputs, **options), None)


@pytest.fixture(scope="module", params=["k2-tiny", "llama-tiny"])
def runner(request, tmp_path_factory):
    model = "k2-tiny"
    if request.param == "llama-tiny":
        model = str(tmp_path_factory.mktemp("llama"))
        make_tiny(model, tied=False, llama3=False)
    # a drafter, so the target's context features are computed too
    llm = LLM(model=model, device="cpu", dtype="float32", spec="ddtree", drafter="random", block_size=4, budget=8,
              max_num_seqs=2, num_pages=64)  # on the CPU on a GPU machine too: fp32 tolerances
    return llm.engine.runner


@pytest.mark.parametrize("start,n", [(0, 21), (8, 21), (0, 16), (8, 1)])
def test_padded_chunk_equals_the_unpadded_pass(runner, start, n):
    ps, vocab = runner.page_size, runner.target.model.cfg.vocab_size
    scratch = runner.slots.scratch_page
    assert n + start <= PROMPT_BUCKETS[1] and runner.layout.max_pages_per_seq * ps >= start + PROMPT_BUCKETS[1]
    g = torch.Generator().manual_seed(start * 100 + n)
    pages = list(range(2, 2 + -(-(start + n) // ps)))
    table = torch.full((1, runner.layout.max_pages_per_seq), scratch, dtype=torch.int32)  # [1, pages]
    table[0, :len(pages)] = torch.tensor(pages)
    ids = torch.randint(0, vocab, (n,), generator=g)
    mask = causal_tree_mask([n], "cpu") if start else None  # after cached tokens: the verify form
    fb = ForwardBatch.build(ids, torch.arange(start, start + n), [n], [start], table, ps, mask)
    last = fb.cu_q[1:].long() - 1
    runner.kv.normal_(generator=g)  # cached tokens (and everything else) random
    runner.draft_kv.normal_(generator=g)
    before, draft_before = runner.kv.clone(), runner.draft_kv.clone()
    logits, features = runner.forward_prompts(fb, [start], last, None)
    runner.add_context(features, fb.positions, fb.slot_mapping)  # what prefill does after an unpadded pass
    unpadded, draft_unpadded = runner.kv.clone(), runner.draft_kv.clone()
    runner.kv.copy_(before)
    runner.draft_kv.copy_(draft_before)
    padded_logits, padded_features = runner.forward_prompts(fb, [start], last, eager_graphs(runner))
    assert padded_logits.shape == logits.shape and torch.allclose(padded_logits, logits, atol=1e-5)
    assert padded_features is None  # the padded pass wrote them into the drafter's context itself
    assert torch.allclose(runner.kv[:, :scratch], unpadded[:, :scratch], atol=1e-5)  # the chunk's KV, nothing else
    assert torch.allclose(runner.draft_kv[:, :scratch], draft_unpadded[:, :scratch], atol=1e-5)
    # the padding's KV went to the scratch page (16 tokens fill their bucket: no padding)
    assert torch.equal(runner.kv[:, scratch], unpadded[:, scratch]) == (n in PROMPT_BUCKETS)


def test_a_chunk_past_the_buckets_or_the_block_table_runs_unpadded(runner):
    """Over the largest bucket, or padded past the block table's last position, the chunk runs as it is."""
    ps = runner.page_size
    limit = runner.layout.max_pages_per_seq * ps
    calls = []

    def graphs(inputs, **options):
        calls.append(inputs[0].shape[0])
        return eager_graphs(runner)(inputs, **options)

    over = PROMPT_BUCKETS[-1] + 1
    for start, n in [(limit - 20, 17)] + ([(0, over)] if over <= limit else []):
        table = torch.arange(runner.layout.max_pages_per_seq, dtype=torch.int32)[None] % runner.slots.scratch_page
        mask = causal_tree_mask([n], "cpu") if start else None
        fb = ForwardBatch.build(torch.zeros(n, dtype=torch.int64), torch.arange(start, start + n), [n], [start], table,
                                ps, mask)
        runner.forward_prompts(fb, [start], fb.cu_q[1:].long() - 1, graphs)
    assert calls == []
    fb = ForwardBatch.build(torch.zeros(17, dtype=torch.int64), torch.arange(17), [17], [0], table, ps, None)
    runner.forward_prompts(fb, [0], fb.cu_q[1:].long() - 1, graphs)
    assert calls == [32]
