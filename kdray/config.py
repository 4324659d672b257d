"""Validated configuration dataclasses of every model kdray loads (K2, Llama, the DFlash drafter) and the
speculative step; the engine's settings are :class:`kdray.engine.args.EngineArgs`.

Every user-facing value is checked where it enters (``from_hf`` / ``__post_init__``) and a bad one
raises ``ValueError`` that names the field and says what would fix it.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

K2_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
LLAMA_MODEL_TYPES = ("llama",)
DFLASH_BLOCK_SIZE = 16  # DFlash's block (the bonus token and 15 drafts) when a checkpoint or the args name none


def _require(raw: dict, name: str, source: str) -> Any:
    if name not in raw:
        raise ValueError(f"{source}: missing required field '{name}' in config.json")
    return raw[name]


@dataclass(frozen=True)
class Int4Config:
    """compressed-tensors ``pack-quantized`` W4A16: symmetric int4 weights, one bf16 scale per group."""

    group_size: int = 32
    num_bits: int = 4
    symmetric: bool = True

    def __post_init__(self):
        if self.num_bits != 4:
            raise ValueError(f"quantization_config: num_bits={self.num_bits}; kdray supports 4-bit weights only")
        if not self.symmetric:
            raise ValueError("quantization_config: asymmetric int4 (zero points) is not supported; use symmetric: true")
        if self.group_size <= 0 or self.group_size % 8:
            raise ValueError(f"quantization_config: group_size={self.group_size} must be a positive multiple of 8")

    @classmethod
    def from_hf(cls, qc: dict | None, source: str) -> "Int4Config | None":
        """Parse an HF ``quantization_config``; None when the checkpoint is not quantized."""
        if not qc:
            return None
        method = qc.get("quant_method")
        if method != "compressed-tensors":
            raise ValueError(f"{source}: quant_method '{method}' is not supported; kdray reads compressed-tensors "
                             "pack-quantized INT4 checkpoints (or unquantized bf16/fp32 ones)")
        fmt = qc.get("format")
        if fmt != "pack-quantized":
            raise ValueError(f"{source}: compressed-tensors format '{fmt}' is not supported; expected 'pack-quantized'")
        groups = qc.get("config_groups") or {}
        if not groups:
            raise ValueError(f"{source}: quantization_config has no config_groups")
        weights = next(iter(groups.values())).get("weights") or {}
        if weights.get("strategy", "group") != "group":
            raise ValueError(f"{source}: weight strategy '{weights.get('strategy')}' is not supported; expected 'group'")
        return cls(group_size=int(weights.get("group_size", 32)), num_bits=int(weights.get("num_bits", 4)),
                   symmetric=bool(weights.get("symmetric", True)))


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling fields as DeepSeek-V3 / Kimi K2 write them."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self):
        if self.factor < 1.0:
            raise ValueError(f"rope_scaling.factor={self.factor} must be >= 1")
        if self.beta_fast <= 0 or self.beta_slow <= 0:
            raise ValueError("rope_scaling.beta_fast and beta_slow must be positive")


def _rope_fields(raw: dict) -> tuple[float, str, dict]:
    """(rope_theta, scaling type or "default", scaling fields) from ``rope_scaling`` (HF 4.x) or
    ``rope_parameters`` (HF 5.x)."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    return theta, scaling.get("rope_type", scaling.get("type")) or "default", scaling


