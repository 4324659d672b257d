"""An engine's shapes, decided once from its arguments and what the loaded models report.

:class:`ModelFacts` is what loading tells the engine (in-process, or reported by the Ray actors);
:class:`EngineLayout` is what every runner is built with: the speculative spec, context length, KV
pages, the block-table width and the target layers that feed the drafter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kdray.config import DFLASH_BLOCK_SIZE, DFlashConfig, K2Config, SpecConfig
from kdray.engine.args import AUTO_MAX_NODES, EngineArgs
from kdray.model.k2 import PLAIN_CHUNK_PAIRS, PLAIN_CHUNK_TOKENS
from kdray.model.tokenizer import Tokenizer

KV_BUDGET_BYTES_CPU = 512 << 20
# Token counts a lone prompt chunk's graphed forward is padded to. Past 512 no chunk is padded by more than half: on K2
# a 1-2k-token pass is mostly GPU time, and 1108 tokens padded to 2048 lost to the eager pass (H200, K2 TP8 shard).
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048)


@dataclass
class ModelFacts:
    """What the engine learns from loading: the target's config, tokenizer and name, the drafter's config, and
    how many KV pages fit beside the weights (the smallest over every process that holds a cache)."""

    config: object
    tokenizer: Tokenizer | None
    name: str
    draft_config: DFlashConfig | None
    kv_pages: int


@dataclass(frozen=True)
class EngineLayout:
    spec: SpecConfig
    max_model_len: int
    num_pages: int
    page_size: int
    num_slots: int  # sequences that can be running at once (max_num_seqs)
    max_pages_per_seq: int  # block-table width: every sequence's pages up to the context limit
    target_layer_ids: tuple[int, ...]  # target layers whose outputs feed the drafter
    cuda_graphs: bool
    # a lone prompt chunk of at most this many tokens runs inside the running sequences' step, in their verify pass
    # (the weights read once for both); 0: chunks always run in a pass of their own
    step_chunk: int = 0
    # (tokens, pairs): a lone prompt chunk of at least this many tokens whose tokens x cached tokens reach pairs runs
    # in an eager pass of its own, neither replayed from a prompt graph nor riding in a verify pass (K2, whose plain
    # attention form, which only such a pass runs, beats the absorbed form of the other two over a long cache);
    # None: never
    plain_chunks: tuple[int, int] | None = None

    @classmethod
    def plan(cls, args: EngineArgs, facts: ModelFacts) -> EngineLayout:
        """The layout for resolved ``args`` and the loaded models' ``facts``."""
        cfg, draft = facts.config, facts.draft_config
        auto = args.budget == "auto"
        spec = SpecConfig(mode=args.spec, budget=AUTO_MAX_NODES if auto else args.budget,
                          block_size=draft.block_size if draft else (args.block_size or DFLASH_BLOCK_SIZE),
                          auto=auto and args.spec == "ddtree")
        limit = args.max_model_len or cfg.max_position_embeddings
        chunk = args.prefill_chunk or args.max_tokens_per_step
        if limit > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={limit} exceeds the model's max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
        return cls(spec=spec, max_model_len=limit, num_pages=args.num_pages or facts.kv_pages,
                   page_size=args.page_size, num_slots=args.max_num_seqs,
                   max_pages_per_seq=-(-(limit + spec.cache_slack) // args.page_size),
                   target_layer_ids=draft.target_layer_ids if draft else (), cuda_graphs=args.cuda_graphs,
                   step_chunk=chunk if chunk <= PROMPT_BUCKETS[-1] else 0,
                   plain_chunks=(PLAIN_CHUNK_TOKENS, PLAIN_CHUNK_PAIRS) if isinstance(cfg, K2Config) else None)


def kv_pages_that_fit(models, page_size: int, device: torch.device, dtype: torch.dtype, gpu_share: float = 1.0) -> int:
    """Pages of the caches of ``models`` (a target and/or a drafter: anything with ``cfg.num_hidden_layers`` and
    ``kv_row_shape``) that fit half the free GPU memory (times ``gpu_share``, the part of the GPU this process
    may use), or a fixed budget on the CPU."""
    per_token = sum(m.cfg.num_hidden_layers * int(torch.Size(m.kv_row_shape).numel()) for m in models)
    per_page = per_token * page_size * torch.finfo(dtype).bits // 8
    budget = int(torch.cuda.mem_get_info(device)[0] * gpu_share) // 2 if device.type == "cuda" else KV_BUDGET_BYTES_CPU
    return max(16, budget // per_page)
