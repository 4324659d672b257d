"""The model work of one engine: prefill, and one speculative step (draft, build, verify, accept, commit).

``ModelRunner`` owns the target, the drafter and both paged KV caches. AR, chain and DDTree are the
same step with different trees: a root alone, a single path, or the best-first tree. Only the small
per-sequence results (accepted tokens) come back to the host, once per step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kdray.config import SpecConfig
from kdray.engine.cuda_graphs import GraphedPass
from kdray.engine.sequence import Sequence
from kdray.kernels.kv_compact import kv_compact
from kdray.kernels.tree_accept import tree_accept
from kdray.kernels.tree_build import DraftTree, tree_build
from kdray.model.batch import ForwardBatch, pack_bits
from kdray.model.dflash import DFlashDrafter
from kdray.spec.sampling import RowParams, choose_tokens


@dataclass
class StepResult:
    tokens: list[list[int]]  # per sequence: accepted draft tokens, then the next bonus
    seconds: dict[str, float]  # per stage, for the whole batch


class StageTimer:
    """Seconds per stage of one step. On a GPU (``cuda``) each stage end records a CUDA event on the current
    stream, so timing adds no host synchronisation; the times are read once the step's results are on the
    host. Otherwise, host wall time."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._marks = [("", self._now())]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def end(self, name: str):
        self._marks.append((name, self._now()))

    @property
    def seconds(self) -> dict[str, float]:
        if self.cuda:
            self._marks[-1][1].synchronize()
        out: dict[str, float] = {}
        for (_, start), (name, stop) in zip(self._marks, self._marks[1:]):
            out[name] = out.get(name, 0.0) + (start.elapsed_time(stop) / 1e3 if self.cuda else stop - start)
        return out


def root_only_tree(roots: torch.Tensor) -> DraftTree:
    """The tree of autoregressive decoding: the bonus token alone. roots ``[B]``."""
    B, dev = roots.shape[0], roots.device
    return DraftTree(tokens=roots[:, None].clone(), parents=torch.full((B, 1), -1, dtype=torch.int32, device=dev),
                     depths=torch.zeros(B, 1, dtype=torch.int32, device=dev),
                     num_nodes=torch.ones(B, dtype=torch.int32, device=dev),
                     mask=torch.ones(B, 1, 1, dtype=torch.int32, device=dev))


