"""What flows through one speculative step, stage by stage.

The engine hands a runner a :class:`PrefillBatch` or a :class:`StepBatch` (host values, one entry per
sequence); the runner turns a step batch into :class:`StepInputs` (device tensors) and runs the five
stages, each a method of :class:`~kdray.engine.runner.ModelRunner` that takes and returns these
dataclasses::

    draft(StepInputs) -> DraftOutput                                   the drafter's per-depth logits
    build_tree(DraftOutput, StepInputs) -> DraftTree                   best-first tree (or a chain, or the root)
    verify(DraftTree, StepInputs) -> Verified                          one target pass over every tree node
    accept(Verified, DraftTree, StepInputs) -> Accepted                the longest path the target agrees with
    commit(Accepted, DraftTree, Verified, StepInputs) -> Committed     its KV and drafter context kept

Only :meth:`Committed.packed` goes back to the host, once per step and asynchronously (a :class:`Pending`);
request state is changed by the engine alone, from the :class:`StepResult`, one step behind the device.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from itertools import accumulate
from typing import Generic, TypeVar

import torch

from kdray.engine.request import SamplingParams
from kdray.model.batch import ForwardBatch
from kdray.spec.grammar import GrammarState
from kdray.spec.sampling import RowParams

STAGES = ("draft", "build", "verify", "accept", "commit")
T = TypeVar("T")


@dataclass(frozen=True)
class PrefillBatch:
    """Context chunks to prefill: per sequence its slot, the chunk's tokens and where it starts (the tokens before
    are cached), its KV pages, sampling settings and seed; ``last`` marks a context's final chunk, whose last
    position gives the first token, unless ``roots`` gives the token already chosen (a preempted request resuming)."""

    slots: list[int]
    prompts: list[list[int]]
    starts: list[int]
    pages: list[list[int]]
    params: list[SamplingParams]
    seeds: list[int]
    last: list[bool]
    roots: list[int | None]
    prompt_lens: list[int]  # each request's prompt (the context may hold output too, after a preemption)
    bans: list[list[int]]  # the tokens masked until min_tokens are out (EOS and stop_token_ids; [] without)
    histories: list[list[int] | None]  # a last chunk of a penalised request: its whole context (else None)
    # prompt_logprobs: the prompt tokens after the chunk's first positions, one each, that they score (else [])
    scored: list[list[int]]
    # with a grammar in the batch: per sequence the tokens its first token may be, [B, ceil(V/32)] int32 on the host
    # (:func:`~kdray.spec.grammar.next_token_masks`; every token for a sequence without one), else None
    allowed: torch.Tensor | None = None


@dataclass(frozen=True)
class StepBatch:
    """The slots of the sequences that take one speculative step, and the draft nodes each verifies (0: plain
    decoding). Each slot's bonus token (the tree's root) and cached length live on the device, advanced by every
    step, so the host never has to know them to launch. With ``grammars`` the step runs eagerly, its trees on the
    engine's host between draft and verify for their masks (on Ray the drafter sends them there, and the masks go to
    the shards). A grammar's free thought has one mask, sent once (``thoughts``): its sequence steps as a plain one
    there, until its end marker."""

    slots: list[int]
    nodes: int
    pages: dict[int, list[int]] = field(default_factory=dict)  # slot -> its pages, where they grew since last sent
    grammars: list[GrammarState | None] | None = None  # per sequence the grammar it is masked by, when any is
    # slot -> (its thought's end marker, the mask inside [ceil(V/32)] int32 on the host), where a thought began since
    # last sent; (-1, None) where one ended
    thoughts: dict[int, tuple[int, torch.Tensor | None]] = field(default_factory=dict)


@dataclass
class StepInputs:
    """A step's slots and their per-slot device state (written at prefill, advanced by each step)."""

    slots: torch.Tensor  # [B] int64
    roots: torch.Tensor  # [B] int64 bonus tokens
    prefix_lens: torch.Tensor  # [B] int32 cached lengths
    block_table: torch.Tensor  # [B, max_pages] int32
    params: RowParams  # one row per sequence
    extras: tuple[str, ...] = ()  # the request features (:data:`~kdray.engine.request.FEATURES`) the batch uses
    allowed: torch.Tensor | None = None  # [B * (1+N), ceil(V/32)] int32: per tree node the tokens its grammar allows


