"""One request's state inside the engine."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kdray.engine.request import SamplingParams

STAGES = ("draft", "build", "verify", "accept", "commit")


@dataclass
class Sequence:
    """Committed tokens, KV pages and the drafter's pending context of one request.

    Invariant between steps: ``cached_len = len(prompt) + len(output) - 1``; the last output token is the
    *bonus* (chosen by the target, not yet run through it) and is the root of the next draft tree.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    cached_len: int = 0
    drafted_len: int = 0  # context positions already written into the drafter's cache
    features: torch.Tensor | None = None  # [n, F] target hidden states not yet seen by the drafter
    text: str = ""
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    steps: int = 0
    accepted: int = 0
    stage_seconds: dict = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def metrics(self) -> dict:
        return {"steps": self.steps, "tau": self.accepted / self.steps if self.steps else 0.0,
                "accepted_tokens": self.accepted, "prompt_tokens": len(self.prompt_ids),
                "generated_tokens": len(self.output_ids),
                "ttft": (self.first_token_at - self.arrival) if self.first_token_at else None,
                "seconds": dict(self.stage_seconds)}
