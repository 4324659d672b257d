"""Continuous batching: admit waiting requests when their pages fit, pick each step's batch, retire."""
from __future__ import annotations

from collections import deque

from kdray.config import EngineConfig
from kdray.engine.kv_pages import PagePool
from kdray.engine.sequence import Sequence


class Scheduler:
    """Requests wait in arrival order; a request is admitted with every page it can ever need, so a
    running sequence never stalls for memory. Each step runs at most ``max_tokens_per_step`` tokens."""

    def __init__(self, pool: PagePool, cfg: EngineConfig, max_model_len: int, slack_tokens: int,
                 tokens_per_seq_step: int):
        self.pool, self.cfg = pool, cfg
        self.max_model_len, self.slack, self.per_seq = max_model_len, slack_tokens, tokens_per_seq_step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._turn = 0

    def pages_needed(self, seq: Sequence) -> int:
        longest = min(len(seq.prompt_ids) + seq.params.max_tokens, self.max_model_len)
        return self.pool.pages_for(longest + self.slack)

    def admit(self) -> list[Sequence]:
        """Move waiting requests into the running set while sequences, step tokens and pages allow."""
        admitted, tokens = [], 0
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            need = self.pages_needed(seq)
            if need > self.pool.free_pages() or (admitted and tokens + len(seq.prompt_ids) > self.cfg.max_tokens_per_step):
                break
            self.waiting.popleft()
            seq.pages = self.pool.allocate(need)
            tokens += len(seq.prompt_ids)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def decode_batch(self, exclude: list[Sequence]) -> list[Sequence]:
        """Running, prefilled sequences for this step, rotating the start when the token bound cuts the list."""
        ready = [s for s in self.running if s.cached_len > 0 and not s.finished and s not in exclude]
        limit = max(1, self.cfg.max_tokens_per_step // self.per_seq)
        if len(ready) <= limit:
            return ready
        self._turn %= len(ready)
        chosen = (ready[self._turn:] + ready[:self._turn])[:limit]
        self._turn += limit
        return chosen

    def retire(self, seq: Sequence):
        self.pool.release(seq.pages)
        if seq in self.running:
            self.running.remove(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.retire(seq)
                return seq
        return None
