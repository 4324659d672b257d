"""Loading models by name: a preset, an HF checkpoint directory or a GGUF file -> a target (or just its
embedding and LM head, for the drafter's actor), and a DFlash drafter checked against its target.

Every path goes through :func:`open_checkpoint` (config, tensor reader, tokenizer) and the model's own
``load(reader)``, which reads only this rank's slice of each tensor; ``load_format="dummy"`` reads the config and
tokenizer alone and fills the weights with random values on the device (:mod:`kdray.model.dummy`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kdray.config import DFLASH_BLOCK_SIZE, LOAD_FORMATS, load_model_config
from kdray.model.checkpoint import CheckpointReader, NoWeightsError
from kdray.model.dflash import DFlashDrafter
from kdray.model.dummy import fill_random
from kdray.model.k2 import K2Model
from kdray.model.layers import TargetHead
from kdray.model.llama import LlamaModel
from kdray.model.parallel import SINGLE
from kdray.model.presets import PRESETS, k2_tiny_path
from kdray.model.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedTarget:
    model: TargetHead  # a whole target (K2Model, LlamaModel), or only its embedding and LM head
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


def model_config(model: str):
    """The config of ``model`` (a preset or a path), read without its weights."""
    path = resolve_model(model)
    if path.suffix == ".gguf":
        from kdray.model.gguf import open_gguf

        return open_gguf(path)[0]
    return load_model_config(path)


@dataclass(frozen=True)
class _Width:
    """Rank 0 of a tensor-parallel group of ``size``, for building a shard's shapes only (no collective runs)."""

    size: int
    rank: int = 0


def check_parallel(model: str, tp: int, expert_parallel: bool = False):
    """Refuse a TP width (with expert parallelism: the experts split by id) that the model's heads, experts or
    widths do not divide, before any weight is read. The ``ValueError`` names the dimension, the numbers and the
    widths that fit."""
    if tp == 1:
        return
    cfg = model_config(model)
    problem = _misfit(cfg, tp, expert_parallel)
    if problem is not None:
        widths = ", ".join(str(w) for w in range(1, 9) if _misfit(cfg, w, expert_parallel) is None)
        raise ValueError(f"tp={tp}{' with expert_parallel' if expert_parallel else ''} does not fit model "
                         f"'{model}': {problem}; widths up to 8 that fit: {widths}")


def _misfit(cfg, width: int, expert_parallel: bool) -> str | None:
    """Why rank 0's shard at TP ``width`` cannot be built (on the meta device, where every split is checked), or
    None when it can."""
    try:
        with torch.device("meta"):
            _target(cfg, torch.float32, _Width(width), expert_parallel)
    except ValueError as e:
        return str(e)
    return None


def _target(cfg, dtype: torch.dtype, group, expert_parallel: bool) -> TargetHead:
    """An unloaded target for ``cfg`` (its architecture's model), this rank's shard of it."""
    if cfg.architecture == "k2":
        return K2Model(cfg, dtype, group, expert_parallel)
    return LlamaModel(cfg, dtype, group)


def open_checkpoint(path: Path, weights: bool = True):
    """(config, tensor reader with ``get`` and ``close`` or None without ``weights``, tokenizer or None) of an HF
    directory or a GGUF file."""
    if path.suffix == ".gguf":
        from kdray.model.gguf import open_gguf

        cfg, reader, tokenizer = open_gguf(path)
        if not weights:
            reader.close()
        return cfg, reader if weights else None, tokenizer
    cfg = load_model_config(path)
    try:
        reader = CheckpointReader(path) if weights else None
    except NoWeightsError as e:
        raise NoWeightsError(f"{e} To run its config with random weights (benchmarks), load it with "
                             "load_format='dummy'.") from None
    return cfg, reader, Tokenizer.from_dir(path)


def load_target(model: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                group=SINGLE, expert_parallel: bool = False, head_only: bool = False,
                load_format: str = "auto") -> LoadedTarget:
    """Build the target for ``model`` on ``device`` with this rank's slice of the weights; ``head_only`` builds
    just the embedding and LM head (what the drafter borrows). ``load_format="dummy"`` reads only the config (and
    tokenizer) and fills the weights with seeded random values in place on ``device``."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} must be one of {', '.join(LOAD_FORMATS)}")
    torch_dtype = parse_dtype(dtype)
    cfg, reader, tokenizer = open_checkpoint(resolve_model(model), weights=load_format == "auto")
    with torch.device(device):
        net = TargetHead(cfg, torch_dtype) if head_only else _target(cfg, torch_dtype, group, expert_parallel)
    if reader is None:
        return LoadedTarget(fill_random(net), cfg, tokenizer, model)
    try:
        with torch.no_grad():
            net.load(reader)
    finally:
        reader.close()
    return LoadedTarget(net.eval(), cfg, tokenizer, model)


def load_drafter(drafter: str | DFlashDrafter | None, target_config, dtype: torch.dtype, device,
                 block_size: int | None) -> DFlashDrafter | None:
    """None, ``"random"`` (shaped to the target, for tests), a DFlash checkpoint directory or a loaded drafter,
    checked against the target it drafts for."""
    if drafter is None:
        return None
    if isinstance(drafter, str) and drafter == "random":
        return DFlashDrafter.random_for(target_config, block_size or DFLASH_BLOCK_SIZE, dtype, device)
    d = drafter if isinstance(drafter, DFlashDrafter) else DFlashDrafter.from_pretrained(drafter, dtype, device)
    if d.cfg.hidden_size != target_config.hidden_size or d.cfg.vocab_size != target_config.vocab_size:
        raise ValueError(f"drafter '{drafter}' (hidden {d.cfg.hidden_size}, vocab {d.cfg.vocab_size}) does not match "
                         f"the target (hidden {target_config.hidden_size}, vocab {target_config.vocab_size})")
    if max(d.cfg.target_layer_ids) >= target_config.num_hidden_layers:
        raise ValueError(f"drafter '{drafter}' reads target layers {list(d.cfg.target_layer_ids)}, but the target has "
                         f"{target_config.num_hidden_layers}")
    return d
