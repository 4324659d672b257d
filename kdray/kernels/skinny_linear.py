"""``y = x W^T`` for a few tokens (decode, tree verify): ``skinny_linear``; and per group, ``skinny_bmm``.

At a few tokens a projection is a weight stream: cuBLAS picks split-K GEMMs plus a reduce kernel for K2's shard
projections (issue 12). Two kernels stream the weights instead, with K split across the blocks of a thread-block
cluster so that even 384 output rows fill the GPU, and the cluster's blocks adding the partial sums from each other's
shared memory (one launch, no host sync, no global scratch, capturable in a CUDA graph). fp32 accumulation, one
rounding, as cuBLAS's bf16 GEMM does. Clusters need sm_90; on earlier GPUs a projection whose K would be split runs
on cuBLAS (``kernel_splits``).

* One or two rows (``MAX_ROWS``): ``cuda/skinny_linear.cu`` streams the weights through FMAs at 16 bytes per lane,
  two rows per warp. It compiles for up to 8 rows of ``x`` (``M_ROWS``), but beats cuBLAS at 1-2 rows only: alone on
  the H200 (``benchmarks/bench_linear.py`` with more rows allowed, 2026-12-03) 1.0-1.6x at 2 rows, 0.6-1.1x at 8; in
  K2's graphed TP8-shard pass on an H100 (2026-12-06, alternated) 2 tokens 6.50 -> 6.17 ms, 3 tokens -0.9% in one
  call and +0.2% in another, 4 tokens 7.44 -> 7.75, and 8 tokens 9.7 -> 11.0 on the H200 (2026-12-03).
* Three to ``WGMMA_ALL_ROWS`` (32) rows on an sm_90 GPU: ``cuda/skinny_linear_wgmma.cu`` streams them through the
  tensor cores (wgmma, the weights as A, 64 rows a block; x's rows as B), its first weight stages loaded before the
  dependency wait (so in a graph the weights must not be written by the kernel just ahead: they are a model's). In
  K2's graphed shard pass on an H100 (2026-12-07, alternated with cuBLAS): 8 tokens 9.945 -> 9.543 ms (-4.0%), 17
  tokens 13.01 -> 12.42 (-4.6%), 4 tokens -0.8%, and three split-K reduce kernels a layer fewer. Past 32 rows o_proj
  and the shared experts' down GEMM lose to cuBLAS (1.1-1.4x its time alone at 65 rows; every projection on the
  kernel made 65 tokens 2.7-4.3% slower).
* ``WGMMA_ALL_ROWS`` + 1 to ``WGMMA_MAX_ROWS`` (72) rows: only projections of at most half the SMs' worth of 64-row
  blocks (those cuBLAS splits K on: K2's a_proj, q_b and router), and not those run ``beside`` other kernels. The
  shared experts run beside the routed ones (``model/k2.py``): on the kernel, with no split-K reduce kernel to wait
  for SM room, their gate/up and then their down GEMM ran as the routed experts' kernels started and slowed them by
  more than they took (H100, a 65-token pass's layer: the routed down kernel 107 -> 134 us), and the pass got 2.8%
  slower. Without them (H100, 2026-12-07, alternated): 65 tokens -0.7%, 34 tokens -2.5%, 68 tokens -0.8%, and two
  split-K reduce kernels a layer fewer; up to 128 rows made 97 tokens 0.8-1.0% slower.

CUDA bf16 / fp16 inputs in those row ranges, with ``K % 256 == 0`` (and ``N % 4`` for the tensor cores) and
16-byte aligned rows take a kernel; everything else (and the reference) is ``F.linear``, or cuBLAS's fp32-output
GEMM. The output is x's dtype, or fp32 (the MoE router's logits: 16-bit operands, fp32 sums); ``accumulate`` adds
the product into ``out`` instead (a decoder layer's residual stream: see ``model/layers.py``). Small projections
(K < 256, k2-tiny's) stay on cuBLAS at every row count, so that its bf16 passes of a few rows and a verify's hundreds
round alike, which the GPU engine's bf16 DDTree-equals-AR tests rely on: with k2-tiny's K = 64 projections on the
tensor cores at 3-32 rows two of them failed, though neither kernel is nearer fp32 (H100, 2026-12-07: k2-tiny's bf16
AR leaves its fp32 tokens after 2-14 tokens on cuBLAS, 2-25 on the tensor cores, its logprobs 0.01-0.07 from fp32's
either way).

``skinny_bmm`` is the first kernel over groups: output rows of group g read x's row g and weight group g, as
``torch.bmm`` of ``[G, T, K]`` by ``[G, K, R]``: MLA's W_UV product per head at a token or two (one: 2.2 us on K2's
shard against torch.bmm's 4.8, a cuBLAS kernel, which the next one cannot start behind). Its x may also be the MLA
attention's unmerged key-split partials (``SplitPartials``, ``mla_tree_attention(unmerged=True)``), which the kernel
merges as it loads them, to the same bits as the attention's own merge: the attention then ends when its clusters have
merged their own splits, without the fence, ticket and second merge that its last cluster would run.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kdray.kernels.cuda_module import launch, sm90_or_later, sm90a, sm_count
from kdray.kernels.tree_verify_attention import SplitPartials, merge_split_partials

MAX_ROWS = 2  # rows of x that take the kernel (see above)
WGMMA_ALL_ROWS = 32  # rows of x past MAX_ROWS with which every projection takes skinny_linear_wgmma.cu (sm_90)
WGMMA_MAX_ROWS = 72  # ... and past WGMMA_ALL_ROWS, those of few 64-row blocks not run beside other kernels (above)
WGMMA_STAGES = 6  # its cp.async ring: stages of 64 k
WGMMA_ROWS_PER_BLOCK = 64  # weight rows a block (one warpgroup's wgmma M)
WGMMA_WAVES = 2  # blocks per SM its K split aims for up to WGMMA_ALL_ROWS rows of x; one past them
ROWS_PER_BLOCK = 16  # WARPS * RPW in the .cu
RPW = 2  # weight rows per warp in the .cu: a group of skinny_bmm holds whole warps
THREADS = 256  # 32 * WARPS in the .cu
K_STEP = 256  # elements of K one warp covers per step
WAVES = 4  # blocks per SM the K split aims for
MAX_SPLIT = 8  # blocks of a cluster (the portable limit): the K split's largest
DTYPES = {torch.bfloat16: 1, torch.float16: 2}


def skinny_linear_reference(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, w)
    if x.is_cuda:  # 16-bit operands, fp32 sums and output
        return torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=out_dtype).view(*x.shape[:-1], w.shape[0])
    return F.linear(x.to(out_dtype), w.to(out_dtype))


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``x [..., K] @ w [N, K]^T`` takes the FMA kernel: 1 to MAX_ROWS rows."""
    return 0 < _streamed_rows(x, w) <= MAX_ROWS


