"""Random weights for a model built from its config alone (``load_format="dummy"``, as vLLM's): every parameter and
buffer filled in place on the model's device, so a model larger than the host's memory or disk (a K2 TP8 shard's
~65 GB) is made where it runs, laid out as loading a checkpoint leaves it there."""
from __future__ import annotations

import torch
from torch import nn

from kdray.model.k2 import MoE


@torch.no_grad()
def fill_random(model: nn.Module) -> nn.Module:
    """``model``'s parameters and buffers filled in place, seeded (INT4 experts as random nibbles, symmetric about
    zero: see :func:`_symmetric_int4`); then its experts laid out for their device as ``MoE.load`` leaves them (INT4
    tiled on a GPU). Every rank of a tensor-parallel group draws the same sequence, so the weights each holds whole
    (the router, the norms) agree across ranks."""
    g = torch.Generator(next(model.parameters()).device).manual_seed(0)  # the global RNG is left alone
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("inv_freq"):
            continue
        if t.dtype == torch.int32:
            _symmetric_int4(t.view(torch.uint8).random_(generator=g))  # packed INT4 words
        elif name.endswith("_scale"):
            t.uniform_(0.5, 1.5, generator=g).div_(5 * (32 * t.shape[-1]) ** 0.5)  # weights near 1 / sqrt(in_features)
        elif name.endswith("e_score_correction_bias"):
            t.uniform_(0, 0.1, generator=g)
        elif t.dim() == 1:
            t.uniform_(0.9, 1.1, generator=g)
        else:
            t.normal_(0, t.shape[-1] ** -0.5, generator=g)
    for m in model.modules():
        if isinstance(m, MoE):
            m.lay_out_experts()
    return model.eval()


def _symmetric_int4(packed: torch.Tensor) -> torch.Tensor:
    """Random packed INT4 bytes (``q = nibble - 8``) made symmetric about zero: nibble 0 (q = -8) becomes 8 (q = 0),
    so q lies in [-7, 7] with mean 0. Uniform nibbles give q a mean of -1/2, a part every expert row shares; it adds
    the same direction to every token's residual, layer after layer, until all tokens route to the same experts
    (a 61-layer K2 shard: MoE inputs at cosine 1.000 past the first layers, ~9 experts a layer for any batch)."""
    packed |= ((packed & 0x0F) == 0).to(torch.uint8) * 0x08  # low nibbles
    packed |= ((packed & 0xF0) == 0).to(torch.uint8) * 0x80  # high nibbles
    return packed
