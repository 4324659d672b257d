"""What users pass in (``SamplingParams``) and get back (``RequestOutput``), following vLLM's names."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_SEED = 2**63 - 1  # seeds are int64 on the device; the engine draws its own from 63 bits
MAX_TOP_K = 1 << 20  # beyond any vocabulary, where top_k is the same as off
MAX_TOKENS = 1 << 24  # beyond any context length


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
            (_whole(self.max_tokens, 1, MAX_TOKENS), "max_tokens", f"an integer in [1, {MAX_TOKENS}]"),
            (_real(self.temperature) and self.temperature >= 0, "temperature", "a finite number >= 0"),
            (_real(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]"),
            (_whole(self.top_k, 0, MAX_TOP_K), "top_k", f"an integer in [0, {MAX_TOP_K}] (0 disables it)"),
            (self.seed is None or _whole(self.seed, 0, MAX_SEED), "seed", "None or an integer in [0, 2^63 - 1]"),
        ]
        for ok, name, what in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={_shown(getattr(self, name))} must be {what}")
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


def _whole(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _shown(value) -> str:
    """``value`` for an error message: short, even for an integer too long to print."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"<a {value.bit_length()}-bit integer>"
    return repr(value)[:80]


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
