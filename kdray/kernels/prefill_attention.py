"""Causal attention inside each prompt of a packed prefill batch: ``prefill_attention``.

``out[i] = softmax(scale * q[i] . k[j] for j <= i of i's prompt) @ v`` for ``q [T, H, Dqk]``, ``k [T, Hkv, Dqk]``,
``v [T, Hkv, Dv]`` with the prompts' rows ``cu[b]:cu[b+1]``; query head ``h`` reads KV head ``h // (H / Hkv)``.
A chunk after cached tokens gives its prompts' keys and values separately (``cu_k``, ``k_lens``: the cached and the
new positions): its queries are the last ``q_lens[b]`` of its ``k_lens[b]`` positions, causal aligned to the end.

CUDA tensors in bf16 / fp16 run on tensor cores with nothing T x T in memory:

- MLA (values narrower than queries and keys): one prompt, or a batch of prompts that are all :data:`LONG_PROMPT`
  tokens or more, runs one cuDNN fused attention per prompt (torch SDPA's cuDNN backend: Hopper kernels that take
  the 192/128 head dims as they are). On the H200 at K2's TP8-shard dims (8 heads), replayed from a CUDA graph,
  cuDNN against the call below: one prompt of 128 tokens 9.8 against 13.9 us, 512 15.4 against 30.1, 1k 23.5
  against 51.1, 4k 123 against 298, 16k 1.2 against 2.9 ms, 64k 18 against 41 ms (610 TFLOP/s); 8 x 2048 tokens
  0.34 against 0.47 ms. Each call costs ~10 us on the GPU and ~40 us of host time (eager), so batches with
  shorter prompts stay on the call below (4 x 512: 57 against 35 us; 16 x 1024: 0.38 against 0.29 ms; 5000 + 17
  + 4096 + 1: 0.78 against 0.58 ms), as do equal head dims (SmolLM2's 64: 0.27 against 0.17 ms at 4k);
- every other batch, and every chunk after cached tokens (cuDNN with a causal mask aligned to the end took 1.32 ms
  against FlashAttention's 0.79 for 2048 queries over 18,432 keys), runs one variable-length FlashAttention call over
  all its prompts
  (``torch.nn.attention.varlen.varlen_attn``). FlashAttention takes one head dim for keys and values, so MLA's
  values (128) are zero-padded to the query/key dim (192) and the padding is cut from the output.

Where cuDNN cannot take a prompt, SDPA falls back to its memory-efficient kernel. Other tensors (the CPU, fp32 on a
GPU) run the reference: one SDPA per prompt on 4-D tensors (fused kernels where the backend has one).

MLA's layers call :func:`mla_prefill_attention` with the keys in their two parts (the per-head nope columns of kv_b's
output, the rope column shared by the heads). On Hopper in bf16 at K2's head dims it is one launch of our kernel
(``cuda/prefill_attention.cu``), which reads both parts and the values where they lie, so no ``[keys, heads, 192]``
key tensor is built; where a batch has too few query tiles to keep every SM busy and long runs of keys each (a chunk
after many cached keys) the tiles' keys are cut into runs, a CTA each, and a second launch merges them
(:func:`_key_splits`); elsewhere, and for prompts all of ``MLA_CUDNN_PROMPT`` tokens or more, it builds that tensor and
calls :func:`prefill_attention`. On the H200 at K2's TP8-shard dims (8 heads), graph-replayed, against the joined keys
and the paths above (``benchmarks/bench_kernels.py --only prefill``): one prompt of 1k tokens 29.5-31.0 against
33.4-37 us, 4k 99-101 against 151, 16k 1.28-1.29 against 1.27 ms, 64k 21.9 against 19.0 ms; 8 x 2048 tokens 208
against 425 us; 2048 new tokens after 16,384 cached 0.37 against 0.88 ms; 1024 after 16,384 cached 201 us in 2 runs a
tile against 347 in one (and 0.85 ms on joined keys).
"""
from __future__ import annotations

import functools
import heapq
from itertools import accumulate

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kdray.kernels.cuda_module import launch, sm90a, sm_count
from kdray.kernels.tree_verify_attention import combine_cols, split_k_outputs

