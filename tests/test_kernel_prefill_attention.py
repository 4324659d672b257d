"""prefill_attention: causal attention inside each prompt of a packed batch, against a float64 reference.

The reference computes only sampled query rows (every row of short prompts; the first, last and random rows of
long ones), so prompts of 64k tokens are checked without a 64k x 64k score matrix."""
import pytest
import torch

from kdray.kernels.prefill_attention import prefill_attention

K2_DIMS = (192, 128)  # MLA's query/key and value head dims
LLAMA_DIMS = (64, 64)


def packed(lens, H, Hkv, dims, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, (D, Dv) = sum(lens), dims
    q, k, v = (torch.randn(T, h, d, generator=g).to(device, dtype) for h, d in ((H, D), (Hkv, D), (Hkv, Dv)))
    cu = torch.tensor([0] + list(lens)).cumsum(0).to(torch.int32).to(device)
    return q, k, v, cu


def sampled_rows(lens, per_prompt=48, seed=0):
    """(global row, prompt start) of the rows to check."""
    g, rows, start = torch.Generator().manual_seed(seed), [], 0
    for n in lens:
        local = range(n) if n <= per_prompt else sorted({0, n - 1, *torch.randint(0, n, (per_prompt,), generator=g)
                                                          .tolist()})
        rows += [(start + i, start) for i in local]
        start += n
    return rows


def reference_rows(q, k, v, rows, scale):
    """float64 causal attention of the given rows -> ``[len(rows), H, Dv]``."""
    H, Hkv = q.shape[1], k.shape[1]
    out = []
    for i, start in rows:
        kk = k[start:i + 1].double().repeat_interleave(H // Hkv, dim=1)  # [n, H, D]
        vv = v[start:i + 1].double().repeat_interleave(H // Hkv, dim=1)
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
    got = out[torch.tensor([r for r, _ in rows], device=device)].double()
    err = (got - ref).abs().max().item()
    assert err < tol, f"max error {err} for prompts {lens[:4]}..."


@pytest.mark.parametrize("lens,H,Hkv,dims", [
    ([5, 1, 17], 4, 4, K2_DIMS),
    ([9, 30], 6, 2, LLAMA_DIMS),
])
def test_reference_path_matches_float64(lens, H, Hkv, dims):
    check(lens, H, Hkv, dims, torch.float32, "cpu", 1e-5)


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
