"""The engine: requests in, tokens out, one ``step()`` at a time (the same in-process and on Ray).

The engine owns request state. Its runner (a :class:`~kdray.engine.runner.ModelRunner` in this process,
or :class:`~kdray.actors.ray_runner.RayRunner` on actors) takes host batches and returns tokens; the
engine applies each result to its requests in one place, :meth:`Engine._advance`.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from kdray.engine.request import MAX_BAN, CompletionOutput, Logprob, RequestOutput, SamplingParams, stop_hold
from kdray.engine.scheduler import Scheduler
from kdray.engine.sequence import Sequence
from kdray.engine.step import Pending, PrefillBatch, StepBatch
from kdray.model.tokenizer import IncrementalDetokenizer
from kdray.spec.budget import BudgetPolicy
from kdray.spec.grammar import Grammars, GrammarState, next_token_masks

TEXT_PIECES = 1024  # pieces of a request's unreported text kept before they are joined into one


class RunnerFailure(RuntimeError):
    """The runner lost its state (a Ray actor died or failed mid-step); ``request_ids`` lists the requests
    that failed with it."""

    def __init__(self, message: str, request_ids: tuple[str, ...] = ()):
        super().__init__(message)
        self.request_ids = tuple(request_ids)


@dataclass
class _Launch:
    """Work launched on the device: a prefill of ``seqs`` or one step of them (verifying ``nodes`` draft nodes
    each), its result pending."""

    seqs: list[Sequence]
    pending: Pending
    prefill: bool
    nodes: int = 0
    at: float = 0.0  # perf_counter when launched
    grammar: bool = False  # a sequence has a grammar (the next launch follows its tokens: it waits for them)
    last: list[bool] | None = None  # prefill: which chunks end their context
    starts: list[int] | None = None  # prefill: where each chunk starts


@dataclass
class StepReport:
    """What one :meth:`Engine.step` applied: each stage's seconds, and per sequence stepped (draft nodes it verified,
    draft tokens it accepted)."""

    seconds: dict[str, float] = field(default_factory=dict)
    drafts: list[tuple[int, int]] = field(default_factory=list)


class Engine:
    """Continuous batching over a runner: each ``step()`` prefills newly admitted requests and runs one
    speculative step for the rest, then reports every request that emitted tokens or finished."""

    def __init__(self, runner, scheduler: Scheduler, tokenizer, max_model_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], model_name: str, nodes: int, policy: BudgetPolicy | None = None,
                 grammars: Grammars | None = None):
        """``nodes``: draft nodes per sequence per step; ``policy`` (``budget="auto"``) chooses them each step;
        ``grammars`` compiles ``structured_outputs`` (None: refused)."""
        self.runner, self.scheduler, self.tokenizer = runner, scheduler, tokenizer
        self.nodes, self.policy = nodes, policy
        self.grammars = grammars or Grammars(None, vocab_size, (), "this engine was built without grammars")
        self.max_model_len, self.vocab_size, self.model_name = max_model_len, vocab_size, model_name
        self.eos_token_ids = set(eos_token_ids)
        self._seqs: dict[str, Sequence] = {}
        self._seed_source = random.Random()
        self._inflight: list[_Launch] = []  # launched on the device, results not yet applied
        self.report = StepReport()  # what the last step (or drain) applied

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; bad input raises ``ValueError`` naming the problem."""
        if request_id in self._seqs:
            raise ValueError(f"request id '{request_id}' is already in use")
        if not prompt_token_ids:
            raise ValueError("prompt is empty: give at least one token")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; the context limit is {self.max_model_len} "
                             "(prompt plus at least one generated token)")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop: model '{self.model_name}' has no tokenizer, so stop strings cannot match; "
                             "leave them out")
        outside = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if outside:
            raise ValueError(f"logit_bias: token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(self._ban(params)) > MAX_BAN:
            raise ValueError(f"min_tokens: masks the EOS ids and stop_token_ids until it is reached, at most {MAX_BAN} "
                             "of them; give fewer stop_token_ids")
        grammar = None
        if params.structured_outputs is not None:
            try:
                grammar = self.grammars.start(params.structured_outputs)
            except ValueError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        seq = Sequence(request_id, list(prompt_token_ids), params, seed,
                       detokenizer=IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None,
                       grammar=grammar)
        need, have = self.scheduler.pages_at_most(seq), self.scheduler.pool.num_pages
        if need > have:
            raise ValueError(f"the request may need {need} KV pages (prompt and max_tokens); the pool has {have}: "
                             "lower max_tokens, shorten the prompt or give the engine more pages (num_pages)")
        self._seqs[request_id] = seq
        self.scheduler.waiting.append(seq)

    def abort_request(self, request_id: str) -> None:
        """Drop a request and free its pages, at once or (while a step in flight still writes them) when that
        step is collected; no-op for unknown or finished ids."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        seq.finish_reason = seq.finish_reason or "abort"
        if seq.inflight == 0:
            self.scheduler.abort(request_id)
            del self._seqs[request_id]

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running, or a step still on the device whose pages are not back yet."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._inflight)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def free_pages(self) -> int:
        return self.scheduler.pool.free_pages()

    def step(self, stream: bool = True) -> list[RequestOutput]:
        """Launch the next step on the device, then apply the one before it while this one runs: the host is one
        step behind. Prefill what the scheduler admits, step what runs, report every request that emitted tokens
        or finished (``stream``: each output holds what its request added since its last one, see :meth:`_output`),
        or only those that finished (whole, their text then made once, at the end). Tokens a request produced after
        its end (found one step late) are discarded; its pages come back once no step in flight can write them. A
        request with a grammar masks its next step by its tokens so far, so while one is in flight the step before
        is applied first (that step pipelines nothing). Inside a grammar's free thought (one mask throughout) steps
        pipeline: the step launched before the host has seen the thought's end emits nothing for it (its slot halts
        on the device until the host ends the thought, see :meth:`SlotState.halt_thoughts`).

        Any error fails every running request (their state is gone, their pages freed) and is raised as a
        :class:`RunnerFailure` naming them; waiting requests stay queued, so the engine serves on."""
        self.report = StepReport()
        try:
            touched = []
            if any(launch.grammar for launch in self._inflight):
                # a grammar masks a sequence's next step by the tokens of its last one: apply that first
                previous, self._inflight = self._inflight, []
                touched = self._collect(previous, time.perf_counter(), stream)
            launched = self._launch()
            previous, self._inflight = self._inflight, launched
            touched += self._collect(previous, time.perf_counter(), stream)
        except Exception as e:  # noqa: BLE001 - one step's failure must not end the engine
            failed = tuple(dict.fromkeys(s.request_id for s in self.scheduler.running))
            self._inflight = []
            for seq in list(self.scheduler.running):
                seq.inflight = seq.owed = 0
                self.abort_request(seq.request_id)
            self.scheduler.pool.forget()  # a rebuilt runner's caches hold none of the cached prefixes
            if isinstance(e, RunnerFailure):
                raise type(e)(f"{e}\n-> request(s) {list(failed)} failed", failed) from None
            raise RunnerFailure(f"the step failed ({type(e).__name__}: {e})\n-> request(s) {list(failed)} failed",
                                failed) from e
        return [self._output(s) for s in touched if stream or s.finished]

    def drain(self) -> list[RequestOutput]:
        """Apply the step still in flight without launching another (its pages come back)."""
        self.report = StepReport()
        previous, self._inflight = self._inflight, []
        return [self._output(s) for s in self._collect(previous, None)]

    def _launch(self) -> list[_Launch]:
        """Admit, pick this step's sequences (pages for what they may write; preemption when none are left), then
        launch the context chunks that fit the step's remaining token budget and the step itself (the runner runs a
        lone chunk inside the step's pass where it can)."""
        self.scheduler.admit()
        batch = self.scheduler.reserve(self.scheduler.decode_batch())
        for seq in [s for s in self.scheduler.running if s.preempted and s.inflight == 0]:
            self.scheduler.release(seq)  # nothing in flight writes its pages: back to the pool, the request waits
        nodes = 0
        if batch:
            nodes = self.policy.choose([s.masses for s in batch]) if self.policy is not None else self.nodes
        chunks = self.scheduler.prefill_chunks(self.scheduler.max_tokens_per_step - len(batch) * (1 + nodes))
        prefill = step = None
        if chunks:
            seqs = [seq for seq, _, _ in chunks]
            prefill = PrefillBatch(
                slots=[s.slot for s in seqs], prompts=[s.tokens_between(a, b) for s, a, b in chunks],
                starts=[a for _, a, _ in chunks], pages=[list(s.pages) for s in seqs], params=[s.params for s in seqs],
                seeds=[s.seed for s in seqs], last=[b == s.prefill_len for s, _, b in chunks],
                roots=[s.output_ids[-1] if s.output_ids else None for s in seqs],
                prompt_lens=[len(s.prompt_ids) for s in seqs], bans=[self._ban(s.params) for s in seqs],
                histories=[s.context_ids if b == s.prefill_len and "penalties" in s.params.features else None
                           for s, _, b in chunks], allowed=_first_masks(seqs, self.vocab_size),
                scored=[s.prompt_ids[a + 1:b + 1] if s.scores_prompt else [] for s, a, b in chunks])
            now = time.perf_counter()
            for seq, _, end in chunks:
                seq.prefilled, seq.pages_sent, seq.thought_sent = end, len(seq.pages), False
                seq.scheduled_at = seq.scheduled_at or now
        if batch:
            grown, thoughts = {}, {}  # slot -> its pages, where they grew since last sent; its thought, where changed
            for seq in batch:
                if len(seq.pages) != seq.pages_sent:
                    grown[seq.slot], seq.pages_sent = list(seq.pages), len(seq.pages)
                mask = seq.grammar.thought_mask(self.vocab_size) if seq.grammar is not None else None
                if (mask is not None) != seq.thought_sent:
                    thoughts[seq.slot] = (seq.grammar.thought.end, mask) if mask is not None else (-1, None)
                    seq.thought_sent = mask is not None
            step = StepBatch([s.slot for s in batch], nodes, grown,
                             _grammars([None if s.thought_sent else s.grammar for s in batch]), thoughts)
        prefilled, stepped = self.runner.launch(prefill, step)
        launches = []
        if prefill is not None:
            launches.append(_Launch(seqs, prefilled, prefill=True, last=prefill.last, starts=prefill.starts,
                                    grammar=prefill.allowed is not None))
        if step is not None:
            launches.append(_Launch(batch, stepped, prefill=False, nodes=nodes, at=time.perf_counter(),
                                    grammar=step.grammars is not None))
        for launch in launches:
            for i, seq in enumerate(launch.seqs):
                seq.inflight += 1
                seq.owed += _emits(launch, i, seq)
        return launches

    def _collect(self, launches: list[_Launch], now: float | None, stream: bool = True) -> list[Sequence]:
        """Apply launched work's results to its requests; give back the pages of those that ended (or were
        preempted) and have nothing in flight. ``now``: when the next step was launched (a step's wall time, for
        the budget policy's cost table); ``stream``: the requests' text kept current (see :meth:`_emit`)."""
        touched = []
        for launch in launches:
            result = launch.pending.result()
            tokens, masses = result.tokens, result.masses or [None] * len(result.tokens)
            logprobs = result.logprobs or [None] * len(tokens)
            scores = result.prompt_logprobs or [None] * len(tokens)
            if not launch.prefill:
                share = {k: v / len(launch.seqs) for k, v in result.seconds.items()}
                for stage, s in result.seconds.items():
                    self.report.seconds[stage] = self.report.seconds.get(stage, 0.0) + s
                if self.policy is not None:  # its acceptance from the sequences that stepped (a halted one did not)
                    stepped = [i for i, t in enumerate(tokens) if t]
                    self.policy.observe(launch.nodes, [result.masses[i] for i in stepped]
                                        if result.masses is not None and stepped else None,
                                        [len(tokens[i]) for i in stepped], len(launch.seqs),
                                        sum(result.seconds.values()) or None, now - launch.at if now else None)
            for i, (seq, toks, mass, lps, scored) in enumerate(zip(launch.seqs, tokens, masses, logprobs, scores)):
                seq.inflight -= 1
                seq.owed -= _emits(launch, i, seq)
                if seq.finished or seq.preempted or (not launch.prefill and not toks):  # (no tokens: it halted)
                    pass
                elif not launch.prefill:
                    self._advance(seq, toks, share, launch.nodes, mass, lps, stream)
                    self.report.drafts.append((launch.nodes, len(toks) - 1))  # the bonus token is no draft's
                    touched.append(seq)
                else:
                    if scored:
                        self._score_prompt(seq, launch.starts[i], scored)
                    if launch.last[i]:
                        self._prefilled(seq, toks, lps, stream)
                        touched.append(seq)
                if (seq.finished or seq.preempted) and seq.inflight == 0:
                    self._retire(seq)
        if len(launches) > 1:  # a request prefilled and stepped: once
            touched = list({id(s): s for s in touched}.values())
        return touched

    def _retire(self, seq: Sequence):
        """Pages and slot back to the scheduler: a finished request leaves, a preempted one waits again."""
        self.scheduler.release(seq)
        if seq.finished and self._seqs.get(seq.request_id) is seq:
            del self._seqs[seq.request_id]

    @staticmethod
    def _score_prompt(seq: Sequence, start: int, scored: list):
        """A chunk's prompt log-probabilities (values, ids per token): those of the prompt tokens from ``start + 1``
        on, each given the tokens before it (a chunk sent again after a preemption replaces what it sent)."""
        k, after = seq.params.prompt_logprobs, seq.prompt_ids[start + 1:]
        seq.prompt_logprobs[start + 1:] = [_logprobs(t, values, ids, k) for t, (values, ids) in zip(after, scored)]

    def _prefilled(self, seq: Sequence, first: list[int], logprobs: list | None, stream: bool):
        """A context's last chunk is in: its KV is cached; a new request emits its first token (a resumed one chose
        its next token before it was preempted)."""
        seq.cached_len = seq.prefill_len
        self.scheduler.register(seq)
        if not seq.output_ids:
            self._emit(seq, first, logprobs, stream)

    def _advance(self, seq: Sequence, tokens: list[int], stage_seconds: dict[str, float], nodes: int,
                 masses: list | None, logprobs: list | None, stream: bool):
        """Apply a step's tokens (from a tree of ``nodes`` draft nodes, whose ``masses`` the budget policy reads
        next; their log-probabilities where asked) to ``seq``: with :meth:`_prefilled`, the only place where request
        state changes after admission."""
        seq.cached_len += len(tokens)
        seq.steps += 1
        seq.accepted += len(tokens)
        seq.tree_sizes[nodes] = seq.tree_sizes.get(nodes, 0) + 1
        if masses is not None:
            seq.masses = masses
        spent = seq.stage_seconds
        for stage, s in stage_seconds.items():
            spent[stage] = spent.get(stage, 0.0) + s
        self._emit(seq, tokens, logprobs, stream)
        self.scheduler.register(seq)

    def _ban(self, params: SamplingParams) -> list[int]:
        """The tokens masked until ``min_tokens`` tokens are out: EOS (unless ``ignore_eos``) and ``stop_token_ids``
        (those in the vocabulary)."""
        if not params.min_tokens:
            return []
        eos = [] if params.ignore_eos else sorted(self.eos_token_ids)
        return list(dict.fromkeys(t for t in eos + params.stop_token_ids if t < self.vocab_size))

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list | None, stream: bool):
        """Append tokens one by one, stopping exactly where autoregressive decoding would (a stop needs
        ``min_tokens`` tokens out). The text grows by incremental detokenization (:meth:`_add_text`): with stop
        strings token by token, else once per call (``stream``) or once the request has finished."""
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        p, detok = seq.params, seq.detokenizer
        by_token = detok is not None and bool(p.stop)
        out, limit = seq.output_ids, seq.length_limit(self.max_model_len)
        for i, t in enumerate(tokens):
            out.append(t)
            if seq.grammar is not None:
                seq.grammar.accept(t)
            if p.logprobs is not None:
                seq.logprobs.append(_logprobs(t, *logprobs[i], p.logprobs))
                seq.cumulative_logprob += seq.logprobs[-1][t].logprob
            may_stop = len(out) >= p.min_tokens
            if by_token:
                seq.detokenized += 1
                if (stop := self._add_text(seq, detok.add([t]), may_stop)) is not None:
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    return
            eos = not p.ignore_eos and t in self.eos_token_ids
            if may_stop and (eos or t in p.stop_token_ids or (seq.grammar is not None and seq.grammar.ended)):
                seq.finish_reason = "stop"
                seq.stop_reason = None if eos or t not in p.stop_token_ids else t  # as vLLM: EOS is no stop token
            elif len(out) >= limit:  # max_tokens, or the context limit
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                break
        if detok is None:
            return
        if not by_token and (stream or seq.finished):
            self._add_text(seq, detok.add(seq.output_ids[seq.detokenized:]), False)
            seq.detokenized = len(seq.output_ids)
        if seq.finished:
            self._add_text(seq, detok.flush(), False)

    @staticmethod
    def _add_text(seq: Sequence, new: str, may_stop: bool) -> str | None:
        """Append ``new`` to the request's text. With ``may_stop``, the first stop string that ends in the held text
        followed by ``new`` (the last :func:`stop_hold` characters before ``new`` and ``new``: where new text can
        complete one), or None; if one does, the text is cut there (after it with ``include_stop_str_in_output``).
        Else all but the last :func:`stop_hold` characters settle: each call costs the text it adds, never the
        length of the text (a long output's text is never copied whole while it grows)."""
        p = seq.params
        text = seq.held + new
        hits = [(i, i + len(s), s) for s in p.stop if (i := text.find(s)) >= 0] if may_stop else []
        if hits:
            start, end, stop = min(hits)  # the first stop string in the text
            seq.held = text[:end if p.include_stop_str_in_output else start]
            return stop
        settled = len(text) - stop_hold(p.stop)
        if settled > 0:
            seq.text.append(text[:settled])
            text = text[settled:]
            if len(seq.text) >= TEXT_PIECES:
                seq.text[:] = ["".join(seq.text)]
        seq.held = text
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        """What the request added since its last output: its new token ids, log-probabilities and settled text (the
        held text too once it finished), as of now its finish and metrics. A request's first output carries
        everything so far, so one reported only once it finished is whole; each costs what it carries, not the
        length of the output (its prompt log-probabilities are all in once it has any: shared, never changed)."""
        asked = seq.params.logprobs is not None
        ids, text = seq.reported, "".join(seq.text)
        seq.text.clear()
        if seq.finished:
            text, seq.held = text + seq.held, ""
        seq.reported = len(seq.output_ids)
        return RequestOutput(seq.request_id, seq.prompt_ids,
                             [CompletionOutput(0, text, seq.output_ids[ids:], seq.finish_reason,
                                               seq.cumulative_logprob if asked else None,
                                               seq.logprobs[ids:] if asked else None, seq.stop_reason)],
                             seq.finished, seq.metrics(),
                             prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
                             num_cached_tokens=seq.cached_prompt or 0)


