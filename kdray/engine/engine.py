"""The engine: requests in, tokens out, one ``step()`` at a time (the same in-process and on Ray).

The engine owns request state. Its runner (a :class:`~kdray.engine.runner.ModelRunner` in this process,
or :class:`~kdray.actors.ray_runner.RayRunner` on actors) takes host batches and returns tokens; the
engine applies each result to its requests in one place, :meth:`Engine._advance`.
"""
from __future__ import annotations

import random
import time

from kdray.engine.request import CompletionOutput, RequestOutput, SamplingParams
from kdray.engine.scheduler import Scheduler
from kdray.engine.sequence import Sequence
from kdray.engine.step import PrefillBatch, StepBatch


class RunnerFailure(RuntimeError):
    """The runner lost its state (a Ray actor died or failed mid-step); ``request_ids`` lists the requests
    that failed with it."""

    def __init__(self, message: str, request_ids: tuple[str, ...] = ()):
        super().__init__(message)
        self.request_ids = tuple(request_ids)


class Engine:
    """Continuous batching over a runner: each ``step()`` prefills newly admitted requests and runs one
    speculative step for the rest, then reports every request that emitted tokens or finished."""

    def __init__(self, runner, scheduler: Scheduler, tokenizer, max_model_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], model_name: str):
        self.runner, self.scheduler, self.tokenizer = runner, scheduler, tokenizer
        self.max_model_len, self.vocab_size, self.model_name = max_model_len, vocab_size, model_name
        self.eos_token_ids = set(eos_token_ids)
        self._seqs: dict[str, Sequence] = {}
        self._seed_source = random.Random()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; bad input raises ``ValueError`` naming the problem."""
        if request_id in self._seqs:
            raise ValueError(f"request id '{request_id}' is already in use")
        if not prompt_token_ids:
            raise ValueError("prompt is empty: give at least one token")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; the context limit is {self.max_model_len} "
                             "(prompt plus at least one generated token)")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop: model '{self.model_name}' has no tokenizer, so stop strings cannot match; "
                             "leave them out")
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        seq = Sequence(request_id, list(prompt_token_ids), params, seed)
        need, have = self.scheduler.pages_needed(seq), self.scheduler.pool.num_pages
        if need > have:
            raise ValueError(f"prompt plus max_tokens={params.max_tokens} needs {need} KV pages; the pool has {have}: "
                             "lower max_tokens or give the engine more pages (num_pages)")
        self._seqs[request_id] = seq
        self.scheduler.waiting.append(seq)

    def abort_request(self, request_id: str) -> None:
        """Drop a request and free its pages (no-op for unknown or finished ids)."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            seq.finish_reason = seq.finish_reason or "abort"
            self._seqs.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def free_pages(self) -> int:
        return self.scheduler.pool.free_pages()

    def step(self) -> list[RequestOutput]:
        """Prefill what the scheduler admits, step what runs. Any error fails every running request (their pages
        are freed) and is raised as a :class:`RunnerFailure` naming them; waiting requests stay queued, so the
        engine serves on."""
        try:
            touched = self._run()
        except Exception as e:  # noqa: BLE001 - one step's failure must not end the engine
            failed = tuple(s.request_id for s in self.scheduler.running)
            for rid in failed:
                self.abort_request(rid)
            if isinstance(e, RunnerFailure):
                raise type(e)(f"{e}\n-> request(s) {list(failed)} failed", failed) from None
            raise RunnerFailure(f"the step failed ({type(e).__name__}: {e})\n-> request(s) {list(failed)} failed",
                                failed) from e
        outputs = [self._output(s) for s in touched]
        for seq in touched:
            if seq.finished:
                self.scheduler.retire(seq)
                self._seqs.pop(seq.request_id, None)
        return outputs

    def _run(self) -> list[Sequence]:
        admitted = self.scheduler.admit()
        if admitted:
            first = self.runner.prefill(PrefillBatch(
                slots=[s.slot for s in admitted], prompts=[s.prompt_ids for s in admitted],
                pages=[s.pages for s in admitted], params=[s.params for s in admitted],
                seeds=[s.seed for s in admitted]))
            for seq, token in zip(admitted, first):
                self._advance(seq, [token])
        batch = self.scheduler.decode_batch(exclude=admitted)
        if batch:
            result = self.runner.step(StepBatch(slots=[s.slot for s in batch], roots=[s.output_ids[-1] for s in batch],
                                                prefix_lens=[s.cached_len for s in batch]))
            share = {k: v / len(batch) for k, v in result.seconds.items()}
            for seq, tokens in zip(batch, result.tokens):
                self._advance(seq, tokens, share)
        return admitted + batch

    def _advance(self, seq: Sequence, tokens: list[int], stage_seconds: dict[str, float] | None = None):
        """Apply a prefill's first token (``stage_seconds`` None) or a step's tokens to ``seq``: the one place
        where request state changes after admission."""
        if stage_seconds is None:
            seq.cached_len = len(seq.prompt_ids)
        else:
            seq.cached_len += len(tokens)
            seq.steps += 1
            seq.accepted += len(tokens)
            for stage, s in stage_seconds.items():
                seq.stage_seconds[stage] += s
        self._emit(seq, tokens)

    def _emit(self, seq: Sequence, tokens: list[int]):
        """Append tokens one by one, stopping exactly where autoregressive decoding would."""
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        p = seq.params
        for t in tokens:
            seq.output_ids.append(t)
            if not p.ignore_eos and t in self.eos_token_ids:
                seq.finish_reason = "stop"
            elif p.stop and self._hit_stop(seq):
                seq.finish_reason = "stop"
                return
            elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
            if seq.finished:
                break
        if self.tokenizer is not None:
            seq.text = self.tokenizer.decode(seq.output_ids)

    def _hit_stop(self, seq: Sequence) -> bool:
        text = self.tokenizer.decode(seq.output_ids)
        hits = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
        if not hits:
            return False
        seq.text = text[:min(hits)]
        return True

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt_ids,
                             [CompletionOutput(0, seq.text, list(seq.output_ids), seq.finish_reason)],
                             seq.finished, seq.metrics())
