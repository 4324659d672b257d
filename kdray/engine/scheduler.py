"""Continuous batching over KV pages held as sequences grow: admission by current need, chunked prefill, the prefix
cache, and preemption when pages run out."""
from __future__ import annotations

from collections import deque

from kdray.engine.kv_pages import PagePool, extend_keys
from kdray.engine.layout import EngineLayout
from kdray.engine.sequence import Sequence


class Scheduler:
    """Requests wait in arrival order. A request is admitted when a slot is free and the pages of its context (less
    what the prefix cache holds) plus a step's look-ahead fit above a watermark; its context is prefilled in
    chunks that share the step's token budget with the running sequences; a running sequence gets pages as it
    grows, and when none are left the most recently admitted one is preempted (its KV recomputed later).

    The host applies results one step after the device produces them, so a sequence may write up to
    ``lookahead`` tokens past the cached length the host knows: two steps' accepted tokens and one step's writes.
    """

    def __init__(self, pool: PagePool, layout: EngineLayout, max_tokens_per_step: int, prefill_chunk: int):
        self.pool, self.max_tokens_per_step, self.prefill_chunk = pool, max_tokens_per_step, prefill_chunk
        self.max_model_len, self.page_size = layout.max_model_len, layout.page_size
        self.per_seq = 1 + layout.spec.nodes  # tokens one sequence runs per step
        self.lookahead = 2 * (1 + layout.spec.depth) + layout.spec.cache_slack
        self.max_pages = layout.max_pages_per_seq
        self.watermark = max(1, pool.num_pages // 100)  # pages kept free for the running sequences to grow into
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(layout.num_slots - 1, -1, -1))
        self._turn = 0
        self.preemptions = 0
        self.prefix_lookups = self.prefix_hits = 0  # full context pages of admitted requests; those found cached

    def pages_to_start(self, seq: Sequence) -> int:
        """Pages a request needs to be admitted (without the prefix cache): its context and the look-ahead."""
        return self.pool.pages_for(seq.context_len + self.lookahead)

    def pages_at_most(self, seq: Sequence) -> int:
        """Pages a request may hold at once in its life: its context grown to ``max_tokens`` (or the context
        limit), and the look-ahead. A request the pool cannot hold alone could never finish."""
        grown = min(len(seq.prompt_ids) + seq.params.max_tokens, self.max_model_len)
        return self.pool.pages_for(grown + self.lookahead)

    def admit(self) -> list[Sequence]:
        """Move waiting requests into the running set while slots and pages allow (their prefill comes in chunks)."""
        admitted = []
        while self.waiting and self._free_slots:
            seq = self.waiting[0]
            n, ps = seq.context_len, self.page_size
            # the last context token is always run (its logits); a prompt to score runs whole (cached pages have no
            # logits)
            looked = (n - 1) // ps if self.pool.prefix_caching and not seq.scores_prompt else 0
            extend_keys(seq.keys, seq.tokens_between(len(seq.keys) * ps, looked * ps), ps, looked)
            cached = self.pool.match(seq.keys[:looked])
            need = self.pages_to_start(seq) - len(cached)
            reserve = self.watermark if self.running else 0
            if need + reserve > self.pool.free_pages():
                self.pool.release(cached)
                break
            self.waiting.popleft()
            if self.pool.prefix_caching:  # counted once a request is admitted, not at every try before
                self.prefix_lookups, self.prefix_hits = self.prefix_lookups + looked, self.prefix_hits + len(cached)
            seq.pages, seq.slot = cached + self.pool.allocate(need), self._free_slots.pop()
            seq.prefill_len, seq.prefilled, seq.registered = n, len(cached) * ps, len(cached)
            if seq.cached_prompt is None:
                seq.cached_prompt = seq.prefilled
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def prefill_chunks(self, budget: int) -> list[tuple[Sequence, int, int]]:
        """``(sequence, start, end)`` context chunks to prefill this step, at most ``budget`` tokens in all (at
        least one chunk, so a long prompt always advances) and ``prefill_chunk`` per sequence."""
        chunks = []
        for seq in self.running:
            left = seq.prefill_len - seq.prefilled
            if left <= 0 or seq.finished or seq.preempted:
                continue
            n = min(left, self.prefill_chunk, budget if chunks else max(budget, self.page_size))
            if n <= 0:
                break
            chunks.append((seq, seq.prefilled, seq.prefilled + n))
            budget -= n
        return chunks

    def decode_batch(self) -> list[Sequence]:
        """Running sequences whose prefill is launched (the device runs it first) and that the work in flight does
        not surely end (a step past a request's length limit is wasted device time, and the next request would wait
        behind it), rotating the start when the token bound cuts the list."""
        ready = [s for s in self.running if not s.finished and not s.preempted and s.prefilled >= s.prefill_len
                 and not s.ends_in_flight(self.max_model_len)]
        limit = max(1, self.max_tokens_per_step // self.per_seq)
        if len(ready) <= limit:
            return ready
        self._turn %= len(ready)
        chosen = (ready[self._turn:] + ready[:self._turn])[:limit]
        self._turn += limit
        return chosen

    def reserve(self, batch: list[Sequence]) -> list[Sequence]:
        """Give each sequence of ``batch`` the pages its next step can write; when the pool runs dry, preempt the
        most recently admitted running sequences. Returns the sequences that can step now."""
        ready, victims = [], set()  # ids of the sequences preempted here (one released at once is marked no more)
        for seq in batch:
            if id(seq) in victims:
                continue
            need = min(self.pool.pages_for(seq.cached_len + self.lookahead), self.max_pages) - len(seq.pages)
            while need > self.pool.free_pages():
                victim = next((s for s in reversed(self.running) if not s.preempted and s is not seq), None)
                if victim is None:
                    break
                self.preempt(victim)
                victims.add(id(victim))
                if victim.inflight == 0:
                    self.release(victim)
            if need > self.pool.free_pages():
                continue  # its pages come back once the preempted sequences' steps in flight are applied
            if need > 0:
                seq.pages += self.pool.allocate(need)
            ready.append(seq)
        return [s for s in ready if id(s) not in victims]  # a victim may have been ready before a later one's need

    def preempt(self, seq: Sequence):
        """Stop ``seq`` from stepping; its pages and slot come back (:meth:`release`) once nothing in flight writes
        them, and it waits again, first in line, to be prefilled from its context."""
        seq.preempted = True
        self.preemptions += 1

    def release(self, seq: Sequence):
        """Give a running sequence's pages and slot back (finished, aborted or preempted): a preempted one waits
        again first in line, its KV to be recomputed."""
        self.pool.release(seq.pages)
        if seq in self.running:
            self.running.remove(seq)
            self._free_slots.append(seq.slot)
            seq.slot = -1
        if seq.preempted and not seq.finished:
            seq.preempted, seq.prefilled, seq.cached_len, seq.registered = False, 0, 0, 0
            self.waiting.appendleft(seq)

    def register(self, seq: Sequence):
        """Put the full pages of ``seq``'s committed tokens in the prefix cache (keyed from the first page not keyed
        yet: no copy of the whole context per page)."""
        full = min(seq.cached_len, seq.num_tokens) // self.page_size
        if full > seq.registered:
            if self.pool.prefix_caching:
                ps = self.page_size
                extend_keys(seq.keys, seq.tokens_between(len(seq.keys) * ps, full * ps), ps, full)
                self.pool.register(seq.pages[seq.registered:full], seq.keys[seq.registered:full])
            seq.registered = full

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.release(seq)
                return seq
        return None
