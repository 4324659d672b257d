"""kv_compact: the reference against a flat per-position model; the CUDA kernel against the reference."""
import pytest
import torch

from kdray.kernels.kv_compact import kv_compact


def _case(layers, B, S, R, A, pages_per_seq, dtype, device, seed):
    """Random paged cache, shuffled page tables, prefixes and accepted paths (strictly increasing)."""
    gen = torch.Generator().manual_seed(seed)
    P = B * pages_per_seq
    cache = torch.randn(layers, P, S, R, generator=gen).to(dtype)
    table = torch.randperm(P, generator=gen).view(B, pages_per_seq).to(torch.int32)
    prefix = torch.randint(0, pages_per_seq * S - A, (B,), generator=gen).to(torch.int32)
    accept_len = torch.randint(1, A + 1, (B,), generator=gen).to(torch.int32)
    accepted = torch.full((B, A), -1, dtype=torch.int32)
    room = pages_per_seq * S - prefix  # tree slots available after the prefix
    for b in range(B):
        n = int(accept_len[b])
        accepted[b, 0] = 0
        if n > 1:
            picks = torch.randperm(min(int(room[b]) - 1, 4 * A), generator=gen)[:n - 1].sort().values + 1
            accepted[b, 1:n] = picks.to(torch.int32)
    return [t.to(device) for t in (cache, table, prefix, accepted, accept_len)]


def _flat_model(cache, table, prefix, accepted, accept_len):
    """Expected cache: per sequence, positions as one flat array, moved with a gather."""
    out = cache.clone()
    S = cache.shape[2]
    for b in range(table.shape[0]):
        pos = torch.arange(table.shape[1] * S)
        flat = cache[:, table[b].long()[pos // S], pos % S]  # [layers, positions, R]
        new = flat.clone()
        p, n = int(prefix[b]), int(accept_len[b])
        for j in range(1, n):
            new[:, p + j] = flat[:, p + int(accepted[b, j])]
        out[:, table[b].long()[pos // S], pos % S] = new
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_flat_model(dtype):
    cache, table, prefix, accepted, accept_len = _case(3, 5, 8, 12, 7, 6, dtype, "cpu", seed=0)
    want = _flat_model(cache, table, prefix, accepted, accept_len)
    kv_compact(cache, table, prefix, accepted, accept_len)
    assert torch.equal(cache, want)


def test_destination_that_is_another_source():
    cache = torch.arange(10.0).view(1, 1, 10, 1)  # one page of 10 rows
    table = torch.zeros(1, 1, dtype=torch.int32)
    accepted = torch.tensor([[0, 2, 3, 5]], dtype=torch.int32)
    kv_compact(cache, table, torch.tensor([1], dtype=torch.int32), accepted, torch.tensor([4], dtype=torch.int32))
    assert cache.flatten().tolist() == [0, 1, 3, 4, 6, 5, 6, 7, 8, 9]


def test_accept_len_one_moves_nothing():
    cache, table, prefix, accepted, _ = _case(2, 3, 4, 6, 5, 4, torch.float32, "cpu", seed=1)
    before = cache.clone()
    kv_compact(cache, table, prefix, accepted, torch.ones(3, dtype=torch.int32))
    assert torch.equal(cache, before)


def test_bad_inputs_raise():
    cache, table, prefix, accepted, accept_len = _case(2, 3, 4, 6, 5, 4, torch.float32, "cpu", seed=2)
    with pytest.raises(ValueError, match="accepted"):
        kv_compact(cache, table, prefix, accepted.long(), accept_len)
    with pytest.raises(ValueError, match="cache"):
        kv_compact(cache[0], table, prefix, accepted, accept_len)


@pytest.mark.gpu
@pytest.mark.parametrize("layers,B,S,R,A,pages,dtype", [
    (61, 32, 64, 576, 16, 6, torch.bfloat16),  # K2 latent rows
    (3, 5, 16, 7, 9, 4, torch.float32),  # 28-byte rows: 4-byte copies
    (2, 4, 8, 3, 5, 3, torch.uint8),  # 3-byte rows: 1-byte copies
    (4, 6, 32, 2 * 8 * 128, 33, 5, torch.float16),  # a GQA cache viewed as [layers, P, S, 2*Hkv*D]
    (1, 1, 4, 8, 2, 2, torch.bfloat16),
])
def test_cuda_matches_reference(layers, B, S, R, A, pages, dtype):
    cache, table, prefix, accepted, accept_len = _case(layers, B, S, R, A, pages, torch.float32, "cpu", seed=R + A)
    cache = (cache * 50).to(dtype)
    want = cache.clone()
    kv_compact(want, table, prefix, accepted, accept_len)
    got = cache.cuda()
    kv_compact(got, table.cuda(), prefix.cuda(), accepted.cuda(), accept_len.cuda())
    assert torch.equal(got.cpu(), want)
