"""Continuous batching: admit waiting requests when their pages fit, pick each step's batch, retire."""
from __future__ import annotations

from collections import deque

from kdray.engine.kv_pages import PagePool
from kdray.engine.layout import EngineLayout
from kdray.engine.sequence import Sequence


class Scheduler:
    """Requests wait in arrival order; a request is admitted with every page it can ever need (so a running
    sequence never stalls for memory) and a free slot. One step prefills newly admitted prompts of at most
    ``max_tokens_per_step`` tokens together (a longer prompt is admitted alone) and steps at most
    ``max_tokens_per_step // (1 + nodes)`` running sequences, rotating through them when there are more."""

    def __init__(self, pool: PagePool, layout: EngineLayout, max_tokens_per_step: int):
        self.pool, self.max_tokens_per_step = pool, max_tokens_per_step
        self.max_model_len, self.slack = layout.max_model_len, layout.spec.cache_slack
        self.per_seq = 1 + layout.spec.nodes  # tokens one sequence runs per step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(layout.num_slots - 1, -1, -1))
        self._turn = 0

    def pages_needed(self, seq: Sequence) -> int:
        longest = min(len(seq.prompt_ids) + seq.params.max_tokens, self.max_model_len)
        return self.pool.pages_for(longest + self.slack)

    def admit(self) -> list[Sequence]:
        """Move waiting requests into the running set while slots, step tokens and pages allow."""
        admitted, tokens = [], 0
        while self.waiting and self._free_slots:
            seq = self.waiting[0]
            need = self.pages_needed(seq)
            if need > self.pool.free_pages() or (admitted and tokens + len(seq.prompt_ids) > self.max_tokens_per_step):
                break
            self.waiting.popleft()
            seq.pages, seq.slot = self.pool.allocate(need), self._free_slots.pop()
            tokens += len(seq.prompt_ids)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def decode_batch(self) -> list[Sequence]:
        """Running sequences not known to have finished (their prefill is launched before any step), rotating the
        start when the token bound cuts the list."""
        ready = [s for s in self.running if not s.finished]
        limit = max(1, self.max_tokens_per_step // self.per_seq)
        if len(ready) <= limit:
            return ready
        self._turn %= len(ready)
        chosen = (ready[self._turn:] + ready[:self._turn])[:limit]
        self._turn += limit
        return chosen

    def retire(self, seq: Sequence):
        """Give a finished or aborted running sequence's pages and slot back."""
        self.pool.release(seq.pages)
        if seq in self.running:
            self.running.remove(seq)
            self._free_slots.append(seq.slot)
            seq.slot = -1

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
