"""Built-in models: ``k2-tiny`` (a K2-architecture model made from a seed) and checkpoints written from a seed.

``k2-tiny`` is written once as a real HF-layout safetensors checkpoint under the cache directory and
then loaded like any other, so every shard of a tensor-parallel run reads the same weights.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from kdray.config import K2Config
from kdray.kernels.int4 import quantize_int4

K2_TINY = {
    "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.827, "kv_lora_rank": 32, "q_lora_rank": 48,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "rms_norm_eps": 1e-6,
    "rope_theta": 50000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 1.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "bos_token_id": 0, "eos_token_id": 1,
}
K2_TINY_SEED = 20260711
PRESETS = ("k2-tiny", "smollm2-135m")
BUILTIN_DRAFTERS = Path(__file__).resolve().parent.parent / "assets" / "drafters"  # <preset>/ in the DFlash layout


def cache_dir() -> Path:
    return Path(os.environ.get("KDRAY_CACHE", Path.home() / ".cache" / "kdray"))


def k2_random_tensors(cfg: K2Config, seed: int, int4_experts: bool = False) -> dict[str, torch.Tensor]:
    """HF-named random weights for a K2 config, scaled so logits spread (greedy choices have clear margins)."""
    g = torch.Generator().manual_seed(seed)
    H, V = cfg.hidden_size, cfg.vocab_size
    t: dict[str, torch.Tensor] = {}

    def lin(name, out, inp, gain=1.0):
        t[name] = torch.randn(out, inp, generator=g) * (gain / inp ** 0.5)

    def norm(name, dim):
        t[name] = 1.0 + 0.1 * torch.randn(dim, generator=g)

    def mlp(prefix, inner):
        lin(f"{prefix}.gate_proj.weight", inner, H)
        lin(f"{prefix}.up_proj.weight", inner, H)
        lin(f"{prefix}.down_proj.weight", H, inner)

    t["model.embed_tokens.weight"] = torch.randn(V, H, generator=g)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        norm(f"{p}.input_layernorm.weight", H)
        norm(f"{p}.post_attention_layernorm.weight", H)
        a = f"{p}.self_attn"
        qd = cfg.num_attention_heads * cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            lin(f"{a}.q_proj.weight", qd, H)
        else:
            lin(f"{a}.q_a_proj.weight", cfg.q_lora_rank, H)
            norm(f"{a}.q_a_layernorm.weight", cfg.q_lora_rank)
            lin(f"{a}.q_b_proj.weight", qd, cfg.q_lora_rank)
        lin(f"{a}.kv_a_proj_with_mqa.weight", cfg.kv_cache_dim, H)
        norm(f"{a}.kv_a_layernorm.weight", cfg.kv_lora_rank)
        lin(f"{a}.kv_b_proj.weight", cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            cfg.kv_lora_rank)
        lin(f"{a}.o_proj.weight", H, cfg.num_attention_heads * cfg.v_head_dim)
        if i < cfg.first_k_dense_replace:
            mlp(f"{p}.mlp", cfg.intermediate_size)
            continue
        lin(f"{p}.mlp.gate.weight", cfg.n_routed_experts, H, gain=2.0)
        t[f"{p}.mlp.gate.e_score_correction_bias"] = 0.1 * torch.randn(cfg.n_routed_experts, generator=g)
        for e in range(cfg.n_routed_experts):
            mlp(f"{p}.mlp.experts.{e}", cfg.moe_intermediate_size)
        if cfg.n_shared_experts:
            mlp(f"{p}.mlp.shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts)
    norm("model.norm.weight", H)
    lin("lm_head.weight", V, H, gain=4.0)
    if int4_experts:
        for name in [n for n in t if ".experts." in n]:
            packed, scale = quantize_int4(t.pop(name), cfg.quantization.group_size if cfg.quantization else 32)
            base = name.removesuffix(".weight")
            t[f"{base}.weight_packed"], t[f"{base}.weight_scale"] = packed, scale
            t[f"{base}.weight_shape"] = torch.tensor([packed.shape[0], packed.shape[1] * 8], dtype=torch.int32)
    return t


def write_checkpoint(path: Path, config: dict, tensors: dict[str, torch.Tensor]):
    """Write ``config.json`` and ``model.safetensors`` into ``path`` (atomically replaced)."""
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f"model.safetensors.{os.getpid()}.tmp"  # one per writer: concurrent first uses do not collide
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    cfg_tmp = path / f"config.json.{os.getpid()}.tmp"
    cfg_tmp.write_text(json.dumps(config, indent=1))
    cfg_tmp.replace(path / "config.json")
    tmp.replace(path / "model.safetensors")


def k2_tiny_path() -> Path:
    """The ``k2-tiny`` checkpoint directory, written on first use."""
    path = cache_dir() / f"k2-tiny-{K2_TINY_SEED}"
    if not (path / "model.safetensors").is_file():
        write_checkpoint(path, K2_TINY, k2_random_tensors(K2Config.from_hf(K2_TINY), K2_TINY_SEED))
    return path


def builtin_drafter(model: str) -> str | None:
    """The drafter shipped for a preset (``kdray/assets/drafters/<preset>/``), or None."""
    path = BUILTIN_DRAFTERS / model
    return str(path) if model in PRESETS and (path / "config.json").is_file() else None
