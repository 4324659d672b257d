"""tree_verify_attention: the torch reference against SDPA on CPU; the CUDA kernels against the reference."""
import math
import zlib

import pytest
import torch
import torch.nn.functional as F

import kdray.kernels.tree_verify_attention as tva
from gpu_checks import poison_allocator
from kdray.kernels.mla_rope_cache import mla_rope_cache
from kdray.kernels.cuda_module import sm90_or_later
from kdray.kernels.skinny_linear import skinny_bmm
from kdray.kernels.tree_verify_attention import (CLUSTER_SIZES, DECODE_SPLIT_TILES, _cluster_splits, _grid_splits,
                                                 _mma_smem_bytes, _num_splits, _tree_attention_cuda, combine_cols,
                                                 SplitPartials, gqa_tree_attention, merge_split_partials,
                                                 mla_tree_attention, split_k_outputs, tree_attention_reference)

MLA_DK, MLA_DV = 576, 512


def _pack_mask(visible: torch.Tensor, words: int) -> torch.Tensor:
    """``[n, n]`` bool (row i sees tree token j) -> ``[n, words]`` int32 bit words."""
    n = visible.shape[0]
    bits = torch.zeros(n, words * 32, dtype=torch.int64)
    bits[:, :n] = visible.long()
    packed = (bits.view(n, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def _random_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, n]`` bool ancestor-or-self matrix of a random tree whose node i has a parent < i."""
    vis = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        vis[i] |= vis[int(torch.randint(0, i, (1,), generator=gen))]
    return vis


def make_case(q_lens, prefixes, *, heads, page_size, kv_heads=None, head_dim=MLA_DK, dtype=torch.float32,
              device="cpu", seed=0, chain=False):
    """A random paged batch. ``kv_heads=None``: MLA layout ``[P, S, Dk]``; else GQA ``[P, S, 2, Hkv, D]``.

    Cache rows that no sequence owns (tails of last pages, spare pages) hold NaN, so reading one shows.
    """
    gen = torch.Generator().manual_seed(seed)
    B, q_max = len(q_lens), max(max(q_lens), 1)
    words = -(-q_max // 32)
    n_pages = [-(-(p + q) // page_size) for p, q in zip(prefixes, q_lens)]
    max_pages = max(n_pages) + 1
    total_pages = sum(n_pages) + 2
    perm = torch.randperm(total_pages, generator=gen).to(torch.int32)
    block_table = perm[torch.randint(0, total_pages, (B, max_pages), generator=gen)]  # unused entries: junk
    row_shape = (head_dim,) if kv_heads is None else (2, kv_heads, head_dim)
    cache = torch.full((total_pages, page_size) + row_shape, float("nan"))
    tree_mask = torch.zeros(B, q_max, words, dtype=torch.int32)
    start = 0
    for b, (p, q) in enumerate(zip(prefixes, q_lens)):
        block_table[b, :n_pages[b]] = perm[start:start + n_pages[b]]
        start += n_pages[b]
        pos = torch.arange(p + q)
        cache[block_table[b, pos // page_size].long(), pos % page_size] = torch.randn((p + q,) + row_shape,
                                                                                      generator=gen)
        if q:
            vis = torch.ones(q, q, dtype=torch.bool).tril() if chain else _random_tree(q, gen)
            tree_mask[b, :q] = _pack_mask(vis, words)
    cu_q = torch.tensor([0] + list(q_lens), dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), heads, head_dim, generator=gen)
    prefix_lens = torch.tensor(prefixes, dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return (to(q.to(dtype)), to(cache.to(dtype)), to(block_table), to(prefix_lens), to(cu_q), to(tree_mask))


def _reference(case, kv_heads, scale):
    """fp32 reference of either form on the case's device."""
    q, cache, *rest = case
    split = ((lambda r: (r.unsqueeze(1), r[:, None, :MLA_DV])) if kv_heads is None  # noqa: E731
             else (lambda r: (r[:, 0], r[:, 1])))
    return tree_attention_reference(q.float(), cache.float(), *rest, scale, split)


def _rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _where_wrong(out, ref):
    """Failure note: error per column half and the share of rows that are off."""
    d = (out.double() - ref.double()).flatten(0, 1)
    r = ref.double().flatten(0, 1)
    h = d.shape[1] // 2
    halves = [(d[:, s].norm() / r[:, s].norm()).item() for s in (slice(0, h), slice(h, None))]
    bad = (d.norm(dim=1) > 0.05 * r.norm(dim=1)) | d.isnan().any(1)
    return f"rel err per half {halves}, bad rows {int(bad.sum())}/{bad.numel()} first {bad.nonzero()[:5].flatten().tolist()}"


# --- CPU: the reference ------------------------------------------------------------------------------------

def test_reference_causal_matches_sdpa():
    scale = 0.13
    q, cache, bt, pl, cu, mask = make_case([23], [0], heads=4, page_size=4, seed=1, chain=True)
    out = mla_tree_attention(q, cache, bt, pl, cu, mask, scale, MLA_DV)
    pos = torch.arange(23)
    rows = cache[bt[0, pos // 4].long(), pos % 4]  # [23, 576]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), rows.expand(4, -1, -1), rows[:, :MLA_DV].expand(4, -1, -1),
                                         is_causal=True, scale=scale).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_reference_tree_matches_dense_mask_sdpa():
    scale = 0.1
    q, cache, bt, pl, cu, mask = make_case([3, 37], [5, 40], heads=2, page_size=16, seed=2)
    out = mla_tree_attention(q, cache, bt, pl, cu, mask, scale, MLA_DV)
    b, n, prefix = 1, 37, 40
    pos = torch.arange(prefix + n)
    rows = cache[bt[b, pos // 16].long(), pos % 16]
    bits = (mask[b, :n, torch.arange(n) // 32] >> (torch.arange(n) % 32)) & 1
    dense = torch.cat([torch.ones(n, prefix, dtype=torch.bool), bits.bool()], dim=1)
    ref = F.scaled_dot_product_attention(q[3:].transpose(0, 1), rows.expand(2, -1, -1),
                                         rows[:, :MLA_DV].expand(2, -1, -1), attn_mask=dense,
                                         scale=scale).transpose(0, 1)
    torch.testing.assert_close(out[3:], ref, rtol=1e-5, atol=1e-5)


def test_reference_gqa_groups_query_heads():
    scale = 0.125
    q, cache, bt, pl, cu, mask = make_case([6], [9], heads=6, kv_heads=2, head_dim=16, page_size=4, seed=3)
    out = gqa_tree_attention(q, cache, bt, pl, cu, mask, scale)
    pos = torch.arange(15)
    rows = cache[bt[0, pos // 4].long(), pos % 4]  # [15, 2, Hkv, D]
    k, v = (rows[:, i].transpose(0, 1).repeat_interleave(3, dim=0) for i in (0, 1))  # [Hq, 15, D]
    bits = (mask[0, :6, torch.arange(6) // 32] >> (torch.arange(6) % 32)) & 1
    dense = torch.cat([torch.ones(6, 9, dtype=torch.bool), bits.bool()], dim=1)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=dense, scale=scale).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_bad_mask_dtype_is_rejected():
    q, cache, bt, pl, cu, mask = make_case([4], [3], heads=2, page_size=4)
    with pytest.raises(ValueError, match="tree_mask"):
        mla_tree_attention(q, cache, bt, pl, cu, mask.long(), 0.1, MLA_DV)


def test_launch_geometry():
    assert _mma_smem_bytes(MLA_DK, MLA_DV, True, 2) <= 227 * 1024  # the H100/H200 per-block limit
    assert _num_splits(8, 65, 132) == 16  # B = 1, 8 heads x 64 nodes: 8 tiles x 16 splits
    assert _num_splits(256, 65, 132) == 1  # two waves, the second 94% full
    assert _num_splits(288, 65, 132) == 2  # 32 sequences x 65 queries: 3 waves (the last 18% full) -> 5 (87%)
    assert _num_splits(140, 65, 132) == 4  # 2 waves (the last 6% full) -> 5 (85%)
    assert _num_splits(140, 2, 132) == 2  # at most one split per key tile
    assert _num_splits(133, 65, 132) == 4  # none reaches 85%: the fullest last wave (4 splits, 81%)
    assert _num_splits(8, 3, 132) == 3  # never more splits than key tiles
    assert DECODE_SPLIT_TILES == 2  # the cases below
    assert _grid_splits(1, 1, 1, 8, 1, 65, 132, 2) == 33  # one K2 query after 4096 keys: splits of two key tiles
    assert _grid_splits(1, 1, 1, 8, 1, 65, 132) == 65  # one key tile a split where no more is asked (GQA)
    assert _grid_splits(8, 8, 1, 8, 1, 65, 132, 2) == 16  # 8 sequences: 8 tiles x 16 splits of 5 key tiles
    assert _grid_splits(1, 1, 1, 8, 1, 512, 132, 2) == 132  # after 32k keys: 4 key tiles a split already
    assert _grid_splits(17, 1, 17, 8, 1, 65, 132, 2) == 44  # a 17-node tree is not one query: 3 tiles x 44
    assert _grid_splits(1, 1, 1, 8, 1, 0, 132, 2) == 1  # an empty block table still gets its one split
    assert _cluster_splits(33, 1, 65, 132, 8) == 40  # 32 would take 3 key tiles a split
    assert _cluster_splits(33, 1, 65, 132, 4) == 36
    assert _cluster_splits(44, 3, 65, 132, 8) == 40  # still 2 key tiles a split
    assert _cluster_splits(16, 8, 65, 132, 8) == 16
    assert _cluster_splits(33, 4, 65, 132, 8) is None  # 4 x 40 splits would take a second wave
    assert _cluster_splits(33, 4, 65, 132, 4) is None  # 4 x 36, the same
    assert _cluster_splits(132, 1, 512, 132, 8) == 128
    assert _cluster_splits(132, 1, 512, 132, 4) == 132
    assert combine_cols(8, 512, 132) == 32  # one K2 query: 8 rows x 16 warps
    assert combine_cols(136, 512, 132) == 64  # 17 queries: 1088 warps, ~8 per SM
    assert combine_cols(16640, 512, 132) == 256
    assert combine_cols(3, 64, 132) == 32


def test_split_k_partials_follow_the_output_in_the_layout_the_combine_reads():
    out, ws_o, ws_ml = split_k_outputs(5, 8, 128, torch.bfloat16, 3, torch.device("cpu"))
    assert out.shape == (5, 8, 128) and out.dtype == torch.bfloat16
    assert ws_o.data_ptr() == out.data_ptr() + out.nbytes and ws_o.numel() == 3 * 40 * 128 * 2  # bf16 partials
    assert ws_ml.data_ptr() == ws_o.data_ptr() + ws_o.numel() and ws_ml.numel() == 3 * 40 * 8  # (max, sum) pairs
    given = torch.empty(5, 8, 64)
    out, ws_o, ws_ml = split_k_outputs(5, 8, 64, torch.float32, 1, torch.device("cpu"), given)
    assert out is given and ws_o == 0 and ws_ml == 0  # one split: the given output, no partials


def test_a_ragged_batch_gets_the_splits_of_its_longest_sequence():
    """Llama-3.1-8B on the H200 (GQA 32/8 heads, 2 CTAs per SM): 8 decoding sequences with a 128-token prompt chunk
    riding after them, counted as 17 equal tiles x 8 heads, got one split; the chunk alone has 8 tiles x 8 heads, so
    4. A batch of equal sequences keeps its count."""
    assert _grid_splits(136, 9, None, 4, 8, 257, 264) == 1
    assert _grid_splits(136, 9, 128, 4, 8, 257, 264) == 4
    assert _grid_splits(136, 9, 128, 4, 8, 2, 264) == 2  # still one split per key tile at most
    for T, B, longest in [(8 * 65, 8, 65), (32, 32, 1), (256, 1, 256)]:
        assert _grid_splits(T, B, longest, 8, 1, 65, 132) == _grid_splits(T, B, None, 8, 1, 65, 132)


# --- GPU: the kernels against the reference ------------------------------------------------------------------

MLA_CASES = {  # name: (q_lens, prefixes, heads, page_size)
    "one-token": ([1], [0], 8, 16),  # one split
    "ragged": ([5, 64, 17, 0], [100, 0, 333, 7], 8, 16),
    "heads64": ([33, 2], [70, 200], 64, 64),
    "tree256": ([256, 3], [1000, 64], 8, 64),
    "tree1024": ([1024], [77], 8, 16),  # one split: 128 tiles fill the GPU
    "split-k": ([16, 1], [5000, 0], 8, 64),
    "decode": ([1], [4096], 8, 64),  # K2's TP8 shard at one query: 33 splits of two key tiles (the last of one)
    "decode-32k": ([1], [32767], 8, 16),  # 128 splits of 4
    "decode-ragged": ([1] * 16, [4095, 1, 63, 64, 65, 1000, 2047, 0, 129, 3333, 17, 511, 4097, 7, 255, 100], 8, 16),
    "decode-heads64": ([1, 1], [4095, 200], 64, 64),  # full 64-row tiles at one query
    "tree9": ([9], [2001], 8, 16),  # a 64-row tile and an 8-row tile: different splits per tile
    "waves": ([65] * 18, [300 + 37 * i for i in range(18)], 8, 64),  # 162 tiles: past one wave (H200: 3 splits)
    "riding": ([1] * 8 + [64], [300 + 50 * i for i in range(8)] + [8000], 8, 64),  # a prompt chunk after 8 trees
}


def _run(fn, case, out_shape, dtype):
    out = torch.full(out_shape, float("nan"), dtype=dtype, device="cuda")
    res = fn(*case, out=out)
    assert res.data_ptr() == out.data_ptr()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["bf16", "bf16-mma.sync", "fp32"])
@pytest.mark.parametrize("name", list(MLA_CASES))
def test_mla_matches_reference(name, variant):
    q_lens, prefixes, heads, page = MLA_CASES[name]
    if variant == "bf16-mma.sync" and name in ("tree1024", "one-token"):
        pytest.skip("covered by the default path")
    dtype = torch.float32 if variant == "fp32" else torch.bfloat16
    scale = 0.13
    case = make_case(q_lens, prefixes, heads=heads, page_size=page, dtype=dtype, device="cuda",
                     seed=zlib.crc32(name.encode()))
    T = case[0].shape[0]

    def fn(q, cache, bt, pl, cu, mask, out):
        if variant == "bf16-mma.sync":
            return _tree_attention_cuda(q, cache, bt, pl, cu, mask, scale, kv_heads=1, dv=MLA_DV,
                                        row_stride=MLA_DK, v_off=0, out=out, mma_sync=True)
        return mla_tree_attention(q, cache, bt, pl, cu, mask, scale, MLA_DV, out=out, longest=max(q_lens))

    out = _run(fn, case, (T, heads, MLA_DV), dtype)
    ref = _reference(case, None, scale)
    assert _rel_err(out, ref) < (1e-4 if dtype == torch.float32 else 2e-2), _where_wrong(out, ref)


@pytest.mark.gpu
def test_mla_default_output_holds_split_partials():
    """Without ``out=`` the split-K partials share the output's allocation; the result must not change."""
    scale = 0.13
    case = make_case([16, 5], [3000, 900], heads=8, page_size=64, dtype=torch.bfloat16, device="cuda", seed=7)
    out = mla_tree_attention(*case, scale, MLA_DV)
    assert out.shape == (21, 8, MLA_DV) and out.is_contiguous()
    assert _rel_err(out, _reference(case, None, scale)) < 2e-2


GQA_CASES = {  # name: (q_lens, prefixes, Hq, Hkv, D, page_size)
    "smollm-ragged": ([1, 64, 9], [0, 129, 1000], 9, 3, 64, 16),
    "llama-tree1024": ([1024, 3], [50, 4000], 32, 8, 128, 64),
    "mha-split": ([7], [3000], 4, 4, 128, 16),
    "smollm-decode": ([1], [4095], 9, 3, 64, 64),
    "llama-decode": ([1, 1, 1], [4097, 63, 1000], 32, 8, 128, 16),
    "llama-riding": ([1] * 8 + [128], [200] * 8 + [16000], 32, 8, 128, 16),  # a prompt chunk after 8 decoding
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(GQA_CASES))
def test_gqa_matches_reference(name, dtype):
    q_lens, prefixes, hq, hkv, d, page = GQA_CASES[name]
    scale = d ** -0.5
    case = make_case(q_lens, prefixes, heads=hq, kv_heads=hkv, head_dim=d, page_size=page, dtype=dtype,
                     device="cuda", seed=zlib.crc32(name.encode()))
    out = _run(lambda *a, out: gqa_tree_attention(*a, scale, out=out, longest=max(q_lens)), case,
               (case[0].shape[0], hq, d), dtype)
    ref = _reference(case, hkv, scale)
    assert _rel_err(out, ref) < (1e-4 if dtype == torch.float32 else 2e-2), _where_wrong(out, ref)


@pytest.mark.gpu
def test_mla_cuda_graph_replay_equals_eager():
    scale = 0.13
    case = make_case([16, 40], [4000, 300], heads=8, page_size=64, dtype=torch.bfloat16, device="cuda", seed=11)
    eager = mla_tree_attention(*case, scale, MLA_DV)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mla_tree_attention(*case, scale, MLA_DV)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            static_out = mla_tree_attention(*case, scale, MLA_DV)
    torch.cuda.current_stream().wait_stream(stream)
    static_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens,prefixes", [([1], [4096]), ([1, 3, 17], [4095, 64, 2000])], ids=["decode", "ragged"])
def test_early_prefix_reads_the_tree_rows_after_the_kernel_ahead(q_lens, prefixes):
    """``early_prefix`` copies prefix rows while the kernel ahead runs, the tree's rows only after it: in a captured
    pass ``mla_rope_cache`` writes the tree's rows (NaN before it) and the attention must see what it wrote."""
    scale, page = 0.13, 64
    case = make_case(q_lens, prefixes, heads=8, page_size=page, dtype=torch.bfloat16, device="cuda", seed=5)
    q, cache, bt = case[:3]
    pos = [torch.arange(p, p + n, device="cuda") for p, n in zip(prefixes, q_lens)]  # the trees' cache positions
    slots = torch.cat([bt[b, x // page].long() * page + x % page for b, x in enumerate(pos)])
    rows = cache.view(-1, MLA_DK)
    rows[slots] = float("nan")
    T = q.shape[0]
    gen = torch.Generator(device="cuda").manual_seed(3)
    kv_a = torch.randn(T, MLA_DK, device="cuda", generator=gen).bfloat16()
    angles = torch.rand(T, (MLA_DK - MLA_DV) // 2, device="cuda", generator=gen)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    weight = torch.ones(MLA_DV, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.zeros(T, 8, MLA_DK - MLA_DV, device="cuda", dtype=torch.bfloat16)
    out = torch.full((T, 8, MLA_DV), float("nan"), dtype=torch.bfloat16, device="cuda")

    def step():
        mla_rope_cache(kv_a, weight, 1e-6, cos, sin, q_rope, q_rope, rows, slots)
        mla_tree_attention(*case, scale, MLA_DV, out=out, early_prefix=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # loads the kernels outside the capture
        torch.cuda.synchronize()
        rows[slots] = float("nan")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert not rows[slots].isnan().any()
    ref = _reference(case, None, scale)
    assert _rel_err(out, ref) < 2e-2, _where_wrong(out, ref)


REPEAT_CASES = {  # name: (q_lens, prefixes, Hq, Hkv or None (MLA), D, page_size)
    "mla-decode": ([1], [4096], 8, None, MLA_DK, 64),
    "mla-decode-ragged": ([1, 1, 1, 1], [4095, 1, 333, 2048], 8, None, MLA_DK, 16),
    "mla-split-k": ([16, 1], [5000, 0], 8, None, MLA_DK, 64),
    "llama-decode": ([1, 1, 1], [4097, 63, 1000], 32, 8, 128, 16),
}


def _graph_replays(fn, case, shape, n: int):
    """The bf16 output ``shape`` after each of ``n`` replays of ``fn`` captured in a CUDA graph, each poisoned first."""
    out = torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*case, out=out)
    for _ in range(n):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        yield out


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(REPEAT_CASES))
def test_repeated_calls_and_graph_replays_agree(name):
    """Three eager calls and two replays of a captured one write the same bits into a poisoned output."""
    q_lens, prefixes, hq, hkv, d, page = REPEAT_CASES[name]
    scale = 0.13
    case = make_case(q_lens, prefixes, heads=hq, kv_heads=hkv, head_dim=d, page_size=page, dtype=torch.bfloat16,
                     device="cuda", seed=zlib.crc32(name.encode()))
    fn = ((lambda *a, out: mla_tree_attention(*a, scale, MLA_DV, out=out)) if hkv is None  # noqa: E731
          else (lambda *a, out: gqa_tree_attention(*a, scale, out=out)))
    shape = (case[0].shape[0], hq, MLA_DV if hkv is None else d)
    first = _run(fn, case, shape, torch.bfloat16)
    ref = _reference(case, hkv, scale)
    assert _rel_err(first, ref) < 2e-2, _where_wrong(first, ref)
    for _ in range(2):
        assert torch.equal(_run(fn, case, shape, torch.bfloat16), first)
    for out in _graph_replays(fn, case, shape, 2):
        assert torch.equal(out, first)


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens,prefixes,sizes,merged", [
    ([1], [4096], (8, 4, 2), (8, 5)),  # one K2 query: 33 -> 40 splits of 2 key tiles, the last cluster's 8th idle
    ([1, 1], [4096, 3000], (8, 4, 2), (8, 10)),
    ([1, 1, 1], [959, 129, 1], (8, 4, 2), (8, 3)),  # one cluster a tile (16 key tiles, 8 splits): 8 used, 6 and 7 idle
    ([1, 1, 1], [1000, 129, 1], (8, 4, 2), (8, 6)),  # 17 key tiles: 9 splits of 2 rounded up to 16, two clusters a tile
    ([1], [4096], (4,), (4, 9)),  # 33 -> 36 splits, clusters of 4
    ([1, 1], [4096, 1000], (4,), (4, 18)),
    ([1, 1, 1], [959, 129, 1], (4,), (4, 6)),  # 8 splits, two clusters a tile: the 2nd tile's 2nd cluster idle
    ([1], [2048], (2,), (2, 9)),  # 17 -> 18 splits, clusters of 2
    ([1, 1, 1], [1000, 129, 1], (2,), (2, 15)),  # 9 -> 10 splits: five clusters a tile, some idle
    ([16, 1], [5000, 0], (8, 4, 2), None),  # a tree: 4 tiles x 66 splits, 32 clusters of 8 where resident
    ([1], [32767], (8, 4, 2), None),  # no clusters of 8 (128 splits take 5 key tiles), of 4 or 2 partials too many
    ([1] * 8, [4096, 4000, 3000, 2048, 1024, 64, 1, 0], (8, 4, 2), None),  # 8 tiles x 16 splits: 16 of 8, 32 of 4
    # or 64 of 2, the largest resident (on an H100, of 2)
], ids=["decode", "two-sequences", "one-cluster-idle-splits", "two-clusters-idle-splits", "decode-by-4",
        "two-sequences-by-4", "idle-cluster-by-4", "decode-by-2", "idle-clusters-by-2", "tree", "decode-32k",
        "eight-sequences"])
def test_splits_merged_in_the_kernel(q_lens, prefixes, sizes, merged, monkeypatch):
    """On sm_90 the MLA kernel's key splits merge inside it (a cluster's splits through distributed shared memory,
    several clusters' by the last ticket), with no tva_combine launch, in clusters of the largest of ``sizes`` whose
    clusters are all resident: every launch, eager or replayed, matches the reference and leaves the tickets zero
    for the next. ``merged``: (blocks a cluster, clusters) where few enough to be resident on any sm_90 part."""
    dev = torch.cuda.current_device()
    if not sm90_or_later(dev):
        pytest.skip("thread-block clusters need sm_90")
    monkeypatch.setattr(tva, "CLUSTER_SIZES", sizes)
    launched = []
    real_launch = tva.launch
    monkeypatch.setattr(tva, "launch", lambda name, kernel, grid, *a, **k: (launched.append(
        (kernel, grid, dict(k.get("defines", ())).get("TVA_CLUSTER"))), real_launch(name, kernel, grid, *a, **k))[1])
    scale = 0.13
    case = make_case(q_lens, prefixes, heads=8, page_size=64, dtype=torch.bfloat16, device="cuda",
                     seed=sum(prefixes))
    shape = (case[0].shape[0], 8, MLA_DV)

    def fn(*a, out):
        return mla_tree_attention(*a, scale, MLA_DV, out=out, longest=max(q_lens))

    first = _run(fn, case, shape, torch.bfloat16)
    size = launched[0][2]
    assert [k for k, _, _ in launched] == ["tva_mma_mla576"] if size else ["tva_mma_mla576", "tva_combine"]
    if merged is not None:
        assert (size, launched[0][1][0] * launched[0][1][1]) == (merged[0], merged[0] * merged[1])
    ref = _reference(case, None, scale)
    assert _rel_err(first, ref) < 2e-2, _where_wrong(first, ref)
    tickets = tva._TICKETS.get(dev, torch.zeros(1))
    assert not tickets.any() and torch.equal(_run(fn, case, shape, torch.bfloat16), first) and not tickets.any()
    for out in _graph_replays(fn, case, shape, 3):
        assert torch.equal(out, first) and not tickets.any()


def test_split_merge_cluster_size_rule(monkeypatch):
    """Where a grid's MLA key splits merge inside the kernel on an H100 (15 resident clusters of 8, 30 of 4, 66 of
    2): in the largest clusters that are all resident, unless each block of a tile's last cluster would merge more
    than MERGE_BLOCK_BYTES of the other clusters' partials."""
    monkeypatch.setattr(tva, "sm90_or_later", lambda index: True)
    monkeypatch.setattr(tva, "max_active_clusters", lambda *a: {8: 15, 4: 30, 2: 66}[dict(a[3])["TVA_CLUSTER"]])
    monkeypatch.setattr(tva, "_split_tickets", lambda dev, n: "tickets")
    kernel, warpgroups, _, tiles_a_split = tva._MMA[(MLA_DK, MLA_DV, True)]

    def merge(T, B, longest, key_tiles=65):
        tiles = tva._query_tiles(T, B, 8)
        n_splits = _grid_splits(T, B, longest, 8, 1, key_tiles, 132, tiles_a_split)
        rows = min(64, longest * 8)
        got = tva._merge_in_kernel(torch.device("cpu"), kernel, warpgroups, 0, tiles, n_splits, key_tiles, 132,
                                   rows * MLA_DV * 2)
        return got and got[:2]

    assert tva.MERGE_BLOCK_BYTES == 64 * 1024 and CLUSTER_SIZES == (8, 4, 2)
    assert merge(1, 1, 1) == (8, 40)  # one query after 4096 keys: 5 clusters of 8
    assert merge(17, 1, 17) == (8, 40)  # a 17-node tree: 3 tiles x 5 clusters of 8, 40 KiB a block
    assert merge(8, 8, 1) == (2, 16)  # 8 sequences: 16 clusters of 8 or 32 of 4 are too many, 64 of 2 fit
    assert merge(257, 1, 257) == (2, 4)  # 33 tiles x 4 splits: 33 clusters of 4 too many; of 2, 64 KiB a block
    assert merge(65, 1, 65) is None  # 9 tiles x 14 splits: 7 clusters of 2 a tile, 224 KiB a block
    assert merge(4, 4, 1) is None  # 4 tiles x 33 splits: 36 of 4, 34 of 2 would take a second wave
    assert merge(1, 1, 1, key_tiles=513) is None  # 132 splits: 33 clusters of 4 too many, 66 of 2 264 KiB a block


COMBINE_CASES = [("mla", vw) for vw in (32, 64, 128, 256)] + [("llama", vw) for vw in (32, 64, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("form,vw", COMBINE_CASES)
def test_every_combine_width_matches_reference(form, vw, monkeypatch):
    """tva_combine at each width of value columns per warp (the host picks one by the row count), on ragged
    sequences of split and unsplit keys."""
    monkeypatch.setattr(tva, "combine_cols", lambda rows, dv, sms: vw)
    monkeypatch.setattr(tva, "_CLUSTER_KERNELS", set())  # MLA's splits too through tva_combine
    hkv, d, hq = (None, MLA_DK, 8) if form == "mla" else (8, 128, 32)
    scale = 0.13
    case = make_case([16, 1, 3, 40], [5000, 2100, 0, 700], heads=hq, kv_heads=hkv, head_dim=d, page_size=64,
                     dtype=torch.bfloat16, device="cuda", seed=vw)
    fn = ((lambda *a, out: mla_tree_attention(*a, scale, MLA_DV, out=out)) if hkv is None  # noqa: E731
          else (lambda *a, out: gqa_tree_attention(*a, scale, out=out)))
    out = _run(fn, case, (case[0].shape[0], hq, MLA_DV if hkv is None else d), torch.bfloat16)
    ref = _reference(case, hkv, scale)
    assert _rel_err(out, ref) < 2e-2, _where_wrong(out, ref)


@pytest.mark.gpu
def test_cuda_inputs_are_checked():
    q, cache, bt, pl, cu, mask = make_case([4], [3], heads=8, page_size=16, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(TypeError, match="block_table"):
        mla_tree_attention(q, cache, bt.long(), pl, cu, mask, 0.1, MLA_DV)
    with pytest.raises(ValueError, match="contiguous"):
        mla_tree_attention(q.transpose(0, 1).contiguous().transpose(0, 1), cache, bt, pl, cu, mask, 0.1, MLA_DV)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        mla_tree_attention(q.half(), cache.half(), bt, pl, cu, mask, 0.1, MLA_DV)
    odd = torch.empty(q.shape[0] * 8 * MLA_DV + 1, dtype=torch.bfloat16, device="cuda")[1:].view(-1, 8, MLA_DV)
    with pytest.raises(ValueError, match="16-byte aligned"):
        mla_tree_attention(q, cache, bt, pl, cu, mask, 0.1, MLA_DV, out=odd)
    q48, cache48, *rest48 = make_case([4], [3], heads=8, page_size=48, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="page size 48 .*power of two"):
        mla_tree_attention(q48, cache48, *rest48, 0.1, MLA_DV)
    gq, gcache, *grest = make_case([2], [3], heads=2, kv_heads=1, head_dim=1024, page_size=4, device="cuda")
    with pytest.raises(ValueError, match="value head dim 1024 .*1 to 512"):
        gqa_tree_attention(gq, gcache, *grest, 0.1)
    assert math.isfinite(float(mla_tree_attention(q, cache, bt, pl, cu, mask, 0.1, MLA_DV).float().sum()))


def test_split_partials_merge_to_the_attention_over_all_keys():
    """``merge_split_partials``: partials over disjoint key runs (each normalised by its own sum, with its max in log2
    units and its sum) merge to the softmax over all keys; an empty partial (sum 0, values never written) adds
    nothing."""
    gen = torch.Generator().manual_seed(4)
    T, H, D, K, scale = 3, 4, 16, 30, 0.3
    q, k, v = (torch.randn(T, H, D, generator=gen), torch.randn(K, D, generator=gen), torch.randn(K, D, generator=gen))
    s = torch.einsum("thd,kd->thk", q, k) * scale * math.log2(math.e)  # [T, H, K] in log2 units
    o, ml = [], []
    for run in (slice(0, 7), slice(7, 7), slice(7, 30)):  # the middle run holds no key
        part = s[..., run]
        m = part.amax(-1) if part.shape[-1] else torch.full((T, H), float("-inf"))
        p = torch.exp2(part - m[..., None])
        total = p.sum(-1)
        o.append(torch.einsum("thk,kd->thd", p, v[run]) / total[..., None] if part.shape[-1]
                 else torch.full((T, H, D), float("nan")))
        ml.append(torch.stack([m, total], -1))
    merged = merge_split_partials(SplitPartials(torch.stack(o), torch.stack(ml)))
    torch.testing.assert_close(merged, torch.einsum("thk,kd->thd", torch.softmax(s * math.log(2), -1), v))


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens,prefixes", [
    ([1], [4096]),  # K2's TP8 shard at one query: 5 clusters of 8 splits
    ([1, 1], [4096, 1000]),  # the second sequence's tile has fewer clusters: the rest marked empty
    ([1, 1], [4096, 10]),  # ... and one key tile, one split: its partial by that split
    ([2], [3000]),  # two queries of a sequence (16-row tile)
    ([1], [100]),  # one cluster: merged here
], ids=["decode", "two-lengths", "one-split", "two-queries", "one-cluster"])
def test_unmerged_partials_give_the_w_uv_product_the_merged_bits(q_lens, prefixes):
    """``unmerged=True`` leaves a launch's cluster partials to the W_UV product (``skinny_bmm``), which merges them as
    it loads them: its output has the bits it has after the attention's own merge (allocations poisoned: a partial
    left unwritten or unmarked shows)."""
    if not sm90_or_later(torch.cuda.current_device()):
        pytest.skip("thread-block clusters need sm_90")
    scale = 0.13
    case = make_case(q_lens, prefixes, heads=8, page_size=64, dtype=torch.bfloat16, device="cuda", seed=sum(prefixes))
    T = case[0].shape[0]
    gen = torch.Generator(device="cuda").manual_seed(2)
    w_uv = (torch.randn(8, 128, MLA_DV, device="cuda", generator=gen) / MLA_DV ** 0.5).bfloat16()
    merged = mla_tree_attention(*case, scale, MLA_DV, longest=max(q_lens))
    poison_allocator()
    parts = mla_tree_attention(*case, scale, MLA_DV, longest=max(q_lens), unmerged=True)
    if max(prefixes) <= 100:
        assert isinstance(parts, torch.Tensor) and torch.equal(parts, merged)
        return
    assert isinstance(parts, SplitPartials) and 2 <= parts.o.shape[0] <= tva.MAX_UNMERGED
    torch.testing.assert_close(merge_split_partials(parts), merged, rtol=2 ** -7, atol=2e-3)
    out = torch.full((T, 8, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    ref = skinny_bmm(merged, w_uv, torch.empty_like(out))
    assert torch.equal(skinny_bmm(parts, w_uv, out), ref)
