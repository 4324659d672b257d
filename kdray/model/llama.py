"""Dense Llama-family target (Llama 2/3, SmolLM2, ...): GQA attention over a paged KV cache, SwiGLU MLP.

Prefill runs causal attention over the batch's prompts (``prefill_attention``); verify passes run the tree-verify
kernel's GQA form over the cache. Tensor parallelism splits the attention heads (q/k/v column-parallel, o_proj
row-parallel), the MLP width and the vocabulary; each shard caches only its own KV heads.
"""
from __future__ import annotations

import torch
from torch import nn

from kdray.config import LlamaConfig
from kdray.kernels.gqa_rope_cache import gqa_rope_cache
from kdray.kernels.prefill_attention import prefill_attention
from kdray.kernels.tree_verify_attention import gqa_tree_attention
from kdray.model.batch import ForwardBatch
from kdray.model.checkpoint import CheckpointReader
from kdray.model.layers import DecoderLayer, DecoderLM, GatedMLP, Linear, Rotary
from kdray.model.parallel import SINGLE, shard_range


class LlamaAttention(nn.Module):
    """Grouped-query attention; query and KV heads split across the tensor-parallel group."""

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype, group=SINGLE):
        super().__init__()
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q0, q1 = shard_range(H, group, "num_attention_heads")
        k0, k1 = shard_range(Hkv, group, "num_key_value_heads")
        self.heads, self.kv_heads, self.head_dim, self.scale = q1 - q0, k1 - k0, D, D ** -0.5
        self.q_proj = Linear(cfg.hidden_size, H * D, dtype, tp_dim=0, group=group)
        self.k_proj = Linear(cfg.hidden_size, Hkv * D, dtype, tp_dim=0, group=group)
        self.v_proj = Linear(cfg.hidden_size, Hkv * D, dtype, tp_dim=0, group=group)
        self.o_proj = Linear(H * D, cfg.hidden_size, dtype, tp_dim=1, group=group)

    def forward(self, x: torch.Tensor, rotary: Rotary, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, cache: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[T, hidden]``, cache ``[P, S, 2, Hkv/tp, D]`` (this layer) -> ``[T, hidden]`` (+ ``residual``, added by
        o_proj over its storage)."""
        T, D = x.shape[0], self.head_dim
        q = self.q_proj(x).view(T, self.heads, D)  # [T, Hl, D]
        k = self.k_proj(x).view(T, self.kv_heads, D)  # [T, Hkvl, D]
        v = self.v_proj(x).view(T, self.kv_heads, D)
        gqa_rope_cache(q, k, v, cos, sin, cache.view(-1, 2, self.kv_heads, D), batch.slot_mapping)  # q, k roped
        if batch.is_prefill:
            out = prefill_attention(q, k, v, batch.cu_q, batch.q_lens, self.scale)  # [T, Hl, D]
        else:
            out = gqa_tree_attention(q, cache, batch.block_table, batch.prefix_lens, batch.cu_q, batch.tree_mask,
                                     self.scale, longest=max(batch.q_lens))  # [T, Hl, D]
        return self.o_proj(out.reshape(T, self.heads * D), add=residual)

    def load(self, reader: CheckpointReader, prefix: str):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(self, name).load(reader, f"{prefix}.{name}.weight")


class LlamaModel(DecoderLM):
    """The whole target, with K2Model's interface: ``forward`` returns final hidden states and the drafter's
    context features."""

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype = torch.float32, group=SINGLE):
        layers = [DecoderLayer(LlamaAttention(cfg, dtype, group),
                               GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, group),
                               cfg.hidden_size, cfg.rms_norm_eps, dtype, group)
                  for _ in range(cfg.num_hidden_layers)]
        super().__init__(cfg, dtype, group, layers,
                         Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, interleaved=False))

    @property
    def kv_row_shape(self) -> tuple[int, ...]:
        """Values cached per token and layer on this shard: keys and values of its KV heads."""
        return (2, self.layers[0].self_attn.kv_heads, self.cfg.head_dim)