@dataclass
class ChunkRows:
    """A lone prompt chunk's pass inputs: its tokens after ``prefix_len`` cached ones, causal among themselves, padded
    to a prompt bucket under CUDA graphs (padding rows come last, so the chunk's tokens never see them, and write their
    KV to the scratch page). It runs alone (a graphed prefill) or rides in a step's verify pass, after the trees'
    rows."""

    ids: torch.Tensor  # [C] int64
    positions: torch.Tensor  # [C] int64
    prefix_len: torch.Tensor  # [1] int32
    block_table: torch.Tensor  # [1, max_pages] int32
    slot_mapping: torch.Tensor  # [C] int64
    last: torch.Tensor  # [1] int64: the row of the chunk's last token
    mask: torch.Tensor | None = None  # [1, C, ceil(C/32)] int32: causal; None: the prefill form (nothing cached)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields in order (a graph's inputs)."""
        return tuple(t for f in fields(self) if (t := getattr(self, f.name)) is not None)

    def forward_batch(self) -> ForwardBatch:
        """The chunk as one sequence of a pass, its row offsets made on the device (no host copy in a graph)."""
        C = self.ids.shape[0]
        cu = torch.arange(0, 2 * C, C, dtype=torch.int32, device=self.ids.device)  # [2]: made on the device
        return ForwardBatch(input_ids=self.ids, positions=self.positions, cu_q=cu, q_lens=[C],
                            prefix_lens=self.prefix_len, block_table=self.block_table, slot_mapping=self.slot_mapping,
                            tree_mask=self.mask)


@dataclass
class DraftOutput:
    logits: torch.Tensor  # [B, L, V] fp32: the drafter's logits at depths 1..L


@dataclass
class Verified:
    logits: torch.Tensor  # [B * (1+N), V] fp32: the target's logits at every tree node
    positions: torch.Tensor  # [B * (1+N)] int64
    features: torch.Tensor | None  # [B * (1+N), F]: the drafter's context features at every node
    chunk_logits: torch.Tensor | None = None  # [1, V] fp32: a riding prompt chunk's at its last token
    chunk_features: torch.Tensor | None = None  # [C, F]: its context features (padding rows included)


@dataclass
class Accepted:
    nodes: torch.Tensor  # [B, 1+L] int32: accepted node indices along the path (-1 past its end)
    length: torch.Tensor  # [B] int32: accepted nodes, the root included (0: a halted thought's slot keeps nothing)
    next_token: torch.Tensor  # [B] int64: the target's choice after the path (the next bonus token)


@dataclass
class Committed:
    path: torch.Tensor  # [B, 1+L] int64: the accepted path's tokens (root first)
    length: torch.Tensor  # [B] int32
    next_token: torch.Tensor  # [B] int64
    features: torch.Tensor | None  # [B, 1+L, F]: the path's context features, handed to the drafter
    logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # emitted tokens' (values, ids) [B, 1+L, 1+K]

    def packed(self) -> torch.Tensor:
        """``[B, 2 + (1+L)]`` int64: the length, the next token, then the path, for one copy to the host."""
        return torch.cat([self.length[:, None].long(), self.next_token[:, None], self.path], dim=1)

    def emitted(self) -> torch.Tensor:
        """``[B, 1+L]`` int64: the tokens the step emits in order (the accepted drafts, then the next bonus at
        ``length - 1``; padding after)."""
        out = torch.cat([self.path[:, 1:], self.next_token[:, None]], dim=1)  # [B, 1+L]
        return out.scatter(1, (self.length.long() - 1).clamp(min=0)[:, None], self.next_token[:, None])


def unpack_tokens(rows: list[list[int]]) -> list[list[int]]:
    """Per sequence, the tokens a step emits (the accepted drafts, then the next bonus; none at length 0) from
    :meth:`Committed.packed` rows."""
    return [row[3:2 + row[0]] + [row[1]] if row[0] else [] for row in rows]


