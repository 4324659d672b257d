"""What users pass in (``SamplingParams``) and get back (``RequestOutput``), following vLLM's names."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from kdray.spec.structured_outputs import StructuredOutputsParams

MAX_SEED = 2**63 - 1  # seeds are int64 on the device; the engine draws its own from 63 bits
MAX_TOP_K = 1 << 20  # beyond any vocabulary, where top_k is the same as off
MAX_TOKENS = 1 << 24  # beyond any context length
MAX_VOCAB = 1 << 24  # beyond any vocabulary: token ids lie below it
MAX_PENALTY = 2.0  # |presence_penalty| and |frequency_penalty| (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0  # repetition_penalty lies in (0, MAX_REPETITION_PENALTY]
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
MAX_BIAS = 100.0  # |bias| of one logit_bias entry
MAX_LOGPROBS = 20  # top log-probabilities per token
MAX_BAN = 96  # tokens min_tokens masks: the EOS ids (unless ignore_eos) and stop_token_ids
# The features of a request that cost the step something; a batch pays for those its requests use
FEATURES = ("bias", "logprobs", "min_p", "min_tokens", "penalties")


@dataclass
class SamplingParams:
    """How to pick tokens for one request. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 disable them.

    A request stops at EOS (unless ``ignore_eos``), at any of ``stop_token_ids`` (always; the token is kept, like
    EOS) or at a ``stop`` string (cut from the text unless ``include_stop_str_in_output``), never before ``min_tokens``
    tokens (EOS and ``stop_token_ids`` are masked until then).

    The target's logits are changed in vLLM's order: ``logit_bias`` (``{token id: bias}`` added), then
    ``repetition_penalty`` (over the prompt and the output: positive logits divided by it, negative ones multiplied),
    ``frequency_penalty`` and ``presence_penalty`` (over the output: ``count * frequency + (count > 0) * presence``
    subtracted); then temperature, ``min_p`` (tokens below ``min_p`` times the likeliest's probability dropped), top-k
    and top-p. ``logprobs`` = k reports each emitted token's log-probability and the k likeliest (see
    :class:`Logprob`); ``prompt_logprobs`` = k the same for every prompt token after the first, given the tokens
    before it (the prompt is then prefilled whole, never from the prefix cache). ``structured_outputs``
    (:class:`~kdray.spec.structured_outputs.StructuredOutputsParams`) constrains the output to a grammar (a JSON
    schema, any JSON object, a structural tag): tokens it does not allow get no probability, and the request stops
    where the grammar ends."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        checks = [
            (_whole(self.max_tokens, 1, MAX_TOKENS), "max_tokens", f"an integer in [1, {MAX_TOKENS}]"),
            (_real(self.temperature) and self.temperature >= 0, "temperature", "a finite number >= 0"),
            (_real(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]"),
            (_whole(self.top_k, 0, MAX_TOP_K), "top_k", f"an integer in [0, {MAX_TOP_K}] (0 disables it)"),
            (self.seed is None or _whole(self.seed, 0, MAX_SEED), "seed", "None or an integer in [0, 2^63 - 1]"),
            (_whole(self.min_tokens, 0, self.max_tokens) if _whole(self.max_tokens, 1, MAX_TOKENS) else True,
             "min_tokens", "an integer in [0, max_tokens]"),
            (_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1] (0 disables it)"),
            (_real(self.presence_penalty) and abs(self.presence_penalty) <= MAX_PENALTY, "presence_penalty",
             f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 disables it)"),
            (_real(self.frequency_penalty) and abs(self.frequency_penalty) <= MAX_PENALTY, "frequency_penalty",
             f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 disables it)"),
            (_real(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
             "repetition_penalty", f"a number in (0, {MAX_REPETITION_PENALTY:g}] (1 disables it)"),
            (self.logprobs is None or _whole(self.logprobs, 0, MAX_LOGPROBS), "logprobs",
             f"None or an integer in [0, {MAX_LOGPROBS}] (the top alternatives reported beside each token)"),
            (self.prompt_logprobs is None or _whole(self.prompt_logprobs, 0, MAX_LOGPROBS), "prompt_logprobs",
             f"None or an integer in [0, {MAX_LOGPROBS}] (the top alternatives reported beside each prompt token)"),
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
        bias = self.logit_bias or {}
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"SamplingParams.logit_bias must be a dict {{token id: bias}} of at most {MAX_LOGIT_BIAS} "
                             "entries")
        for t, b in bias.items():
            if not _whole(t, 0, MAX_VOCAB - 1) or not (_real(b) and abs(b) <= MAX_BIAS):
                raise ValueError(f"SamplingParams.logit_bias[{_shown(t)}]={_shown(b)}: keys must be token ids "
                                 f"(integers in [0, 2^24)), values numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
        self.logit_bias = {t: float(b) for t, b in bias.items()} or None
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("SamplingParams.structured_outputs must be a kdray.StructuredOutputsParams, not "
                                 f"{type(self.structured_outputs).__name__}")
            if self.min_tokens:
                raise ValueError("SamplingParams.min_tokens cannot be combined with structured_outputs: the grammar "
                                 "decides where the output ends (it may allow nothing but EOS earlier)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def features(self) -> frozenset[str]:
        """The costly :data:`FEATURES` this request uses (the rest of a step skips them for a batch without them)."""
        used = {"bias": self.logit_bias is not None, "logprobs": self.logprobs is not None,
                "min_p": self.min_p > 0 and not self.greedy, "min_tokens": self.min_tokens > 0,
                "penalties": (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != (0, 0, 1)}
        return frozenset(name for name, on in used.items() if on)


def join_output(whole: dict[str, RequestOutput], out: RequestOutput) -> RequestOutput:
    """Join the streamed ``out`` onto its request's output so far in ``whole`` (request id -> output; a request's first
    output is kept as it is, then grows) -> the request's output so far."""
    known = whole.setdefault(out.request_id, out)
    if known is not out:
        known.add(out)
    return known


def stop_hold(stop: list[str]) -> int:
    """Characters at the end of a running request's text that may yet turn out to begin one of its ``stop``
    strings (which are cut from the text), so are not reported while it runs."""
    return max(map(len, stop), default=1) - 1


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
class Logprob:
    """A token's log-probability under the target (``log_softmax`` of its raw logits, before any penalty, bias or
    temperature: vLLM's default), and its rank there (1: the likeliest)."""

    logprob: float
    rank: int


@dataclass
class CompletionOutput:
    """One sample. With ``SamplingParams.logprobs`` = k, ``logprobs`` holds per token ``{token id: Logprob}``: the
    emitted token first, then the k likeliest (best first; the emitted one appears once), and
    ``cumulative_logprob`` their emitted tokens' sum; else both are None."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # None while running, then "stop", "length" or "abort"
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it (EOS: None)


@dataclass
class RequestOutput:
    """One request's state: its prompt (``prompt`` is the text, None when it was given as token ids), its samples,
    whether it finished, and its metrics. A streamed output (``Engine.step``) holds only the text, token ids and
    log-probabilities added since the request's previous one (:meth:`add` joins them); its finish, cumulative
    log-probability and metrics are as of now. With ``SamplingParams.prompt_logprobs`` = k, ``prompt_logprobs``
    holds per prompt token None for the first (nothing comes before it), then ``{token id: Logprob}`` as
    ``CompletionOutput.logprobs`` does (the prompt token, then the k likeliest at its place); else it is None."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    prompt: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV the prefix cache held at the request's first admission

    def add(self, later: RequestOutput):
        """Join ``later``, the next streamed output of the same request (what it added since this one), onto this
        one in place: streamed outputs joined in order are the request's whole output."""
        for mine, new in zip(self.outputs, later.outputs, strict=True):
            mine.text += new.text
            mine.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                mine.logprobs.extend(new.logprobs)
            mine.finish_reason, mine.cumulative_logprob = new.finish_reason, new.cumulative_logprob
            mine.stop_reason = new.stop_reason
        self.finished, self.metrics = later.finished, later.metrics
