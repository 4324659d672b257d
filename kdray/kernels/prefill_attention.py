"""Causal attention inside each prompt of a packed prefill batch: ``prefill_attention``.

``out[i] = softmax(scale * q[i] . k[j] for j <= i of i's prompt) @ v`` for ``q [T, H, Dqk]``, ``k [T, Hkv, Dqk]``,
``v [T, Hkv, Dv]`` with the prompts' rows ``cu[b]:cu[b+1]``; query head ``h`` reads KV head ``h // (H / Hkv)``.

CUDA tensors in bf16 / fp16 run one variable-length FlashAttention call over every prompt of the batch
(``torch.nn.attention.varlen.varlen_attn``: tensor cores, nothing T x T in memory). FlashAttention takes one head
dim for keys and values, so MLA's values (128) are zero-padded to the query/key dim (192) and the padding is cut
from the output: 1.2x the attention FLOPs of an unpadded kernel (qk 192 + v 192 against 192 + 128). Other
tensors (the CPU, fp32 on a GPU) run the reference: one SDPA per prompt on 4-D tensors (fused kernels where the
backend has one).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_FLASH_HEAD_DIM = 256  # FlashAttention's largest head dim


def prefill_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: list[int],
                                scale: float) -> torch.Tensor:
    """One causal SDPA per prompt -> ``[T, H, Dv]``."""
    outs, start = [], 0
    for n in q_lens:
        sl = slice(start, start + n)
        o = F.scaled_dot_product_attention(*(t[sl].transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                           is_causal=True, scale=scale, enable_gqa=True)  # [1, H, n, Dv]
        outs.append(o[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, q_lens: list[int],
                      scale: float) -> torch.Tensor:
    """q ``[T, H, Dqk]``, k ``[T, Hkv, Dqk]``, v ``[T, Hkv, Dv]``, cu ``[B+1]`` int32 (the prompts' row offsets,
    on q's device), q_lens their host copy -> ``[T, H, Dv]`` in q's dtype."""
    T, H, D = q.shape
    Hkv, Dv = v.shape[1], v.shape[2]
    if k.shape != (T, Hkv, D) or v.shape[0] != T or H % Hkv or sum(q_lens) != T:
        raise ValueError(f"prefill_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} and "
                         f"prompt lengths summing to {sum(q_lens)} do not fit [T, H, D] / [T, Hkv, D] / [T, Hkv, Dv] "
                         "with H a multiple of Hkv")
    flash = (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and Dv <= D <= MAX_FLASH_HEAD_DIM
             and D % 8 == 0)
    if not flash:
        return prefill_attention_reference(q, k, v, q_lens, scale)
    from torch.nn.attention.varlen import varlen_attn

    longest = max(q_lens)
    v_padded = v if Dv == D else F.pad(v, (0, D - Dv))  # [T, Hkv, D]
    out = varlen_attn(q, k, v_padded, cu, cu, longest, longest, scale=scale, window_size=(-1, 0))  # [T, H, D]
    return out if Dv == D else out[..., :Dv]
