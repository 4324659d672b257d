"""A lone prompt chunk padded to a prompt bucket, as the graphed prefill runs it (here eagerly, on the CPU): the
chunk's logits, KV and drafter context equal the unpadded pass's, and the padding writes only the scratch page."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from test_llama import make_tiny

from kdray.config import K2Config
from kdray.engine.runner import PROMPT_BUCKETS, riding_rows
from kdray.llm import LLM
from kdray.model.batch import ForwardBatch, causal_tree_mask
from kdray.model.k2 import PLAIN_CHUNK_PAIRS, PLAIN_CHUNK_TOKENS


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


def test_a_long_chunk_after_a_long_cache_runs_in_an_eager_pass_on_k2(runner, monkeypatch):
    """K2's layout sends a lone chunk of PLAIN_CHUNK_TOKENS or more whose tokens x cached tokens reach
    PLAIN_CHUNK_PAIRS to an eager pass of its own (the plain attention form), neither replayed from a graph nor riding
    in a verify pass; shorter chunks and smaller products still do both. Other models have no such chunks."""
    k2 = isinstance(runner.target.model.cfg, K2Config)
    assert runner.layout.plain_chunks == ((PLAIN_CHUNK_TOKENS, PLAIN_CHUNK_PAIRS) if k2 else None)
    layout = dataclasses.replace(runner.layout, plain_chunks=(5, 40), step_chunk=32)  # scaled down to the tiny model
    monkeypatch.setattr(runner, "layout", layout)
    calls = []

    def graphs(inputs, **options):
        calls.append(inputs[0].shape[0])
        return eager_graphs(runner)(inputs, **options)

    table = torch.arange(layout.max_pages_per_seq, dtype=torch.int32)[None] % runner.slots.scratch_page
    step = SimpleNamespace(grammars=None)
    riding = []
    for start, n in [(8, 5), (8, 4), (7, 5), (4, 10), (3, 10)]:
        fb = ForwardBatch.build(torch.zeros(n, dtype=torch.int64), torch.arange(start, start + n), [n], [start], table,
                                runner.page_size, causal_tree_mask([n], "cpu"))
        runner.forward_prompts(fb, [start], fb.cu_q[1:].long() - 1, graphs)
        chunk = SimpleNamespace(slots=[0], prompts=[[0] * n], scored=[[]], allowed=None, starts=[start])
        riding.append(riding_rows(layout, chunk, step, graphs=False))
    assert calls == [16, 16, 16]  # 4 tokens after 8, 5 after 7, 10 after 3: padded to the first bucket
    assert riding == [None, 4, 5, None, 10]
