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
"""
from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

MAX_FLASH_HEAD_DIM = 256  # FlashAttention's largest head dim
LONG_PROMPT = 2048  # MLA batches whose prompts are all at least this long run through cuDNN, one call each
LONG_PROMPT_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]  # in this order


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


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, q_lens: list[int],
                      scale: float, cu_k: torch.Tensor | None = None, k_lens: list[int] | None = None
                      ) -> torch.Tensor:
    """q ``[T, H, Dqk]``, k ``[Tk, Hkv, Dqk]``, v ``[Tk, Hkv, Dv]``, cu ``[B+1]`` int32 (the prompts' row offsets,
    on q's device), q_lens their host copy -> ``[T, H, Dv]`` in q's dtype. Keys and values are the queries' rows
    (``Tk = T``) unless ``cu_k [B+1]`` and its host copy ``k_lens`` (each at least the prompt's ``q_lens``) say
    otherwise."""
    T, H, D = q.shape
    Hkv, Dv = v.shape[1], v.shape[2]
    chunks = k_lens is not None and list(k_lens) != list(q_lens)
    k_lens, cu_k = (k_lens, cu_k) if k_lens is not None else (q_lens, cu)
    Tk = sum(k_lens)
    if (k.shape != (Tk, Hkv, D) or v.shape[0] != Tk or H % Hkv or sum(q_lens) != T or cu_k is None
            or len(k_lens) != len(q_lens) or any(m < n for m, n in zip(k_lens, q_lens))):
        raise ValueError(f"prefill_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, prompt "
                         f"lengths summing to {sum(q_lens)} and key lengths summing to {Tk} do not fit [T, H, D] / "
                         "[Tk, Hkv, D] / [Tk, Hkv, Dv] with H a multiple of Hkv and each prompt's keys (with cu_k) "
                         "at least its queries")
    flash = (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and Dv <= D <= MAX_FLASH_HEAD_DIM
             and D % 8 == 0)
    if not flash:
        return per_prompt_sdpa(q, k, v, q_lens, scale, k_lens)
    if Dv == D or chunks or (len(q_lens) > 1 and min(q_lens) < LONG_PROMPT):
        return _flash_varlen(q, k, v, cu, q_lens, scale, cu_k, k_lens)
    with sdpa_kernel(LONG_PROMPT_BACKENDS, set_priority=True):
        return per_prompt_sdpa(q, k, v, q_lens, scale)
