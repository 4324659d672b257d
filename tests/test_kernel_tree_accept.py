"""tree_accept: the reference on built trees, with and without stop tokens; the CUDA kernel against the
reference."""
import pytest
import torch

from kdray.kernels.tree_accept import tree_accept
from kdray.kernels.tree_build import tree_build


def _tree(B, L, V, budgets, max_nodes, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, V, generator=gen) * 2
    return tree_build(logits, torch.randint(V, (B,), generator=gen), torch.tensor(budgets, dtype=torch.int32),
                      max_nodes)


def _steer(tree, b, target, choices):
    """Set ``choices`` of sequence ``b`` so that the walk reaches node ``target`` and stops there."""
    path, j = [], target
    while j > 0:
        path.append(j)
        j = int(tree.parents[b, j])
    path = [0] + path[::-1]
    for a, c in zip(path, path[1:]):
        choices[b, a] = tree.tokens[b, c]
    kids = set(tree.tokens[b, 1:][tree.parents[b, 1:] == target].tolist())
    choices[b, target] = next(t for t in range(10**6) if t not in kids)
    return path


def test_walk_follows_the_choices():
    B, L, V, N = 6, 5, 40, 60
    budgets = [60, 0, 1, 30, 45, 60]
    tree = _tree(B, L, V, budgets, N, seed=1)
    gen = torch.Generator().manual_seed(2)
    choices = torch.randint(V, (B, N + 1), generator=gen)
    paths = [_steer(tree, b, int(torch.randint(int(tree.num_nodes[b]), (1,), generator=gen)), choices)
             for b in range(B)]
    accepted, accept_len, next_token = tree_accept(tree.tokens, tree.parents, tree.num_nodes, choices, L)
    assert accepted.shape == (B, L + 1) and accepted.dtype == torch.int32
    for b, path in enumerate(paths):
        assert accept_len[b] == len(path)
        assert accepted[b].tolist() == path + [-1] * (L + 1 - len(path))
        assert next_token[b] == choices[b, path[-1]]


def test_root_only_when_nothing_matches():
    tree = _tree(2, 3, 20, [10, 10], 10, seed=3)
    kids = [set(tree.tokens[b, 1:][tree.parents[b, 1:] == 0].tolist()) for b in range(2)]
    choices = torch.zeros(2, 11, dtype=torch.int64)
    choices[:, 0] = torch.tensor([next(t for t in range(100) if t not in k) for k in kids])
    accepted, accept_len, next_token = tree_accept(tree.tokens, tree.parents, tree.num_nodes, choices, 3)
    assert accept_len.tolist() == [1, 1] and accepted[:, 0].tolist() == [0, 0]
    assert accepted[:, 1:].eq(-1).all() and torch.equal(next_token, choices[:, 0])


def test_slots_beyond_num_nodes_are_ignored():
    tokens = torch.tensor([[5, 7, 9, 0]])
    parents = torch.tensor([[-1, 0, 1, 0]], dtype=torch.int32)
    choices = torch.tensor([[3, 9, 4, 1]])  # slot 3 (unused) would match the root's choice 3
    tokens[0, 3] = 3
    accepted, accept_len, next_token = tree_accept(tokens, parents, torch.tensor([3], dtype=torch.int32), choices, 2)
    assert accept_len.tolist() == [1] and next_token.tolist() == [3]
    choices[0, 0] = 7
    accepted, accept_len, next_token = tree_accept(tokens, parents, torch.tensor([3], dtype=torch.int32), choices, 2)
    assert accepted.tolist() == [[0, 1, 2]] and accept_len.tolist() == [3] and next_token.tolist() == [4]


def test_a_stop_token_ends_the_walk_as_the_bonus():
    """A sequence's walk stops where the target chooses its stop token, wherever on the path (the root's choice
    included): the token is the bonus and no node after it is accepted; other sequences (stop -1) walk on."""
    B, L, V, N = 4, 6, 30, 40
    tree = _tree(B, L, V, [N] * B, N, seed=5)
    deepest = tree.depths.argmax(1)  # [B]: a node of the longest path
    choices = torch.randint(V, (B, N + 1), generator=torch.Generator().manual_seed(6))
    paths = [_steer(tree, b, int(deepest[b]), choices) for b in range(B)]
    assert min(len(p) for p in paths) >= 4
    stop = torch.tensor([int(tree.tokens[0, paths[0][2]]), int(choices[1, 0]), int(tree.tokens[2, paths[2][-1]]), -1])
    accepted, accept_len, next_token = tree_accept(tree.tokens, tree.parents, tree.num_nodes, choices, L, stop)
    assert accept_len.tolist() == [2, 1, len(paths[2]) - 1, len(paths[3])]
    assert next_token.tolist() == stop[:3].tolist() + [int(choices[3, paths[3][-1]])]
    assert accepted[0].tolist() == paths[0][:2] + [-1] * (L - 1)
    with pytest.raises(ValueError, match="stop must be int64"):
        tree_accept(tree.tokens, tree.parents, tree.num_nodes, choices, L, stop.int())


def test_bad_inputs_raise():
    t = torch.zeros(2, 5, dtype=torch.int64)
    p = torch.zeros(2, 5, dtype=torch.int32)
    n = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="parents"):
        tree_accept(t, p.long(), n, t, 3)
    with pytest.raises(ValueError, match="choices"):
        tree_accept(t, p, n, t[:, :4], 3)


@pytest.mark.gpu
@pytest.mark.parametrize("B,L,V,N,max_depth", [(32, 15, 1000, 256, 15), (1, 15, 5000, 1024, 15), (7, 3, 20, 10, 6),
                                                (9, 6, 50, 40, 6), (3, 40, 4, 80, 40)])
def test_cuda_matches_reference(B, L, V, N, max_depth):
    from tests.test_kernel_tree_build import poison_cuda_cache

    gen = torch.Generator().manual_seed(B * 1000 + N)
    budgets = torch.randint(0, N + 1, (B,), generator=gen)
    budgets[0] = N
    tree = _tree(B, L, V, budgets.tolist(), N, seed=B + N)
    choices = torch.randint(V, (B, N + 1), generator=gen)
    for b in range(0, B, 2):  # half the sequences walk to a random node, the rest follow random choices
        _steer(tree, b, int(torch.randint(int(tree.num_nodes[b]), (1,), generator=gen)), choices)
    # every third sequence stops at the token its path's second node carries (or the root's choice), some at none
    stop = torch.where(torch.arange(B) % 3 == 0, choices.gather(1, tree.parents[:, 2:3].long().clamp(min=0))[:, 0], -1)
    for s in (None, stop):
        want = tree_accept(tree.tokens, tree.parents, tree.num_nodes, choices, max_depth, s)
        poison_cuda_cache()
        got = tree_accept(tree.tokens.cuda(), tree.parents.cuda(), tree.num_nodes.cuda(), choices.cuda(), max_depth,
                          None if s is None else s.cuda())
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g.cpu(), w)