def _parse_rope(raw: dict, source: str) -> tuple[float, YarnScaling | None]:
    """Return (rope_theta, yarn or None) from either ``rope_scaling`` (HF 4.x) or ``rope_parameters`` (HF 5.x)."""
    theta, kind, scaling = _rope_fields(raw)
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ValueError(f"{source}: rope scaling type '{kind}' is not supported; expected 'yarn' or none")
    try:
        yarn = YarnScaling(
            factor=float(scaling["factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            beta_fast=float(scaling.get("beta_fast", 32.0)), beta_slow=float(scaling.get("beta_slow", 1.0)),
            mscale=float(scaling.get("mscale", 1.0)), mscale_all_dim=float(scaling.get("mscale_all_dim", 0.0)))
    except KeyError as e:
        raise ValueError(f"{source}: rope_scaling of type yarn is missing '{e.args[0]}'") from None
    return theta, yarn


@dataclass(frozen=True)
class K2Config:
    """Kimi K2 / DeepSeek-V3 architecture (MLA attention, sigmoid-routed MoE)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    quantization: Int4Config | None = None
    model_type: str = "deepseek_v3"

    architecture = "k2"

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f}={getattr(self, f)} must be positive")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} must lie in [0, num_hidden_layers]")
        if self.first_k_dense_replace < self.num_hidden_layers:
            if self.n_routed_experts <= 0 or self.moe_intermediate_size <= 0:
                raise ValueError("MoE layers need n_routed_experts > 0 and moe_intermediate_size > 0")
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must lie in "
                                 f"[1, n_routed_experts={self.n_routed_experts}]")
            if self.n_group < 1 or self.n_routed_experts % self.n_group:
                raise ValueError(f"n_group={self.n_group} must divide n_routed_experts={self.n_routed_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group={self.topk_group} must lie in [1, n_group={self.n_group}]")
            if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
                raise ValueError("group-limited routing needs at least 2 experts per group")
            if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
                raise ValueError("num_experts_per_tok exceeds the experts reachable through topk_group groups")
        if self.quantization is not None and self.first_k_dense_replace < self.num_hidden_layers:
            g = self.quantization.group_size
            if self.hidden_size % g or self.moe_intermediate_size % g:
                raise ValueError(f"INT4 group_size={g} must divide hidden_size={self.hidden_size} and "
                                 f"moe_intermediate_size={self.moe_intermediate_size}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token and layer: the normalised latent plus the roped key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.rope_scaling is not None and self.rope_scaling.mscale_all_dim:
            m = 0.1 * self.rope_scaling.mscale_all_dim * math.log(self.rope_scaling.factor) + 1.0
            scale *= m * m
        return scale

    @classmethod
    def from_hf(cls, raw: dict, source: str = "config.json") -> "K2Config":
        req = lambda n: _require(raw, n, source)  # noqa: E731
        theta, yarn = _parse_rope(raw, source)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        q_lora = raw.get("q_lora_rank")
        return cls(
            vocab_size=int(req("vocab_size")), hidden_size=int(req("hidden_size")),
            intermediate_size=int(req("intermediate_size")),
            moe_intermediate_size=int(raw.get("moe_intermediate_size", 0) or 0),
            num_hidden_layers=int(req("num_hidden_layers")), num_attention_heads=int(req("num_attention_heads")),
            n_routed_experts=int(raw.get("n_routed_experts") or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            kv_lora_rank=int(req("kv_lora_rank")), q_lora_rank=None if q_lora in (None, 0) else int(q_lora),
            qk_nope_head_dim=int(req("qk_nope_head_dim")), qk_rope_head_dim=int(req("qk_rope_head_dim")),
            v_head_dim=int(req("v_head_dim")),
            first_k_dense_replace=int(raw.get("first_k_dense_replace", 0)),
            n_group=int(raw.get("n_group") or 1), topk_group=int(raw.get("topk_group") or 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=yarn,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), eos_token_ids=eos_ids,
            quantization=Int4Config.from_hf(raw.get("quantization_config"), source),
            model_type=raw["model_type"])


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1 RoPE scaling: long wavelengths divided by ``factor``, a smooth ramp between the two bands."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if self.factor < 1.0:
            raise ValueError(f"rope_scaling.factor={self.factor} must be >= 1")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"rope_scaling needs 0 < low_freq_factor={self.low_freq_factor} < "
                             f"high_freq_factor={self.high_freq_factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError("rope_scaling.original_max_position_embeddings must be positive")


@dataclass(frozen=True)
class LlamaConfig:
    """Dense Llama-family architecture (GQA attention, SwiGLU MLP, RMSNorm, NeoX-style RoPE)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Llama3Scaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"

    architecture = "llama"

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f}={getattr(self, f)} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} must be positive")

    @classmethod
    def from_hf(cls, raw: dict, source: str = "config.json") -> "LlamaConfig":
        req = lambda n: _require(raw, n, source)  # noqa: E731
        for flag in ("attention_bias", "mlp_bias"):
            if raw.get(flag):
                raise ValueError(f"{source}: {flag}=true is not supported; kdray's Llama has no linear biases")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act='{raw['hidden_act']}' is not supported; expected 'silu'")
        if raw.get("quantization_config"):
            raise ValueError(f"{source}: quantized Llama checkpoints are not supported; use a bf16/fp32 "
                             "checkpoint or a GGUF file")
        hidden, heads = int(req("hidden_size")), int(req("num_attention_heads"))
        if not raw.get("head_dim") and hidden % heads:
            raise ValueError(f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads}; "
                             "set head_dim")
        theta, kind, scaling = _rope_fields(raw)
        if kind not in ("default", "llama3"):
            raise ValueError(f"{source}: rope scaling type '{kind}' is not supported for Llama; "
                             "expected 'llama3' or none")
        llama3 = None
        if kind == "llama3":
            try:
                llama3 = Llama3Scaling(
                    factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
                    high_freq_factor=float(scaling["high_freq_factor"]),
                    original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
            except KeyError as e:
                raise ValueError(f"{source}: rope_scaling of type llama3 is missing '{e.args[0]}'") from None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(req("vocab_size")), hidden_size=hidden, intermediate_size=int(req("intermediate_size")),
            num_hidden_layers=int(req("num_hidden_layers")), num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=llama3,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), eos_token_ids=eos_ids,
            model_type=raw.get("model_type", "llama"))


