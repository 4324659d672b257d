"""Random weights for a model built from its config alone (``load_format="dummy"``, as vLLM's): every parameter and
buffer filled in place on the model's device, so a model larger than the host's memory or disk (a K2 TP8 shard's
~65 GB) is made where it runs, laid out as loading a checkpoint leaves it there."""
from __future__ import annotations

import torch
from torch import nn

from kdray.model.k2 import MoE


@torch.no_grad()
def fill_random(model: nn.Module) -> nn.Module:
    """``model``'s parameters and buffers filled in place, seeded (INT4 experts as random bytes: every nibble
    uniform, so no expert row shares a common-mode part and tokens route apart as K2's do); then its experts laid
    out for their device as ``MoE.load`` leaves them (INT4 tiled on a GPU). Every rank of a tensor-parallel group
    draws the same sequence, so the weights each holds whole (the router, the norms) agree across ranks."""
    g = torch.Generator(next(model.parameters()).device).manual_seed(0)  # the global RNG is left alone
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("inv_freq"):
            continue
        if t.dtype == torch.int32:
            t.view(torch.uint8).random_(generator=g)  # packed INT4 words: every nibble uniform in [0, 16)
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
