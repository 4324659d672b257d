"""From a model name (a preset, an HF checkpoint directory or a GGUF file) to a loaded target model."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kdray.config import load_model_config
from kdray.model.checkpoint import CheckpointReader
from kdray.model.k2 import K2Model
from kdray.model.parallel import SINGLE
from kdray.model.presets import PRESETS, k2_tiny_path
from kdray.model.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedTarget:
    model: torch.nn.Module
    config: object
    tokenizer: Tokenizer | None
    name: str


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype='{dtype}' is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_model(model: str) -> Path:
    """A preset name or a path -> the checkpoint directory or GGUF file to load."""
    if model == "k2-tiny":
        return k2_tiny_path()
    if model == "smollm2-135m":
        from kdray.model.gguf import smollm2_path

        return smollm2_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model '{model}' is neither a preset ({', '.join(PRESETS)}) nor an existing path")
    return path


def load_target(model: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                group=SINGLE, expert_parallel: bool = False) -> LoadedTarget:
    """Build the target for ``model`` on ``device`` with this rank's slice of the weights."""
    torch_dtype, path = parse_dtype(dtype), resolve_model(model)
    if path.suffix == ".gguf":
        from kdray.model.gguf import load_gguf_target

        loaded = load_gguf_target(path, torch_dtype, device, group)
        loaded.name = model
        return loaded
    cfg = load_model_config(path)
    with torch.device(device):
        if cfg.architecture == "k2":
            net = K2Model(cfg, torch_dtype, group, expert_parallel)
        else:
            from kdray.model.llama import LlamaModel

            net = LlamaModel(cfg, torch_dtype, group)
    reader = CheckpointReader(path)
    try:
        with torch.no_grad():
            net.load(reader)
    finally:
        reader.close()
    tok = Tokenizer.from_dir(path)
    return LoadedTarget(net.eval(), cfg, tok, model)