MAX_FLASH_HEAD_DIM = 256  # FlashAttention's largest head dim
LONG_PROMPT = 2048  # MLA batches whose prompts are all at least this long run through cuDNN, one call each
LONG_PROMPT_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]  # in this order
MLA_KERNEL_DIMS = (128, 64, 128)  # (nope, rope, value) head dims of mla_prefill_mma: DeepSeek-V3's and Kimi K2's
# MLA prompts all this long (no cached keys) run on cuDNN with the keys joined instead (H200, K2 TP8 shard, 8 heads, a
# layer: one 65,536-token prompt 19.0 ms there against 21.9 on mla_prefill_mma; 16,384 tokens 1.27 against 1.28-1.29,
# and the 61-layer pass 458 against 464 ms; 4096 tokens 151 against 99-101 us).
MLA_CUDNN_PROMPT = 16384
_ROWS = 128  # query rows per CTA of mla_prefill_mma (MP_ROWS in cuda/prefill_attention.cu), 64 a warpgroup
_MLA_SMEM = (4 * 64 * sum(MLA_KERNEL_DIMS) + _ROWS * sum(MLA_KERNEL_DIMS[:2])) * 2 + 64  # 4 stages of keys and values, Q, mbarriers
_KEY_TILE = 64  # keys per tile of mla_prefill_mma (BN)
# mla_prefill_mma's key runs (_key_splits), times in key tiles of one CTA (~1.4 us on the H200), fitted to the kernel's
# times at 512-4096 tokens and chunks after cached keys over run lengths (benchmarks/RESULTS.md, issue 21):
RUN_COST = 5.0  # a CTA's fixed time: its queries, the pipeline's start and drain, its output
MERGE_COST = 6.0  # mla_prefill_combine's, when some query tile's keys take more than one run
MAX_RUNS = 8  # runs a query tile at most
CUT_GAIN = 0.75  # keys are cut only where that is estimated to take at most this share of the uncut grid's time


def per_prompt_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: list[int], scale: float,
                    k_lens: list[int] | None = None) -> torch.Tensor:
    """One causal SDPA per prompt, on ``[1, heads, n, D]`` views (no copies) -> ``[T, H, Dv]``: the reference, and
    under cuDNN the long MLA prompts' path. With ``k_lens``, prompt b's queries are the last of its k_lens[b] keys."""
    outs, enable_gqa = [], q.shape[1] != k.shape[1]
    k_lens = q_lens if k_lens is None else k_lens
    for s, n, sk, m in zip(accumulate(q_lens, initial=0), q_lens, accumulate(k_lens, initial=0), k_lens):
        mask = None if m == n else torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)  # [n, m]
        o = F.scaled_dot_product_attention(q[s:s + n].transpose(0, 1).unsqueeze(0),
                                           *(t[sk:sk + m].transpose(0, 1).unsqueeze(0) for t in (k, v)),
                                           attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=enable_gqa)  # [1, H, n, Dv]
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, q_lens: list[int],
                  scale: float, cu_k: torch.Tensor, k_lens: list[int]) -> torch.Tensor:
    """One variable-length FlashAttention call over the prompts ``cu [B+1]`` (keys ``cu_k [B+1]``; causal aligned to
    the end, as FlashAttention aligns it) -> ``[T, H, Dv]``."""
    from torch.nn.attention.varlen import varlen_attn

    D, Dv = q.shape[2], v.shape[2]
    v_padded = v if Dv == D else F.pad(v, (0, D - Dv))  # [Tk, Hkv, D]
    out = varlen_attn(q, k, v_padded, cu, cu_k, max(q_lens), max(k_lens), scale=scale,
                      window_size=(-1, 0))  # [T, H, D]
    return out if Dv == D else out[..., :Dv]