def _emits(launch: _Launch, i: int, seq: Sequence) -> int:
    """1 if ``launch`` emits a token for ``seq``, its ``i``-th sequence: a step always; a prefill when the chunk ends
    the context of a request with no output yet (a resumed one chose its next token before it was preempted)."""
    return int(not launch.prefill or (launch.last[i] and not seq.output_ids))


def _first_masks(seqs: list[Sequence], vocab: int):
    """The tokens each sequence's first token may be ``[B, ceil(vocab/32)]``, or None when none has a grammar."""
    grammars = _grammars([s.grammar for s in seqs])
    return None if grammars is None else next_token_masks(grammars, vocab)


def _grammars(grammars: list[GrammarState | None]) -> list[GrammarState | None] | None:
    """A batch's grammars to mask by, or None when there are none (the batch runs as it would without them)."""
    return grammars if any(g is not None for g in grammars) else None


def _logprobs(token: int, values: list[float], ids: list[int], k: int) -> dict[int, Logprob]:
    """One emitted (or prompt) token's ``{token id: Logprob}``: the token first, then the top ``k`` (from
    :func:`kdray.spec.logprobs.token_logprobs`'s values and ids). The token's rank is its place in that top list
    when it is there (ties are ordered as the list orders them), else after it."""
    top = ids[1:]
    rank = top.index(token) + 1 if token in top else max(ids[0], len(top) + 1)
    out = {token: Logprob(values[0], rank)}
    for place, (t, v) in enumerate(zip(top[:k], values[1:1 + k]), start=1):
        out.setdefault(t, Logprob(v, place))
    return out
