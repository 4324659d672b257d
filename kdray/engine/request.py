"""What users pass in (``SamplingParams``) and get back (``RequestOutput``), following vLLM's names."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens for one request. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 disable them."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        checks = [
            (isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1,
             "max_tokens", "an integer >= 1"),
            (isinstance(self.temperature, (int, float)) and self.temperature >= 0, "temperature", "a number >= 0"),
            (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0 (0 disables it)"),
            (self.seed is None or isinstance(self.seed, int), "seed", "an integer or None"),
        ]
        for ok, name, what in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} must be {what}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("SamplingParams.stop must be a string or a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # None while running, then "stop", "length" or "abort"


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