def _key_rows(T: int, Tk: int, cu: torch.Tensor, q_lens: list[int], cu_k: torch.Tensor | None,
              k_lens: list[int] | None, what: str) -> tuple[torch.Tensor, list[int], bool]:
    """The prompts' key rows ``(cu_k, k_lens, cached)``: the queries' own unless ``k_lens`` (with ``cu_k``) says
    otherwise, checked against ``T`` query rows and ``Tk`` key rows; ``cached``: some prompt has keys before its
    queries."""
    cached = k_lens is not None and list(k_lens) != list(q_lens)
    cu_k, k_lens = (cu, q_lens) if k_lens is None else (cu_k, k_lens)
    if cu_k is None:
        raise ValueError(f"{what}: k_lens needs cu_k, its device copy")
    if sum(q_lens) != T or sum(k_lens) != Tk or len(k_lens) != len(q_lens) or any(
            m < n for m, n in zip(k_lens, q_lens)):
        raise ValueError(f"{what}: prompt lengths summing to {sum(q_lens)} and key lengths summing to {sum(k_lens)} "
                         f"do not fit {T} query rows and {Tk} key rows with each prompt's keys (with cu_k) at least "
                         "its queries")
    return cu_k, k_lens, cached


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, q_lens: list[int],
                      scale: float, cu_k: torch.Tensor | None = None, k_lens: list[int] | None = None
                      ) -> torch.Tensor:
    """q ``[T, H, Dqk]``, k ``[Tk, Hkv, Dqk]``, v ``[Tk, Hkv, Dv]``, cu ``[B+1]`` int32 (the prompts' row offsets,
    on q's device), q_lens their host copy -> ``[T, H, Dv]`` in q's dtype. Keys and values are the queries' rows
    (``Tk = T``) unless ``cu_k [B+1]`` and its host copy ``k_lens`` (each at least the prompt's ``q_lens``) say
    otherwise."""
    T, H, D = q.shape
    Hkv, Dv = v.shape[1], v.shape[2]
    Tk = k.shape[0]
    if k.shape != (Tk, Hkv, D) or v.shape[0] != Tk or H % Hkv:
        raise ValueError(f"prefill_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                         "[T, H, D] / [Tk, Hkv, D] / [Tk, Hkv, Dv] with H a multiple of Hkv")
    cu_k, k_lens, chunks = _key_rows(T, Tk, cu, q_lens, cu_k, k_lens, "prefill_attention")
    flash = (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and Dv <= D <= MAX_FLASH_HEAD_DIM
             and D % 8 == 0)
    if not flash:
        return per_prompt_sdpa(q, k, v, q_lens, scale, k_lens)
    if Dv == D or chunks or (len(q_lens) > 1 and min(q_lens) < LONG_PROMPT):
        return _flash_varlen(q, k, v, cu, q_lens, scale, cu_k, k_lens)
    with sdpa_kernel(LONG_PROMPT_BACKENDS, set_priority=True):
        return per_prompt_sdpa(q, k, v, q_lens, scale)


def mla_prefill_attention(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                          cu: torch.Tensor, q_lens: list[int], scale: float, cu_k: torch.Tensor | None = None,
                          k_lens: list[int] | None = None) -> torch.Tensor:
    """MLA's causal prefill attention with the keys in two parts: q ``[T, H, nope + rope]`` (its rope part roped),
    k_nope ``[Tk, H, nope]``, k_pe ``[Tk, rope]`` (each position's roped key, shared by the heads), v ``[Tk, H, Dv]``
    -> ``[T, H, Dv]``; cu, q_lens, cu_k, k_lens as :func:`prefill_attention`'s. k_nope, k_pe and v may be strided
    views (kv_b's output split in two, the cache rows' rope part)."""
    T, H, D = q.shape
    Tk, nope, rope, Dv = k_nope.shape[0], k_nope.shape[-1], k_pe.shape[-1], v.shape[-1]
    if (k_nope.shape != (Tk, H, nope) or k_pe.shape != (Tk, rope) or v.shape != (Tk, H, Dv) or nope + rope != D):
        raise ValueError(f"mla_prefill_attention: q {tuple(q.shape)}, k_nope {tuple(k_nope.shape)}, k_pe "
                         f"{tuple(k_pe.shape)}, v {tuple(v.shape)} do not fit [T, H, nope + rope] / [Tk, H, nope] / "
                         "[Tk, rope] / [Tk, H, Dv]")
    cu_k, k_lens, cached = _key_rows(T, Tk, cu, q_lens, cu_k, k_lens, "mla_prefill_attention")
    if not _mla_kernel_takes(q, k_nope, k_pe, v) or (q_lens and not cached and min(q_lens) >= MLA_CUDNN_PROMPT):
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, H, -1)], dim=-1)  # [Tk, H, nope + rope]
        return prefill_attention(q, k, v, cu, q_lens, scale, cu_k, k_lens)
    if any(c.dtype != torch.int32 or c.device != q.device or c.shape != (len(q_lens) + 1,)
           for c in (cu, cu_k)):
        raise ValueError(f"mla_prefill_attention: cu and cu_k must be int32 [{len(q_lens) + 1}] on "
                         f"{q.device}")
    return _mla_prefill_cuda(q, k_nope, k_pe, v, cu, cu_k, q_lens, k_lens, scale)