def wgmma_fits(x: torch.Tensor, w: torch.Tensor, beside: bool = False) -> bool:
    """Whether ``x [..., K] @ w [N, K]^T`` takes the tensor-core kernel on an sm_90 GPU, N a multiple of 4:
    MAX_ROWS + 1 to WGMMA_ALL_ROWS rows; up to WGMMA_MAX_ROWS where w has at most half the SMs' worth of 64-row
    blocks and the product does not run ``beside`` other kernels (see above)."""
    rows, N = _streamed_rows(x, w), w.shape[0]
    if not (MAX_ROWS < rows <= WGMMA_MAX_ROWS and N % 4 == 0 and sm90a(x.device.index)):
        return False
    few_blocks = 2 * math.ceil(N / WGMMA_ROWS_PER_BLOCK) <= sm_count(x.device.index)
    return rows <= WGMMA_ALL_ROWS or (few_blocks and not beside)


def _streamed_rows(x: torch.Tensor, w: torch.Tensor) -> int:
    """x's rows where both kernels could take ``x [..., K] @ w [N, K]^T`` (CUDA, x and w of one 16-bit dtype,
    K a positive multiple of 256, w contiguous and 16-byte aligned, no autograd), else 0."""
    K = w.shape[-1]
    if not (K and x.is_cuda and x.dtype in DTYPES and w.dtype == x.dtype and K % K_STEP == 0 and x.shape[-1] == K
            and w.is_contiguous() and w.data_ptr() % 16 == 0
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return 0
    return x.numel() // K


def skinny_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
                  out: torch.Tensor | None = None, accumulate: bool = False, beside: bool = False) -> torch.Tensor:
    """x ``[..., K]``, w ``[N, K]`` -> ``[..., N]`` in ``out_dtype``: x's dtype (None) or float32; written into
    ``out`` (contiguous, x's dtype) when given, else into a new tensor. With ``accumulate``, ``out += x W^T``:
    out's values join the fp32 sums before their one rounding (a GEMM's beta = 1; in place, no copy). ``beside``:
    the caller runs it on a side stream beside other kernels (past WGMMA_ALL_ROWS rows: cuBLAS)."""
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"skinny_linear's out_dtype is x's dtype ({x.dtype}) or torch.float32, got {out_dtype}")
    N, K = w.shape
    if out is not None and (out_dtype not in (None, x.dtype) or out.dtype != x.dtype or not out.is_contiguous()
                            or out.shape != (*x.shape[:-1], N) or out.device != x.device):
        raise ValueError(f"skinny_linear's out must be a contiguous {x.dtype} tensor of shape "
                         f"{(*x.shape[:-1], N)} on {x.device}, got {out.dtype} {tuple(out.shape)} on {out.device} "
                         f"(contiguous: {out.is_contiguous()}), with out_dtype None")
    if accumulate and out is None:
        raise ValueError("skinny_linear's accumulate adds into out: give out")
    out_aligned = out is None or out.data_ptr() % 16 == 0
    tensor_cores = out_aligned and wgmma_fits(x, w, beside)
    splits = kernel_splits(*w.shape, x.device) if out_aligned and not tensor_cores and fits(x, w) else 0
    if not (tensor_cores or splits):
        if out is None:
            return skinny_linear_reference(x, w, out_dtype)
        if accumulate:
            out.view(-1, N).addmm_(x.reshape(-1, K), w.t())
        else:
            torch.mm(x.reshape(-1, K), w.t(), out=out.view(-1, N))
        return out
    x2 = x.reshape(-1, K)
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    fp32_out = out_dtype == torch.float32
    y = torch.empty(x2.shape[0], N, dtype=torch.float32 if fp32_out else x.dtype, device=x.device) \
        if out is None else out.view(-1, N)  # [M, N]
    if tensor_cores:
        _launch_wgmma(x2, w, y, fp32_out, accumulate)
    else:
        _launch(x2, w, y, N, K, splits, group_rows=N, w_pitch=N, fp32_out=fp32_out, accumulate=accumulate)
    return y.view(*x.shape[:-1], N) if out is None else out