class ModelRunner:
    """Prefill and speculative steps over paged KV caches. In-process one runner does all of it. On Ray a
    shard's runner verifies (no drafter: trees arrive from the drafter actor; ``aux_layer_ids`` names the
    target layers whose hidden states it keeps for the drafter) and the drafter actor's runner proposes
    (its ``target`` holds only the embedding and LM head, so ``target_kv=False``)."""

    def __init__(self, target, drafter: DFlashDrafter | None, spec: SpecConfig, num_pages: int, page_size: int,
                 device: torch.device, cuda_graphs: bool = False,
                 max_pages_per_seq: int | None = None, aux_layer_ids: tuple[int, ...] = (), target_kv: bool = True):
        self.target, self.drafter, self.spec = target, drafter, spec
        self.max_pages_per_seq = max_pages_per_seq  # fixed block-table width, so captured graphs are reused
        self.device, self.page_size = torch.device(device), page_size
        m = target.model
        self.kv = torch.zeros(m.cfg.num_hidden_layers, num_pages, page_size, *m.kv_row_shape, dtype=m.dtype,
                              device=device) if target_kv else None  # [layers, P, S, *row]
        self.aux_ids: tuple[int, ...] = tuple(aux_layer_ids)
        if drafter is not None and spec.mode != "ar":
            self.draft_kv = torch.zeros(drafter.cfg.num_hidden_layers, num_pages, page_size, *drafter.kv_row_shape,
                                        dtype=drafter.dtype, device=device)  # [d_layers, P, S, 2, Hkv, D]
            self.aux_ids = drafter.cfg.target_layer_ids
            blk = spec.block_size
            self._see_block = pack_bits(torch.ones(blk, blk, dtype=torch.bool, device=device))  # [blk, W]
        graphs = cuda_graphs and self.device.type == "cuda"
        self._verify_pass = GraphedPass(self._target_pass) if graphs else self._target_pass
        self._block_pass = GraphedPass(self._drafter_pass) if graphs else self._drafter_pass

    def stage_timer(self) -> StageTimer:
        return StageTimer(cuda=self.device.type == "cuda")

    def block_table(self, seqs: list[Sequence]) -> torch.Tensor:
        width = self.max_pages_per_seq or max(len(s.pages) for s in seqs)
        table = torch.zeros(len(seqs), width, dtype=torch.int32)  # [B, max_pages]
        for i, s in enumerate(seqs):
            table[i, :len(s.pages)] = torch.tensor(s.pages, dtype=torch.int32)
        return table.to(self.device)

    def _row_params(self, seqs: list[Sequence], rows_per_seq: int) -> RowParams:
        """Each sequence's sampling parameters, repeated for its ``rows_per_seq`` rows of logits."""
        def rep(vals: list, dt: torch.dtype) -> torch.Tensor:
            return torch.tensor(vals, dtype=dt, device=self.device).repeat_interleave(rows_per_seq)

        ps = [s.params for s in seqs]
        return RowParams(temperature=rep([p.temperature for p in ps], torch.float32),
                         top_k=rep([p.top_k for p in ps], torch.int64), top_p=rep([p.top_p for p in ps], torch.float32),
                         seeds=rep([s.seed for s in seqs], torch.int64), all_greedy=all(p.greedy for p in ps))

    @torch.no_grad()
    def prefill(self, seqs: list[Sequence]) -> list[int]:
        """Run the prompts, cache their KV, keep the drafter's context features; return the first tokens."""
        lens = [len(s.prompt_ids) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s.prompt_ids], dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        batch = ForwardBatch.build(ids, positions, lens, [0] * len(seqs), self.block_table(seqs), self.page_size,
                                   None)
        hidden, aux = self.target.model(batch, self.kv, self.aux_ids)
        last = batch.cu_q[1:].long() - 1  # [B]
        first = choose_tokens(self.target.model.logits(hidden[last]), positions[last],
                              self._row_params(seqs, 1))
        for s, start, n in zip(seqs, batch.cu_q[:-1].tolist(), lens):
            s.cached_len = n
            s.features = aux[start:start + n] if aux is not None else None
        return first.tolist()

    @torch.no_grad()
    def step(self, seqs: list[Sequence]) -> StepResult:
        """One speculative step for sequences that all have a bonus token and a cached prefix."""
        stages = self.stage_timer()
        block_table = self.block_table(seqs)
        tree = self.propose(seqs, block_table, stages)
        return self.verify(seqs, tree, block_table, stages)

    def propose(self, seqs: list[Sequence], block_table: torch.Tensor, stages: StageTimer) -> DraftTree:
        """Draft and build: each sequence's tree rooted at its bonus token (the root alone for AR)."""
        roots = torch.tensor([s.output_ids[-1] for s in seqs], dtype=torch.int64, device=self.device)
        if self.spec.mode == "ar":
            tree = root_only_tree(roots)
        else:
            draft_logits = self._draft(seqs, roots, [s.cached_len for s in seqs], block_table)  # [B, L, V]
            stages.end("draft")
            budgets = torch.full((len(seqs),), self.spec.nodes, dtype=torch.int32, device=self.device)
            tree = tree_build(draft_logits, roots, budgets, self.spec.nodes, self.spec.max_topk)
        stages.end("build")
        return tree

    def verify(self, seqs: list[Sequence], tree: DraftTree, block_table: torch.Tensor,
               stages: StageTimer) -> StepResult:
        """Verify the trees in one target pass, accept the longest matching paths and commit their KV;
        the accepted nodes' hidden states become each sequence's pending drafter context."""
        B, width = tree.tokens.shape
        prefix_host = [s.cached_len for s in seqs]
        prefix = torch.tensor(prefix_host, dtype=torch.int32, device=self.device)
        # Every tree is verified at its full width 1 + nodes (slots past num_nodes hold token 0 seeing only
        # itself, and are never accepted), so the pass's shape is known without reading the trees back.
        q_lens = [width] * B
        valid = torch.arange(width, device=self.device)[None, :] < tree.num_nodes[:, None]  # [B, 1+N]
        positions = (prefix[:, None] + tree.depths).long().flatten()  # [B * (1+N)]
        batch = ForwardBatch.build(tree.tokens.flatten(), positions, q_lens, prefix_host, block_table,
                                   self.page_size, tree.mask)
        logits, aux = self._verify_pass(batch)  # [B * (1+N), V], [B * (1+N), F] or None
        stages.end("verify")

        flat_choice = choose_tokens(logits, positions, self._row_params(seqs, width))  # [B * (1+N)]
        choices = torch.where(valid, flat_choice.view(B, width), -1)  # [B, 1+N]
        accepted, accept_len, next_token = tree_accept(tree.tokens, tree.parents, tree.num_nodes, choices,
                                                       self.spec.depth)
        stages.end("accept")

        kv_compact(self.kv.flatten(3), block_table, prefix, accepted, accept_len)  # rows [layers, P, S, R]
        kept = accepted.clamp(min=0).long()  # [B, 1+L]
        tokens = tree.tokens.gather(1, kept)  # [B, 1+L]
        features = aux.view(B, width, -1).gather(1, kept[..., None].expand(-1, -1, aux.shape[-1])) \
            if aux is not None else None  # [B, 1+L, F]
        host = torch.cat([accept_len[:, None].long(), next_token[:, None], tokens], dim=1).tolist()  # one read
        out = []
        for i, s in enumerate(seqs):
            n, nxt, path = host[i][0], host[i][1], host[i][2:]
            s.cached_len += n
            if features is not None:
                s.features = features[i, :n]
            out.append(path[1:n] + [nxt])
        stages.end("commit")
        return StepResult(out, stages.seconds)

    def _draft(self, seqs: list[Sequence], roots: torch.Tensor, prefix_host: list[int],
               block_table: torch.Tensor) -> torch.Tensor:
        """Feed pending context features to the drafter, then run ``[bonus, MASK x L]`` -> logits ``[B, L, V]``."""
        d, blk = self.drafter, self.spec.block_size
        ctx_lens = [s.cached_len - s.drafted_len for s in seqs]
        if sum(ctx_lens):
            cu = torch.tensor([0] + ctx_lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(self.device)
            start = torch.tensor([s.drafted_len for s in seqs], dtype=torch.int32, device=self.device)
            positions = torch.cat([torch.arange(s.drafted_len, s.cached_len) for s in seqs]).to(self.device)
            slots = ForwardBatch.slots(block_table, start, cu, self.page_size, sum(ctx_lens))
            d.add_context(torch.cat([s.features for s in seqs if s.features is not None]), positions, slots,
                          self.draft_kv)
        for s in seqs:
            s.drafted_len, s.features = s.cached_len, None
        B = len(seqs)
        tokens = torch.full((B, blk), d.cfg.mask_token_id, dtype=torch.int64, device=self.device)
        tokens[:, 0] = roots
        positions = (torch.tensor(prefix_host, device=self.device)[:, None]
                     + torch.arange(blk, device=self.device)[None, :]).reshape(-1)
        see_all = self._see_block.expand(B, blk, -1)
        batch = ForwardBatch.build(tokens.reshape(-1), positions, [blk] * B, prefix_host, block_table,
                                   self.page_size, see_all.contiguous())
        return self._block_pass(batch)[0]

    def _target_pass(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target forward and LM head: (logits ``[T, V]``, drafter features ``[T, F]`` or None)."""
        hidden, aux = self.target.model(batch, self.kv, self.aux_ids)
        return self.target.model.logits(hidden), aux

    def _drafter_pass(self, batch: ForwardBatch) -> tuple[torch.Tensor]:
        """Drafter over the blocks ``[bonus, MASK x L]`` -> draft logits ``[B, L, V]`` at positions 1..L."""
        B, blk = batch.cu_q.shape[0] - 1, self.spec.block_size
        hidden = self.drafter(self.target.model.embed_tokens(batch.input_ids), batch, self.draft_kv)  # [B*blk, H]
        hidden = hidden.view(B, blk, -1)[:, 1:].reshape(B * (blk - 1), -1).to(self.target.model.dtype)
        return (self.target.model.logits(hidden).view(B, blk - 1, -1),)
