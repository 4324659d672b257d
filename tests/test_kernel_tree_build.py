"""tree_build: the reference against brute force and the tree invariants; the CUDA kernel against the reference."""
import itertools

import pytest
import torch

from kdray.kernels.tree_build import ancestor_mask, log_normalizer, mask_words, topk_logprobs, tree_build


def _paths(tree, b):
    """Token path (root excluded) of every node of sequence ``b``."""
    n = int(tree.num_nodes[b])
    par, tok = tree.parents[b].tolist(), tree.tokens[b].tolist()
    out = []
    for i in range(1, n):
        path, j = [], i
        while j > 0:
            path.append(tok[j])
            j = par[j]
        out.append(tuple(reversed(path)))
    return out


def _check_invariants(tree, budgets, max_nodes, depth_limit):
    B = tree.tokens.shape[0]
    assert tree.mask.shape == (B, max_nodes + 1, mask_words(max_nodes))
    assert torch.equal(tree.mask, ancestor_mask(tree.parents, tree.num_nodes, max_nodes))
    for b in range(B):
        n = int(tree.num_nodes[b])
        assert 1 <= n <= budgets[b] + 1
        par, dep = tree.parents[b].tolist(), tree.depths[b].tolist()
        assert par[0] == -1 and dep[0] == 0
        for i in range(1, n):
            assert 0 <= par[i] < i and dep[i] == dep[par[i]] + 1 <= depth_limit
        assert all(p == -1 for p in par[n:]) and all(d == 0 for d in dep[n:])
        assert tree.tokens[b, n:].eq(0).all()
        kids = {}
        for i in range(1, n):  # siblings carry distinct tokens
            assert (par[i], int(tree.tokens[b, i])) not in kids
            kids[(par[i], int(tree.tokens[b, i]))] = i
        for i in range(n):  # the mask row of node i: exactly its ancestors and itself
            anc, j = set(), i
            while j >= 0:
                anc.add(j)
                j = par[j]
            bits = {w * 32 + k for w, word in enumerate(tree.mask[b, i].tolist()) for k in range(32) if word >> k & 1}
            assert bits == (anc if i < n else {i})


def test_log_normalizer_matches_logsumexp():
    x = torch.randn(3, 5, 1000) * 4
    torch.testing.assert_close(log_normalizer(x), torch.logsumexp(x.double(), -1).float(), rtol=1e-6, atol=1e-6)


def test_topk_ties_go_to_the_smaller_id():
    logits = torch.tensor([[[1.0, 3.0, 3.0, 2.0, 3.0]]])
    logp, ids = topk_logprobs(logits, 4)
    assert ids[0, 0].tolist() == [1, 2, 4, 3]
    assert torch.equal(logp[0, 0], logits[0, 0, [1, 2, 4, 3]] - log_normalizer(logits)[0, 0])


@pytest.mark.parametrize("V,L,budget", [(3, 3, 7), (4, 3, 10), (5, 2, 12), (2, 4, 9), (6, 2, 1)])
def test_nodes_are_the_top_budget_prefixes(V, L, budget):
    gen = torch.Generator().manual_seed(V * 100 + L * 10 + budget)
    for _ in range(5):
        logits = torch.randn(1, L, V, generator=gen) * 2
        logp = torch.log_softmax(logits.double(), -1)[0]  # [L, V]
        prefixes = [p for d in range(1, L + 1) for p in itertools.product(range(V), repeat=d)]
        score = {p: sum(float(logp[i, t]) for i, t in enumerate(p)) for p in prefixes}
        ranked = sorted(prefixes, key=lambda p: -score[p])
        if budget < len(ranked) and score[ranked[budget - 1]] - score[ranked[budget]] < 1e-4:
            continue  # a near tie: fp32 may order it either way
        tree = tree_build(logits, torch.tensor([7]), torch.tensor([budget], dtype=torch.int32), budget)
        assert set(_paths(tree, 0)) == set(ranked[:budget])
        _check_invariants(tree, [budget], budget, L)


def test_pop_order_is_best_first():
    logits = torch.randn(2, 6, 50) * 3
    tree = tree_build(logits, torch.tensor([1, 2]), torch.tensor([40, 25], dtype=torch.int32), 40)
    logp = torch.log_softmax(logits.double(), -1)
    for b in range(2):
        scores = [sum(float(logp[b, d, t]) for d, t in enumerate(p)) for p in _paths(tree, b)]
        assert all(x >= y - 1e-5 for x, y in zip(scores, scores[1:]))


