"""The model work of one engine: prefill, and the five stages of a speculative step, resident on the device.

``ModelRunner`` owns the target, the drafter, both paged KV caches and the per-slot state (block tables,
sampling settings, each slot's bonus token and cached length). A step reads its slots' state and advances
it on the device, so the next step needs nothing from the host but the list of slots: the host reads a
step's tokens back while the next one runs. AR, chain and DDTree are the same step with different trees:
the root alone, a single path, or the best-first tree. In-process one runner does all of it
(:meth:`ModelRunner.step`, one CUDA graph per batch-size bucket on GPUs; a lone prompt chunk of up to 2048 tokens
is prefilled from a graph too, since an eager pass of a short chunk costs more host time than device time, and
while sequences run it rides in their step's verify pass, reading the weights once: :meth:`ModelRunner.launch`); on
Ray a shard's runner verifies, accepts and commits, and the drafter actor's runner drafts and builds (see
:mod:`kdray.actors`), calling the same stage methods.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from kdray.engine.cuda_graphs import GraphedFn
from kdray.engine.layout import PROMPT_BUCKETS, EngineLayout
from kdray.engine.request import MAX_BAN, MAX_LOGIT_BIAS, MAX_LOGPROBS
from kdray.engine.step import (Accepted, ChunkRows, Committed, DraftOutput, Pending, PrefillBatch, StageTimer,
                               StepBatch, StepInputs, StepResult, Verified, first_tokens, unpack_logprobs,
                               unpack_tokens)
from kdray.kernels.kv_compact import kv_compact
from kdray.kernels.tree_accept import tree_accept
from kdray.kernels.tree_build import DraftTree, tree_build
from kdray.model.batch import (ForwardBatch, causal_tree_mask, device_array, join, pack_bits, prompt_chunks,
                               uniform_batch)
from kdray.model.dflash import DFlashDrafter
from kdray.model.loader import LoadedTarget
from kdray.spec.budget import WIDTHS, width_masses
from kdray.spec.grammar import GrammarState, masked, tree_masks
from kdray.spec.logprobs import head_logprobs, token_logprobs
from kdray.spec.sampling import RowParams, choose_tokens
from kdray.spec.transforms import Penalties, RowTransforms, add_path_tokens, apply_transforms

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # batch sizes a graphed step is padded to
THOUGHT_HALTED = -2  # SlotState.thought_end of a slot whose thought's end a step accepted (halt_thoughts)
NUMPY_DTYPES = {torch.float32: np.float32, torch.int64: np.int64, torch.int32: np.int32}  # of the slot state


def bucket(n: int, limit: int) -> int:
    """The batch size a step of ``n`` sequences runs at under CUDA graphs (the smallest bucket that holds it)."""
    return next((b for b in BUCKETS if b >= n and b <= max(limit, 1)), max(n, limit))


def plain_chunk(layout: EngineLayout, T: int, start: int) -> bool:
    """Whether a lone chunk of ``T`` tokens after ``start`` cached ones runs in an eager pass of its own
    (``layout.plain_chunks``)."""
    return layout.plain_chunks is not None and T >= layout.plain_chunks[0] and T * start >= layout.plain_chunks[1]


def prompt_bucket(layout: EngineLayout, T: int, starts: list[int]) -> int | None:
    """The prompt bucket a lone chunk of ``T`` tokens (after ``starts[0]`` cached ones) is padded to under graphs, or
    None when it cannot be or should not be: several chunks, over the largest bucket, padded past the block table's
    last position, or a :func:`plain_chunk`."""
    size = next((n for n in PROMPT_BUCKETS if n >= T), None)
    limit = layout.max_pages_per_seq * layout.page_size
    if size is None or len(starts) != 1 or starts[0] + size > limit or plain_chunk(layout, T, starts[0]):
        return None
    return size


def riding_rows(layout: EngineLayout, prefill: PrefillBatch, step: StepBatch, graphs: bool) -> int | None:
    """The rows a prefill's chunk runs at inside ``step``'s verify pass (its tokens, padded to a prompt bucket under
    CUDA ``graphs``), or None where it runs in a pass of its own: several chunks, more tokens than
    ``layout.step_chunk``, prompt tokens to score, grammars (their steps run eagerly), a :func:`plain_chunk`, or a
    padded chunk past the block table. The engine's runner decides (in-process, or for the shards on Ray)."""
    T = len(prefill.prompts[0])
    if (len(prefill.slots) != 1 or T > layout.step_chunk or any(prefill.scored)
            or prefill.allowed is not None or step.grammars is not None or plain_chunk(layout, T, prefill.starts[0])):
        return None
    return prompt_bucket(layout, T, prefill.starts) if graphs else T


def fitting_buckets(layout: EngineLayout) -> list[int]:
    """The prompt buckets that fit a sequence's block table after a cached page."""
    room = layout.max_pages_per_seq * layout.page_size - layout.page_size
    return [n for n in PROMPT_BUCKETS if n <= room]


def riding_buckets(layout: EngineLayout) -> list[int]:
    """The padded sizes a riding chunk's step replays from graphs at (none without graphs): what the warm-up
    captures."""
    if not layout.cuda_graphs or not layout.step_chunk:
        return []
    top = next(n for n in PROMPT_BUCKETS if n >= layout.step_chunk)
    return [n for n in fitting_buckets(layout) if n <= top]


def launch(runner, prefill: PrefillBatch | None, step: StepBatch | None, graphs: bool
           ) -> tuple[Pending | None, Pending | None]:
    """One engine step's work on ``runner`` (a :class:`ModelRunner`, or the actors' ``RayRunner``): its prompt chunks
    and its speculative step -> their results on the way to the host (None for the part not given). A lone chunk that
    may ride (:func:`riding_rows`, padded under CUDA ``graphs``) runs inside the step's verify pass
    (``runner.run_step``), else the chunks run in a prefill pass first."""
    rows = riding_rows(runner.layout, prefill, step, graphs) if prefill and step else None
    if rows is not None:
        return runner.run_step(step, prefill, rows)
    return (runner.prefill(prefill) if prefill is not None else None), (runner.step(step) if step is not None else None)


def chunk_positions(starts: list[int], lens: list[int], device: torch.device) -> torch.Tensor:
    """``[sum(lens)]`` int64 on ``device``: the positions of context chunks of ``lens`` tokens after ``starts``."""
    return device_array(np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)]), device)


