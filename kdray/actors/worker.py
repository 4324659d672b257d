"""What every actor of an engine shares: its layout options, its groups, the mirrors of the running
sequences and the long-running loop that reads one step plan per step.

A step plan (msgpack) is ``{"op", "free", ...}``:

- ``prefill``: ``add`` = ``[[key, prompt_ids, pages, temperature, top_k, top_p, seed], ...]``, the batch;
- ``step``: ``seqs`` = ``[[key, cached_len, bonus_token], ...]``, the batch;
- ``noop``: a step-shaped plan that does no model work (the control-path benchmark).

``free`` lists keys of sequences that left the engine. Shard 0 answers ``prefill`` / ``step`` / ``noop``
with ``{"tokens": ...}``; every other actor answers nothing unless it fails (``{"error": traceback}``).
The loop ends when the coordinator closes the channel.
"""
from __future__ import annotations

import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kdray.actors.channel import PlanClient
from kdray.actors.communicator import BACKENDS, connect_store
from kdray.config import SpecConfig
from kdray.engine.request import SamplingParams
from kdray.engine.sequence import Sequence
from kdray.kernels.tree_build import DraftTree, mask_words
from kdray.model.dflash import DFlashConfig
from kdray.model.loader import LoadedTarget
from kdray.model.parallel import SINGLE


@dataclass(frozen=True)
class GangOptions:
    """What the actors of one engine load, where, and how long each start-up phase may take."""

    model: str
    device: str  # "cpu" or "cuda"
    dtype: str
    tp: int
    expert_parallel: bool
    drafter: str | None  # None (AR), "random" or a DFlash checkpoint directory
    block_size: int | None
    page_size: int
    cuda_graphs: bool = False  # replay the verify (shards) and draft (drafter) passes from CUDA graphs
    place_timeout_s: float = 120.0
    join_timeout_s: float = 120.0
    load_timeout_s: float = 3600.0
    step_timeout_s: float = 300.0


@dataclass
class Loaded:
    """What an actor reports once its weights are in: how many KV pages fit, and (shard 0) the target's
    config and tokenizer or (drafter) the drafter's config."""

    kv_pages: int
    target: LoadedTarget | None = None
    draft_config: DFlashConfig | None = None


def tree_width(nodes: int) -> int:
    """int32 values per sequence in a packed tree of ``nodes`` draft nodes."""
    return (1 + nodes) * (3 + mask_words(nodes)) + 1


def pack_tree(tree: DraftTree) -> torch.Tensor:
    """All fields of a tree in one int32 buffer ``[B, tree_width(N)]``, so it crosses the link in one broadcast."""
    return torch.cat([tree.tokens.int(), tree.parents, tree.depths, tree.num_nodes[:, None], tree.mask.flatten(1)],
                     dim=1)


def unpack_tree(buf: torch.Tensor, nodes: int) -> DraftTree:
    """Inverse of :func:`pack_tree`."""
    n1, words = 1 + nodes, mask_words(nodes)
    tokens, parents, depths, num_nodes, mask = buf.split([n1, n1, n1, 1, n1 * words], dim=1)
    return DraftTree(tokens=tokens.long(), parents=parents.contiguous(), depths=depths.contiguous(),
                     num_nodes=num_nodes.squeeze(1).contiguous(), mask=mask.reshape(-1, n1, words).contiguous())


class Worker(ABC):
    """Base of :class:`ShardWorker` and :class:`Drafter`: ``join`` its groups, ``load``, ``setup``, then ``run``."""

    role = "worker"

    def __init__(self, rank: int, options: GangOptions, gpu_share: float):
        self.rank, self.options, self.gpu_share = rank, options, gpu_share
        # Ray shows an actor only its own GPU, as device 0.
        self.device = torch.device("cuda", 0) if options.device == "cuda" else torch.device("cpu")
        self.tp, self.link = SINGLE, None
        self.runner = None
        self.seqs: dict[int, Sequence] = {}

    @property
    def name(self) -> str:
        return f"{self.role} {self.rank}"

    def join(self, host: str, port: int, groups: dict[str, tuple[str, int, int]], timeout_s: float) -> None:
        """Join the coordinator's store at ``host:port``, then each group ``{name: (backend, rank, size)}``
        in order (``tp``: the shards' tensor-parallel group; ``link``: the shards and the drafter)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._store = connect_store(host, port, timeout_s)
        made = {name: BACKENDS[backend](self._store, name, rank, size, timeout_s)
                for name, (backend, rank, size) in groups.items()}
        self.tp, self.link = made.get("tp", SINGLE), made.get("link")

    @abstractmethod
    def load(self) -> Loaded:
        """Load this actor's weights."""

    @abstractmethod
    def setup(self, spec: SpecConfig, num_pages: int, aux_layer_ids: tuple[int, ...],
              max_pages_per_seq: int | None) -> None:
        """Build the runner and the KV pages (``max_pages_per_seq``: the fixed block-table width that CUDA
        graphs need, None without them)."""

    @abstractmethod
    def prefill(self, seqs: list[Sequence]) -> dict | None:
        """This actor's part of a prefill of newly admitted ``seqs``; shard 0 returns the first tokens."""

    @abstractmethod
    def step(self, seqs: list[Sequence]) -> dict | None:
        """This actor's part of one speculative step; shard 0 returns the accepted tokens."""

    @property
    def answers(self) -> bool:
        """Whether this actor sends the step results (shard 0 alone)."""
        return False

    def run(self, address: tuple[str, int] | str) -> None:
        """The step loop: this actor's one long-running call, whose ``ObjectRef`` is its liveness sentinel.
        Reads plans until the coordinator closes the channel. A failing step sends its traceback to the
        coordinator (which reports it) and ends the loop."""
        channel = PlanClient(address, self.name, self.options.join_timeout_s)
        try:
            with torch.no_grad():
                while True:
                    reply = self._handle(channel.recv())
                    if reply is not None:
                        channel.send(reply)
        except ConnectionError:
            pass  # the coordinator released the gang (or died)
        except Exception:  # noqa: BLE001 - handed to the coordinator, which raises WorkerFailure
            try:
                channel.send({"error": traceback.format_exc()})
            except OSError:
                pass
        finally:
            channel.close()

    def _handle(self, plan: dict) -> dict | None:
        for key in plan.get("free", ()):
            del self.seqs[key]
        op = plan["op"]
        if op == "prefill":
            seqs = []
            for key, prompt, pages, temperature, top_k, top_p, seed in plan["add"]:
                params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
                self.seqs[key] = Sequence(str(key), prompt, params, seed, pages=pages)
                seqs.append(self.seqs[key])
            return self.prefill(seqs)
        if op == "step":
            seqs = []
            for key, cached_len, bonus in plan["seqs"]:
                s = self.seqs[key]
                s.cached_len, s.output_ids = cached_len, [bonus]
                seqs.append(s)
            return self.step(seqs)
        if op == "noop":
            return {"tokens": [[bonus] * plan["tau"] for _, _, bonus in plan["seqs"]]} if self.answers else None
        raise ValueError(f"unknown step-plan op '{op}'")