def test_chain_is_the_argmax_path():
    logits = torch.randn(3, 5, 40)
    budgets = torch.tensor([5, 3, 8], dtype=torch.int32)
    tree = tree_build(logits, torch.tensor([4, 5, 6]), budgets, 8, max_topk=1)
    for b, n in enumerate([5, 3, 5]):
        assert int(tree.num_nodes[b]) == n + 1
        assert tree.tokens[b, 1:n + 1].tolist() == logits[b, :n].argmax(-1).tolist()
        assert tree.parents[b, 1:n + 1].tolist() == list(range(n))
        assert tree.tokens[b, 0] == 4 + b
    _check_invariants(tree, budgets.tolist(), 8, 5)


def test_budget_zero_is_the_root_alone():
    tree = tree_build(torch.randn(2, 4, 30), torch.tensor([11, 12]), torch.zeros(2, dtype=torch.int32), 40)
    assert tree.num_nodes.tolist() == [1, 1] and tree.tokens[:, 0].tolist() == [11, 12]
    _check_invariants(tree, [0, 0], 40, 4)


def test_budget_beyond_all_prefixes():
    logits = torch.randn(1, 2, 2)  # 2 + 4 prefixes in all
    tree = tree_build(logits, torch.tensor([0]), torch.tensor([10], dtype=torch.int32), 10)
    assert int(tree.num_nodes[0]) == 7
    assert set(_paths(tree, 0)) == {p for d in (1, 2) for p in itertools.product(range(2), repeat=d)}
    _check_invariants(tree, [10], 10, 2)


def test_ragged_batch_equals_single_sequences():
    logits = torch.randn(4, 5, 64) * 2
    budgets = torch.tensor([0, 17, 33, 6], dtype=torch.int32)
    roots = torch.tensor([3, 1, 4, 1])
    tree = tree_build(logits, roots, budgets, 40, max_topk=8)
    _check_invariants(tree, budgets.tolist(), 40, 5)
    for b in range(4):
        one = tree_build(logits[b:b + 1], roots[b:b + 1], budgets[b:b + 1], 40, max_topk=8)
        for name in ("tokens", "parents", "depths", "num_nodes", "mask"):
            assert torch.equal(getattr(tree, name)[b], getattr(one, name)[0]), name


def test_bf16_logits_build_the_fp32_upcast_tree():
    logits = (torch.randn(2, 4, 300) * 3).bfloat16()  # many exact ties
    args = (torch.tensor([1, 2]), torch.tensor([50, 90], dtype=torch.int32), 90)
    a, b = tree_build(logits, *args), tree_build(logits.float(), *args)
    assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "parents", "depths", "num_nodes", "mask"))
    _check_invariants(a, [50, 90], 90, 4)


