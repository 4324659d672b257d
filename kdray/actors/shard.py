"""``ShardWorker``: one tensor-parallel rank of the target (its weight shard, its KV pages, the kernels, its
groups). Every shard verifies, accepts and commits identically; shard 0 also reports the tokens to the
engine and hands the prompts' and accepted paths' results to the drafter."""
from __future__ import annotations

import torch

from kdray.actors.worker import LoadReport, Worker, int32_rows
from kdray.engine.layout import EngineLayout, kv_pages_that_fit
from kdray.engine.runner import ModelRunner, Prefilled
from kdray.engine.step import PrefillBatch, StepBatch, add_seconds, unpack_logprobs, unpack_tokens
from kdray.kernels.tree_build import packed_width
from kdray.model.loader import load_target, parse_dtype


def first_tokens_reply(done: Prefilled) -> dict:
    """Shard 0's reply for prefilled chunks: their first tokens and log-probabilities (the scored prompt tokens' after
    them), read back by :func:`~kdray.engine.step.first_tokens`."""
    return {"tokens": done.first.tolist(), "logprobs": None if done.logprobs is None else
            [t.tolist() for t in done.logprobs]}


class ShardWorker(Worker):
    role = "shard"

    @property
    def reports_tokens(self) -> bool:
        return self.rank == 0

    @property
    def drafter_rank(self) -> int:
        return self.tp.size  # the drafter's rank in the link group, after the shards

    def load(self) -> LoadReport:
        """Load this rank's slice of the checkpoint (random under ``load_format="dummy"``); shard 0 also reports the
        config and tokenizer."""
        a = self.args
        self.target = load_target(a.model, a.dtype, self.device, group=self.tp, expert_parallel=a.expert_parallel,
                                  load_format=a.load_format)
        pages = kv_pages_that_fit([self.target.model], a.page_size, self.device, parse_dtype(a.dtype), self.gpu_share)
        if self.rank:
            return LoadReport(kv_pages=pages)
        return LoadReport(pages, self.target.config, self.target.tokenizer, self.target.name)

    def setup(self, layout: EngineLayout) -> None:
        self.runner = ModelRunner(self.target, None, layout, self.device)

    def _to_drafter(self, *tensors: torch.Tensor):
        if self.rank == 0 and self.link is not None:
            for t in tensors:
                self.link.send(t, self.drafter_rank)

    def _allowed(self, batch: StepBatch, seqs: list[int]) -> torch.Tensor:
        """The grammar masks of this step's tree nodes ``[Bp * (1+N), ceil(V/32)]`` on this device: the rows of the
        sequences ``seqs`` come from the engine to shard 0 (its ``allowed`` frame), which broadcasts them to the other
        shards; the other sequences' rows and the padding's allow every token."""
        width, words = 1 + batch.nodes, (self.target.config.vocab_size + 31) // 32
        masks = torch.empty(len(seqs), width, words, dtype=torch.int32, device=self.device)  # [G, 1+N, W]
        if self.rank == 0:
            frame = self.channel.recv()
            if frame.get("op") != "allowed":
                raise RuntimeError(f"expected the step's grammar masks from the engine, got a '{frame.get('op')}' "
                                   "frame")
            masks.copy_(int32_rows(frame["masks"], len(seqs) * width).view_as(masks))
        if self.tp.size > 1:
            self.tp.broadcast(masks, 0)
        allowed = torch.full((self.runner.padded(len(batch.slots)), width, words), -1, dtype=torch.int32,
                             device=self.device)  # [Bp, 1+N, W]
        allowed[seqs] = masks
        return allowed.flatten(0, 1)

    def prefill(self, batch: PrefillBatch) -> dict | None:
        done = self.runner.run_prompts(batch)
        self._to_drafter(done.features, done.first)
        return first_tokens_reply(done) if self.reports_tokens else None

    def step(self, batch: StepBatch, chunk: PrefillBatch | None = None, rows: int = 0,
             grammars: list[int] | None = None) -> dict | None:
        """Take the drafter's trees (the root alone for AR) and, for the sequences ``grammars``, the engine's masks of
        their nodes, verify (with a riding prompt ``chunk``), accept, commit; shard 0 sends the results and the
        accepted paths' context features back to the drafter, then the chunk's features and first token."""
        r, seconds = self.runner, {}
        if self.link is None:  # AR: the root alone, built here
            tree, _, timer = r.propose_step(batch)
            seconds = timer.seconds
        else:
            tree = torch.empty(r.padded(len(batch.slots)), packed_width(batch.nodes), dtype=torch.int32,
                               device=self.device)  # [Bp, packed]
            self.link.broadcast(tree, self.drafter_rank)
        allowed = self._allowed(batch, grammars) if grammars else None
        packed, features, logprobs, timer, started = r.settle_step(batch, tree, chunk, rows, allowed)
        self._to_drafter(packed, features)
        if started is not None:
            self._to_drafter(started.features, started.first)
        if not self.reports_tokens:
            return None
        n = len(batch.slots)
        tokens = unpack_tokens(packed[:n].tolist())
        reply = {"tokens": tokens, "seconds": add_seconds(seconds, timer.seconds),
                 "logprobs": None if logprobs is None else unpack_logprobs(*(t[:n].tolist() for t in logprobs), tokens)}
        if started is not None:
            reply["first"] = first_tokens_reply(started)
        return reply
