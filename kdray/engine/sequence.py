"""One request's state inside the engine."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kdray.engine.request import SamplingParams
from kdray.engine.step import STAGES
from kdray.model.tokenizer import IncrementalDetokenizer
from kdray.spec.grammar import GrammarState


@dataclass
class Sequence:
    """Committed tokens and KV pages of one request, changed only by the engine (and its scheduler, which
    hands out pages and slots).

    Invariant between applied steps: ``cached_len = len(prompt) + len(output) - 1``; the last output token is
    the *bonus* (chosen by the target, not yet run through it) and is the root of the next draft tree. A
    preempted request gives its pages back and is prefilled again later from its :attr:`context_ids` (prompt and
    output but the bonus), keeping its output.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    slot: int = -1  # the runner's per-slot state (block table, sampling settings) while running
    cached_len: int = 0  # as of the last step applied (the device runs one step ahead)
    prefill_len: int = 0  # context tokens to prefill, fixed at admission
    prefilled: int = 0  # of those, the ones whose prefill (chunk by chunk, or from the prefix cache) is launched
    keys: list = field(default_factory=list)  # prefix-cache chain keys of the full pages of its committed tokens
    registered: int = 0  # pages put in the prefix cache
    cached_prompt: int | None = None  # prompt tokens found in the prefix cache at its first admission
    pages_sent: int = 0  # pages the runner's block-table row holds
    thought_sent: bool = False  # the runner's slot holds its grammar's running thought (no masks made on the host)
    preempted: bool = False  # to give its pages back once nothing in flight writes them, then wait again
    inflight: int = 0  # launched prefills and steps of this request whose results are not applied yet
    owed: int = 0  # of those, the ones that emit a token each: steps, and a new request's last prefill chunk
    detokenizer: IncrementalDetokenizer | None = None
    grammar: GrammarState | None = None  # structured_outputs: its matcher, at the committed output's end
    text: list[str] = field(default_factory=list)  # settled text not in an output yet, in pieces
    held: str = ""  # the text after it, which a stop string may still claim (at most its stop_hold characters)
    detokenized: int = 0  # output ids whose text is made (but a held unfinished character)
    reported: int = 0  # output ids its outputs have carried
    logprobs: list = field(default_factory=list)  # per output token {token id: Logprob}, when the request asks
    cumulative_logprob: float = 0.0
    prompt_logprobs: list = field(default_factory=lambda: [None])  # per prompt token scored so far (prompt_logprobs)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (None: another end)
    arrival: float = field(default_factory=time.perf_counter)
    scheduled_at: float | None = None  # perf_counter when its first prefill chunk was launched
    first_token_at: float | None = None
    steps: int = 0
    accepted: int = 0
    tree_sizes: dict = field(default_factory=dict)  # draft nodes verified -> steps
    masses: list | None = None  # budget="auto": the latest tree's mass per candidate width and depth
    stage_seconds: dict = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))

    @property
    def context_ids(self) -> list[int]:
        """The tokens a prefill runs: the prompt and, after a preemption, the output but its last (the bonus)."""
        return self.prompt_ids + self.output_ids[:-1]

    @property
    def context_len(self) -> int:
        """``len(context_ids)``, without building it."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)

    def tokens_between(self, lo: int, hi: int) -> list[int]:
        """Tokens ``[lo, hi)`` of the prompt followed by the output, without building the whole context."""
        n = len(self.prompt_ids)
        return self.prompt_ids[lo:min(hi, n)] + self.output_ids[max(lo - n, 0):max(hi - n, 0)]

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's log-probabilities are asked and not all in: its prefill scores every prompt token."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def length_limit(self, max_model_len: int) -> int:
        """Output tokens at which it ends by length: ``max_tokens``, or the context limit."""
        return min(self.params.max_tokens, max_model_len - len(self.prompt_ids))

    def ends_in_flight(self, max_model_len: int) -> bool:
        """Whether the work in flight surely ends it by length (each owed launch emits at least one token, but for
        a step that halts at a thought's end, which only delays the next one): a step launched now could only
        produce tokens that are discarded."""
        return len(self.output_ids) + self.owed >= self.length_limit(max_model_len)

    def metrics(self) -> dict:
        return {"steps": self.steps, "tau": self.accepted / self.steps if self.steps else 0.0,
                "accepted_tokens": self.accepted, "prompt_tokens": len(self.prompt_ids),
                "generated_tokens": len(self.output_ids),
                "ttft": (self.first_token_at - self.arrival) if self.first_token_at else None,
                "scheduled_at": self.scheduled_at,
                "seconds": dict(self.stage_seconds), "tree_sizes": dict(self.tree_sizes)}
