"""DFlash block-diffusion drafter: Qwen3-style layers fed with the target's hidden states.

The drafter has no embedding or LM head of its own (it borrows the target's). The target's hidden
states at ``target_layer_ids`` are concatenated, projected by ``fc`` and normalised; every layer turns
them into extra keys/values (kept in the drafter's paged cache, at the context tokens' positions).
One forward over the block ``[bonus, MASK x L]`` (bidirectional inside the block) gives logits for
the L draft positions. Checkpoints use the published DFlash layout (``config.json`` with
``block_size`` and ``dflash_config``; tensors ``layers.i.self_attn.q_proj.weight``, ``fc.weight``, ...).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kdray.config import DFlashConfig, default_target_layer_ids
from kdray.kernels.tree_verify_attention import gqa_tree_attention
from kdray.model.batch import ForwardBatch
from kdray.model.checkpoint import CheckpointReader
from kdray.model.layers import DecoderLayer, GatedMLP, Linear, RMSNorm, Rotary


class DFlashAttention(nn.Module):
    """Qwen3 attention projections with per-head q/k norms (names as in DFlash checkpoints)."""

    def __init__(self, cfg: DFlashConfig, dtype: torch.dtype):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = Linear(H, self.heads * D, dtype)
        self.k_proj = Linear(H, self.kv_heads * D, dtype)
        self.v_proj = Linear(H, self.kv_heads * D, dtype)
        self.o_proj = Linear(self.heads * D, H, dtype)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)

    def kv(self, x: torch.Tensor, rotary: Rotary, cos, sin) -> torch.Tensor:
        """x ``[n, H]`` -> cache rows ``[n, 2, Hkv, D]`` (normed, roped keys; values)."""
        k = rotary(self.k_norm(self.k_proj(x).view(-1, self.kv_heads, self.head_dim)), cos, sin)
        return torch.stack([k, self.v_proj(x).view(-1, self.kv_heads, self.head_dim)], dim=1)

    def q(self, x: torch.Tensor, rotary: Rotary, cos, sin) -> torch.Tensor:
        """x ``[n, H]`` -> normed, roped queries ``[n, heads, D]``."""
        return rotary(self.q_norm(self.q_proj(x).view(-1, self.heads, self.head_dim)), cos, sin)

    def forward(self, x, rotary, cos, sin, batch: ForwardBatch, cache: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        cache.view(-1, *cache.shape[2:])[batch.slot_mapping] = self.kv(x, rotary, cos, sin).to(cache.dtype)
        o = gqa_tree_attention(self.q(x, rotary, cos, sin).contiguous(), cache, batch.block_table, batch.prefix_lens,
                               batch.cu_q, batch.tree_mask, self.head_dim ** -0.5)
        return self.o_proj(o.reshape(x.shape[0], -1), add=residual)

    def forward_dense(self, x: torch.Tensor, ctx: torch.Tensor, rotary: Rotary, cos, sin, ctx_cos, ctx_sin,
                      mask: torch.Tensor) -> torch.Tensor:
        """Training form, no cache: blocks x ``[B, Q, H]`` and projected context ``[B, S, H]`` (cos/sin per flattened
        row), mask ``[B, Q, S + Q]`` bool (True: visible) -> ``[B, Q, H]``."""
        (B, Q, _), S, G = x.shape, ctx.shape[1], self.heads // self.kv_heads
        kv = torch.cat([self.kv(ctx.flatten(0, 1), rotary, ctx_cos, ctx_sin).view(B, S, 2, self.kv_heads, -1),
                        self.kv(x.flatten(0, 1), rotary, cos, sin).view(B, Q, 2, self.kv_heads, -1)], dim=1)
        k, v = (kv[:, :, i].transpose(1, 2).repeat_interleave(G, dim=1) for i in (0, 1))  # [B, heads, S+Q, D]
        q = self.q(x.flatten(0, 1), rotary, cos, sin).view(B, Q, self.heads, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None],
                                           scale=self.head_dim ** -0.5)  # [B, heads, Q, D]
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, -1))

    def load(self, reader: CheckpointReader, prefix: str):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            getattr(self, name).load(reader, f"{prefix}.{name}.weight")


class DFlashLayer(DecoderLayer):
    """A Qwen3 decoder layer whose attention also sees the context keys/values; ``forward_dense`` is the
    training form (no cache, a block-sparse mask)."""

    def __init__(self, cfg: DFlashConfig, dtype: torch.dtype):
        super().__init__(DFlashAttention(cfg, dtype), GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype),
                         cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward_dense(self, h, ctx, rotary, cos, sin, ctx_cos, ctx_sin, mask) -> torch.Tensor:
        h = h + self.self_attn.forward_dense(self.input_layernorm(h), ctx, rotary, cos, sin, ctx_cos, ctx_sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """The drafter proper; the target's ``embed_tokens`` and ``logits`` are passed in where needed."""

    def __init__(self, cfg: DFlashConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.layers = nn.ModuleList(DFlashLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))
        self.fc = Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, dtype)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    @property
    def kv_row_shape(self) -> tuple[int, ...]:
        return (2, self.cfg.num_key_value_heads, self.cfg.head_dim)

    def add_context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                    cache: torch.Tensor):
        """Write context keys/values: features ``[n, len(ids) * H]`` at ``positions [n]`` into cache rows
        ``slots [n]`` of ``cache [layers, P, S, 2, Hkv, D]``."""
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))  # [n, H]
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        for i, layer in enumerate(self.layers):
            cache[i].view(-1, *cache.shape[3:])[slots] = layer.self_attn.kv(ctx, self.rotary, cos, sin).to(cache.dtype)

    def forward(self, block_embeds: torch.Tensor, batch: ForwardBatch, cache: torch.Tensor) -> torch.Tensor:
        """Block embeddings ``[T, H]`` (``T = B * block_size``; ``batch`` holds their positions and an all-ones
        mask over each block) -> hidden states ``[T, H]`` after the final norm."""
        # a copy of our own: the first layer adds into it in place
        h = block_embeds.to(self.dtype, memory_format=torch.contiguous_format, copy=True)  # [T, H]
        cos, sin = self.rotary.cos_sin(batch.positions, h.dtype)
        for i, layer in enumerate(self.layers):  # one shard: a layer's output is the stream itself
            h = layer(h, True, self.rotary, cos, sin, batch, cache[i])
        return self.norm(h)

    def forward_dense(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, features: torch.Tensor,
                      context_positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Training forward without a cache: blocks ``[B, Q, H]`` at ``block_positions [B, Q]`` attend to context
        features ``[B, S, len(ids) * H]`` at ``context_positions [B, S]`` and to the blocks where ``mask [B, Q, S + Q]``
        is True -> hidden states ``[B, Q, H]`` after the final norm."""
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))  # [B, S, H]
        h = block_embeds.to(self.dtype)
        cos, sin = self.rotary.cos_sin(block_positions.flatten(), h.dtype)
        ctx_cos, ctx_sin = self.rotary.cos_sin(context_positions.flatten(), h.dtype)
        for layer in self.layers:
            h = layer.forward_dense(h, ctx, self.rotary, cos, sin, ctx_cos, ctx_sin, mask)
        return self.norm(h)

    def load(self, reader: CheckpointReader):
        for i, layer in enumerate(self.layers):
            layer.load(reader, f"layers.{i}")
        self.fc.load(reader, "fc.weight")
        self.hidden_norm.load(reader, "hidden_norm.weight")
        self.norm.load(reader, "norm.weight")

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """Tensors under the DFlash checkpoint names (gate/up unstacked, ``down`` as ``down_proj``)."""
        out = {}
        for name, t in self.state_dict().items():
            if name.endswith("mlp.gate_up.weight"):
                gate, up = t.chunk(2, dim=0)
                out[name.replace("gate_up", "gate_proj")], out[name.replace("gate_up", "up_proj")] = gate, up
            else:
                out[name.replace("mlp.down.weight", "mlp.down_proj.weight")] = t
        return {k: v.contiguous() for k, v in out.items()}

    def save(self, path: str | Path):
        """Write the drafter in the DFlash layout (``config.json`` + ``model.safetensors``)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(self.state_dict_hf(), str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(self.cfg.to_hf(), indent=1))

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype, device) -> "DFlashDrafter":
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"drafter '{path}' has no config.json; pass a DFlash checkpoint directory, "
                             "'random' or None")
        cfg = DFlashConfig.from_hf(json.loads((path / "config.json").read_text()), str(path / "config.json"))
        with torch.device(device):
            drafter = cls(cfg, dtype)
        reader = CheckpointReader(path)
        try:
            with torch.no_grad():
                drafter.load(reader)
        finally:
            reader.close()
        return drafter.eval()

    @classmethod
    def random_for(cls, target_cfg, block_size: int, dtype: torch.dtype, device, seed: int = 0,
                   num_layers: int = 1) -> "DFlashDrafter":
        """A randomly initialised drafter shaped to a target, for tests and demos."""
        H = target_cfg.hidden_size
        head_dim = 16 if H <= 256 else 64
        heads = max(1, H // head_dim // 2)
        cfg = DFlashConfig(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=num_layers,
                           num_attention_heads=heads, num_key_value_heads=1 if heads == 1 else heads // 2,
                           head_dim=head_dim, block_size=block_size, mask_token_id=target_cfg.vocab_size - 1,
                           target_layer_ids=tuple(default_target_layer_ids(target_cfg.num_hidden_layers,
                                                                           num_layers)),
                           num_target_layers=target_cfg.num_hidden_layers, vocab_size=target_cfg.vocab_size,
                           rope_theta=target_cfg.rope_theta)
        g = torch.Generator().manual_seed(seed)
        with torch.device(device):
            drafter = cls(cfg, dtype)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
        return drafter.eval()
