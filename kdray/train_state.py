"""The resumable state of a drafter training run (``train_state.pt`` beside the exported checkpoint): the drafter's
fp32 weights, the AdamW state, the step, the elapsed training time, the data order and RNG states, the log, and the
settings a resumed run must share with it. Files are written atomically (a temporary file, then a rename), so a run
stopped at any moment leaves the previous state or the new one, never half of one."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

STATE_FILE = "train_state.pt"


def write_atomic(path: Path, write: Callable[[Path], None]):
    """``write(tmp)`` to a temporary file beside ``path``, then rename it over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_state(out: Path, state: dict):
    """Write ``state`` (tensors, numbers, strings, lists, tuples and dicts of them) to ``out/train_state.pt``."""
    write_atomic(out / STATE_FILE, lambda tmp: torch.save(state, tmp))


def check_output(out: Path, resume: bool):
    """A ValueError when ``out`` holds a run's state and ``resume`` is off, or holds none and it is on."""
    path = out / STATE_FILE
    if path.is_file() and not resume:
        raise ValueError(f"{path} holds the state of an earlier run: pass --resume to continue it, or choose "
                         f"another --output")
    if resume and not path.is_file():
        raise ValueError(f"--resume: {out} holds no training state ({STATE_FILE}); start the run without --resume")


def load_state(out: Path) -> dict:
    """The state saved in ``out`` (on the CPU; the optimizer's state moves to its parameters when loaded)."""
    return torch.load(out / STATE_FILE, map_location="cpu", weights_only=True)


def check_settings(saved: dict, current: dict):
    """A ValueError naming every setting of ``current`` whose value differs from the run being resumed."""
    differ = [f"{name}: {saved.get(name)!r} then, {value!r} now" for name, value in current.items()
              if saved.get(name) != value]
    if differ:
        raise ValueError("--resume continues a run with its own settings, and these differ from it: "
                         + "; ".join(differ) + ". Pass the run's values, or start a new run in another --output")
