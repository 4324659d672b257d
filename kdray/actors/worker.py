"""What every actor of an engine shares: its groups, its runner and the long-running loop that reads one step
plan per step.

A step plan (msgpack) is ``{"op", ...}``:

- ``prefill``: the fields of a :class:`~kdray.engine.step.PrefillBatch` (``slots``, ``prompts`` (the chunks),
  ``starts``, ``pages``, ``sampling`` = each request's ``SamplingParams`` fields as a dict (its grammar left with
  the engine), ``seeds``, ``last``, ``roots``, ``prompt_lens``, ``bans``, ``histories``, ``scored``, ``allowed``: the
  first tokens' masks as bytes, or None);
- ``step``: the ``slots``, ``nodes``, grown ``pages`` and changed ``thoughts`` (their masks as bytes) of a
  :class:`~kdray.engine.step.StepBatch` (each actor keeps every slot's state), and where a lone prompt chunk rides in
  its verify pass, that chunk's ``prefill`` plan as ``chunk`` and its padded ``rows``; ``grammars``: the sequences
  masked by a grammar, if any. Then the drafter sends its
  trees to the engine (``{"trees"}``, the packed rows of the batch's sequences) before its broadcast, and shard 0
  reads one more frame before it verifies, ``allowed`` (``masks``: those sequences' tree nodes' masks, made by the
  engine from the trees, or without a drafter from the roots alone), and broadcasts the masks to the other shards;
- ``noop``: a step-shaped plan that does no model work (the control-path benchmark), answered with
  ``tau`` tokens per slot.

Shard 0 answers ``prefill`` with ``{"tokens", "logprobs"}`` (the first tokens', then the scored prompt tokens'),
``step`` with ``{"tokens", "seconds", "logprobs"}`` and, with a riding chunk, its ``prefill`` answer as ``first``; the
drafter answers ``step`` with ``{"seconds", "masses"}`` (its stages, and its trees' masses for ``budget="auto"``);
other actors answer nothing unless they fail
(``{"error": traceback}``). The loop ends when the engine closes the channel.
"""
from __future__ import annotations

import os
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kdray.actors.channel import PlanClient
from kdray.actors.communicator import BACKENDS, connect_store
from kdray.config import DFlashConfig
from kdray.engine.args import EngineArgs
from kdray.engine.layout import EngineLayout
from kdray.engine.request import SamplingParams
from kdray.engine.step import PrefillBatch, StepBatch
from kdray.model.parallel import SINGLE
from kdray.model.tokenizer import Tokenizer


@dataclass
class LoadReport:
    """What an actor reports once its weights are in: how many KV pages fit beside them, and (shard 0) the
    target's config, tokenizer and name or (the drafter) the drafter's config."""

    kv_pages: int
    config: object = None
    tokenizer: Tokenizer | None = None
    name: str = ""
    draft_config: DFlashConfig | None = None


def int32_bytes(t: torch.Tensor) -> bytes:
    """An int32 tensor's values (grammar masks, packed trees) as a plan or a reply carries them."""
    return t.cpu().numpy().tobytes()


def int32_rows(data: bytes, rows: int) -> torch.Tensor:
    """Inverse of :func:`int32_bytes`: ``[rows, -1]`` int32 on the host."""
    return torch.frombuffer(bytearray(data), dtype=torch.int32).view(rows, -1)


def prefill_batch(plan: dict) -> PrefillBatch:
    params = [SamplingParams(**{**p, "logit_bias": p["logit_bias"] and dict(p["logit_bias"])})
              for p in plan["sampling"]]
    allowed = None if plan["allowed"] is None else int32_rows(plan["allowed"], len(plan["slots"]))
    return PrefillBatch(plan["slots"], plan["prompts"], plan["starts"], plan["pages"], params, plan["seeds"],
                        plan["last"], plan["roots"], plan["prompt_lens"], plan["bans"], plan["histories"],
                        plan["scored"], allowed)


def prefill_plan(batch: PrefillBatch) -> dict:
    """The ``prefill`` plan of ``batch`` (what :func:`prefill_batch` reads back; logit_bias as [id, bias] pairs,
    msgpack's maps take no integer keys everywhere; a grammar as its first tokens' masks: the matchers stay with the
    engine)."""
    sampling = [{**vars(p), "logit_bias": p.logit_bias and list(p.logit_bias.items()), "structured_outputs": None}
                for p in batch.params]
    return {"op": "prefill", "slots": batch.slots, "prompts": batch.prompts, "starts": batch.starts,
            "pages": batch.pages, "sampling": sampling, "seeds": batch.seeds, "last": batch.last,
            "roots": batch.roots, "prompt_lens": batch.prompt_lens, "bans": batch.bans, "histories": batch.histories,
            "scored": batch.scored, "allowed": None if batch.allowed is None else int32_bytes(batch.allowed)}