def unpack_logprobs(values: list, ids: list, tokens: list[list[int]]) -> list[list[tuple[list, list]]]:
    """Per sequence, per emitted token, its (values, ids) of :func:`kdray.spec.logprobs.token_logprobs`, from the
    host copies of :attr:`Committed.logprobs` (``tokens``: what :func:`unpack_tokens` gave)."""
    return [list(zip(v[:len(t)], i[:len(t)])) for v, i, t in zip(values, ids, tokens)]


class Pending(Generic[T]):
    """A runner's result on its way (a copy from the device, a reply from the actors): ``result()`` waits for it.
    The engine launches step k+1 before it asks for step k's result, so the host works while the device does."""

    def __init__(self, wait: Callable[[], T]):
        self._wait, self._done, self._value = wait, False, None

    @classmethod
    def ready(cls, value: T) -> Pending[T]:
        return cls(lambda: value)

    def result(self) -> T:
        if not self._done:
            self._value, self._done = self._wait(), True
        return self._value


@dataclass
class StepResult:
    """What a step (or a prefill: one token per sequence) gives the engine."""

    tokens: list[list[int]]  # per sequence: accepted draft tokens, then the next bonus
    seconds: dict[str, float]  # per stage, for the whole batch
    masses: list | None = None  # budget="auto": per sequence, its tree's mass per candidate width and depth
    logprobs: list | None = None  # asked for: per sequence, per emitted token, (values, ids) (unpack_logprobs)
    prompt_logprobs: list | None = None  # a prefill's: per sequence, per prompt token it scored, (values, ids)


def first_tokens(first: list[int], values: list | None = None, ids: list | None = None,
                 scored: list[int] = ()) -> StepResult:
    """A prefill's result from host copies: each sequence's first token and, when log-probabilities are asked,
    (values, ids) ``[B + S, 1+K]``: the first tokens', then the prompt tokens' that the chunks scored (``scored``:
    how many per sequence, S in all)."""
    tokens, B = [[t] for t in first], len(first)
    if values is None:
        return StepResult(tokens, {})
    ends = list(accumulate(scored, initial=B))
    return StepResult(tokens, {}, logprobs=unpack_logprobs([[v] for v in values[:B]], [[i] for i in ids[:B]], tokens),
                      prompt_logprobs=[list(zip(values[a:b], ids[a:b])) for a, b in zip(ends, ends[1:])] or None)


class StageTimer:
    """Seconds per stage of one step. On a GPU (``cuda``) each mark records a CUDA event on the current stream, so
    timing adds no host synchronisation; the times are read once the step's results are on the host. Marks made
    while a CUDA graph captures (``in_graph``) become event nodes, recorded again by every replay. Otherwise,
    host wall time. ``end(None)`` closes an interval that belongs to no stage (waiting on a peer)."""

    def __init__(self, cuda: bool, in_graph: bool = False):
        self.cuda, self.in_graph = cuda, in_graph
        self._marks: list = []
        if not in_graph:
            self.start()

    def start(self):
        self._marks = [(None, self._now())]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        try:
            event = torch.cuda.Event(enable_timing=True, external=self.in_graph)
        except TypeError:  # a torch without graph event nodes: stages inside graphs go untimed
            return None
        event.record()
        return event

    def end(self, stage: str | None):
        self._marks.append((stage, self._now()))

    @property
    def seconds(self) -> dict[str, float]:
        """Per stage, once the marked work has finished (waits for it on a GPU); {} where events are missing."""
        if not self._marks or any(m is None for _, m in self._marks):
            return {}
        if self.cuda:
            self._marks[-1][1].synchronize()
        out: dict[str, float] = {}
        try:
            for (_, start), (stage, stop) in zip(self._marks, self._marks[1:]):
                if stage is not None:
                    out[stage] = out.get(stage, 0.0) + (start.elapsed_time(stop) / 1e3 if self.cuda else stop - start)
        except RuntimeError:  # the driver did not time these graph nodes
            return {}
        return out


def add_seconds(*parts: dict[str, float]) -> dict[str, float]:
    """Stage times of the parts of one step (the drafter's and a shard's on Ray), added per stage."""
    out: dict[str, float] = {}
    for part in parts:
        for stage, s in part.items():
            out[stage] = out.get(stage, 0.0) + s
    return out
