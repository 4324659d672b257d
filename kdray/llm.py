"""``LLM``: the offline API (vLLM's shape) over the engine, in-process or on Ray actors."""
from __future__ import annotations

import sys
import uuid
from pathlib import Path

import torch

from kdray.actors.worker import GangOptions
from kdray.config import EngineConfig, ParallelConfig, SpecConfig
from kdray.engine.engine import Engine
from kdray.engine.kv_pages import PagePool
from kdray.engine.request import RequestOutput, SamplingParams
from kdray.engine.runner import ModelRunner
from kdray.engine.scheduler import Scheduler
from kdray.model.dflash import DFlashDrafter
from kdray.model.loader import LoadedTarget, load_target, parse_dtype
from kdray.model.presets import PRESETS

DEFAULT_MODEL = "smollm2-135m"  # the real small model, with its shipped DFlash drafter
KV_BUDGET_BYTES_CPU = 512 << 20
BUILTIN_DRAFTERS = Path(__file__).resolve().parent / "assets" / "drafters"  # <preset>/ in the DFlash layout


def builtin_drafter(model: str | LoadedTarget) -> str | None:
    """The drafter shipped for a preset (``kdray/assets/drafters/<preset>/``), or None."""
    name = model.name if isinstance(model, LoadedTarget) else model
    path = BUILTIN_DRAFTERS / name
    return str(path) if name in PRESETS and (path / "config.json").is_file() else None


def load_drafter(drafter: str | DFlashDrafter | None, target, dtype: torch.dtype, device, block_size: int | None):
    """None, ``"random"`` (shaped to the target, for tests), a DFlash checkpoint directory or a loaded drafter."""
    if drafter is None:
        return None
    if isinstance(drafter, str) and drafter == "random":
        return DFlashDrafter.random_for(target.config, block_size or 16, dtype, device)
    d = drafter if isinstance(drafter, DFlashDrafter) else DFlashDrafter.from_pretrained(drafter, dtype, device)
    if d.cfg.hidden_size != target.config.hidden_size or d.cfg.vocab_size != target.config.vocab_size:
        raise ValueError(f"drafter '{drafter}' (hidden {d.cfg.hidden_size}, vocab {d.cfg.vocab_size}) does not match "
                         f"the target (hidden {target.config.hidden_size}, vocab {target.config.vocab_size})")
    if max(d.cfg.target_layer_ids) >= target.config.num_hidden_layers:
        raise ValueError(f"drafter '{drafter}' reads target layers {list(d.cfg.target_layer_ids)}, but the target has "
                         f"{target.config.num_hidden_layers}")
    return d


def default_num_pages(model, drafter, page_size: int, device: torch.device, dtype: torch.dtype,
                      gpu_share: float = 1.0) -> int:
    """Pages that fit half the free GPU memory (times ``gpu_share``, the part of the GPU this process
    may use), or a fixed budget on the CPU. ``model`` or ``drafter`` may be None (a Ray actor holds one)."""
    per_token = sum(m.cfg.num_hidden_layers * int(torch.Size(m.kv_row_shape).numel())
                    for m in (model, drafter) if m is not None)
    per_page = per_token * page_size * torch.finfo(dtype).bits // 8
    budget = int(torch.cuda.mem_get_info(device)[0] * gpu_share) // 2 if device.type == "cuda" else KV_BUDGET_BYTES_CPU
    return max(16, budget // per_page)


def context_limit(cfg, max_model_len: int | None) -> int:
    """The engine's context length: ``max_model_len``, or the model's when None; never beyond the model's."""
    limit = max_model_len or cfg.max_position_embeddings
    if limit > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len={limit} exceeds the model's max_position_embeddings="
                         f"{cfg.max_position_embeddings}")
    return limit


def graph_table_width(pool: PagePool, limit: int, spec: SpecConfig, cuda_graphs: bool) -> int | None:
    """With CUDA graphs, one block-table width (pages) for every step, so each batch shape is captured once;
    None without them (each step's table is as wide as its longest sequence)."""
    return pool.pages_for(limit + spec.cache_slack) if cuda_graphs else None


