"""What users pass in (``SamplingParams``) and get back (``RequestOutput``), following vLLM's names."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens for one request. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 disable them.

    A request stops at EOS (unless ``ignore_eos``), at any of ``stop_token_ids`` (always; the token is kept, like
    EOS) or at a ``stop`` string (cut from the text unless ``include_stop_str_in_output``)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
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
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("SamplingParams.stop_token_ids must be a list of token ids (integers >= 0)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class CompletionOutput:
    """One sample. ``cumulative_logprob`` and ``logprobs`` are None: the engine does not report
    log-probabilities yet."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # None while running, then "stop", "length" or "abort"
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    """One request's state: its prompt (``prompt`` is the text, None when it was given as token ids), its samples,
    whether it finished, and its metrics."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    prompt: str | None = None
