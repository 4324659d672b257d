"""``DrafterWorker``: the DFlash drafter's actor, with the target's embedding and LM head (loaded alone).

Each step it drafts and builds the trees (``tree_build``) and broadcasts them, packed in one buffer, to
every shard; then it receives shard 0's results and the accepted paths' context features, writes those into
its cache and advances its slots as the shards advanced theirs. At prefill it receives the prompts' features
and first tokens.
"""
from __future__ import annotations

import torch

from kdray.actors.worker import LoadReport, Worker, int32_bytes
from kdray.engine.layout import EngineLayout, kv_pages_that_fit
from kdray.engine.runner import ModelRunner
from kdray.engine.step import PrefillBatch, StepBatch, add_seconds
from kdray.model.loader import load_drafter, load_target, parse_dtype


class DrafterWorker(Worker):
    role = "drafter"

    @property
    def name(self) -> str:
        return "drafter"

    def load(self) -> LoadReport:
        a, dtype = self.args, parse_dtype(self.args.dtype)
        self.head = load_target(a.model, dtype, self.device, head_only=True, load_format=a.load_format)
        self.drafter = load_drafter(a.drafter, self.head.config, dtype, self.device, a.block_size)
        return LoadReport(kv_pages_that_fit([self.drafter], a.page_size, self.device, dtype, self.gpu_share),
                          draft_config=self.drafter.cfg)

    def setup(self, layout: EngineLayout) -> None:
        self.runner = ModelRunner(self.head, self.drafter, layout, self.device, target_kv=False)
        self.width = len(self.drafter.cfg.target_layer_ids) * self.head.config.hidden_size  # features per token

    def _receive(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        """The next tensor of ``shape`` from shard 0."""
        return self.link.recv(torch.empty(shape, dtype=dtype, device=self.device), 0)

    def prefill(self, batch: PrefillBatch) -> None:
        features = self._receive(sum(map(len, batch.prompts)), self.width, dtype=self.head.model.dtype)  # [T, F]
        first = self._receive(len(batch.slots), dtype=torch.int64)  # [B]
        self.runner.absorb_prompts(batch, features, first)

    def step(self, batch: StepBatch, chunk: PrefillBatch | None = None, rows: int = 0,
             grammars: list[int] | None = None) -> dict:
        """Draft and build the trees (with ``grammars``, sent to the engine too, which masks their nodes), then take
        the shards' commit (and a riding ``chunk``'s context, as :meth:`prefill` takes a chunk's)."""
        r = self.runner
        tree, masses, timer = r.propose_step(batch)
        if grammars:
            self.channel.send({"trees": int32_bytes(tree[:len(batch.slots)])})
        self.link.broadcast(tree, self.link.rank)
        rows, path = r.padded(len(batch.slots)), r.spec.depth + 1
        packed = self._receive(rows, 2 + path, dtype=torch.int64)  # [Bp, 2 + (1+L)]
        features = self._receive(rows, path, self.width, dtype=self.head.model.dtype)  # [Bp, 1+L, F]
        commit = r.timer()  # starts after the receives on the stream: the shards' work is not counted
        r.absorb_step(batch, packed, features)
        if chunk is not None:
            self.prefill(chunk)
        commit.end("commit")
        return {"seconds": add_seconds(timer.seconds, commit.seconds),
                "masses": masses[:len(batch.slots)].tolist() if masses is not None else None}