def wgmma_splits(N: int, K: int, rows: int, device: torch.device) -> int:
    """skinny_linear_wgmma's K split (blocks of a cluster) for ``rows`` rows of x: the largest divisor of K's 64-k
    steps, up to MAX_SPLIT, that keeps the grid within ``WGMMA_WAVES`` blocks an SM (one past WGMMA_ALL_ROWS)."""
    waves = WGMMA_WAVES if rows <= WGMMA_ALL_ROWS else 1
    return k_splits(math.ceil(N / WGMMA_ROWS_PER_BLOCK), K // 64, sm_count(device.index), waves=waves)


def wgmma_smem(nx: int, stages: int = WGMMA_STAGES) -> int:
    """skinny_linear_wgmma's dynamic shared memory: the ring of stages (weights [64][64 k] and x [nx][64 k]),
    1024-aligned."""
    return 1024 + stages * (WGMMA_ROWS_PER_BLOCK * 128 + nx * 128)


def _launch_wgmma(x, w, y, fp32_out: bool, accumulate: bool):
    """skinny_linear_wgmma.cu over x ``[M, K]``, w ``[N, K]`` into y ``[M, N]``; ``accumulate``: y += the product."""
    (M, K), N = x.shape, w.shape[0]
    nx = -(-M // 8) * 8  # x's rows as wgmma's N: a multiple of 8
    splits = wgmma_splits(N, K, M, x.device)
    launch("skinny_linear_wgmma", "skinny_linear_wgmma", (math.ceil(N / WGMMA_ROWS_PER_BLOCK), splits), (128,),
           (x, w, y, np.int32(M), np.int32(N), np.int32(K)), shared_mem=wgmma_smem(nx), device=x.device,
           defines=(("DTYPE", DTYPES[x.dtype]), ("NX", nx), ("CLUSTER", splits), ("STAGES", WGMMA_STAGES))
           + ((("OUT_F32", 1),) if fp32_out else ()) + ((("ACCUMULATE", 1),) if accumulate else ()))


def skinny_bmm_reference(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
    return out


def bmm_fits(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``skinny_bmm(x [T, G, K], w [G, R, K], out [T, G, R])`` takes the kernel."""
    if x.dim() != 3 or w.dim() != 3:
        return False
    T, G, K = x.shape
    R = w.shape[1]
    return (x.is_cuda and x.dtype in DTYPES and w.dtype == x.dtype == out.dtype and 0 < T <= MAX_ROWS
            and K % K_STEP == 0 and w.shape == (G, R, K) and R % RPW == 0 and out.shape == (T, G, R)
            and x.is_contiguous() and out.is_contiguous() and w.stride(2) == 1 and w.stride(1) == K
            and w.stride(0) % K == 0 and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def bmm_merges_partials(T: int) -> bool:
    """Whether ``skinny_bmm`` of ``T`` tokens merges ``SplitPartials`` on its kernel (else in torch, then the bmm)."""
    return 0 < T <= MAX_ROWS


def skinny_bmm(x: torch.Tensor | SplitPartials, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[t, g] = w[g] @ x[t, g]``: x ``[T, G, K]`` or the split partials of one (merged as loaded), w ``[G, R, K]``
    (rows contiguous; groups any multiple of K apart, as a view of a larger weight), out ``[T, G, R]``; returns
    out."""
    partials = x if isinstance(x, SplitPartials) else None
    xt = x if partials is None else partials.o[0]  # [T, G, K]: x, or the first partial
    splits = kernel_splits(w.shape[0] * w.shape[1], w.shape[2], xt.device) if bmm_fits(xt, w, out) else 0
    if not splits:
        return skinny_bmm_reference(x if partials is None else merge_split_partials(partials), w, out)
    G, R, K = w.shape
    _launch(xt, w, out, G * R, K, splits, group_rows=R, w_pitch=w.stride(0) // K, fp32_out=False, accumulate=False,
            partials=partials)
    return out


def kernel_splits(N: int, K: int, device: torch.device) -> int:
    """The K split of N x K on ``device`` (a CUDA tensor's, so indexed; ``k_splits``), or 0 where it splits K and the
    device has no thread-block clusters (before sm_90): cuBLAS then."""
    splits = k_splits(math.ceil(N / ROWS_PER_BLOCK), K // K_STEP, sm_count(device.index))
    return splits if splits == 1 or sm90_or_later(device.index) else 0


def _launch(x, w, y, N: int, K: int, splits: int, group_rows: int, w_pitch: int, fp32_out: bool, accumulate: bool,
            partials: SplitPartials | None = None):
    """The kernel over output rows N (groups of ``group_rows`` rows, ``w_pitch`` weight rows apart), K split over
    ``splits`` blocks, one cluster a row group; ``accumulate``: y += the product; ``partials``: x is the first of
    these, merged as loaded."""
    launch("skinny_linear", "skinny_linear", (math.ceil(N / ROWS_PER_BLOCK), splits), (THREADS,),
           (x, w, y, np.int32(N), np.int32(K), np.int32(group_rows), np.int32(w_pitch),
            0 if partials is None else partials.ml), device=x.device,
           defines=(("DTYPE", DTYPES[x.dtype]), ("M_ROWS", x.shape[0]), ("CLUSTER", splits))
           + ((("OUT_F32", 1),) if fp32_out else ()) + ((("ACCUMULATE", 1),) if accumulate else ())
           + ((("X_PARTIALS", partials.o.shape[0]),) if partials is not None else ()))


def k_splits(groups: int, steps: int, sm_count: int, waves: int = WAVES) -> int:
    """The K split: the largest divisor of the K steps that keeps the grid within ``waves`` blocks per SM and a
    cluster within ``MAX_SPLIT`` blocks."""
    cap = min(MAX_SPLIT, max(1, waves * sm_count // groups))
    return max(d for d in range(1, steps + 1) if steps % d == 0 and d <= cap)
