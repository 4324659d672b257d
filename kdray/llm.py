"""``LLM``: the offline API (vLLM's shape) over the engine, in-process or on Ray actors."""
from __future__ import annotations

import sys
import uuid

from kdray.engine.args import DEFAULT_MODEL, EngineArgs
from kdray.engine.build import build_engine
from kdray.engine.request import RequestOutput, SamplingParams
from kdray.model.dflash import DFlashDrafter
from kdray.model.loader import LoadedTarget


class LLM:
    """Load a target (and a drafter), then ``generate`` completions for batches of prompts.

    Keyword arguments are :class:`~kdray.engine.args.EngineArgs` fields (``device``, ``dtype``, ``spec``,
    ``budget``, ``tp``, ...). ``model`` and ``drafter`` may also be already loaded objects (in-process only).
    ``tp > 1`` (or ``distributed="ray"``) runs the engine's model work on Ray actors; call :meth:`shutdown`
    (or use ``with LLM(...)``) to release them early.
    """

    def __init__(self, model: str | LoadedTarget = DEFAULT_MODEL, drafter: str | DFlashDrafter | None = None,
                 **engine_args):
        target = model if isinstance(model, LoadedTarget) else None
        loaded = drafter if isinstance(drafter, DFlashDrafter) else None
        if target is not None:  # a loaded target decides where the engine runs
            engine_args.setdefault("device", str(next(target.model.parameters()).device))
            engine_args.setdefault("dtype", str(target.model.dtype).removeprefix("torch."))
        self.args = EngineArgs(model=target.name if target else model, drafter=None if loaded else drafter,
                               **engine_args)
        self.engine, facts = build_engine(self.args, target, loaded)
        self.config, self.tokenizer, self.model_name = facts.config, facts.tokenizer, facts.name

    def shutdown(self):
        """Release the engine's caches, and on Ray its actors, their placement group and GPUs."""
        self.engine.runner.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info):
        self.shutdown()

    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Complete every prompt (text, or token ids); outputs come back in input order."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts= (text) or prompt_token_ids=")
        if prompts is not None:
            if self.tokenizer is None:
                raise ValueError(f"model '{self.model_name}' has no tokenizer; pass prompt_token_ids= instead")
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
            self.engine.drain()  # the step launched past the last finish: its pages come back
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[r] for r in ids]
