"""``ShardWorker``: one tensor-parallel rank of the target (its weight shard, its KV pages, the kernels,
its groups). Every shard verifies, accepts and commits identically; shard 0 also answers the coordinator
and hands the accepted hidden states to the drafter."""
from __future__ import annotations

import torch

from kdray.actors.worker import Loaded, Worker, tree_width, unpack_tree
from kdray.config import SpecConfig
from kdray.engine.runner import ModelRunner
from kdray.engine.sequence import Sequence
from kdray.llm import default_num_pages
from kdray.model.loader import LoadedTarget, load_target, parse_dtype


class ShardWorker(Worker):
    role = "shard"

    @property
    def answers(self) -> bool:
        return self.rank == 0

    def load(self) -> Loaded:
        """Load this rank's slice of the checkpoint; shard 0 also reports the config and tokenizer."""
        o = self.options
        self.target = load_target(o.model, o.dtype, self.device, group=self.tp, expert_parallel=o.expert_parallel)
        pages = default_num_pages(self.target.model, None, o.page_size, self.device, parse_dtype(o.dtype),
                                  self.gpu_share)
        facts = LoadedTarget(None, self.target.config, self.target.tokenizer, self.target.name)
        return Loaded(kv_pages=pages, target=facts if self.rank == 0 else None)

    def setup(self, spec: SpecConfig, num_pages: int, aux_layer_ids: tuple[int, ...],
              max_pages_per_seq: int | None) -> None:
        self.spec = spec
        self.runner = ModelRunner(self.target, None, spec, num_pages, self.options.page_size, self.device,
                                  cuda_graphs=self.options.cuda_graphs, max_pages_per_seq=max_pages_per_seq,
                                  aux_layer_ids=aux_layer_ids)

    def prefill(self, seqs: list[Sequence]) -> dict | None:
        tokens = self.runner.prefill(seqs)
        return {"tokens": tokens} if self.answers else None

    def step(self, seqs: list[Sequence]) -> dict | None:
        """Send the pending drafter context (shard 0), take the drafter's trees, verify, accept, commit."""
        block_table = self.runner.block_table(seqs)
        stages = self.runner.stage_timer()
        if self.link is None:  # AR: each tree is its root alone
            tree = self.runner.propose(seqs, block_table, stages)
        else:
            drafter = self.tp.size  # the drafter's rank in the link group
            features = torch.cat([s.features for s in seqs])  # [sum(cached_len - drafted_len), F]
            for s in seqs:
                s.features = None
            if self.rank == 0:
                self.link.send(features, drafter)
            buf = torch.empty(len(seqs), tree_width(self.spec.nodes), dtype=torch.int32, device=self.device)
            tree = unpack_tree(self.link.broadcast(buf, drafter), self.spec.nodes)
            stages.end("draft")  # the drafter's draft and build, as this shard waited for them
        result = self.runner.verify(seqs, tree, block_table, stages)
        return {"tokens": result.tokens, "seconds": result.seconds} if self.answers else None