def root_only_tree(roots: torch.Tensor) -> DraftTree:
    """The tree of autoregressive decoding: the bonus token alone. roots ``[B]``."""
    B, dev = roots.shape[0], roots.device
    return DraftTree(tokens=roots[:, None].clone(), parents=torch.full((B, 1), -1, dtype=torch.int32, device=dev),
                     depths=torch.zeros(B, 1, dtype=torch.int32, device=dev),
                     num_nodes=torch.ones(B, dtype=torch.int32, device=dev),
                     mask=torch.ones(B, 1, 1, dtype=torch.int32, device=dev))


class SlotState:
    """Per-slot device state: written when a sequence is admitted into the slot (its KV pages as a block-table
    row, its sampling settings), then its bonus token and cached length, set by the prefill and advanced by
    every step. The extra last slot is scratch: padding rows of a batch run there, their KV in a scratch page.
    With ``vocab`` (a runner that chooses tokens) the penalties' per-slot counts are kept too, made when a
    request first asks for penalties."""

    def __init__(self, num_slots: int, max_pages: int, scratch_page: int, device: torch.device,
                 vocab: int | None = None):
        n, self.scratch, self.scratch_page = num_slots + 1, num_slots, scratch_page
        self.block_table = torch.full((n, max_pages), scratch_page, dtype=torch.int32, device=device)  # [n, pages]
        self.temperature = torch.zeros(n, dtype=torch.float32, device=device)  # [n]
        self.top_k = torch.zeros(n, dtype=torch.int64, device=device)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(n, dtype=torch.int64, device=device)
        self.roots = torch.zeros(n, dtype=torch.int64, device=device)  # bonus token per slot
        self.prefix_lens = torch.zeros(n, dtype=torch.int32, device=device)  # cached length per slot
        self.greedy = [True] * n  # host copy: a batch of greedy slots skips the sampling path
        self.features: list[frozenset[str]] = [frozenset()] * n  # host copy: what a batch of these slots pays for
        self.special = 0  # slots set for sampling or a costly feature (0: every batch is greedy and plain)
        self.prompt_lens = torch.zeros(n, dtype=torch.int64, device=device)  # [n]
        self.min_tokens = torch.zeros(n, dtype=torch.int64, device=device)
        self.min_p = torch.zeros(n, dtype=torch.float32, device=device)
        self.presence = torch.zeros(n, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(n, dtype=torch.float32, device=device)
        self.repetition = torch.ones(n, dtype=torch.float32, device=device)
        self.bias_ids = torch.zeros(n, MAX_LOGIT_BIAS, dtype=torch.int64, device=device)  # [n, MAX_LOGIT_BIAS]
        self.bias_values = torch.zeros(n, MAX_LOGIT_BIAS, dtype=torch.float32, device=device)
        self.ban_ids = torch.full((n, MAX_BAN), -1, dtype=torch.int64, device=device)  # [n, MAX_BAN]
        # [n]: a running thought's end marker (-1: none; THOUGHT_HALTED once a step accepted it, until the host ends it)
        self.thought_end = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.thought_mask: torch.Tensor | None = None  # [n, ceil(V/32)] int32: the tokens its grammar allows there
        self.vocab = vocab
        self.counts: torch.Tensor | None = None  # [n, V] fp32: the output's token counts (bonus included)
        self.prompt_seen: torch.Tensor | None = None  # [n, V] bool: the prompt's tokens

    def admit(self, batch: PrefillBatch):
        """Write the sequences' block-table rows and sampling settings (again at every chunk: rows grow); at a
        penalised context's last chunk, its counts from its history."""
        dev = self.block_table.device
        self.set_pages(dict(zip(batch.slots, batch.pages)))
        idx = device_array(batch.slots, dev)  # [B]

        def put(state: torch.Tensor, values: list):
            state[idx] = device_array(values, dev, NUMPY_DTYPES[state.dtype])

        ps = batch.params
        for state, values in ((self.temperature, [p.temperature for p in ps]), (self.top_k, [p.top_k for p in ps]),
                              (self.top_p, [p.top_p for p in ps]), (self.seeds, batch.seeds)):
            put(state, values)
        # the costly fields' settings: written when these requests, or the slots' last ones, use any of them
        features = [p.features for p in ps]
        plain = not any(features) and not any(self.features[s] for s in batch.slots)
        for slot, p, f in zip(batch.slots, ps, features):
            self._set_kind(slot, p.greedy, f)
        if plain:
            return
        for state, values in ((self.prompt_lens, batch.prompt_lens), (self.min_tokens, [p.min_tokens for p in ps]),
                              (self.min_p, [p.min_p for p in ps]), (self.presence, [p.presence_penalty for p in ps]),
                              (self.frequency, [p.frequency_penalty for p in ps]),
                              (self.repetition, [p.repetition_penalty for p in ps]),
                              (self.bias_ids, [_padded(list(p.logit_bias or {}), MAX_LOGIT_BIAS, 0) for p in ps]),
                              (self.bias_values, [_padded(list((p.logit_bias or {}).values()), MAX_LOGIT_BIAS, 0.0)
                                                  for p in ps]),
                              (self.ban_ids, [_padded(b, MAX_BAN, -1) for b in batch.bans]),
                              (self.thought_end, [-1] * len(ps))):  # a thought is set (again) by a step
            put(state, values)
        if self.vocab is None or not any("penalties" in f for f in features):
            return
        if self.counts is None:  # the first penalised request
            n = self.block_table.shape[0]
            self.counts = torch.zeros(n, self.vocab, dtype=torch.float32, device=dev)  # [n, V]
            self.prompt_seen = torch.zeros(n, self.vocab, dtype=torch.bool, device=dev)  # [n, V]
        for slot, n, history in zip(batch.slots, batch.prompt_lens, batch.histories):
            if history is not None:  # the prompt's tokens and the output's counts (a resumed request has output)
                self.counts[slot] = self._bincount(history[n:]).float()
                self.prompt_seen[slot] = self._bincount(history[:n]) > 0

    def _bincount(self, tokens: list[int]) -> torch.Tensor:
        """``[V]`` int64 on the device: each token's count in ``tokens``."""
        return torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=self.vocab).to(self.block_table.device)

    def set_pages(self, pages: dict[int, list[int]]):
        """Block-table rows ``{slot: pages}``; unused entries point at the scratch page."""
        if not pages:
            return
        width, dev = self.block_table.shape[1], self.block_table.device
        rows = np.full((len(pages), width), self.scratch_page, dtype=np.int32)  # [n, pages]
        for i, row in enumerate(pages.values()):
            if len(row) > width:
                raise ValueError(f"{len(row)} KV pages for one sequence exceed the block-table width {width}")
            rows[i, :len(row)] = row
        self.block_table[device_array(list(pages), dev)] = device_array(rows, dev, np.int32)

    def set_thoughts(self, thoughts: dict[int, tuple[int, torch.Tensor | None]]):
        """Thoughts begun or ended ``{slot: (end marker, the tokens allowed inside [ceil(V/32)] int32), or (-1, None)
        where one ended}``: a slot whose thought runs steps with those tokens alone allowed (the mask its grammar would
        make at every position there), accepting nothing after its end marker."""
        if not thoughts:
            return
        dev = self.block_table.device
        if self.thought_mask is None:  # the first thought
            self.thought_mask = torch.full((self.block_table.shape[0], (self.vocab + 31) // 32), -1, dtype=torch.int32,
                                           device=dev)  # [n, ceil(V/32)]
        for slot, (end, allowed) in thoughts.items():
            self.thought_end[slot] = end
            if allowed is not None:
                self.thought_mask[slot] = allowed.to(dev)
            thought = frozenset({"thought"} if end >= 0 else ())
            self._set_kind(slot, self.greedy[slot], self.features[slot] - {"thought"} | thought)

    def halt_thoughts(self, idx: torch.Tensor, next_token: torch.Tensor):
        """After a step of slots ``idx [B]`` with thoughts: a slot whose step accepted its thought's end marker (its
        next bonus ``next_token [B]``) halts. The host sees that end one step late, so the step it launched meanwhile
        followed the thought's mask; that step and any before the host ends the thought emit nothing."""
        ends = self.thought_end[idx]
        self.thought_end.index_put_((idx,), torch.where(next_token == ends, THOUGHT_HALTED, ends))

    def _set_kind(self, slot: int, greedy: bool, features: frozenset[str]):
        """The host copies of what a batch holding ``slot`` pays for, and the count of special slots with them."""
        self.special -= not self.greedy[slot] or bool(self.features[slot])
        self.greedy[slot], self.features[slot] = greedy, features
        self.special += not greedy or bool(features)

    def start(self, idx: torch.Tensor, first: torch.Tensor, ends: torch.Tensor, done: torch.Tensor):
        """After a prefill: each slot of ``idx [B]`` whose chunk ends its context (``done [B]``) has its first
        generated token ``first [B]`` as its bonus token (counted) and its context's length ``ends [B]`` as its cached
        length; the others keep theirs. Selected on the device (a boolean index would wait for the prefill). The
        scratch slot (the warm-up's prefills) stays at length 0."""
        self.roots[idx] = torch.where(done, first, self.roots[idx])
        self.prefix_lens[idx] = torch.where(done, ends.to(torch.int32), self.prefix_lens[idx])
        self.prefix_lens[self.scratch:].zero_()
        if self.counts is not None:
            self.counts.index_put_((idx, first), done.float(), accumulate=True)

    def inputs(self, idx: torch.Tensor, all_greedy: bool, extras: tuple[str, ...] = ()) -> StepInputs:
        """The state of slots ``idx [B]`` for one step."""
        params = RowParams(temperature=self.temperature[idx], top_k=self.top_k[idx], top_p=self.top_p[idx],
                           seeds=self.seeds[idx], all_greedy=all_greedy,
                           min_p=self.min_p[idx] if "min_p" in extras else None)
        return StepInputs(slots=idx, roots=self.roots[idx], prefix_lens=self.prefix_lens[idx],
                          block_table=self.block_table[idx], params=params, extras=extras)

    def transforms(self, idx: torch.Tensor, positions: torch.Tensor, extras: tuple[str, ...], width: int = 1,
                   path: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> RowTransforms | None:
        """The logit changes of the ``width`` rows per slot of ``idx [B]`` choosing at ``positions [B * width]``
        (None: the batch has none). ``path``: the trees' (tokens, parents, depth), whose path tokens each node's
        penalties count."""
        if not {"bias", "min_tokens", "penalties"} & set(extras):
            return None
        rows = idx.repeat_interleave(width)  # [R]
        t = RowTransforms()
        if "bias" in extras:
            t.bias_ids, t.bias_values = self.bias_ids[rows], self.bias_values[rows]
        if "min_tokens" in extras:  # generated before the choice at a position: position + 1 - the prompt's length
            t.ban_ids, t.banned = self.ban_ids[rows], positions + 1 - self.prompt_lens[rows] < self.min_tokens[rows]
        if "penalties" in extras:
            counts = self.counts[rows]  # [R, V]
            if path is not None:
                add_path_tokens(counts, *path)
            t.penalties = Penalties(counts, self.prompt_seen[rows], self.presence[rows], self.frequency[rows],
                                    self.repetition[rows])
        return t

    def advance(self, idx: torch.Tensor, length: torch.Tensor, next_token: torch.Tensor):
        """After a step: the accepted path is cached and the target's next choice is the new bonus token. The
        scratch slot (padding) stays at length 0."""
        self.prefix_lens.index_put_((idx,), self.prefix_lens[idx] + length)
        self.roots.index_put_((idx,), next_token)
        self.prefix_lens[self.scratch:].zero_()  # a kernel, not a host-to-device copy (graph capture)

    def count(self, idx: torch.Tensor, committed: Committed):
        """Add a step's emitted tokens to the penalties' counts of slots ``idx``."""
        emitted = committed.emitted()  # [B, 1+L]
        kept = torch.arange(emitted.shape[1], device=idx.device)[None, :] < committed.length[:, None]  # [B, 1+L]
        flat = idx[:, None] * self.vocab + emitted  # [B, 1+L]: rows of the flattened counts
        self.counts.view(-1).scatter_add_(0, flat.flatten(), kept.float().flatten())

    def all_greedy(self, slots: list[int]) -> bool:
        return not self.special or all(self.greedy[s] for s in slots)

    def extras(self, slots: list[int]) -> tuple[str, ...]:
        """The features a batch of ``slots`` pays for: those any of its requests uses."""
        if not self.special:
            return ()
        return tuple(sorted(frozenset().union(*(self.features[s] for s in slots))))

    def snapshot(self):
        """A function that puts back the advancing state (lengths, roots, halted thoughts, counts) as it is now."""
        saved = [(t, t.clone()) for t in (self.prefix_lens, self.roots, self.thought_end, self.counts) if t is not None]

        def restore():
            for t, copy in saved:
                t.copy_(copy)

        return restore


def _padded(values: list, width: int, pad) -> list:
    return values + [pad] * (width - len(values))


@dataclass
class Prefilled:
    first: torch.Tensor  # [B] int64: each prompt's first generated token
    features: torch.Tensor | None  # [T, F]: the prompts' context features for the drafter
    positions: torch.Tensor  # [T] int64
    cache_rows: torch.Tensor  # [T] int64: flat cache rows of the prompt tokens
    # where asked: (values, ids) [B + S, 1+K], the first tokens' then the S scored prompt tokens' (prompt_logprobs)
    logprobs: tuple[torch.Tensor, torch.Tensor] | None = None


class ModelRunner:
    """Prefill and speculative steps over paged KV caches. ``target`` may be a whole target or (the drafter's
    actor on Ray) only its embedding and LM head, with ``target_kv=False``; ``drafter`` None runs no drafts
    (AR, or a shard on Ray whose trees come from the drafter's actor)."""

    def __init__(self, target: LoadedTarget, drafter: DFlashDrafter | None, layout: EngineLayout,
                 device: torch.device, target_kv: bool = True):
        self.target, self.drafter, self.layout, self.spec = target, drafter, layout, layout.spec
        self.device, self.page_size = torch.device(device), layout.page_size
        pages = layout.num_pages + 1  # the last page is the scratch page of batch padding and overflow
        m = target.model
        self.slots = SlotState(layout.num_slots, layout.max_pages_per_seq, layout.num_pages, self.device,
                               m.cfg.vocab_size if target_kv else None)
        self.kv = torch.zeros(m.cfg.num_hidden_layers, pages, layout.page_size, *m.kv_row_shape, dtype=m.dtype,
                              device=device) if target_kv else None  # [layers, P, S, *row]
        self.draft_kv = None
        if drafter is not None:
            self.draft_kv = torch.zeros(drafter.cfg.num_hidden_layers, pages, layout.page_size,
                                        *drafter.kv_row_shape, dtype=drafter.dtype, device=device)
            blk = self.spec.block_size  # [d_layers, P, S, 2, Hkv, D] above; [blk, W] below
            self._see_block = pack_bits(torch.ones(blk, blk, dtype=torch.bool, device=device))
        self.widths = [w for w in WIDTHS if w <= self.spec.nodes]  # the tree widths budget="auto" chooses from
        self._widths = torch.tensor(self.widths, device=self.device)  # [widths]
        self.graphs = layout.cuda_graphs and self.device.type == "cuda"
        graphed = (lambda fn: GraphedFn(fn, self.slots.snapshot)) if self.graphs else (lambda fn: None)
        self._step_graphs = graphed(self._step_fn)
        self._propose_graphs = graphed(self._propose_fn)
        self._settle_graphs = graphed(self._settle_fn)
        self._prompt_graphs = GraphedFn(self._prompt_fn, lambda: lambda: None) if self.graphs and target_kv else None
        self._prompt_masks: dict[int, torch.Tensor] = {}  # padded size -> causal mask [1, n, ceil(n/32)], when used

    def shutdown(self):
        """Free the KV caches and captured graphs; the runner cannot step afterwards."""
        self.kv = self.draft_kv = self._step_graphs = self._propose_graphs = self._settle_graphs = None
        self._prompt_graphs = None

    def prompt_buckets(self) -> list[int]:
        """The padded sizes a lone prompt chunk's forward replays from graphs at (none without graphs): what the
        warm-up captures."""
        return fitting_buckets(self.layout) if self._prompt_graphs is not None else []

    def timer(self) -> StageTimer:
        return StageTimer(cuda=self.device.type == "cuda")

    # ---- prefill

    @torch.no_grad()
    def prefill(self, batch: PrefillBatch) -> Pending[StepResult]:
        """In-process prefill: the prompts, then their features into the drafter's context -> the first tokens
        (one per sequence, with their log-probabilities and the prompts' where asked), on their way to the host."""
        done = self.run_prompts(batch, self._prompt_graphs)
        if done.features is not None:
            self.add_context(done.features, done.positions, done.cache_rows)
        return self._first_tokens_to_host(batch, done.first, done.logprobs)

    def _first_tokens_to_host(self, batch: PrefillBatch, first: torch.Tensor, logprobs: tuple | None) -> Pending:
        """A prefill's first tokens ``[B]`` (and log-probabilities, the prompts' after the first tokens') on their
        way to the host."""
        scored = [len(s) for s in batch.scored]
        return self._to_host([first, *(logprobs or ())], lambda host, _: first_tokens(*host, scored=scored))

    def run_prompts(self, batch: PrefillBatch, graphs: GraphedFn | None = None) -> Prefilled:
        """Record the sequences' slots, run their context chunks (after their cached tokens), cache the KV; at a
        context's last chunk, start the slot at its first token (the one chosen here, or the given root). With
        ``graphs``, a lone chunk that fits a prompt bucket replays its forward from them, unless the batch scores
        prompt tokens (``prompt_logprobs``: those run eagerly)."""
        self.slots.admit(batch)
        lens = [len(p) for p in batch.prompts]
        ids = device_array([t for p in batch.prompts for t in p], self.device)  # [T]
        positions = chunk_positions(batch.starts, lens, self.device)  # [T]
        idx = device_array(batch.slots, self.device)  # [B]
        scored = any(batch.scored)
        graphed = not scored and graphs is not None and prompt_bucket(self.layout, len(ids), batch.starts) is not None
        # a chunk after cached tokens attends to them: the verify form with a causal mask over the chunk (a graphed
        # chunk has its bucket's own)
        table = self.slots.block_table[idx]
        if graphed:
            fb = ForwardBatch.build(ids, positions, lens, batch.starts, table, self.page_size, None)
        else:
            fb = prompt_chunks(ids, positions, lens, batch.starts, table, self.page_size)
        last = fb.cu_q[1:].long() - 1  # [B]
        scores = None
        if scored:
            logits, features, scores = self.score_prompts(fb, last, lens, batch.scored)
        else:
            logits, features = self.forward_prompts(fb, batch.starts, last, graphs)  # [B, V], [T, F] or None
        first, logprobs = self.start_slots(batch, idx, logits, positions[last], scores is not None)
        if scores is not None:
            logprobs = tuple(torch.cat(pair) for pair in zip(logprobs, scores))  # [B + S, 1+K] each
        return Prefilled(first, features, positions, fb.slot_mapping, logprobs)

    def start_slots(self, batch: PrefillBatch, idx: torch.Tensor, logits: torch.Tensor, at: torch.Tensor,
                    logprobs: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """After the chunks of ``batch`` (slots ``idx [B]``) ran: each one's next token, chosen from the logits of its
        last token ``[B, V]`` at positions ``at [B]`` (a resumed request's given root instead), and the slots of
        those that end their context started -> (the tokens ``[B]``, their log-probabilities (values, ids)
        ``[B, 1+K]`` where asked or ``logprobs``, else None)."""
        extras = self.slots.extras(batch.slots)
        inputs = self.slots.inputs(idx, self.slots.all_greedy(batch.slots), extras)
        changes = self.slots.transforms(idx, at, extras)
        chosen = logits if changes is None else apply_transforms(logits, changes)
        if batch.allowed is not None:  # the first token follows its grammar too
            chosen = masked(chosen, batch.allowed.to(self.device))
        first = choose_tokens(chosen, at, inputs.params)
        given = device_array([-1 if r is None else r for r in batch.roots], self.device)  # [B]
        first = torch.where(given >= 0, given, first)  # [B]
        done = device_array(batch.last, self.device, np.bool_)  # [B]
        self.slots.start(idx, first, at + 1, done)
        if "logprobs" in extras or logprobs:
            return first, token_logprobs(logits, first, MAX_LOGPROBS)  # [B, 1+K] each
        return first, None

    def score_prompts(self, fb: ForwardBatch, last: torch.Tensor, lens: list[int], scored: list[list[int]]
                      ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor]]:
        """The target over the chunks of ``fb`` (``lens`` tokens each), eagerly -> (the logits at rows ``last [B]``:
        ``[B, V]``, the context features ``[T, F]`` or None, the log-probabilities (values, ids) ``[S, 1+K]`` of the
        ``scored`` tokens: per chunk, the prompt token after each of its first positions, S in all)."""
        hidden, features = self.target.model(fb, self.kv, self.layout.target_layer_ids)  # [T, H]
        rows = [start + j for start, s in zip(accumulate(lens, initial=0), scored) for j in range(len(s))]
        rows = device_array(rows, self.device)  # [S]
        tokens = device_array([t for s in scored for t in s], self.device)  # [S]
        head = self.target.model.logits
        return head(hidden[last]), features, head_logprobs(head, hidden[rows], tokens, MAX_LOGPROBS)

    def forward_prompts(self, fb: ForwardBatch, starts: list[int], last: torch.Tensor, graphs: GraphedFn | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target over the chunks of ``fb`` (starting after ``starts`` cached tokens) -> (the logits at rows
        ``last [B]``: ``[B, V]``, the context features ``[T, F]``, or None: none asked, or the graph already handed
        them to the drafter, see :meth:`_prompt_fn`). A lone chunk of at most a prompt
        bucket's tokens is padded to the bucket and replayed from ``graphs``: the padding rows come after the
        chunk's, so causal attention keeps them from the chunk's tokens, and their KV goes to the scratch page
        (their positions stay inside the block table, which the verify form reads)."""
        T = fb.input_ids.shape[0]
        size = prompt_bucket(self.layout, T, starts) if graphs is not None else None
        if size is None:
            hidden, features = self.target.model(fb, self.kv, self.layout.target_layer_ids)
            return self.target.model.logits(hidden[last]), features
        cached = starts[0] > 0  # a chunk after cached tokens: the verify form, causal over the padded chunk
        (logits, features), _ = graphs(self._padded_chunk(fb, last, size, cached), cached=cached)
        return logits, None if features is None else features[:T]

    def _padded_chunk(self, fb: ForwardBatch, last: torch.Tensor, size: int, causal: bool) -> tuple:
        """A lone chunk's rows of ``fb`` padded to ``size`` (the padding's KV to the scratch page, its positions after
        the chunk's): (ids, positions, prefix_lens, block_table, slot_mapping, last), and with ``causal`` the causal
        mask over ``size`` rows, as :meth:`_prompt_fn` and :class:`ChunkRows` take them."""
        after = torch.arange(1, size - fb.input_ids.shape[0] + 1, device=self.device)  # [pad]
        scratch = self.slots.scratch_page * self.page_size + after % self.page_size  # [pad] rows of the scratch page
        inputs = (torch.cat([fb.input_ids, torch.zeros_like(after)]),
                  torch.cat([fb.positions, fb.positions[-1] + after]), fb.prefix_lens, fb.block_table,
                  torch.cat([fb.slot_mapping, scratch]), last)
        if not causal:
            return inputs
        if size not in self._prompt_masks:
            self._prompt_masks[size] = causal_tree_mask([size], self.device)
        return inputs + (self._prompt_masks[size],)

    def _prompt_fn(self, timer: StageTimer, ids: torch.Tensor, positions: torch.Tensor, prefix_lens: torch.Tensor,
                   block_table: torch.Tensor, slot_mapping: torch.Tensor, last: torch.Tensor,
                   mask: torch.Tensor | None = None, cached: bool = False):
        """One padded chunk's forward (what :meth:`forward_prompts` replays) -> (logits ``[1, V]``, features). With a
        drafter in this process the features go into its context here, inside the graph (the padding's into the
        scratch page), and None is returned for them."""
        fb = ChunkRows(ids, positions, prefix_lens, block_table, slot_mapping, last, mask).forward_batch()
        hidden, features = self.target.model(fb, self.kv, self.layout.target_layer_ids)
        if self.drafter is not None and features is not None:
            self.add_context(features, positions, slot_mapping)
            features = None
        return self.target.model.logits(hidden[last]), features

    def absorb_prompts(self, batch: PrefillBatch, features: torch.Tensor, first: torch.Tensor):
        """The drafter actor's prefill, from shard 0's results: record the sequences' slots, write the chunks'
        context ``features [T, F]`` into the drafter's cache and start the slots of last chunks at ``first [B]``."""
        self.slots.admit(batch)
        lens = [len(p) for p in batch.prompts]
        cu = device_array(np.cumsum([0, *lens]), self.device, np.int32)  # [B+1]
        idx = device_array(batch.slots, self.device)  # [B]
        starts = device_array(batch.starts, self.device, np.int32)  # [B]
        rows = ForwardBatch.slots(self.slots.block_table[idx], starts, cu, self.page_size, sum(lens))
        positions = chunk_positions(batch.starts, lens, self.device)  # [T]
        self.add_context(features, positions, rows)
        done = device_array(batch.last, self.device, np.bool_)  # [B]
        ends = device_array([s + n for s, n in zip(batch.starts, lens)], self.device)  # [B]
        self.slots.start(idx, first, ends, done)

    def add_context(self, features: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor):
        """Hand target features ``[n, F]`` at ``positions [n]`` to the drafter: its cache rows ``rows [n]``."""
        self.drafter.add_context(features, positions, rows, self.draft_kv)

    # ---- one speculative step

    def launch(self, prefill: PrefillBatch | None, step: StepBatch | None) -> tuple[Pending | None, Pending | None]:
        """:func:`launch` in this process."""
        return launch(self, prefill, step, self.graphs)

    def step(self, batch: StepBatch) -> Pending[StepResult]:
        """All five stages in this process (one CUDA graph per batch-size bucket and tree width on GPUs), the
        device state advanced; the tokens (and, with ``budget="auto"``, the trees' masses) on their way to the host."""
        return self.run_step(batch)[1]

    @torch.no_grad()
    def run_step(self, batch: StepBatch, prefill: PrefillBatch | None = None, rows: int = 0
                 ) -> tuple[Pending | None, Pending[StepResult]]:
        """:meth:`step`, with ``prefill``'s lone chunk (padded to ``rows``) riding in the verify pass: its first token
        chosen after the pass -> (the chunk's result or None, the step's)."""
        self.slots.set_pages(batch.pages)
        self.slots.set_thoughts(batch.thoughts)
        start = self._mark()
        chunk = self._riding_chunk(prefill, rows) if prefill is not None else None
        idx, options = self.slot_index(batch.slots), dict(greedy=self.slots.all_greedy(batch.slots), nodes=batch.nodes,
                                                          extras=self.slots.extras(batch.slots))
        if batch.grammars is None:
            (packed, masses, chunk_logits, *logprobs), timer = self._run(
                self._step_fn, self._step_graphs, idx, *(chunk.tensors() if chunk else ()), **options)
        else:  # eagerly: the trees come to the host for their grammars' masks between the halves
            timer = self.timer()
            packed, masses, chunk_logits, *logprobs = self._step_fn(timer, idx, **options, grammars=batch.grammars)
        first = None
        if chunk is not None:
            first = self._first_tokens_to_host(prefill, *self._start_riding(prefill, chunk, chunk_logits))
        n = len(batch.slots)
        values = [t[:n] for t in (packed, masses, *logprobs) if t is not None]

        def result(host: list, device_seconds: float | None) -> StepResult:
            # per stage where the graph's event nodes were timed, else the whole step's device time
            seconds = timer.seconds or ({"step": device_seconds} if device_seconds is not None else {})
            tokens, rest = unpack_tokens(host[0]), host[1:]
            found = rest.pop(0) if masses is not None else None
            return StepResult(tokens, seconds, found, unpack_logprobs(*rest, tokens) if rest else None)

        return first, self._to_host(values, result, start)

    def _riding_chunk(self, prefill: PrefillBatch, rows: int) -> ChunkRows:
        """A prefill's lone chunk for a step's verify pass, padded to ``rows`` (its slot's pages and settings
        recorded)."""
        self.slots.admit(prefill)
        ids = device_array(prefill.prompts[0], self.device)  # [T]
        T = ids.shape[0]
        positions = chunk_positions(prefill.starts, [T], self.device)  # [T]
        table = self.slots.block_table[device_array(prefill.slots, self.device)]  # [1, max_pages]
        fb = ForwardBatch.build(ids, positions, [T], prefill.starts, table, self.page_size, None)
        last = torch.full((1,), T - 1, dtype=torch.int64, device=self.device)  # [1]
        return ChunkRows(*self._padded_chunk(fb, last, rows, causal=True))

    def _start_riding(self, prefill: PrefillBatch, chunk: ChunkRows, logits: torch.Tensor
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """After a step that ``prefill``'s chunk rode in: its next token from its ``logits [1, V]``
        (:meth:`start_slots`)."""
        slot = device_array(prefill.slots, self.device)  # [1]
        return self.start_slots(prefill, slot, logits, chunk.positions[chunk.last])

    def propose_step(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None, StageTimer]:
        """The drafter actor's half: draft and build -> (the trees packed for the link ``[Bp, packed_width]``, the
        trees' masses ``[Bp, widths, L]`` or None, the timer)."""
        self.slots.set_pages(batch.pages)
        (packed, masses), timer = self._run(self._propose_fn, self._propose_graphs, self.slot_index(batch.slots),
                                            nodes=batch.nodes)
        return packed, masses, timer

    def settle_step(self, batch: StepBatch, tree: torch.Tensor, prefill: PrefillBatch | None = None, rows: int = 0,
                    allowed: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None, StageTimer, Prefilled | None]:
        """A shard's half: verify, accept and commit the packed trees, advance the slots -> (the committed
        result packed ``[Bp, 2 + (1+L)]``, the path's context features ``[Bp, 1+L, F]`` or None, the emitted
        tokens' log-probabilities (values, ids) ``[Bp, 1+L, 1+K]`` where asked, else None; the timer; the riding
        chunk's result or None). ``prefill``: a lone chunk riding in the verify pass, padded to ``rows``
        (:func:`riding_rows`). ``allowed``: the grammars' masks of the tree nodes ``[Bp * (1+N), ceil(V/32)]`` (then
        the step runs eagerly)."""
        self.slots.set_pages(batch.pages)
        self.slots.set_thoughts(batch.thoughts)
        chunk = self._riding_chunk(prefill, rows) if prefill is not None else None
        options = dict(greedy=self.slots.all_greedy(batch.slots), nodes=batch.nodes,
                       extras=self.slots.extras(batch.slots))
        graphs = self._settle_graphs
        if allowed is not None:  # eagerly, as the in-process step with grammars
            options["allowed"], graphs = allowed, None
        (packed, features, chunk_logits, chunk_features, *logprobs), timer = self._run(
            self._settle_fn, graphs, self.slot_index(batch.slots), tree, *(chunk.tensors() if chunk else ()),
            **options)
        started = None
        if chunk is not None:
            T = len(prefill.prompts[0])
            first, first_logprobs = self._start_riding(prefill, chunk, chunk_logits)
            started = Prefilled(first, None if chunk_features is None else chunk_features[:T], chunk.positions[:T],
                                chunk.slot_mapping[:T], first_logprobs)
        return packed, features, tuple(logprobs) or None, timer, started

    def absorb_step(self, batch: StepBatch, packed: torch.Tensor, features: torch.Tensor):
        """The drafter actor's commit: the accepted paths' features into its cache, its slots advanced as the
        shards advanced theirs (``packed`` from :meth:`settle_step`)."""
        idx = self.slot_index(batch.slots)
        inputs = self.slots.inputs(idx, True)
        self.add_context(features.flatten(0, 1), *self.path_rows(inputs))
        self.slots.advance(idx, packed[:, 0].int(), packed[:, 1])

    def padded(self, n: int) -> int:
        """Rows a step of ``n`` sequences runs (and sends between actors) at."""
        return bucket(n, self.layout.num_slots) if self.graphs else n

    def slot_index(self, slots: list[int]) -> torch.Tensor:
        """The slots as a device index ``[Bp]``, padded with the scratch slot to a bucket's size under graphs."""
        padded = slots + [self.slots.scratch] * (self.padded(len(slots)) - len(slots))
        return device_array(padded, self.device)

    def _run(self, fn, graphs: GraphedFn | None, *inputs, **options) -> tuple[tuple, StageTimer]:
        """``fn(timer, *inputs, **options)``: replayed from ``graphs`` when there are graphs, else eagerly."""
        if graphs is not None:
            return graphs(inputs, **options)
        timer = self.timer()
        return fn(timer, *inputs, **options), timer

    def _step_fn(self, timer: StageTimer, idx: torch.Tensor, *chunk: torch.Tensor, greedy: bool, nodes: int,
                 extras: tuple[str, ...], grammars: list[GrammarState | None] | None = None):
        """The in-process step -> (packed result, masses, the riding chunk's logits at its last token ``[1, V]`` or
        None, the log-probabilities). ``chunk``: the :class:`ChunkRows` fields of a prompt chunk riding in the verify
        pass (its context features go to the drafter here)."""
        inputs = self.slots.inputs(idx, greedy, extras)
        tree, masses = self.propose(inputs, timer, nodes)
        if grammars is not None:  # each node's mask after its path, counted with the tree's build
            inputs.allowed = tree_masks(grammars, tree, self.target.model.cfg.vocab_size).to(self.device)
            timer.end("build")
        rows = ChunkRows(*chunk) if chunk else None
        committed, verified = self.settle(tree, inputs, timer, rows)
        if committed.features is not None:
            self.add_context(committed.features.flatten(0, 1), *self.path_rows(inputs))
        if verified.chunk_features is not None:
            self.add_context(verified.chunk_features, rows.positions, rows.slot_mapping)
        self._advance(idx, committed, extras)
        timer.end("commit")
        return committed.packed(), masses, verified.chunk_logits, *(committed.logprobs or ())

    def _propose_fn(self, timer: StageTimer, idx: torch.Tensor, nodes: int):
        tree, masses = self.propose(self.slots.inputs(idx, True), timer, nodes)
        return tree.pack(), masses

    def _settle_fn(self, timer: StageTimer, idx: torch.Tensor, tree: torch.Tensor, *chunk: torch.Tensor, greedy: bool,
                   nodes: int, extras: tuple[str, ...], allowed: torch.Tensor | None = None):
        """A shard's step -> (packed result, path features, the riding chunk's logits ``[1, V]`` and features
        ``[C, F]`` or None, the log-probabilities); ``chunk`` as :meth:`_step_fn` takes it, ``allowed`` as
        :meth:`settle_step`."""
        inputs = self.slots.inputs(idx, greedy, extras)
        inputs.allowed = allowed
        committed, verified = self.settle(DraftTree.unpack(tree, nodes), inputs, timer,
                                          ChunkRows(*chunk) if chunk else None)
        self._advance(idx, committed, extras)
        timer.end("commit")
        return (committed.packed(), committed.features, verified.chunk_logits, verified.chunk_features,
                *(committed.logprobs or ()))

    def _advance(self, idx: torch.Tensor, committed: Committed, extras: tuple[str, ...]):
        self.slots.advance(idx, committed.length, committed.next_token)
        if "thought" in extras:
            self.slots.halt_thoughts(idx, committed.next_token)
        if "penalties" in extras:
            self.slots.count(idx, committed)

    def propose(self, inputs: StepInputs, timer: StageTimer, nodes: int) -> tuple[DraftTree, torch.Tensor | None]:
        """The drafter's half of a step: ``draft``, then ``build_tree``, each timed under its name; the tree keeps
        its first ``nodes`` (0: the root alone, and no draft). With ``budget="auto"`` also the masses of the whole
        tree at every candidate width ``[B, widths, L]`` (:func:`kdray.spec.budget.width_masses`)."""
        draft = self.draft(inputs) if nodes else None
        timer.end("draft")
        tree = self.build_tree(draft, inputs)
        masses = None
        if self.spec.auto and draft is not None:
            masses = width_masses(draft.logits, tree.tokens, tree.depths, tree.ancestors(), self._widths,
                                  self.spec.depth)
        timer.end("build")
        return (tree.prefix(nodes) if nodes < tree.tokens.shape[1] - 1 else tree), masses

    def settle(self, tree: DraftTree, inputs: StepInputs, timer: StageTimer, chunk: ChunkRows | None = None
               ) -> tuple[Committed, Verified]:
        """The target's half: ``verify`` (with a riding prompt ``chunk``), ``accept``, ``commit`` (its timing closed
        by the caller, after the context hand-off)."""
        verified = self.verify(tree, inputs, chunk)
        timer.end("verify")
        accepted = self.accept(verified, tree, inputs)
        timer.end("accept")
        return self.commit(accepted, tree, verified, inputs), verified

    def draft(self, inputs: StepInputs) -> DraftOutput | None:
        """The drafter over ``[bonus, MASK x L]`` per sequence -> logits at depths 1..L (None for AR)."""
        if self.spec.mode == "ar":
            return None
        d, blk, B = self.drafter, self.spec.block_size, inputs.roots.shape[0]
        tokens = torch.full((B, blk), d.cfg.mask_token_id, dtype=torch.int64, device=self.device)  # [B, blk]
        tokens[:, 0] = inputs.roots
        positions = (inputs.prefix_lens.long()[:, None] + torch.arange(blk, device=self.device)).reshape(-1)
        fb = uniform_batch(tokens.reshape(-1), positions, blk, inputs.prefix_lens, inputs.block_table,
                           self.page_size, self._see_block.expand(B, blk, -1).contiguous())
        return DraftOutput(self._drafter_forward(fb))

    def build_tree(self, draft: DraftOutput | None, inputs: StepInputs) -> DraftTree:
        """Each sequence's best-first tree rooted at its bonus token (a chain for ``chain``, the root for AR)."""
        if draft is None:
            return root_only_tree(inputs.roots)
        budgets = torch.full((inputs.roots.shape[0],), self.spec.nodes, dtype=torch.int32, device=self.device)
        return tree_build(draft.logits, inputs.roots, budgets, self.spec.nodes, self.spec.max_topk)

    def verify(self, tree: DraftTree, inputs: StepInputs, chunk: ChunkRows | None = None) -> Verified:
        """Every tree node through the target in one pass, and after them a riding prompt ``chunk``'s tokens. Each
        tree runs at its full width 1 + nodes (slots past ``num_nodes`` hold token 0 seeing only itself and are never
        accepted), so the pass's shape is known without reading the trees back."""
        width = tree.tokens.shape[1]
        positions = (inputs.prefix_lens[:, None] + tree.depths).long().flatten()  # [B * (1+N)]
        fb = uniform_batch(tree.tokens.flatten(), positions, width, inputs.prefix_lens, inputs.block_table,
                           self.page_size, tree.mask)
        if chunk is None:
            hidden, features = self.target.model(fb, self.kv, self.layout.target_layer_ids)
            return Verified(self.target.model.logits(hidden), positions, features)
        hidden, features = self.target.model(join(fb, chunk.forward_batch()), self.kv, self.layout.target_layer_ids)
        n, logits = positions.shape[0], self.target.model.logits
        return Verified(logits(hidden[:n]), positions, None if features is None else features[:n],
                        chunk_logits=logits(hidden[n + chunk.last]),
                        chunk_features=None if features is None else features[n:])

    def accept(self, verified: Verified, tree: DraftTree, inputs: StepInputs) -> Accepted:
        """The target's choice at every node (argmax, or its exact sample), then the longest path it agrees with (up
        to a running thought's end marker, which its grammar's masks must follow; nothing for a halted thought's
        slot, see :meth:`SlotState.halt_thoughts`)."""
        B, width = tree.tokens.shape
        params = inputs.params
        rows = RowParams(*(t.repeat_interleave(width) for t in (params.temperature, params.top_k, params.top_p,
                                                                  params.seeds)), all_greedy=params.all_greedy,
                         min_p=None if params.min_p is None else params.min_p.repeat_interleave(width))
        logits = verified.logits
        changes = self.slots.transforms(inputs.slots, verified.positions, inputs.extras, width,
                                        (tree.tokens, tree.parents, self.spec.depth))
        if changes is not None:
            logits = apply_transforms(logits, changes)
        if inputs.allowed is not None:
            logits = masked(logits, inputs.allowed)
        stop = None  # [B]: a running thought's end marker per sequence (-1: none), where the batch has thoughts
        if "thought" in inputs.extras:  # the rows of slots whose thought runs: its mask (the others allow every token)
            stop = self.slots.thought_end[inputs.slots]
            thinking = (stop >= 0).repeat_interleave(width)[:, None]  # [B * (1+N), 1]
            masks = self.slots.thought_mask[inputs.slots.repeat_interleave(width)]  # [B * (1+N), ceil(V/32)]
            logits = masked(logits, torch.where(thinking, masks, -1))
        choice = choose_tokens(logits, verified.positions, rows).view(B, width)  # [B, 1+N]
        valid = torch.arange(width, device=self.device)[None, :] < tree.num_nodes[:, None]  # [B, 1+N]
        nodes, length, next_token = tree_accept(tree.tokens, tree.parents, tree.num_nodes,
                                                torch.where(valid, choice, -1), self.spec.depth, stop)
        if stop is not None:
            halted = stop == THOUGHT_HALTED  # [B]: these keep their root, length 0
            length, next_token = torch.where(halted, 0, length), torch.where(halted, inputs.roots, next_token)
        return Accepted(nodes, length, next_token)

    def commit(self, accepted: Accepted, tree: DraftTree, verified: Verified, inputs: StepInputs) -> Committed:
        """Move the accepted nodes' KV into the sequences' next cache slots; gather the path's tokens and context
        features, and where asked the emitted tokens' log-probabilities from the raw logits of the nodes before
        them (positions past each path's end carry padding, overwritten before anything reads them)."""
        kv_compact(self.kv.flatten(3), inputs.block_table, inputs.prefix_lens, accepted.nodes, accepted.length)
        kept = accepted.nodes.clamp(min=0).long()  # [B, 1+L]
        features = None
        if verified.features is not None:
            f = verified.features.view(kept.shape[0], tree.tokens.shape[1], -1)  # [B, 1+N, F]
            features = f.gather(1, kept[..., None].expand(-1, -1, f.shape[-1]))  # [B, 1+L, F]
        committed = Committed(tree.tokens.gather(1, kept), accepted.length, accepted.next_token, features)
        if "logprobs" in inputs.extras:
            logits = verified.logits.view(kept.shape[0], tree.tokens.shape[1], -1)  # [B, 1+N, V]
            path_logits = logits.gather(1, kept[..., None].expand(-1, -1, logits.shape[-1]))  # [B, 1+L, V]
            committed.logprobs = token_logprobs(path_logits, committed.emitted(), MAX_LOGPROBS)
        return committed

    def path_rows(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, flat cache rows), each ``[B * (1+L)]``, of the accepted path's places after the prefix."""
        B, n = inputs.roots.shape[0], self.spec.depth + 1
        positions = (inputs.prefix_lens.long()[:, None] + torch.arange(n, device=self.device)).reshape(-1)
        cu = torch.arange(0, (B + 1) * n, n, dtype=torch.int32, device=self.device)  # [B+1]
        return positions, ForwardBatch.slots(inputs.block_table, inputs.prefix_lens, cu, self.page_size, B * n)

    def _drafter_forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Drafter over the blocks ``[bonus, MASK x L]`` -> draft logits ``[B, L, V]`` at positions 1..L."""
        B, blk = fb.cu_q.shape[0] - 1, self.spec.block_size
        hidden = self.drafter(self.target.model.embed_tokens(fb.input_ids), fb, self.draft_kv)  # [B*blk, H]
        hidden = hidden.view(B, blk, -1)[:, 1:].reshape(B * (blk - 1), -1).to(self.target.model.dtype)
        return self.target.model.logits(hidden).view(B, blk - 1, -1)

    def _mark(self) -> torch.cuda.Event | None:
        """A timing event recorded now on the current stream (None on the CPU)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _to_host(self, values: list[torch.Tensor], parse, start: torch.cuda.Event | None = None) -> Pending:
        """Copy ``values`` to the host without waiting (pinned memory on GPUs); the Pending calls
        ``parse([each as lists], device seconds since start or None)``."""
        if self.device.type != "cuda":
            return Pending.ready(parse([v.tolist() for v in values], None))
        hosts = [torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for v in values]
        for host, v in zip(hosts, values):
            host.copy_(v, non_blocking=True)
        done = self._mark()

        def wait():
            done.synchronize()
            return parse([h.tolist() for h in hosts], start.elapsed_time(done) / 1e3 if start is not None else None)

        return Pending(wait)
