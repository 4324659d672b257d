"""One engine builder for every layout: load the models (here, or in Ray actors), plan the engine's shapes
from what they report, start the runner(s), and put the scheduler and the engine on top."""
from __future__ import annotations

import torch

from kdray.engine.args import EngineArgs
from kdray.engine.engine import Engine
from kdray.engine.kv_pages import PagePool
from kdray.engine.layout import EngineLayout, ModelFacts, kv_pages_that_fit
from kdray.engine.runner import BUCKETS, ModelRunner, riding_buckets
from kdray.engine.scheduler import Scheduler
from kdray.engine.request import SamplingParams
from kdray.engine.step import PrefillBatch, StepBatch
from kdray.model.dflash import DFlashDrafter
from kdray.model.loader import LoadedTarget, load_drafter, load_target, parse_dtype
from kdray.spec.budget import BudgetPolicy
from kdray.spec.grammar import Grammars


class LocalModels:
    """The target and the drafter in this process (loaded here, or given already loaded)."""

    def __init__(self, args: EngineArgs, target: LoadedTarget | None = None, drafter: DFlashDrafter | None = None):
        self.args, self.target, self.drafter = args, target, drafter

    def load(self) -> ModelFacts:
        a = self.args
        device, dtype = torch.device(a.device), parse_dtype(a.dtype)
        if self.target is None:
            self.target = load_target(a.model, dtype, device, expert_parallel=a.expert_parallel,
                                      load_format=a.load_format)
        source = None if a.spec == "ar" else (self.drafter or a.drafter)
        self.drafter = load_drafter(source, self.target.config, dtype, device, a.block_size)
        models = [m for m in (self.target.model, self.drafter) if m is not None]
        return ModelFacts(self.target.config, self.target.tokenizer, self.target.name,
                          self.drafter.cfg if self.drafter is not None else None,
                          kv_pages_that_fit(models, a.page_size, device, dtype))

    def start(self, layout: EngineLayout) -> ModelRunner:
        return ModelRunner(self.target, self.drafter, layout, torch.device(self.args.device))


def build_engine(args: EngineArgs, target: LoadedTarget | None = None,
                 drafter: DFlashDrafter | None = None) -> tuple[Engine, ModelFacts]:
    """An engine for ``args`` (resolved here); ``target`` / ``drafter`` may be given already loaded (in-process
    only). Returns the engine and the facts the models reported (config, tokenizer, name)."""
    args = args.resolve(drafter_given=drafter is not None)
    if args.distributed == "ray":
        if target is not None or drafter is not None:
            raise ValueError("distributed='ray' loads the models inside the actors: pass model= and drafter= as "
                             "names or paths, not loaded objects")
        from kdray.actors.ray_runner import RayModels  # Ray is needed for this layout only

        models = RayModels(args)
    else:
        models = LocalModels(args, target, drafter)
    facts = models.load()
    layout = EngineLayout.plan(args, facts)
    runner = models.start(layout)
    cfg, tok = facts.config, facts.tokenizer
    eos = cfg.eos_token_ids or (tok.eos_token_ids if tok else ())
    scheduler = Scheduler(PagePool(layout.num_pages, args.page_size, args.prefix_caching), layout,
                          args.max_tokens_per_step, args.prefill_chunk or args.max_tokens_per_step)
    policy = warm_up(runner, layout)
    grammars = Grammars(tok, cfg.vocab_size, eos)
    return Engine(runner, scheduler, tok, layout.max_model_len, cfg.vocab_size, eos, facts.name, layout.spec.nodes,
                  policy, grammars=grammars), facts


def warm_steps(runner, layout: EngineLayout, widths: list[int], repeats: int = 2) -> dict[tuple[int, int], float]:
    """Run a step at every width in ``widths`` in the scratch slot (its KV goes to the scratch page), for one
    sequence and, with CUDA graphs, for every batch bucket: this captures every graph those steps will replay,
    so serving never stalls on a capture. Returns the device seconds of the last of ``repeats`` per
    (batch bucket, width)."""
    batches = [b for b in BUCKETS if b <= layout.num_slots] if layout.cuda_graphs else [1]
    measured = {}
    for b in batches:
        for w in widths:
            for _ in range(repeats):
                seconds = runner.step(StepBatch([layout.num_slots] * b, w)).result().seconds
            measured[(b, w)] = sum(seconds.values())
    return measured


def warm_prefill(runner, layout: EngineLayout):
    """Prompts prefilled in the scratch slot (their KV to the scratch page): what the prefill path loads or
    compiles on first use (seconds on a GPU, measured 3.4 s for SmolLM2 on the H200) is paid at start-up, not by
    the first request, and a lone chunk's graphs are captured at every prompt bucket, with nothing cached before
    it and after a cached page."""
    buckets = runner.prompt_buckets() if isinstance(runner, ModelRunner) else []
    for size, start in [(layout.page_size, 0)] + [(n, s) for n in buckets for s in (0, layout.page_size)]:
        runner.prefill(scratch_prompt(layout, size, start)).result()


def warm_riding(runner, layout: EngineLayout):
    """With a fixed budget, the graphs of steps that a lone prompt chunk rides in, captured for every batch bucket
    and every padded chunk size up to ``layout.step_chunk``'s (the scratch slot's, as :func:`warm_steps`)."""
    for b in [b for b in BUCKETS if b <= layout.num_slots]:
        for size in riding_buckets(layout):
            for pending in runner.launch(scratch_prompt(layout, size, 0), StepBatch([layout.num_slots] * b,
                                                                                   layout.spec.nodes)):
                pending.result()


def scratch_prompt(layout: EngineLayout, size: int, start: int) -> PrefillBatch:
    """A chunk of ``size`` tokens after ``start`` in the scratch slot, its KV to the scratch page (the page after the
    pool's, see ModelRunner)."""
    return PrefillBatch(slots=[layout.num_slots], prompts=[[0] * size], starts=[start], pages=[[layout.num_pages]],
                        params=[SamplingParams()], seeds=[0], last=[True], roots=[None], prompt_lens=[start + size],
                        bans=[[]], histories=[None], scored=[[]])


def warm_up(runner, layout: EngineLayout) -> BudgetPolicy | None:
    """Before the first request: the prefill path run once; ``budget="auto"``'s policy with its cost table measured
    on this device at every width it may choose; a fixed budget's step graphs captured for every batch bucket, and
    those a lone prompt chunk rides in. Returns the policy."""
    warm_prefill(runner, layout)
    if layout.spec.auto:
        policy = BudgetPolicy(max_nodes=layout.spec.nodes, depth=layout.spec.depth)
        policy.warm(warm_steps(runner, layout, policy.widths))
        return policy
    if layout.cuda_graphs:
        warm_steps(runner, layout, [layout.spec.nodes], repeats=1)
        warm_riding(runner, layout)
    return None
