"""``ShardWorker``: one tensor-parallel rank of the target (its weight shard, its KV pages, the kernels, its
groups). Every shard verifies, accepts and commits identically; shard 0 also reports the tokens to the
engine and hands the prompts' and accepted paths' context features to the drafter."""
from __future__ import annotations

import torch

from kdray.actors.worker import LoadReport, Worker, tree_width, unpack_tree
from kdray.engine.layout import EngineLayout, kv_pages_that_fit
from kdray.engine.runner import ModelRunner
from kdray.engine.step import PrefillBatch, StepBatch
from kdray.model.loader import load_target, parse_dtype


class ShardWorker(Worker):
    role = "shard"

    @property
    def reports_tokens(self) -> bool:
        return self.rank == 0

    def load(self) -> LoadReport:
        """Load this rank's slice of the checkpoint; shard 0 also reports the config and tokenizer."""
        a = self.args
        self.target = load_target(a.model, a.dtype, self.device, group=self.tp, expert_parallel=a.expert_parallel)
        pages = kv_pages_that_fit([self.target.model], a.page_size, self.device, parse_dtype(a.dtype), self.gpu_share)
        if self.rank:
            return LoadReport(kv_pages=pages)
        return LoadReport(pages, self.target.config, self.target.tokenizer, self.target.name)

    def setup(self, layout: EngineLayout) -> None:
        self.runner = ModelRunner(self.target, None, layout, self.device)

    def prefill(self, batch: PrefillBatch) -> dict | None:
        done = self.runner.run_prompts(batch)
        if self.rank == 0 and self.link is not None:
            self.link.send(done.features, self.drafter_rank)
        return {"tokens": done.first.tolist()} if self.reports_tokens else None

    @property
    def drafter_rank(self) -> int:
        return self.tp.size  # the drafter's rank in the link group, after the shards

    def step(self, batch: StepBatch) -> dict | None:
        """Take the drafter's trees (the root alone for AR), verify, accept, commit; shard 0 sends the accepted
        paths' context features back to the drafter."""
        r = self.runner
        timer = r.timer()
        inputs = r.inputs(batch)
        if self.link is None:  # AR: the root alone
            tree = r.propose(inputs, timer)
        else:
            buf = torch.empty(len(batch.slots), tree_width(r.spec.nodes), dtype=torch.int32, device=self.device)
            tree = unpack_tree(self.link.broadcast(buf, self.drafter_rank), r.spec.nodes)
            timer.end(None)  # waiting for the drafter's draft and build, which it times itself
        committed = r.settle(tree, inputs, timer)
        if self.rank == 0 and self.link is not None:
            self.link.send(committed.features, self.drafter_rank)
        timer.end("commit")
        return {"tokens": committed.tokens(), "seconds": timer.seconds} if self.reports_tokens else None
