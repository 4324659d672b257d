"""``EngineArgs``: every setting of an engine and its default, in one place.

``LLM(**kwargs)``, the Serve app's arguments (:class:`kdray.serve.args.ServeArgs` adds the server's own)
and the ``kdray`` command's flags (generated from the fields' ``help``) all come from here. Values are
checked where they enter (``__post_init__``); :meth:`EngineArgs.resolve` fills in what depends on the
machine (device, dtype, where the shards run, CUDA graphs, a preset's shipped drafter).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from kdray.config import LOAD_FORMATS, SPEC_MODES

DEFAULT_MODEL = "smollm2-135m"  # the real small model, with its shipped DFlash drafter
DTYPES = ("float32", "bfloat16", "float16")
ALL_REDUCES = ("nccl", "peer")
MAX_BUDGET = 4096
AUTO_MAX_NODES = 256  # the largest tree budget="auto" considers


def setting(text: str, **kw):
    """A dataclass field with its ``kdray`` flag help (``metadata["help"]``)."""
    return field(metadata={"help": text}, **kw)


@dataclass(kw_only=True)
class EngineArgs:
    """What one engine loads, where, and how much it runs at once. None means "decide for me" (see
    :meth:`resolve`)."""

    model: str = setting("a preset (smollm2-135m, k2-tiny), an HF checkpoint directory or a GGUF file",
                       default=DEFAULT_MODEL)
    load_format: str = setting("auto: the checkpoint's weights; dummy: random weights of its config, made on the "
                               "device (benchmarks without the weight files, as vLLM's)", default="auto")
    drafter: str | None = setting("a DFlash checkpoint directory, or 'random' (tests); default: the preset's "
                                "shipped drafter", default=None)
    spec: str | None = setting("ddtree, chain or ar; default: ddtree with a drafter, ar without", default=None)
    budget: int | str = setting("draft-tree nodes per sequence per step, or auto: chosen each step by a cost model "
                                "(0: plain decoding)", default="auto")
    block_size: int | None = setting("draft block size (default: the drafter's)", default=None)
    device: str | None = setting("cuda or cpu (default: cuda when a GPU is visible)", default=None)
    dtype: str | None = setting("bfloat16, float16 or float32 (default: bfloat16 on cuda, float32 on cpu)",
                              default=None)
    tp: int = setting("tensor-parallel shards, one Ray actor (and GPU) each", default=1)
    expert_parallel: bool = setting("split routed experts by id across the shards instead of by width",
                                  default=False)
    all_reduce: str = setting("tensor-parallel all-reduce on GPUs: nccl, or peer: a one-shot kernel over CUDA-IPC "
                              "peer buffers for messages of a few tokens (fused with the residual add and RMSNorm "
                              "after it), NCCL for larger ones", default="nccl")
    distributed: str | None = setting("local (in this process) or ray (actors); default: ray when tp > 1",
                                    default=None)
    max_num_seqs: int = setting("sequences decoded together", default=32)
    max_model_len: int | None = setting("context length (default: the model's)", default=None)
    max_tokens_per_step: int = setting("tokens one step may run (prefill chunks and tree nodes)", default=8192)
    prefill_chunk: int | None = setting("most prompt tokens of one request prefilled in one step (default: "
                                        "max_tokens_per_step); at most 2048, a lone chunk runs inside the running "
                                        "sequences' step, which then reads the weights once", default=None)
    prefix_caching: bool = setting("reuse the KV pages of prompts' common prefixes across requests", default=True)
    page_size: int = setting("tokens per KV-cache page (a power of two)", default=16)
    num_pages: int | None = setting("KV-cache pages (default: what fits half the free GPU memory, or 512 MiB "
                                  "on the CPU)", default=None)
    cuda_graphs: bool | None = setting("replay the verify and draft passes from CUDA graphs (default: on GPUs)",
                                     default=None)
    place_timeout_s: float = setting("Ray: seconds to wait for the actors' resources", default=120.0)
    join_timeout_s: float = setting("Ray: seconds for the actors to join their communicators", default=120.0)
    load_timeout_s: float = setting("Ray: seconds for the actors to load their weights", default=3600.0)
    step_timeout_s: float = setting("Ray: seconds one step may take before it counts as stuck", default=300.0)

    def __post_init__(self):
        def check(ok: bool, name: str, what: str):
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} must be {what}")

        def whole(name: str, low: int, allow_none: bool = False):
            v = getattr(self, name)
            check((allow_none and v is None) or (isinstance(v, int) and not isinstance(v, bool) and v >= low),
                  name, f"an integer >= {low}" + (" or None" if allow_none else ""))

        check(self.load_format in LOAD_FORMATS, "load_format", f"one of {', '.join(LOAD_FORMATS)}")
        check(self.spec is None or self.spec in SPEC_MODES, "spec", f"one of {', '.join(SPEC_MODES)}")
        if isinstance(self.budget, str) and self.budget.isdigit():  # from a command line or a config file
            self.budget = int(self.budget)
        check(self.budget == "auto" or (isinstance(self.budget, int) and not isinstance(self.budget, bool)
                                        and 0 <= self.budget <= MAX_BUDGET),
              "budget", f"'auto' or a number of draft nodes in [0, {MAX_BUDGET}]")
        whole("block_size", 2, allow_none=True)
        check(self.device is None or self.device.split(":")[0] in ("cpu", "cuda"), "device", "cpu, cuda or cuda:N")
        check(self.dtype is None or self.dtype in DTYPES, "dtype", f"one of {', '.join(DTYPES)}")
        whole("tp", 1)
        check(self.all_reduce in ALL_REDUCES, "all_reduce", f"one of {', '.join(ALL_REDUCES)}")
        check(self.all_reduce != "peer" or self.tp > 1, "all_reduce", f"'nccl' for tp={self.tp} ('peer' joins shards)")
        check(self.distributed in (None, "local", "ray"), "distributed", "'local' or 'ray'")
        check(not (self.tp > 1 and self.distributed == "local"), "distributed",
              f"'ray' for tp={self.tp} (one Ray actor per shard)")
        whole("max_num_seqs", 1)
        whole("max_model_len", 2, allow_none=True)
        whole("max_tokens_per_step", 1)
        whole("prefill_chunk", 1, allow_none=True)
        whole("page_size", 1)
        check(self.page_size & (self.page_size - 1) == 0, "page_size", "a power of two")
        whole("num_pages", 1, allow_none=True)
        for name in ("place_timeout_s", "join_timeout_s", "load_timeout_s", "step_timeout_s"):
            check(getattr(self, name) > 0, name, "a positive number of seconds")

    def resolve(self, drafter_given: bool = False) -> EngineArgs:
        """A copy with the machine-dependent defaults decided: device (cuda when visible), dtype (bfloat16 on
        cuda), distributed (ray when tp > 1), cuda_graphs (on for cuda), spec and drafter (a preset's shipped
        drafter and ddtree; ar without a drafter). ``drafter_given``: a loaded drafter comes beside the args."""
        import torch

        from kdray.model.presets import builtin_drafter

        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available() and self.distributed != "ray":
            raise ValueError(f"device='{device}' but no CUDA GPU is visible here; use device='cpu'")
        on_gpu = device.startswith("cuda")
        if self.all_reduce == "peer" and not on_gpu:
            raise ValueError("all_reduce='peer' runs on GPUs; use all_reduce='nccl' (gloo on the CPU)")
        drafter = self.drafter
        if drafter is None and self.spec != "ar" and not drafter_given:
            drafter = builtin_drafter(self.model)
        spec = self.spec or ("ddtree" if drafter is not None or drafter_given else "ar")
        if spec != "ar" and drafter is None and not drafter_given:
            raise ValueError(f"spec='{spec}' needs a drafter: drafter=<DFlash checkpoint dir> or drafter='random'")
        return replace(self, device=device, dtype=self.dtype or ("bfloat16" if on_gpu else "float32"),
                       distributed=self.distributed or ("ray" if self.tp > 1 else "local"),
                       cuda_graphs=on_gpu if self.cuda_graphs is None else self.cuda_graphs and on_gpu,
                       spec=spec, drafter=drafter if spec != "ar" else None)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