def _key_tiles(q_lens: list[int], k_lens: list[int]) -> list[int]:
    """Key tiles of each 128-row query tile of mla_prefill_mma (up to its last row's diagonal), for prompts of
    ``q_lens`` queries after ``k_lens - q_lens`` cached keys."""
    return [-(-min(k, t + min(_ROWS, q - t) + k - q) // _KEY_TILE)
            for q, k in zip(q_lens, k_lens) for t in range(0, q, _ROWS)]


@functools.lru_cache(maxsize=256)
def _key_splits(q_lens: tuple[int, ...], k_lens: tuple[int, ...], heads: int, sms: int) -> tuple[int, int]:
    """(runs a query tile at most, key tiles a run) for mla_prefill_mma on ``sms`` SMs (one CTA each): the cut of the
    longest tile's keys into 1 to ``MAX_RUNS`` runs whose grid is estimated to end first, if that takes at most
    ``CUT_GAIN`` of the uncut grid's time. The estimate takes the CTAs longest first, as the grid does, each onto the
    SM that frees first, a CTA costing its run plus ``RUN_COST``, and adds ``MERGE_COST`` where some tile took more
    than one run. A grid with a CTA for every SM is not cut: one prompt of 3072 or 4096 tokens ran 18-31% slower cut
    (H200). Nor are one prompt's 1-2k tokens (estimated 0.8-0.9 of uncut): their kernel gained 1-4 us a layer, their
    61-layer passes nothing measurable. Chunks after many cached keys are: 1024 new tokens after 16,384 cached, 8
    query tiles of 265-272 key tiles a head, take 2 runs a tile (the attention 347 -> 201 us a layer).
    """
    tiles = _key_tiles(q_lens, k_lens)
    if not tiles:
        return 1, 1
    longest = max(tiles)
    if heads * len(tiles) >= sms:
        return 1, longest

    def estimate(per: int) -> float:
        runs = [min(per, n - per * i) for n in tiles for i in range(-(-n // per))] * heads
        free = [0.0] * sms  # when each SM is next free
        for run in sorted(runs, reverse=True):
            heapq.heappush(free, heapq.heappop(free) + run + RUN_COST)
        return max(free) + (MERGE_COST if len(runs) > heads * len(tiles) else 0.0)

    times = {per: estimate(per) for per in sorted({-(-longest // n) for n in range(1, MAX_RUNS + 1)}, reverse=True)}
    per = min(times, key=times.get)  # (the longest runs among equals)
    if times[per] > CUT_GAIN * times[longest]:
        return 1, longest
    return -(-longest // per), per


def _mla_prefill_cuda(q, k_nope, k_pe, v, cu, cu_k, q_lens: list[int], k_lens: list[int], scale: float,
                      splits: tuple[int, int] | None = None) -> torch.Tensor:
    """mla_prefill_mma (checked by the caller), and mla_prefill_combine where a query tile's keys are cut in runs
    (``splits``: (runs a tile at most, key tiles a run), else as :func:`_key_splits` says) -> ``[T, H, Dv]``."""
    T, H, _ = q.shape
    dv, dev = v.shape[-1], q.device
    B = len(q_lens)
    n_splits, per = splits or _key_splits(tuple(q_lens), tuple(k_lens), H, sm_count(dev.index))
    out, ws_o, ws_ml = split_k_outputs(T, H, dv, q.dtype, n_splits, dev)  # [T, H, Dv], the runs' partials
    if T == 0:
        return out
    i32 = np.int32
    tiles = -(-T // _ROWS) + min(B, T) - 1  # >= the prompts' ceil(q_len / 128) summed
    launch("prefill_attention", "mla_prefill_mma", (H, tiles * n_splits), (256,),
           (q, k_nope, k_pe, v, cu, cu_k, out, ws_o, ws_ml, i32(B), i32(T), i32(H), i32(q.stride(0)),
            i32(k_nope.stride(0)), i32(k_nope.stride(1)), i32(k_pe.stride(0)), i32(v.stride(0)), i32(v.stride(1)),
            np.float32(scale * 1.4426950408889634), i32(n_splits), i32(per)),  # scale * log2(e)
           shared_mem=_MLA_SMEM, device=dev)
    if n_splits > 1:
        vw = combine_cols(T * H, dv, sm_count(dev.index))
        launch("prefill_attention", "mla_prefill_combine", (-(-T * H * (dv // vw) // 4),), (128,),
               (ws_o, ws_ml, out, cu, cu_k, i32(B), i32(T), i32(H), i32(n_splits), i32(per), i32(vw)),
               shared_mem=4 * 2 * n_splits * 4, device=dev)
    return out


def _mla_kernel_takes(q, k_nope, k_pe, v) -> bool:
    """Does mla_prefill_mma take these tensors: bf16 on one Hopper GPU, K2's head dims, rows of 16-byte aligned
    contiguous columns?"""
    ts = (q, k_nope, k_pe, v)
    if not (q.is_cuda and all(t.device == q.device and t.dtype == torch.bfloat16 for t in ts)
            and sm90a(q.device.index)
            and (k_nope.shape[-1], k_pe.shape[-1], v.shape[-1]) == MLA_KERNEL_DIMS and q.is_contiguous()):
        return False
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1]) for t in ts)