class LLM:
    """Load a target (and a drafter), then ``generate`` completions for batches of prompts.

    ``distributed="ray"`` runs the same engine on Ray actors (``tp`` shards and a drafter; see
    :mod:`kdray.actors`); call :meth:`shutdown` (or use ``with LLM(...)``) to release them early.
    """

    def __init__(self, model: str | LoadedTarget = DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32",
                 drafter: str | DFlashDrafter | None = None, spec: str | None = None, budget: int = 64,
                 block_size: int | None = None, tp: int = 1, distributed: str = "local", expert_parallel: bool = False,
                 max_num_seqs: int = 32, max_model_len: int | None = None, page_size: int = 16,
                 num_pages: int | None = None, max_tokens_per_step: int = 8192, cuda_graphs: bool | None = None):
        self.parallel = ParallelConfig(tp=tp, expert_parallel=expert_parallel, distributed=distributed)
        torch_dtype = parse_dtype(dtype)
        if drafter is None and spec != "ar":
            drafter = builtin_drafter(model)  # a preset's shipped drafter, if any
        mode = spec or ("ddtree" if drafter is not None else "ar")
        on_gpu = torch.device(device).type == "cuda"  # graphs replay the verify and draft passes on GPUs only
        cuda_graphs = on_gpu if cuda_graphs is None else cuda_graphs and on_gpu
        if mode != "ar" and drafter is None:
            raise ValueError(f"spec='{mode}' needs a drafter: drafter=<DFlash checkpoint dir> or drafter='random'")
        if self.parallel.distributed == "ray":  # the weights load inside the actors
            if not isinstance(model, str) or not isinstance(drafter, (str, type(None))):
                raise ValueError("distributed='ray' takes model= and drafter= as names or paths (not loaded objects)")
            from kdray.actors.coordinator import Coordinator

            options = GangOptions(model=model, device=torch.device(device).type, dtype=dtype, tp=tp,
                                  expert_parallel=expert_parallel, drafter=drafter if mode != "ar" else None,
                                  block_size=block_size, page_size=page_size, cuda_graphs=cuda_graphs)
            self.engine = Coordinator(options, mode, budget, EngineConfig(
                max_num_seqs=max_num_seqs, max_tokens_per_step=max_tokens_per_step, page_size=page_size,
                num_pages=num_pages, max_model_len=max_model_len))
            self.target, self.spec, self.engine_config = self.engine.target, self.engine.spec, self.engine.engine_config
            return
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA GPU is visible; use device='cpu'")
        self.target = model if isinstance(model, LoadedTarget) else load_target(model, torch_dtype, dev,
                                                                               expert_parallel=expert_parallel)
        d = load_drafter(drafter if mode != "ar" else None, self.target, torch_dtype, dev, block_size)
        self.spec = SpecConfig(mode=mode, budget=budget, block_size=d.cfg.block_size if d else (block_size or 16))
        cfg = self.target.config
        limit = context_limit(cfg, max_model_len)
        self.engine_config = EngineConfig(max_num_seqs=max_num_seqs, max_tokens_per_step=max_tokens_per_step,
                                          page_size=page_size, num_pages=num_pages, max_model_len=limit)
        pages = num_pages or default_num_pages(self.target.model, d, page_size, dev, torch_dtype)
        pool = PagePool(pages, page_size)
        runner = ModelRunner(self.target, d, self.spec, pages, page_size, dev, cuda_graphs=cuda_graphs,
                             max_pages_per_seq=graph_table_width(pool, limit, self.spec, cuda_graphs))
        scheduler = Scheduler(pool, self.engine_config, limit, self.spec.cache_slack, 1 + self.spec.nodes)
        eos = cfg.eos_token_ids or (self.target.tokenizer.eos_token_ids if self.target.tokenizer else ())
        self.engine = Engine(runner, scheduler, self.target.tokenizer, limit, cfg.vocab_size, eos,
                             self.target.name)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def shutdown(self):
        """Release the Ray actors, their placement group and GPUs (nothing to release in-process)."""
        if self.parallel.distributed == "ray":
            self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Complete every prompt (text, or token ids); outputs come back in input order."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts= (text) or prompt_token_ids=")
        if prompts is not None:
            if self.tokenizer is None:
                raise ValueError(f"model '{self.target.name}' has no tokenizer; pass prompt_token_ids= instead")
            prompts = [prompts] if isinstance(prompts, str) else prompts
            prompt_token_ids = [self.tokenizer.encode(p) for p in prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompt_token_ids)
        if len(params) != len(prompt_token_ids):
            raise ValueError(f"{len(params)} sampling_params for {len(prompt_token_ids)} prompts")
        ids = [uuid.uuid4().hex for _ in prompt_token_ids]
        for rid, toks, p in zip(ids, prompt_token_ids, params):
            self.engine.add_request(rid, list(toks), p)
        done: dict[str, RequestOutput] = {}
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        bar = None
        if show:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[r] for r in ids]