SEE_ALL_GPUS = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"  # Ray leaves CUDA_VISIBLE_DEVICES as the node's


def own_gpu() -> torch.device:
    """This actor's GPU: device 0, the only one Ray shows it, or, when the actor sees the node's GPUs (the peer
    all-reduce maps its peers' memory), the one Ray assigned it among those visible."""
    if os.environ.get(SEE_ALL_GPUS) != "1":
        return torch.device("cuda", 0)
    import ray

    gpu = str(ray.get_gpu_ids()[0])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", visible.split(",").index(gpu) if visible else int(gpu))


class Worker(ABC):
    """Base of :class:`~kdray.actors.shard.ShardWorker` and :class:`~kdray.actors.drafter.DrafterWorker`:
    ``join`` its groups, ``load``, ``setup``, then ``run``."""

    role = "worker"

    def __init__(self, rank: int, args: EngineArgs, gpu_share: float):
        self.rank, self.args, self.gpu_share = rank, args, gpu_share
        self.device = own_gpu() if args.device.startswith("cuda") else torch.device("cpu")
        self.tp, self.link = SINGLE, None
        self.runner = None
        self.channel: PlanClient | None = None  # the engine's, while the step loop runs

    @property
    def name(self) -> str:
        return f"{self.role} {self.rank}"

    @property
    def reports_tokens(self) -> bool:
        """Whether this actor sends each step's tokens to the engine (shard 0 alone)."""
        return False

    def join(self, host: str, port: int, groups: dict[str, tuple[str, int, int]], timeout_s: float) -> None:
        """Join the engine's store at ``host:port``, then each group ``{name: (backend, rank, size)}`` in order
        (``tp``: the shards' tensor-parallel group; ``link``: the shards and the drafter)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._store = connect_store(host, port, timeout_s)
        made = {name: BACKENDS[backend](self._store, name, rank, size, timeout_s)
                for name, (backend, rank, size) in groups.items()}
        self.tp, self.link = made.get("tp", SINGLE), made.get("link")

    @abstractmethod
    def load(self) -> LoadReport:
        """Load this actor's weights."""

    @abstractmethod
    def setup(self, layout: EngineLayout) -> None:
        """Build the runner (its KV pages and per-slot state) for the engine's layout."""

    @abstractmethod
    def prefill(self, batch: PrefillBatch) -> dict | None:
        """This actor's part of a prefill; shard 0 returns the first tokens."""

    @abstractmethod
    def step(self, batch: StepBatch, chunk: PrefillBatch | None = None, rows: int = 0,
             grammars: list[int] | None = None) -> dict | None:
        """This actor's part of one speculative step (with ``chunk`` riding in its verify pass, padded to ``rows``;
        ``grammars``: the sequences with a grammar, their masks made by the engine mid-step); shard 0 returns the
        tokens, shard 0 and the drafter their stage times."""

    def run(self, address: tuple[str, int] | str) -> None:
        """The step loop: this actor's one long-running call, whose ``ObjectRef`` is its liveness sentinel.
        Reads plans until the engine closes the channel. A failing step sends its traceback to the engine
        (which reports it) and ends the loop."""
        channel = self.channel = PlanClient(address, self.name, self.args.join_timeout_s)
        try:
            with torch.no_grad():
                while True:
                    reply = self._handle(channel.recv())
                    if reply is not None:
                        channel.send(reply)
        except ConnectionError:
            pass  # the engine released its actors (or died)
        except Exception:  # noqa: BLE001 - handed to the engine, which raises WorkerFailure
            try:
                channel.send({"error": traceback.format_exc()})
            except OSError:
                pass
        finally:
            channel.close()

    def _handle(self, plan: dict) -> dict | None:
        op = plan["op"]
        if op == "prefill":
            return self.prefill(prefill_batch(plan))
        if op == "step":
            chunk = prefill_batch(plan["chunk"]) if plan.get("chunk") else None
            thoughts = {int(k): (end, None if mask is None else int32_rows(mask, 1)[0])
                        for k, (end, mask) in plan["thoughts"].items()}
            batch = StepBatch(plan["slots"], plan["nodes"], {int(k): v for k, v in plan["pages"].items()},
                              thoughts=thoughts)
            return self.step(batch, chunk, plan.get("rows", 0), plan.get("grammars"))
        if op == "noop":
            return {"tokens": [[7] * plan["tau"] for _ in plan["slots"]], "seconds": {}} if self.reports_tokens \
                else None
        raise ValueError(f"unknown step-plan op '{op}'")
