"""prefill_attention: causal attention inside each prompt of a packed batch, against a float64 reference.

The reference computes only sampled query rows (every row of short prompts; the first, last and random rows of
long ones), so prompts of 64k tokens are checked without a 64k x 64k score matrix."""
import pytest
import torch

from kdray.kernels import prefill_attention as pa
from kdray.kernels.prefill_attention import mla_prefill_attention, prefill_attention

K2_DIMS = (192, 128)  # MLA's query/key and value head dims
LLAMA_DIMS = (64, 64)


def packed(lens, H, Hkv, dims, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, (D, Dv) = sum(lens), dims
    q, k, v = (torch.randn(T, h, d, generator=g).to(device, dtype) for h, d in ((H, D), (Hkv, D), (Hkv, Dv)))
    cu = torch.tensor([0] + list(lens)).cumsum(0).to(torch.int32).to(device)
    return q, k, v, cu


def sampled_rows(lens, per_prompt=48, seed=0, prefixes=None):
    """(query row, its prompt's first key row, its last visible key row) of the rows to check; with ``prefixes``, the
    prompts' keys are that many cached positions followed by their own."""
    g, rows, start, k_start = torch.Generator().manual_seed(seed), [], 0, 0
    for n, p in zip(lens, prefixes or [0] * len(lens)):
        local = range(n) if n <= per_prompt else sorted({0, n - 1, *torch.randint(0, n, (per_prompt,), generator=g)
                                                          .tolist()})
        rows += [(start + i, k_start, k_start + p + i) for i in local]
        start, k_start = start + n, k_start + p + n
    return rows


def reference_rows(q, k, v, rows, scale):
    """float64 attention of the given rows to their keys -> ``[len(rows), H, Dv]``."""
    H, Hkv = q.shape[1], k.shape[1]
    out = []
    for i, first, last in rows:
        kk = k[first:last + 1].double().repeat_interleave(H // Hkv, dim=1)  # [n, H, D]
        vv = v[first:last + 1].double().repeat_interleave(H // Hkv, dim=1)
        p = torch.einsum("hd,nhd->hn", q[i].double(), kk).mul(scale).softmax(-1)  # [H, n]
        out.append(torch.einsum("hn,nhd->hd", p, vv))
    return torch.stack(out)


def check(lens, H, Hkv, dims, dtype, device, tol):
    q, k, v, cu = packed(lens, H, Hkv, dims, dtype, device)
    scale = dims[0] ** -0.5
    out = prefill_attention(q, k, v, cu, list(lens), scale)
    assert out.shape == (sum(lens), H, dims[1]) and out.dtype == dtype
    rows = sampled_rows(lens)
    ref = reference_rows(q, k, v, rows, scale)  # on the device: float64 on a GPU is fast
    got = out[torch.tensor([r for r, _, _ in rows], device=device)].double()
    err = (got - ref).abs().max().item()
    assert err < tol, f"max error {err} for prompts {lens[:4]}..."


@pytest.mark.parametrize("lens,H,Hkv,dims", [
    ([5, 1, 17], 4, 4, K2_DIMS),
    ([9, 30], 6, 2, LLAMA_DIMS),
])
def test_reference_path_matches_float64(lens, H, Hkv, dims):
    check(lens, H, Hkv, dims, torch.float32, "cpu", 1e-5)


def chunk_case(lens, prefixes, H, dims, dtype, device, seed=1):
    """Chunks of ``lens`` new tokens after ``prefixes`` cached ones: q over the new tokens, k and v over all."""
    g = torch.Generator().manual_seed(seed)
    D, Dv = dims
    k_lens = [p + n for p, n in zip(prefixes, lens)]
    q = torch.randn(sum(lens), H, D, generator=g).to(device, dtype)
    k = torch.randn(sum(k_lens), H, D, generator=g).to(device, dtype)
    v = torch.randn(sum(k_lens), H, Dv, generator=g).to(device, dtype)
    cu_q, cu_k = (torch.tensor([0, *n]).cumsum(0).to(torch.int32).to(device) for n in (lens, k_lens))
    return q, k, v, cu_q, cu_k, k_lens


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("lens,prefixes", [([5, 3], [7, 0]), ([1], [40]), ([300, 2048], [2100, 16])])
def test_chunks_after_cached_tokens_attend_to_them(device, lens, prefixes):
    """Query t of a chunk after p cached tokens sees its prompt's keys 0 .. p + t (float64 reference)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, cu_q, cu_k, k_lens = chunk_case(lens, prefixes, 8, K2_DIMS, dtype, device)
    out = prefill_attention(q, k, v, cu_q, lens, 0.07, cu_k, k_lens)
    assert out.shape == (sum(lens), 8, K2_DIMS[1]) and out.dtype == dtype
    rows = sampled_rows(lens, per_prompt=3, prefixes=prefixes)
    err = (out[[r for r, _, _ in rows]].double() - reference_rows(q, k, v, rows, 0.07)).abs().max().item()
    assert err < (2e-2 if device == "cuda" else 1e-5), err


def test_chunk_keys_must_cover_their_queries():
    q, k, v, cu_q, cu_k, k_lens = chunk_case([4, 4], [2, 0], 4, K2_DIMS, torch.float32, "cpu")
    with pytest.raises(ValueError, match="at least its queries"):
        prefill_attention(q, k[:7], v[:7], cu_q, [4, 4], 0.1, cu_k, [3, 4])  # 3 keys for 4 queries


def test_bad_shapes_are_an_error():
    q, k, v, cu = packed([4, 4], 4, 4, K2_DIMS, torch.float32, "cpu")
    with pytest.raises(ValueError, match="prefill_attention"):
        prefill_attention(q, k[:, :3], v, cu, [4, 4], 0.1)
    with pytest.raises(ValueError, match="summing to 7"):
        prefill_attention(q, k, v, cu, [4, 3], 0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("lens,H,Hkv,dims", [
    ([1], 8, 8, K2_DIMS),  # one token
    ([300], 8, 8, K2_DIMS),  # one short prompt: cuDNN
    ([1, 2, 3, 100, 1000], 8, 8, K2_DIMS),  # ragged
    ([4096, 17, 2049], 64, 64, K2_DIMS),  # K2's whole 64 heads
    ([5000, 4096], 8, 8, K2_DIMS),  # long prompts only: cuDNN, one call each
    ([4096], 64, 64, K2_DIMS),
    ([65536], 8, 8, K2_DIMS),  # a 64k prompt on a TP8 shard
    ([2048] * 8, 8, 8, K2_DIMS),  # several prompts, all long: cuDNN
    ([2047, 2048], 8, 8, K2_DIMS),  # one of them shorter: FlashAttention
    ([777, 1, 300], 9, 3, LLAMA_DIMS),  # SmolLM2's GQA
    ([6000], 9, 3, LLAMA_DIMS),  # equal head dims: FlashAttention at any length
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_float64(lens, H, Hkv, dims, dtype):
    if dtype == torch.float32 and max(lens) > 4096:
        pytest.skip("the fp32 path is the per-prompt reference; long prompts are the flash path's")
    check(lens, H, Hkv, dims, dtype, "cuda", 2e-2 if dtype == torch.bfloat16 else 1e-4)


def mla_parts(lens, prefixes, H, dtype, device, seed=3):
    """MLA's keys as the layer has them: q ``[T, H, 192]``, kv_b's output ``[Tk, H, 256]`` (nope | values) and the
    cache rows ``[Tk, 576]`` (latent | rope), plus cu_q, cu_k, k_lens; and the whole keys ``[Tk, H, 192]``."""
    g = torch.Generator().manual_seed(seed)
    k_lens = [p + n for p, n in zip(prefixes, lens)]
    T, Tk = sum(lens), sum(k_lens)
    q = torch.randn(T, H, 192, generator=g).to(device, dtype)
    kv = torch.randn(Tk, H, 256, generator=g).to(device, dtype)
    rows = torch.randn(Tk, 576, generator=g).to(device, dtype)
    cu_q, cu_k = (torch.tensor([0, *n]).cumsum(0).to(torch.int32).to(device) for n in (lens, k_lens))
    k_nope, v, k_pe = kv[..., :128], kv[..., 128:], rows[:, 512:]  # strided views, as in the layer
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, H, -1)], dim=-1)
    return q, k_nope, k_pe, v, cu_q, cu_k, k_lens, k


def check_mla(lens, prefixes, H, dtype, device, tol, per_prompt=48, kernel=False, splits=None):
    """mla_prefill_attention (or with ``kernel``, the tensor-core kernel whatever the lengths, its key runs as
    ``splits`` says if given) against float64."""
    q, k_nope, k_pe, v, cu_q, cu_k, k_lens, k = mla_parts(lens, prefixes, H, dtype, device)
    if kernel:
        out = pa._mla_prefill_cuda(q, k_nope, k_pe, v, cu_q, cu_k, lens, k_lens, 0.07, splits)
    else:
        out = mla_prefill_attention(q, k_nope, k_pe, v, cu_q, lens, 0.07, cu_k, k_lens)
    assert out.shape == (sum(lens), H, 128) and out.dtype == dtype
    rows = sampled_rows(lens, per_prompt, prefixes=prefixes)
    got = out[torch.tensor([r for r, _, _ in rows], device=device)].double()
    err = (got - reference_rows(q, k, v, rows, 0.07)).abs().max().item()
    assert err < tol, f"max error {err} for prompts {lens[:4]}... after {prefixes[:4]}..."


def test_mla_parts_off_hopper_join_the_keys_and_match_float64():
    check_mla([5, 1, 17], [0, 0, 0], 4, torch.float32, "cpu", 1e-5)
    check_mla([6, 3], [9, 0], 4, torch.float32, "cpu", 1e-5)


def test_mla_parts_bad_shapes_are_an_error():
    q, k_nope, k_pe, v, cu_q, _, _, _ = mla_parts([4, 4], [0, 0], 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="mla_prefill_attention"):
        mla_prefill_attention(q, k_nope, k_pe[:, :32], v, cu_q, [4, 4], 0.1)
    with pytest.raises(ValueError, match="summing to 7"):
        mla_prefill_attention(q, k_nope, k_pe, v, cu_q, [4, 3], 0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("lens,prefixes,H", [
    ([1], [0], 8),  # one token
    ([64], [0], 8),  # one tile exactly
    ([65, 127, 129], [0, 0, 0], 8),  # a row past a warpgroup's 64 or a CTA's 128, ragged
    ([128, 192, 200], [0, 0, 0], 8),
    ([1, 2, 3, 100, 1000], [0] * 5, 8),  # ragged
    ([4096, 17, 2049], [0, 0, 0], 64),  # K2's whole 64 heads
    ([2048] * 8, [0] * 8, 8),
    ([16384], [0], 8),
    ([65536], [0], 8),  # a 64k prompt on a TP8 shard
    ([5, 3, 2048], [7, 0, 16384], 8),  # chunks after cached tokens
    ([1], [40], 8),
    ([300, 2048], [2100, 16], 64),
])
def test_mla_kernel_matches_float64(lens, prefixes, H):
    """The tensor-core kernel (Hopper) on ragged prompts, with the keys' parts as strided views."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("mla_prefill_mma is a Hopper (sm_90a) kernel")
    assert pa._mla_kernel_takes(*mla_parts([1], [0], 8, torch.bfloat16, "cuda")[:4])  # it takes the layer's views
    check_mla(lens, prefixes, H, torch.bfloat16, "cuda", 2e-2, kernel=True)


@pytest.mark.gpu
@pytest.mark.parametrize("lens,prefixes,splits", [
    ([1024], [0], (16, 1)),  # every key tile a CTA of its own
    ([1000, 1, 130], [0, 0, 0], (4, 4)),  # runs where only the long prompt's tiles split
    ([1000, 77], [0, 0], (2, 3)),  # more tiles than runs: the last run takes the rest (a graph replayed longer)
    ([300, 2048], [2100, 16], (7, 5)),  # chunks after cached tokens: runs start inside the cache
    ([64, 129], [0, 0], (3, 2)),  # runs a warpgroup sees no key of (past its rows' diagonal)
])
def test_mla_kernel_key_runs_match_float64(lens, prefixes, splits):
    """A query tile's keys cut into runs, each a CTA of its own, merged by mla_prefill_combine."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("mla_prefill_mma is a Hopper (sm_90a) kernel")
    check_mla(lens, prefixes, 8, torch.bfloat16, "cuda", 2e-2, per_prompt=400, kernel=True, splits=splits)


def test_key_runs_only_where_the_tiles_leave_sms_idle():
    assert pa._key_tiles([1024], [1024]) == [2, 4, 6, 8, 10, 12, 14, 16]
    assert pa._key_tiles([200], [1200]) == [18, 19]  # after 1000 cached keys
    # a CTA for every SM already, too few keys to pay, or too little gain (one prompt of 1-2k tokens)
    for lens in ([3072], [4096], [2048] * 8, [128], [512], [1024], [2048]):
        assert pa._key_splits(tuple(lens), tuple(lens), 8, 132) == (1, max(pa._key_tiles(lens, lens)))
    for lens, prefixes in (([1024], [16384]), ([256], [4096]), ([512, 24], [1536, 0]), ([64], [16384])):
        k_lens = tuple(p + n for p, n in zip(prefixes, lens))
        n_splits, per = pa._key_splits(tuple(lens), k_lens, 8, 132)
        longest = max(pa._key_tiles(lens, k_lens))
        assert 1 < n_splits <= pa.MAX_RUNS and (n_splits - 1) * per < longest <= n_splits * per


@pytest.mark.gpu
@pytest.mark.parametrize("lens,prefixes,kernel", [
    ([2048, 5], [0, 0], True),
    ([1024], [pa.MLA_CUDNN_PROMPT], True),  # cached keys: the kernel, however long
    ([pa.MLA_CUDNN_PROMPT], [0], False),  # long prompts alone: cuDNN on the joined keys
])
def test_mla_prompts_take_the_kernel_below_the_cudnn_length(monkeypatch, lens, prefixes, kernel):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("mla_prefill_mma is a Hopper (sm_90a) kernel")
    calls, launch = [], pa._mla_prefill_cuda
    monkeypatch.setattr(pa, "_mla_prefill_cuda", lambda *a: calls.append(1) or launch(*a))
    check_mla(lens, prefixes, 8, torch.bfloat16, "cuda", 2e-2, per_prompt=4)
    assert bool(calls) == kernel
