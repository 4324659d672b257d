"""The compressed-tensors ``pack-quantized`` INT4 layout: pack, unpack and dequantize.

Layout (symmetric, group-wise): ``q`` int in [-8, 7] is stored as ``q + 8`` in a nibble; eight
nibbles per int32 along the input dimension, element ``8k + i`` in bits ``4i..4i+3`` (LSB first).
``weight_packed [out, ceil(in/8)]`` int32, ``weight_scale [out, in/group]`` (bf16),
``W[o, j] = q[o, j] * weight_scale[o, j // group]``.
"""
from __future__ import annotations

import torch

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # [8]


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """``[..., out, ceil(in/8)]`` int32 -> ``[..., out, in]`` int8 in [-8, 7]."""
    if packed.dtype != torch.int32:
        raise TypeError(f"packed INT4 weights must be int32, got {packed.dtype}")
    nib = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # [..., out, in/8, 8]
    q = nib.reshape(*packed.shape[:-1], packed.shape[-1] * 8)[..., :in_features]
    return (q - 8).to(torch.int8)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[..., out, in]`` integers in [-8, 7] -> ``[..., out, ceil(in/8)]`` int32 (inverse of unpack)."""
    if q.min() < -8 or q.max() > 7:
        raise ValueError("INT4 values must lie in [-8, 7]")
    u = (q.to(torch.int32) + 8)
    pad = (-u.shape[-1]) % 8
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    u = u.reshape(*u.shape[:-1], u.shape[-1] // 8, 8).to(torch.int64) << _SHIFTS.to(u.device)
    word = u.sum(-1)  # [..., out, in/8] as unsigned 32-bit values
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, in_features: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., out, in/8]`` int32 and ``[..., out, in/group]`` scales -> ``[..., out, in]`` weights."""
    q = unpack_int4(packed, in_features).to(dtype)
    group = in_features // scale.shape[-1]
    if group * scale.shape[-1] != in_features:
        raise ValueError(f"scale has {scale.shape[-1]} groups, which does not divide in_features={in_features}")
    return q * scale.to(dtype).repeat_interleave(group, dim=-1)


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group-wise quantisation ``[..., out, in]`` -> (packed int32, bf16 scales); for tests and demos."""
    *lead, out, inp = weight.shape
    if inp % group_size:
        raise ValueError(f"in_features={inp} is not a multiple of group_size={group_size}")
    w = weight.float().reshape(*lead, out, inp // group_size, group_size)
    scale = (w.abs().amax(-1) / 7.5).clamp_min(1e-8).to(torch.bfloat16)  # [..., out, in/group]
    q = torch.round(w / scale.float().unsqueeze(-1)).clamp(-8, 7).reshape(*lead, out, inp)
    return pack_int4(q), scale