def load_model_config(raw_or_path: dict | str | Path):
    """Parse an HF ``config.json`` (a dict or a checkpoint directory) into the matching model config."""
    if isinstance(raw_or_path, dict):
        raw, source = raw_or_path, "config"
    else:
        path = Path(raw_or_path)
        cfg_file = path / "config.json" if path.is_dir() else path
        if not cfg_file.is_file():
            raise ValueError(f"{path}: no config.json found; point model= at an HF checkpoint directory")
        source = str(cfg_file)
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}: not valid JSON ({e})") from None
    model_type = raw.get("model_type")
    if model_type in K2_MODEL_TYPES:
        return K2Config.from_hf(raw, source)
    if model_type in LLAMA_MODEL_TYPES:
        return LlamaConfig.from_hf(raw, source)
    raise ValueError(f"{source}: unknown model_type '{model_type}'; kdray supports "
                     f"{', '.join(K2_MODEL_TYPES + LLAMA_MODEL_TYPES)}")


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 32768

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"drafter num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.block_size < 2:
            raise ValueError(f"drafter block_size={self.block_size} must be >= 2")
        if not self.target_layer_ids or not all(0 <= i < self.num_target_layers for i in self.target_layer_ids):
            raise ValueError(f"drafter target_layer_ids={list(self.target_layer_ids)} must be non-empty and lie in "
                             f"[0, num_target_layers={self.num_target_layers})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"drafter mask_token_id={self.mask_token_id} is outside the vocabulary")

    @classmethod
    def from_hf(cls, raw: dict, source: str = "config.json") -> "DFlashConfig":
        dc = raw.get("dflash_config") or {}
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if k not in raw] + ([] if "mask_token_id" in dc else
                                                                 ["dflash_config.mask_token_id"])
        if missing:
            raise ValueError(f"{source}: DFlash drafter config lacks {', '.join(missing)}")
        layers, heads = int(raw["num_hidden_layers"]), int(raw["num_attention_heads"])
        n_target = int(raw.get("num_target_layers", 0))
        ids = dc.get("target_layer_ids") or default_target_layer_ids(n_target, layers)
        if any(t != "full_attention" for t in raw.get("layer_types") or []):
            raise ValueError(f"{source}: sliding-window drafter layers are not supported")
        rope = raw.get("rope_parameters") or {}
        return cls(hidden_size=int(raw["hidden_size"]), intermediate_size=int(raw["intermediate_size"]),
                   num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
                   head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
                   block_size=int(raw.get("block_size", dc.get("block_size", DFLASH_BLOCK_SIZE))),
                   mask_token_id=int(dc["mask_token_id"]), target_layer_ids=tuple(int(i) for i in ids),
                   num_target_layers=n_target or max(ids) + 1, vocab_size=int(raw["vocab_size"]),
                   rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                   rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 1000000.0))),
                   max_position_embeddings=int(raw.get("max_position_embeddings", 32768)))

    def to_hf(self) -> dict:
        d = asdict(self)
        return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": d.pop("block_size"),
                "num_target_layers": d.pop("num_target_layers"),
                "dflash_config": {"mask_token_id": d.pop("mask_token_id"),
                                  "target_layer_ids": list(d.pop("target_layer_ids"))},
                "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False, **d}


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Spread ``num_draft_layers`` ids evenly over target layers 1 .. N-3 (DFlash's default)."""
    if num_target_layers < 1:
        raise ValueError("num_target_layers must be given when dflash_config.target_layer_ids is absent")
    lo = min(1, num_target_layers - 1)
    hi = max(num_target_layers - 3, lo)
    if num_draft_layers == 1:
        return [(lo + hi) // 2]
    return [round(lo + (hi - lo) * i / (num_draft_layers - 1)) for i in range(num_draft_layers)]


SPEC_MODES = ("ddtree", "chain", "ar")
LOAD_FORMATS = ("auto", "dummy")  # the checkpoint's weights, or random ones of its config (vLLM's names)


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding as the engine runs it: ``ddtree`` (best-first draft tree), ``chain`` (plain DFlash)
    or ``ar`` (none). Derived from validated :class:`~kdray.engine.args.EngineArgs` and the drafter's block size."""

    mode: str
    budget: int  # draft nodes per sequence (with ``auto``: the most a step may verify)
    block_size: int
    auto: bool = False  # each step's tree width chosen by the cost model (kdray.spec.budget)

    @property
    def depth(self) -> int:
        """L: draft positions after the bonus token."""
        return 0 if self.mode == "ar" else self.block_size - 1

    @property
    def nodes(self) -> int:
        """Draft nodes per sequence per step (root excluded)."""
        return {"ar": 0, "chain": self.depth, "ddtree": self.budget}[self.mode]

    @property
    def cache_slack(self) -> int:
        """Cache positions past the committed length that a step writes (tree slots or the draft block)."""
        return max(self.nodes + 1, self.depth + 1)

    @property
    def max_topk(self) -> int | None:
        """Candidates kept per depth: one for a chain, up to the budget for a tree."""
        return 1 if self.mode == "chain" else None


__all__ = ["Int4Config", "YarnScaling", "K2Config", "Llama3Scaling", "LlamaConfig", "DFlashConfig", "SpecConfig",
           "load_model_config", "default_target_layer_ids", "SPEC_MODES", "LOAD_FORMATS",
           "DFLASH_BLOCK_SIZE"]
