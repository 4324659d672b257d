"""The logit changes of the sampling fields, each against a plain torch reference written here: the min_tokens
ban, logit_bias, the penalties, the path counts of tree nodes, min_p, the reported log-probabilities; and the
fields' validation in SamplingParams."""
import math

import pytest
import torch

from kdray import SamplingParams
from kdray.kernels.tree_build import tree_build
from kdray.spec.logprobs import token_logprobs
from kdray.spec.sampling import RowParams, choose_tokens
from kdray.spec.transforms import Penalties, RowTransforms, add_path_tokens, apply_transforms

GEN = torch.Generator().manual_seed(5)
R, V = 6, 40


def randn(*shape):
    return torch.randn(*shape, generator=GEN)


def test_ban_bias_and_penalties_against_their_definitions():
    logits = randn(R, V) * 3
    counts = torch.randint(0, 3, (R, V), generator=GEN).float() * (torch.rand(R, V, generator=GEN) < 0.2)
    prompt = torch.rand(R, V, generator=GEN) < 0.2
    presence, frequency = randn(R), randn(R)
    repetition = torch.rand(R, generator=GEN) * 2 + 0.1
    bias_ids = torch.randint(0, V, (R, 5), generator=GEN)
    bias_ids[:, 0] = bias_ids[:, 1]  # a repeated id adds twice, as a padding id adds 0
    bias_values = randn(R, 5) * 10
    ban_ids = torch.tensor([[3, 7, -1]] * R)
    banned = torch.tensor([True, False] * (R // 2))
    t = RowTransforms(bias_ids, bias_values, ban_ids, banned,
                      Penalties(counts, prompt, presence, frequency, repetition))
    got = apply_transforms(logits, t)
    ref = logits.double().clone()
    for r in range(R):
        if banned[r]:
            ref[r, [3, 7]] = -math.inf
        for i, b in zip(bias_ids[r].tolist(), bias_values[r].tolist()):
            ref[r, i] += b
        for v in range(V):
            x = ref[r, v].item()
            if prompt[r, v] or counts[r, v] > 0:
                x = x / repetition[r].item() if x > 0 else x * repetition[r].item()
            ref[r, v] = x - counts[r, v].item() * frequency[r].item() - (counts[r, v] > 0) * presence[r].item()
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    fin = ~torch.isinf(ref)
    assert torch.allclose(got[fin].double(), ref[fin], atol=1e-4)
    assert torch.equal(logits, logits.clone())  # the input is left as it was


def test_neutral_settings_leave_logits_bit_for_bit():
    """Rows that use no field, in a batch where others do, get exactly their logits back."""
    logits = randn(R, V)
    t = RowTransforms(torch.zeros(R, 3, dtype=torch.int64), torch.zeros(R, 3), torch.full((R, 2), -1),
                      torch.ones(R, dtype=torch.bool),
                      Penalties(torch.randint(0, 4, (R, V), generator=GEN).float(), torch.ones(R, V, dtype=torch.bool),
                                torch.zeros(R), torch.zeros(R), torch.ones(R)))
    assert torch.equal(apply_transforms(logits, t), logits)


def test_path_tokens_are_each_nodes_ancestors_and_itself_but_the_root():
    B, L, N = 3, 5, 12
    tree = tree_build(randn(B, L, V), torch.tensor([1, 2, 3]), torch.full((B,), N, dtype=torch.int32), N)
    base = torch.randint(0, 2, (B * (N + 1), V), generator=GEN).float()
    got = add_path_tokens(base.clone(), tree.tokens, tree.parents, L)
    anc = tree.ancestors()  # [B, 1+N, 1+N]: the root and itself included
    ref = base.clone().view(B, N + 1, V)
    for b in range(B):
        for i in range(N + 1):
            for j in range(1, N + 1):
                if anc[b, i, j]:
                    ref[b, i, tree.tokens[b, j]] += 1
    assert torch.equal(got, ref.view(-1, V))


def test_min_p_keeps_exactly_the_tokens_at_least_min_p_times_the_likeliest():
    logits = randn(2, V) * 2
    temperature, min_p = 0.7, 0.2
    probs = (logits / temperature).softmax(-1)
    allowed = probs >= min_p * probs.max(-1, keepdim=True).values  # [2, V]
    n = 400  # draws per row, one seed each
    rows = logits.repeat_interleave(n, 0)  # [2n, V]
    p = RowParams(torch.full((2 * n,), temperature), torch.zeros(2 * n, dtype=torch.int64), torch.ones(2 * n),
                  torch.arange(2 * n), False, torch.full((2 * n,), min_p))
    chosen = choose_tokens(rows, torch.full((2 * n,), 4), p).view(2, n)
    seen = torch.zeros(2, V, dtype=torch.bool).scatter_(1, chosen, True)
    assert torch.equal(seen, allowed)  # all of them drawn, nothing else


def test_logprobs_are_the_raw_log_softmax_with_rank_and_top():
    logits = randn(2, 3, V)
    tokens = torch.randint(0, V, (2, 3), generator=GEN)
    values, ids = token_logprobs(logits, tokens, 20)
    ref = torch.log_softmax(logits.double(), -1)
    assert values.shape == ids.shape == (2, 3, 21)
    assert torch.allclose(values[..., 0].double(), ref.gather(-1, tokens[..., None])[..., 0], atol=1e-6)
    assert torch.equal(ids[..., 0], (ref > ref.gather(-1, tokens[..., None])).sum(-1) + 1)
    top = ref.topk(20, dim=-1)
    assert torch.equal(ids[..., 1:], top.indices) and torch.allclose(values[..., 1:].double(), top.values, atol=1e-6)


@pytest.mark.parametrize("fields,message", [
    (dict(presence_penalty=2.5), "presence_penalty=2.5 must be a number in \\[-2, 2\\]"),
    (dict(frequency_penalty=math.nan), "frequency_penalty=nan"),
    (dict(repetition_penalty=0), "repetition_penalty=0 must be a number in \\(0, 10\\]"),
    (dict(min_p=-0.1), "min_p=-0.1 must be a number in \\[0, 1\\]"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens=5 must be an integer in \\[0, max_tokens\\]"),
    (dict(logprobs=21), "logprobs=21 must be None or an integer in \\[0, 20\\]"),
    (dict(logit_bias={3: 101}), "logit_bias\\[3\\]=101"),
    (dict(logit_bias={-1: 1}), "logit_bias\\[-1\\]"),
    (dict(logit_bias={i: 1 for i in range(301)}), "at most 300 entries"),
])
def test_sampling_params_name_the_bad_field(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_features_name_what_a_request_pays_for():
    assert SamplingParams().features == frozenset()
    assert SamplingParams(min_p=0.5).features == frozenset()  # greedy: min_p never changes the argmax
    assert SamplingParams(temperature=1.0, min_p=0.5, logit_bias={1: 1}, logprobs=0, min_tokens=1,
                          repetition_penalty=1.1).features == {"min_p", "bias", "logprobs", "min_tokens", "penalties"}
