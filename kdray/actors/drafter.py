"""``DrafterWorker``: the DFlash drafter's actor, with the target's embedding and LM head (loaded alone).

Each step it drafts and builds the trees (``tree_build``) and broadcasts them, packed in one buffer, to
every shard; then it receives the accepted paths' context features from shard 0 and writes them into its
cache. At prefill it receives the prompts' features.
"""
from __future__ import annotations

import torch

from kdray.actors.worker import LoadReport, Worker, pack_tree
from kdray.engine.layout import EngineLayout, kv_pages_that_fit
from kdray.engine.runner import ModelRunner
from kdray.engine.step import PrefillBatch, StepBatch
from kdray.model.loader import load_drafter, load_target, parse_dtype


class DrafterWorker(Worker):
    role = "drafter"

    @property
    def name(self) -> str:
        return "drafter"

    def load(self) -> LoadReport:
        a, dtype = self.args, parse_dtype(self.args.dtype)
        self.head = load_target(a.model, dtype, self.device, head_only=True)
        self.drafter = load_drafter(a.drafter, self.head.config, dtype, self.device, a.block_size)
        return LoadReport(kv_pages_that_fit([self.drafter], a.page_size, self.device, dtype, self.gpu_share),
                          draft_config=self.drafter.cfg)

    def setup(self, layout: EngineLayout) -> None:
        self.runner = ModelRunner(self.head, self.drafter, layout, self.device, target_kv=False)
        self.width = len(self.drafter.cfg.target_layer_ids) * self.head.config.hidden_size  # features per token

    def _receive(self, rows: int) -> torch.Tensor:
        """The next ``[rows, F]`` context features from shard 0."""
        features = torch.empty(rows, self.width, dtype=self.head.model.dtype, device=self.device)  # [rows, F]
        return self.link.recv(features, 0)

    def prefill(self, batch: PrefillBatch) -> None:
        positions, rows = self.runner.prompt_rows(batch)
        self.runner.add_context(self._receive(positions.shape[0]), positions, rows)

    def step(self, batch: StepBatch) -> dict:
        r = self.runner
        timer = r.timer()
        inputs = r.inputs(batch)
        self.link.broadcast(pack_tree(r.propose(inputs, timer)), self.link.rank)
        positions, rows = r.path_rows(inputs)
        features = self._receive(positions.shape[0])
        timer.end(None)  # the shards' verify, accept and commit
        r.add_context(features, positions, rows)
        timer.end("commit")
        return {"seconds": timer.seconds}
