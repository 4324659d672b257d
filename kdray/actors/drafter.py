"""``Drafter``: the DFlash drafter actor, with the target's embedding and LM head (loaded alone).

Each step it receives the pending context features from shard 0, drafts and builds the trees
(``tree_build``) and broadcasts them, packed in one buffer, to every shard.
"""
from __future__ import annotations

import torch
from torch import nn

from kdray.actors.worker import Loaded, Worker, pack_tree
from kdray.config import SpecConfig, load_model_config
from kdray.engine.runner import ModelRunner, StageTimer
from kdray.engine.sequence import Sequence
from kdray.llm import default_num_pages, load_drafter
from kdray.model.checkpoint import CheckpointReader
from kdray.model.layers import LMHead, VocabEmbedding
from kdray.model.loader import LoadedTarget, parse_dtype, resolve_model


class TargetHead(nn.Module):
    """The target's token embedding and LM head: all the drafter borrows from the target."""

    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[T, vocab]`` fp32, as the target computes them."""
        return self.lm_head(hidden)

    @classmethod
    def load(cls, model: str, dtype: torch.dtype, device: torch.device) -> LoadedTarget:
        """Read just ``model.embed_tokens`` and ``lm_head`` (or the tied embedding) of an HF checkpoint or GGUF."""
        path = resolve_model(model)
        if path.suffix == ".gguf":
            from gguf import GGUFReader

            from kdray.model.gguf import GGUFTensors, gguf_config

            file = GGUFReader(path)
            cfg = gguf_config(file, str(path))
            reader, close = GGUFTensors(file, cfg, str(path)), None
        else:
            cfg = load_model_config(path)
            reader = CheckpointReader(path)
            close = reader.close
        with torch.device(device):
            head = cls(cfg, dtype)
        try:
            with torch.no_grad():
                head.embed_tokens.load(reader, "model.embed_tokens.weight")
                head.lm_head.load(reader, "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
        finally:
            if close is not None:
                close()
        return LoadedTarget(head.eval(), cfg, None, model)


class Drafter(Worker):
    role = "drafter"

    @property
    def name(self) -> str:
        return "drafter"

    def load(self) -> Loaded:
        o, dtype = self.options, parse_dtype(self.options.dtype)
        self.head = TargetHead.load(o.model, dtype, self.device)
        self.drafter = load_drafter(o.drafter, self.head, dtype, self.device, o.block_size)
        pages = default_num_pages(None, self.drafter, o.page_size, self.device, dtype, self.gpu_share)
        return Loaded(kv_pages=pages, draft_config=self.drafter.cfg)

    def setup(self, spec: SpecConfig, num_pages: int, aux_layer_ids: tuple[int, ...],
              max_pages_per_seq: int | None) -> None:
        self.runner = ModelRunner(self.head, self.drafter, spec, num_pages, self.options.page_size, self.device,
                                  cuda_graphs=self.options.cuda_graphs,
                                  max_pages_per_seq=max_pages_per_seq, target_kv=False)

    def prefill(self, seqs: list[Sequence]) -> None:
        """Nothing to run: the prompts' features arrive with the sequences' first step."""

    def step(self, seqs: list[Sequence]) -> None:
        pending = [s.cached_len - s.drafted_len for s in seqs]
        width = len(self.drafter.cfg.target_layer_ids) * self.head.config.hidden_size
        features = torch.empty(sum(pending), width, dtype=self.head.model.dtype, device=self.device)  # [n, F]
        self.link.recv(features, 0)
        for s, part in zip(seqs, features.split(pending)):
            s.features = part
        tree = self.runner.propose(seqs, self.runner.block_table(seqs), StageTimer(cuda=False))  # not reported
        self.link.broadcast(pack_tree(tree), self.link.rank)