def test_bad_inputs_raise():
    logits = torch.randn(2, 3, 10)
    with pytest.raises(ValueError, match="budgets"):
        tree_build(logits, torch.tensor([1, 2]), torch.tensor([1, 2], dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="root_tokens"):
        tree_build(logits, torch.tensor([1]), torch.tensor([1, 2], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="budgets must lie"):
        tree_build(logits, torch.tensor([1, 2]), torch.tensor([1, 5], dtype=torch.int32), 4)


FIELDS = ("tokens", "parents", "depths", "num_nodes", "mask")


def poison_cuda_cache():
    """Fill freed blocks of torch's CUDA caching allocator with garbage, so unwritten outputs show."""
    junk = [torch.empty(n, dtype=torch.uint8, device="cuda").fill_(0xA5) for n in [1 << 19] * 64 + [1 << 28]]
    del junk


def _logits(B, L, V, kind, gen):
    """Random draft logits [B, L, V] (fp32, CPU): normal, integer-valued (ties), or one dominant token."""
    if kind == "ties":
        return torch.randint(-4, 5, (B, L, V), generator=gen).float()
    x = torch.randn(B, L, V, generator=gen) * 3
    if kind == "peaked":
        x[..., 0] = 60.0  # log-probability 0 in fp32: equal scores along the chain
        x[..., 1] = 45.0
    return x


GPU_CASES = [  # B, L, V, max_nodes, budgets, max_topk, dtype, kind
    (4, 3, 50, 16, [16, 1, 0, 7], None, torch.float32, "normal"),
    (3, 6, 5000, 1024, [1024, 1, 300], None, torch.bfloat16, "normal"),
    (2, 15, 163840, 256, [256, 64], None, torch.bfloat16, "normal"),
    (5, 4, 1001, 64, [64, 63, 5, 1, 0], 4, torch.bfloat16, "normal"),
    (3, 5, 777, 40, [40, 40, 3], 1, torch.float16, "normal"),
    (2, 2, 3, 50, [50, 12], None, torch.float32, "normal"),
    (6, 8, 20000, 128, [128, 100, 17, 128, 2, 77], None, torch.bfloat16, "ties"),
    (4, 10, 30000, 256, [256, 200, 31, 9], None, torch.bfloat16, "peaked"),
    (2, 7, 12288, 2048, [2048, 1500], None, torch.float32, "normal"),
    (8, 15, 40000, 256, [256, 255, 128, 1, 0, 256, 77, 190], 16, torch.bfloat16, "ties"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_cuda_matches_reference(case):
    from kdray.kernels.tree_build import _topk_cuda, _topk_size

    B, L, V, N, budgets, max_topk, dtype, kind = GPU_CASES[case]
    gen = torch.Generator().manual_seed(1000 + case)
    logits = _logits(B, L, V, kind, gen).to(dtype)
    roots = torch.randint(V, (B,), generator=gen)
    budgets = torch.tensor(budgets, dtype=torch.int32)
    ref = tree_build(logits.float(), roots, budgets, N, max_topk)

    poison_cuda_cache()
    logp, ids = _topk_cuda(logits.cuda(), budgets.cuda(), N, max_topk)  # stage 1 alone: exact per row
    ref_logp, ref_ids = topk_logprobs(logits.float(), _topk_size(N, V, max_topk))
    for b, n in enumerate(budgets.tolist()):
        k = _topk_size(n, V, max_topk)
        assert torch.equal(ids[b, :, :k].cpu().long(), ref_ids[b, :, :k]), f"top-k ids of sequence {b}"
        assert torch.equal(logp[b, :, :k].cpu(), ref_logp[b, :, :k]), f"top-k log-probs of sequence {b}"

    poison_cuda_cache()
    tree = tree_build(logits.cuda(), roots.cuda(), budgets.cuda(), N, max_topk)
    for f in FIELDS:
        got, want = getattr(tree, f).cpu(), getattr(ref, f)
        assert got.shape == want.shape and got.dtype == want.dtype, f
        bad = (got != want).reshape(B, -1).any(1).nonzero().flatten().tolist()
        assert not bad, f"{f} differs for sequences {bad}"


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager():
    from kdray.kernels.kv_compact import kv_compact
    from kdray.kernels.tree_accept import tree_accept

    B, L, V, N, layers, S, R = 4, 15, 32000, 64, 3, 16, 576
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(B, L, V, generator=gen) * 3).bfloat16().cuda()
    roots = torch.randint(V, (B,), generator=gen).cuda()
    budgets = torch.tensor([64, 30, 1, 64], dtype=torch.int32).cuda()
    pages = (200 + N + 1 + S - 1) // S
    cache0 = torch.randn(layers, B * pages, S, R, generator=gen).bfloat16().cuda()
    table = torch.randperm(B * pages, generator=gen).view(B, pages).to(torch.int32).cuda()
    prefix = torch.randint(0, 200, (B,), generator=gen).to(torch.int32).cuda()
    nxt_node = (torch.arange(N + 1) + 1).clamp(max=N).cuda()  # choices[i] = token of node i + 1
    cache = cache0.clone()

    def step():
        tree = tree_build(logits, roots, budgets, N)
        choices = tree.tokens[:, nxt_node]
        accepted, accept_len, next_token = tree_accept(tree.tokens, tree.parents, tree.num_nodes, choices, L)
        kv_compact(cache, table, prefix, accepted, accept_len)
        return [getattr(tree, f) for f in FIELDS] + [accepted, accept_len, next_token]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles and loads the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for trial in range(2):
        logits.copy_((torch.randn(B, L, V, generator=gen) * 3).bfloat16())
        cache.copy_(cache0)
        want = [t.clone() for t in step()]
        want_cache = cache.clone()
        cache.copy_(cache0)
        graph.replay()
        torch.cuda.synchronize()
        assert int(want[-2].max()) > 1, "the walk should accept some nodes"
        for got, exp in zip(outs, want):
            assert torch.equal(got, exp)
        assert torch.equal(cache, want_cache)
