"""The model work of one engine: prefill, and the five stages of a speculative step.

``ModelRunner`` owns the target, the drafter, both paged KV caches and the per-slot state written at
prefill (block tables, sampling settings). AR, chain and DDTree are the same step with different trees:
the root alone, a single path, or the best-first tree. In-process one runner does all of it
(:meth:`ModelRunner.step`); on Ray a shard's runner verifies, accepts and commits, and the drafter actor's
runner drafts and builds (see :mod:`kdray.actors`), calling the same stage methods.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kdray.engine.cuda_graphs import GraphedPass
from kdray.engine.layout import EngineLayout
from kdray.engine.step import (Accepted, Committed, DraftOutput, PrefillBatch, StageTimer, StepBatch, StepInputs,
                               StepResult, Verified)
from kdray.kernels.kv_compact import kv_compact
from kdray.kernels.tree_accept import tree_accept
from kdray.kernels.tree_build import DraftTree, tree_build
from kdray.model.batch import ForwardBatch, pack_bits
from kdray.model.dflash import DFlashDrafter
from kdray.model.loader import LoadedTarget
from kdray.spec.sampling import RowParams, choose_tokens


def root_only_tree(roots: torch.Tensor) -> DraftTree:
    """The tree of autoregressive decoding: the bonus token alone. roots ``[B]``."""
    B, dev = roots.shape[0], roots.device
    return DraftTree(tokens=roots[:, None].clone(), parents=torch.full((B, 1), -1, dtype=torch.int32, device=dev),
                     depths=torch.zeros(B, 1, dtype=torch.int32, device=dev),
                     num_nodes=torch.ones(B, dtype=torch.int32, device=dev),
                     mask=torch.ones(B, 1, 1, dtype=torch.int32, device=dev))


class SlotState:
    """Per-slot device state, written when a sequence is admitted into the slot: its KV pages (a block-table
    row) and its sampling settings. A step gathers the rows of its slots."""

    def __init__(self, num_slots: int, max_pages: int, device: torch.device):
        self.block_table = torch.zeros(num_slots, max_pages, dtype=torch.int32, device=device)  # [slots, pages]
        self.temperature = torch.zeros(num_slots, dtype=torch.float32, device=device)  # [slots]
        self.top_k = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.top_p = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.seeds = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.greedy = [True] * num_slots  # host copy: a batch of greedy slots skips the sampling path

    def write(self, batch: PrefillBatch):
        width = self.block_table.shape[1]
        rows = torch.zeros(len(batch.slots), width, dtype=torch.int32)  # [B, pages]
        for i, pages in enumerate(batch.pages):
            if len(pages) > width:
                raise ValueError(f"{len(pages)} KV pages for one sequence exceed the block-table width {width}")
            rows[i, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        idx = torch.tensor(batch.slots, device=self.block_table.device)
        dev = self.block_table.device
        self.block_table[idx] = rows.to(dev)
        self.temperature[idx] = torch.tensor([p.temperature for p in batch.params], dtype=torch.float32, device=dev)
        self.top_k[idx] = torch.tensor([p.top_k for p in batch.params], dtype=torch.int64, device=dev)
        self.top_p[idx] = torch.tensor([p.top_p for p in batch.params], dtype=torch.float32, device=dev)
        self.seeds[idx] = torch.tensor(batch.seeds, dtype=torch.int64, device=dev)
        for slot, p in zip(batch.slots, batch.params):
            self.greedy[slot] = p.greedy

    def params(self, idx: torch.Tensor, slots: list[int]) -> RowParams:
        """Sampling settings of slots ``idx [B]`` (``slots``: the same on the host)."""
        return RowParams(temperature=self.temperature[idx], top_k=self.top_k[idx], top_p=self.top_p[idx],
                         seeds=self.seeds[idx], all_greedy=all(self.greedy[s] for s in slots))


@dataclass
class Prefilled:
    first: torch.Tensor  # [B] int64: each prompt's first generated token
    features: torch.Tensor | None  # [T, F]: the prompts' context features for the drafter
    positions: torch.Tensor  # [T] int64
    cache_rows: torch.Tensor  # [T] int64: flat cache rows of the prompt tokens


class ModelRunner:
    """Prefill and speculative steps over paged KV caches. ``target`` may be a whole target or (the drafter's
    actor on Ray) only its embedding and LM head, with ``target_kv=False``; ``drafter`` None runs no drafts
    (AR, or a shard on Ray whose trees come from the drafter's actor)."""

    def __init__(self, target: LoadedTarget, drafter: DFlashDrafter | None, layout: EngineLayout,
                 device: torch.device, target_kv: bool = True):
        self.target, self.drafter, self.layout, self.spec = target, drafter, layout, layout.spec
        self.device, self.page_size = torch.device(device), layout.page_size
        self.slots = SlotState(layout.num_slots, layout.max_pages_per_seq, self.device)
        m = target.model
        self.kv = torch.zeros(m.cfg.num_hidden_layers, layout.num_pages, layout.page_size, *m.kv_row_shape,
                              dtype=m.dtype, device=device) if target_kv else None  # [layers, P, S, *row]
        self.draft_kv = None
        if drafter is not None:
            self.draft_kv = torch.zeros(drafter.cfg.num_hidden_layers, layout.num_pages, layout.page_size,
                                        *drafter.kv_row_shape, dtype=drafter.dtype, device=device)
            blk = self.spec.block_size  # [d_layers, P, S, 2, Hkv, D] above; [blk, W] below
            self._see_block = pack_bits(torch.ones(blk, blk, dtype=torch.bool, device=device))
        graphs = layout.cuda_graphs and self.device.type == "cuda"
        self._target_pass = GraphedPass(self._target_forward) if graphs else self._target_forward
        self._drafter_pass = GraphedPass(self._drafter_forward) if graphs else self._drafter_forward

    def shutdown(self):
        """Free the KV caches and captured graphs; the runner cannot step afterwards."""
        self.kv = self.draft_kv = self._target_pass = self._drafter_pass = None

    def timer(self) -> StageTimer:
        return StageTimer(cuda=self.device.type == "cuda")

    # ---- prefill

    @torch.no_grad()
    def prefill(self, batch: PrefillBatch) -> list[int]:
        """In-process prefill: the prompts, then their features into the drafter's context -> first tokens."""
        done = self.run_prompts(batch)
        if done.features is not None:
            self.add_context(done.features, done.positions, done.cache_rows)
        return done.first.tolist()

    def run_prompts(self, batch: PrefillBatch) -> Prefilled:
        """Record the new sequences' slots, run their prompts, cache their KV; pick the first tokens."""
        self.slots.write(batch)
        lens = [len(p) for p in batch.prompts]
        ids = torch.tensor([t for p in batch.prompts for t in p], dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n) for n in lens]).to(self.device)
        idx = torch.tensor(batch.slots, device=self.device)
        fb = ForwardBatch.build(ids, positions, lens, [0] * len(lens), self.slots.block_table[idx], self.page_size,
                                None)
        hidden, features = self.target.model(fb, self.kv, self.layout.target_layer_ids)
        last = fb.cu_q[1:].long() - 1  # [B]
        first = choose_tokens(self.target.model.logits(hidden[last]), positions[last],
                              self.slots.params(idx, batch.slots))
        return Prefilled(first, features, positions, fb.slot_mapping)

    def prompt_rows(self, batch: PrefillBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions ``[T]``, flat cache rows ``[T]``) of a prefill's prompt tokens, for a runner that did not
        run the prefill itself (the drafter's actor)."""
        self.slots.write(batch)
        lens = [len(p) for p in batch.prompts]
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).to(self.device)  # [B+1]
        idx = torch.tensor(batch.slots, device=self.device)
        zeros = torch.zeros(len(lens), dtype=torch.int32, device=self.device)
        rows = ForwardBatch.slots(self.slots.block_table[idx], zeros, cu, self.page_size, sum(lens))
        return torch.cat([torch.arange(n) for n in lens]).to(self.device), rows

    def add_context(self, features: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor):
        """Hand target features ``[n, F]`` at ``positions [n]`` to the drafter: its cache rows ``rows [n]``."""
        self.drafter.add_context(features, positions, rows, self.draft_kv)

    # ---- one speculative step

    @torch.no_grad()
    def step(self, batch: StepBatch) -> StepResult:
        """All five stages in this process; the drafter's context follows the accepted path."""
        timer = self.timer()
        inputs = self.inputs(batch)
        committed = self.settle(self.propose(inputs, timer), inputs, timer)
        if committed.features is not None:
            self.add_context(committed.features.flatten(0, 1), *self.path_rows(inputs))
        timer.end("commit")
        return StepResult(committed.tokens(), timer.seconds)

    def propose(self, inputs: StepInputs, timer: StageTimer) -> DraftTree:
        """The drafter's half of a step: ``draft``, then ``build_tree``, each timed under its name."""
        draft = self.draft(inputs)
        timer.end("draft")
        tree = self.build_tree(draft, inputs)
        timer.end("build")
        return tree

    def settle(self, tree: DraftTree, inputs: StepInputs, timer: StageTimer) -> Committed:
        """The target's half: ``verify``, ``accept``, ``commit`` (its timing closed by the caller, after the
        context hand-off)."""
        verified = self.verify(tree, inputs)
        timer.end("verify")
        accepted = self.accept(verified, tree, inputs)
        timer.end("accept")
        return self.commit(accepted, tree, verified, inputs)

    def inputs(self, batch: StepBatch) -> StepInputs:
        """The step batch on the device, with its slots' block tables and sampling settings."""
        host = torch.tensor([batch.slots, batch.roots, batch.prefix_lens], dtype=torch.int64)  # [3, B]
        idx, roots, prefix = host.to(self.device)
        return StepInputs(roots=roots, prefix_lens=prefix.int(), prefix_host=list(batch.prefix_lens),
                          block_table=self.slots.block_table[idx], params=self.slots.params(idx, batch.slots))

    def draft(self, inputs: StepInputs) -> DraftOutput | None:
        """The drafter over ``[bonus, MASK x L]`` per sequence -> logits at depths 1..L (None for AR)."""
        if self.spec.mode == "ar":
            return None
        d, blk, B = self.drafter, self.spec.block_size, inputs.roots.shape[0]
        tokens = torch.full((B, blk), d.cfg.mask_token_id, dtype=torch.int64, device=self.device)  # [B, blk]
        tokens[:, 0] = inputs.roots
        positions = (inputs.prefix_lens.long()[:, None] + torch.arange(blk, device=self.device)).reshape(-1)
        fb = ForwardBatch.build(tokens.reshape(-1), positions, [blk] * B, inputs.prefix_host, inputs.block_table,
                                self.page_size, self._see_block.expand(B, blk, -1).contiguous())
        return DraftOutput(self._drafter_pass(fb)[0])

    def build_tree(self, draft: DraftOutput | None, inputs: StepInputs) -> DraftTree:
        """Each sequence's best-first tree rooted at its bonus token (a chain for ``chain``, the root for AR)."""
        if draft is None:
            return root_only_tree(inputs.roots)
        budgets = torch.full((inputs.roots.shape[0],), self.spec.nodes, dtype=torch.int32, device=self.device)
        return tree_build(draft.logits, inputs.roots, budgets, self.spec.nodes, self.spec.max_topk)

    def verify(self, tree: DraftTree, inputs: StepInputs) -> Verified:
        """Every tree node through the target in one pass. Each tree runs at its full width 1 + nodes (slots past
        ``num_nodes`` hold token 0 seeing only itself and are never accepted), so the pass's shape is known
        without reading the trees back."""
        B, width = tree.tokens.shape
        positions = (inputs.prefix_lens[:, None] + tree.depths).long().flatten()  # [B * (1+N)]
        fb = ForwardBatch.build(tree.tokens.flatten(), positions, [width] * B, inputs.prefix_host,
                                inputs.block_table, self.page_size, tree.mask)
        logits, features = self._target_pass(fb)
        return Verified(logits, positions, features)

    def accept(self, verified: Verified, tree: DraftTree, inputs: StepInputs) -> Accepted:
        """The target's choice at every node (argmax, or its exact sample), then the longest path it agrees with."""
        B, width = tree.tokens.shape
        params = inputs.params
        rows = RowParams(*(t.repeat_interleave(width) for t in (params.temperature, params.top_k, params.top_p,
                                                                  params.seeds)), all_greedy=params.all_greedy)
        choice = choose_tokens(verified.logits, verified.positions, rows).view(B, width)  # [B, 1+N]
        valid = torch.arange(width, device=self.device)[None, :] < tree.num_nodes[:, None]  # [B, 1+N]
        nodes, length, next_token = tree_accept(tree.tokens, tree.parents, tree.num_nodes,
                                                torch.where(valid, choice, -1), self.spec.depth)
        return Accepted(nodes, length, next_token)

    def commit(self, accepted: Accepted, tree: DraftTree, verified: Verified, inputs: StepInputs) -> Committed:
        """Move the accepted nodes' KV into the sequences' next cache slots; gather the path's tokens and context
        features (positions past each path's end carry padding, overwritten before anything reads them)."""
        kv_compact(self.kv.flatten(3), inputs.block_table, inputs.prefix_lens, accepted.nodes, accepted.length)
        kept = accepted.nodes.clamp(min=0).long()  # [B, 1+L]
        features = None
        if verified.features is not None:
            f = verified.features.view(kept.shape[0], tree.tokens.shape[1], -1)  # [B, 1+N, F]
            features = f.gather(1, kept[..., None].expand(-1, -1, f.shape[-1]))  # [B, 1+L, F]
        return Committed(tree.tokens.gather(1, kept), accepted.length, accepted.next_token, features)

    def path_rows(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, flat cache rows), each ``[B * (1+L)]``, of the accepted path's places after the prefix."""
        B, n = inputs.roots.shape[0], self.spec.depth + 1
        positions = (inputs.prefix_lens.long()[:, None] + torch.arange(n, device=self.device)).reshape(-1)
        cu = torch.arange(0, (B + 1) * n, n, dtype=torch.int32, device=self.device)  # [B+1]
        return positions, ForwardBatch.slots(inputs.block_table, inputs.prefix_lens, cu, self.page_size, B * n)

    # ---- the passes (replayed from CUDA graphs on GPUs)

    def _target_forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target forward and LM head: (logits ``[T, V]``, context features ``[T, F]`` or None)."""
        hidden, features = self.target.model(fb, self.kv, self.layout.target_layer_ids)
        return self.target.model.logits(hidden), features

    def _drafter_forward(self, fb: ForwardBatch) -> tuple[torch.Tensor]:
        """Drafter over the blocks ``[bonus, MASK x L]`` -> draft logits ``[B, L, V]`` at positions 1..L."""
        B, blk = fb.cu_q.shape[0] - 1, self.spec.block_size
        hidden = self.drafter(self.target.model.embed_tokens(fb.input_ids), fb, self.draft_kv)  # [B*blk, H]
        hidden = hidden.view(B, blk, -1)[:, 1:].reshape(B * (blk - 1), -1).to(self.target.model.dtype)
        return (self.target.model.logits(hidden).view(B, blk - 1, -1),)
