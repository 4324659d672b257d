"""``LLM``: the offline API (vLLM's shape) over the engine, in-process or on Ray actors."""
from __future__ import annotations

import sys
import uuid
from typing import Any

from kdray.engine.args import DEFAULT_MODEL, EngineArgs
from kdray.engine.build import build_engine
from kdray.engine.request import RequestOutput, SamplingParams
from kdray.model.dflash import DFlashDrafter
from kdray.model.loader import LoadedTarget

PromptType = str | dict  # text, {"prompt": text} or {"prompt_token_ids": [...]}


class LLM:
    """Load a target (and a drafter), then ``generate`` completions for batches of prompts.

    Keyword arguments are :class:`~kdray.engine.args.EngineArgs` fields (``device``, ``dtype``, ``spec``,
    ``budget``, ``tp``, ...), or vLLM's names for them (``tensor_parallel_size``, ``enforce_eager``,
    ``speculative_config``; see :func:`engine_args_from_vllm`). ``model`` and ``drafter`` may also be already
    loaded objects (in-process only). ``tp > 1`` (or ``distributed="ray"``) runs the engine's model work on Ray
    actors; call :meth:`shutdown` (or use ``with LLM(...)``) to release them early.
    """

    def __init__(self, model: str | LoadedTarget = DEFAULT_MODEL, drafter: str | DFlashDrafter | None = None,
                 **engine_args):
        engine_args = engine_args_from_vllm({**engine_args, **({} if drafter is None else {"drafter": drafter})})
        drafter = engine_args.pop("drafter", None)
        target = model if isinstance(model, LoadedTarget) else None
        loaded = drafter if isinstance(drafter, DFlashDrafter) else None
        if target is not None:  # a loaded target decides where the engine runs
            engine_args.setdefault("device", str(next(target.model.parameters()).device))
            engine_args.setdefault("dtype", str(target.model.dtype).removeprefix("torch."))
        self.args = EngineArgs(model=target.name if target else model, drafter=None if loaded else drafter,
                               **engine_args)
        if target is not None and self.args.load_format != "auto":
            raise ValueError(f"load_format={self.args.load_format!r} chooses how a model given by name is loaded; "
                             "this target is loaded already: pass its name or path instead")
        self.engine, facts = build_engine(self.args, target, loaded)
        self.config, self.tokenizer, self.model_name = facts.config, facts.tokenizer, facts.name

    def shutdown(self):
        """Release the engine's caches, and on Ray its actors, their placement group and GPUs."""
        self.engine.runner.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info):
        self.shutdown()

    def generate(self, prompts: PromptType | list[PromptType] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Complete every prompt (text, ``{"prompt": text}``, ``{"prompt_token_ids": ids}``, or token ids through
        ``prompt_token_ids=``); outputs come back in input order, each with its prompt text (None for ids)."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts= (text or prompt dicts) or prompt_token_ids=")
        if prompts is None:
            pairs = [(None, list(p)) for p in prompt_token_ids]
        else:
            pairs = [self._prompt(p) for p in ([prompts] if isinstance(prompts, (str, dict)) else prompts)]
        return self._run([ids for _, ids in pairs], sampling_params, use_tqdm, [text for text, _ in pairs])

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | list[SamplingParams] |
             None = None, tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Reply to one conversation (a list of messages) or to each of a list of them, through the model's chat
        template (rendered as transformers does, sandboxed); tool calls stay in the text."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError(f"model '{self.model_name}' has no chat template; use generate()")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [self.tokenizer.apply_chat_template(list(c), tools=tools, add_generation_prompt=add_generation_prompt,
                                                    continue_final_message=continue_final_message,
                                                    **(chat_template_kwargs or {})) for c in conversations]
        return self._run([self.tokenizer.encode(t) for t in texts], sampling_params, use_tqdm, texts)

    def _prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """One prompt of ``generate`` as (its text or None, its token ids)."""
        if isinstance(prompt, dict):
            if sorted(prompt) not in (["prompt"], ["prompt_token_ids"]):
                raise ValueError(f"a prompt dict holds 'prompt' (text) or 'prompt_token_ids', not {sorted(prompt)}")
            if "prompt_token_ids" in prompt:
                return None, list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt is text or a dict, not {type(prompt).__name__}; token ids go in "
                             "{'prompt_token_ids': [...]}")
        if self.tokenizer is None:
            raise ValueError(f"model '{self.model_name}' has no tokenizer; pass {{'prompt_token_ids': [...]}} instead")
        return prompt, self.tokenizer.encode(prompt)

    def _run(self, prompt_token_ids: list[list[int]], sampling_params: SamplingParams | list[SamplingParams] | None,
             use_tqdm: bool | None, texts: list[str | None]) -> list[RequestOutput]:
        """Run the prompts to the end, in input order."""
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
                for out in self.engine.step(stream=False):  # the finished requests alone
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
        for rid, text in zip(ids, texts):
            done[rid].prompt = text
        return [done[r] for r in ids]


# vLLM's speculative_config methods -> kdray's spec modes
SPECULATIVE_METHODS = {"ddtree": "ddtree", "dflash": "chain", "chain": "chain"}


def engine_args_from_vllm(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with vLLM's names turned into EngineArgs fields: ``tensor_parallel_size`` -> ``tp``,
    ``enforce_eager=True`` -> ``cuda_graphs=False``, ``speculative_config={"method": "ddtree" | "dflash",
    "model": drafter, "num_speculative_tokens": n, "budget": nodes}`` -> ``spec``, ``drafter``,
    ``block_size = n + 1`` (the drafted positions after the bonus token) and ``budget``. What kdray cannot
    honour raises ``ValueError`` naming it."""
    out = dict(kwargs)

    def alias(vllm: str, ours: str, value: Any):
        if ours in out and out[ours] != value:
            raise ValueError(f"{vllm} and {ours} disagree ({value!r} vs {out[ours]!r}); give one")
        out[ours] = value

    if "tensor_parallel_size" in out:
        alias("tensor_parallel_size", "tp", out.pop("tensor_parallel_size"))
    if out.pop("enforce_eager", False):
        alias("enforce_eager", "cuda_graphs", False)
    spec = out.pop("speculative_config", None) or {}
    unknown = sorted(set(spec) - {"method", "model", "num_speculative_tokens", "budget"})
    if unknown:
        raise ValueError(f"speculative_config.{unknown[0]} is not supported; kdray reads method (ddtree or dflash), "
                         "model (the DFlash drafter), num_speculative_tokens and budget")
    if "method" in spec:
        if spec["method"] not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method={spec['method']!r} is not supported; use 'ddtree' (a draft "
                             "tree) or 'dflash' (one draft chain)")
        alias("speculative_config.method", "spec", SPECULATIVE_METHODS[spec["method"]])
    if "model" in spec:
        alias("speculative_config.model", "drafter", spec["model"])
    if "num_speculative_tokens" in spec:
        n = spec["num_speculative_tokens"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens={n!r} must be an integer >= 1")
        alias("speculative_config.num_speculative_tokens", "block_size", n + 1)
    if "budget" in spec:
        alias("speculative_config.budget", "budget", spec["budget"])
    return out
