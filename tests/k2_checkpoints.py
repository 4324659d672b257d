"""Tiny DeepSeek-V3 / K2 checkpoints made with ``transformers`` (and INT4 ones with ``compressed-tensors``)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}

CONFIGS = {
    # q_lora on, group-limited routing, YaRN, one dense layer
    "grouped": dict(q_lora_rank=48, n_group=2, topk_group=1, first_k_dense_replace=1, rope_parameters=YARN),
    # no q_lora, plain top-k routing, two dense layers, no rope scaling, unnormalised weights
    "plain": dict(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=2, norm_topk_prob=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
}


def make_hf_k2(path: Path, variant: str = "grouped", seed: int = 0, hidden: int = 64, experts: int = 8,
               moe_inner: int = 32):
    """Save a random tiny ``DeepseekV3ForCausalLM`` with weights large enough for clear greedy margins."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(vocab_size=320, hidden_size=hidden, intermediate_size=96, moe_intermediate_size=moe_inner,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                           n_routed_experts=experts, num_experts_per_tok=2, kv_lora_rank=32, qk_rope_head_dim=8,
                           qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512, routed_scaling_factor=2.5,
                           eos_token_id=None, bos_token_id=None, pad_token_id=None, **CONFIGS[variant])
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 1.0 / (p.shape[-1] ** 0.5))
        model.lm_head.weight.mul_(4.0)
        model.model.embed_tokens.weight.normal_(0, 1.0)
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(path)
    return model


def quantize_experts_int4(src: Path, dst: Path, group_size: int = 32) -> dict[str, dict[str, torch.Tensor]]:
    """Copy a checkpoint, compressing every routed expert with compressed-tensors' pack-quantized compressor.

    Returns, per expert projection, what the library wrote (``weight_packed``, ``weight_scale``) and the
    dequantized weight (``dequant``) for building the unquantized twin.
    """
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    tensors = load_file(str(src / "model.safetensors"))
    written: dict[str, dict[str, torch.Tensor]] = {}
    for name in [n for n in tensors if ".mlp.experts." in n]:
        w = tensors.pop(name).float()
        groups = w.view(w.shape[0], -1, group_size)
        scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        scale = scale.to(torch.bfloat16)
        out = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp},
                                                    scheme)
        base = name.removesuffix(".weight")
        for k, v in out.items():
            tensors[f"{base}.{k}"] = v
        q = unpack_from_int32(out["weight_packed"], 4, torch.Size(w.shape))
        written[base] = {"weight_packed": out["weight_packed"], "weight_scale": out["weight_scale"],
                         "dequant": dequantize(q, scale.float(), zp, args).float()}
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group_size}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return written


def write_dequantized_twin(src: Path, dst: Path, written: dict[str, dict[str, torch.Tensor]]):
    """The same checkpoint with each expert replaced by its dequantized INT4 weight (unquantized format)."""
    tensors = load_file(str(src / "model.safetensors"))
    for base, w in written.items():
        tensors[f"{base}.weight"] = w["dequant"].to(tensors[f"{base}.weight"].dtype)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
