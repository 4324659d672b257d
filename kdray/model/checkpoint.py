"""Reading HF safetensors checkpoints (one file, or shards listed in ``model.safetensors.index.json``).

``CheckpointReader.get`` checks each tensor's full shape before it reads only the slice a shard
needs, so a rank never materialises weights it does not own.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file or tensor and what is wrong."""


class NoWeightsError(CheckpointError):
    """A checkpoint directory without weight files (a ``config.json`` alone, say)."""


class CheckpointReader:
    """Random access to the tensors of an HF safetensors checkpoint directory."""

    def __init__(self, path: str | Path, progress: bool | None = None):
        self.path = Path(path)
        self._where = self._index()  # tensor name -> file
        self._handles: dict[Path, object] = {}
        self._progress = _Progress(len(self._where), sys.stderr.isatty() if progress is None else progress)

    def _index(self) -> dict[str, Path]:
        index_path = self.path / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path}: corrupt index ({type(e).__name__}: {e}); it must be JSON "
                                      "with a 'weight_map' of tensor name -> shard file") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to shard files")
            files = {f: self.path / f for f in set(weight_map.values())}
            for f, p in files.items():
                if not p.is_file():
                    raise CheckpointError(f"{index_path}: lists shard '{f}', which is missing from {self.path}")
            return {name: files[f] for name, f in weight_map.items()}
        single = self.path / SINGLE_FILE
        if not single.is_file():
            raise NoWeightsError(f"{self.path}: no {SINGLE_FILE} or {INDEX_FILE}; is this an HF checkpoint "
                                 "directory saved with safetensors?")
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}

    def _open(self, name: str):
        if name not in self._where:
            raise CheckpointError(f"{self.path}: tensor '{name}' is missing from the checkpoint")
        file = self._where[name]
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(file, framework="pt")
            except Exception as e:  # safetensors raises its own error types for truncated files
                raise CheckpointError(f"{file}: cannot be read as safetensors ({e})") from None
        return self._handles[file]

    def get(self, name: str, shape: tuple[int, ...], shard: tuple[int, int, int] | None = None) -> torch.Tensor:
        """Read ``name``, check that its full shape is ``shape``; ``shard=(dim, start, end)`` reads that slice."""
        sl = self._open(name).get_slice(name)
        found = tuple(sl.get_shape())
        if found != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor '{name}' has shape {list(found)}, expected {list(shape)}")
        if shard is None:
            t = sl[:]
        else:
            dim, start, end = shard
            t = sl[(slice(None),) * dim + (slice(start, end),)]
        self._progress.step()
        return t

    def close(self):
        self._progress.close()
        self._handles.clear()


class _Progress:
    """A one-line tensor counter on a terminal; silent otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled and total > 0

    def step(self):
        self.done += 1
        if self.enabled and (self.done % 16 == 0 or self.done == self.total):
            sys.stderr.write(f"\rloading weights: {self.done}/{self.total} tensors")
            sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")
