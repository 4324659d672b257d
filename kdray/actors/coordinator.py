"""The Ray side of an engine: a :class:`Gang` of actors in one placement group, and the
:class:`Coordinator`, an :class:`~kdray.engine.engine.Engine` whose model work runs on that gang.

The coordinator lives in the process that owns the engine (the ``LLM``'s, or a Serve replica's), so a
step costs no Ray call: one msgpack plan goes to every actor loop over the channel and shard 0's reply
comes back; tensors move between the actors over their groups (NCCL on GPUs, gloo on CPUs).
"""
from __future__ import annotations

import weakref
from dataclasses import replace

import ray
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kdray.actors.channel import PlanServer, WorkerFailure, pack
from kdray.actors.communicator import CommunicatorTimeout, missing_ranks
from kdray.actors.drafter import Drafter
from kdray.actors.shard import ShardWorker
from kdray.actors.worker import GangOptions, Loaded
from kdray.config import EngineConfig, SpecConfig
from kdray.engine.engine import Engine
from kdray.engine.kv_pages import PagePool
from kdray.engine.request import RequestOutput
from kdray.engine.runner import StepResult
from kdray.engine.scheduler import Scheduler
from kdray.engine.sequence import Sequence
from kdray.llm import context_limit, graph_table_width
from kdray.model.loader import resolve_model
from kdray.model.presets import PRESETS

ShardActor = ray.remote(ShardWorker)
DrafterActor = ray.remote(Drafter)
JOIN_MARGIN_S = 10.0  # the coordinator waits this much longer than the ranks themselves


def connect_ray():
    """Join a running cluster (``address="auto"``), or start a local one; an existing connection is kept."""
    if ray.is_initialized():
        return
    try:
        ray.init(address="auto")
    except ConnectionError:
        ray.init()


class _Held:
    """Everything a gang holds, released once: explicitly, when the gang is collected, or at exit."""

    def __init__(self):
        self.actors: list = []
        self.pg = None
        self.server: PlanServer | None = None
        self.store: dist.Store | None = None

    def release(self):
        if self.server is not None:
            self.server.close()
        if ray.is_initialized():
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
            if self.pg is not None:
                remove_placement_group(self.pg)
        self.actors, self.pg, self.server, self.store = [], None, None, None


class Gang:
    """The actors of one engine: ``tp`` shards and (unless AR) a drafter, in one STRICT_PACK placement
    group with one bundle per shard and one for the drafter (or, when no node has a GPU to spare, the
    drafter takes half of shard 0's GPU, in shard 0's bundle)."""

    def __init__(self, options: GangOptions):
        self.options = options
        self._held = _Held()
        self._release = weakref.finalize(self, self._held.release)
        self.shards: list = []
        self.drafter = None
        self.loops: dict[str, ray.ObjectRef] = {}
        self.groups: dict[str, tuple[str, int]] = {}  # group name -> (backend, size), once launched

    @property
    def placement_group(self):
        return self._held.pg

    @property
    def actors(self) -> dict[str, object]:
        named = {f"shard {r}": a for r, a in enumerate(self.shards)}
        return named | ({"drafter": self.drafter} if self.drafter is not None else {})

    def _drafter_shares_gpu(self) -> bool:
        if self.options.device != "cuda" or self.options.drafter is None:
            return False
        per_node = max((n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]), default=0)
        return per_node < self.options.tp + 1

    def launch(self) -> list[Loaded]:
        """Place the actors, join their groups (warmed, bounded), load the weights; one report per actor,
        in rank order (shards, then the drafter)."""
        o = self.options
        gpu, shared, drafter = o.device == "cuda", self._drafter_shares_gpu(), o.drafter is not None
        bundles = [{"CPU": 1, "GPU": 1} if gpu else {"CPU": 1} for _ in range(o.tp + (drafter and not shared))]
        homes, parts = list(range(o.tp + drafter)), [1.0] * (o.tp + drafter)  # bundle and GPU fraction per rank
        if shared:
            bundles[0] = {"CPU": 2, "GPU": 1}
            homes[-1], parts[0], parts[-1] = 0, 0.5, 0.5
        pg = self._held.pg = placement_group(bundles, strategy="STRICT_PACK")
        if not ray.wait([pg.ready()], timeout=o.place_timeout_s)[0]:
            raise RuntimeError(f"Ray could not place {bundles} on one node within {o.place_timeout_s:.0f} s "
                               f"(available: {ray.available_resources()}); free resources or lower tp")
        for rank, (home, part) in enumerate(zip(homes, parts)):
            actor = (ShardActor if rank < o.tp else DrafterActor).options(
                num_cpus=1, num_gpus=part if gpu else 0, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=home),
            ).remote(rank, o, part)
            if rank < o.tp:
                self.shards.append(actor)
            else:
                self.drafter = actor
        self._held.actors = list(self.actors.values())

        host = ray.util.get_node_ip_address()
        store = self._held.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        world = o.tp + drafter
        sizes = ({"tp": o.tp} if o.tp > 1 else {}) | ({"link": world} if drafter else {})
        backends = {"tp": "nccl" if gpu else "gloo",
                    "link": "nccl" if gpu and not shared else "gloo"}  # NCCL refuses two ranks on one GPU
        self.groups = {g: (backends[g], n) for g, n in sizes.items()}
        calls = [a.join.remote(host, store.port, {g: (backends[g], rank, n) for g, n in sizes.items()
                                                  if g == "link" or rank < o.tp}, o.join_timeout_s)
                 for rank, a in enumerate(self.actors.values())]

        def absent() -> str:
            gone = {g: missing_ranks(store, g, n) for g, n in sizes.items()}
            return "; ".join(f"group '{g}' is missing rank(s) {m}" for g, m in gone.items() if m)

        self._gather(calls, o.join_timeout_s + JOIN_MARGIN_S, "join their communicators", absent)
        return self._gather([a.load.remote() for a in self.actors.values()], o.load_timeout_s, "load weights")

    def start(self, spec: SpecConfig, num_pages: int, aux_layer_ids: tuple[int, ...], max_pages_per_seq: int | None):
        """Build every runner, start every loop and connect it to the channel."""
        actors = self.actors
        self._gather([a.setup.remote(spec, num_pages, aux_layer_ids, max_pages_per_seq) for a in actors.values()],
                             self.options.load_timeout_s, "build their runners")
        here = ray.get_runtime_context().get_node_id()
        same_node = set(ray.util.placement_group_table(self._held.pg)["bundles_to_node_id"].values()) == {here}
        server = self._held.server = PlanServer(None if same_node else ray.util.get_node_ip_address())
        self.loops = {name: a.run.remote(server.address) for name, a in actors.items()}
        server.accept(list(self.loops), self.options.join_timeout_s, self.check)

    def _gather(self, refs: list, timeout_s: float, what: str, absent=lambda: "") -> list:
        """``ray.get`` with a bound; a timeout names the actors that did not finish."""
        names = list(self.actors)
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            late = [names[refs.index(p)] for p in pending]
            detail = absent()
            raise CommunicatorTimeout(f"{', '.join(late)} did not {what} within {timeout_s:.0f} s"
                                      + (f" ({detail})" if detail else ""))
        return ray.get(refs)

    def check(self):
        """Raise :class:`WorkerFailure` if an actor's loop has ended (the actor died or its loop failed)."""
        ended, _ = ray.wait(list(self.loops.values()), num_returns=len(self.loops), timeout=0)
        for name, ref in self.loops.items():
            if ref in ended:
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001 - reported to the caller
                    raise WorkerFailure(f"{name} is gone: {e}") from None
                raise WorkerFailure(f"{name} left its step loop")

    def call(self, plan: dict) -> dict:
        """Send one plan to every loop and return shard 0's reply."""
        server = self._held.server
        server.broadcast(pack(plan))
        return server.wait("shard 0", self.options.step_timeout_s, self.check)

    def release(self):
        """Kill every actor and remove the placement group (their GPUs are free again)."""
        self._release()


class GangRunner:
    """What the engine asks of a runner (``prefill``, ``step``), done as step plans on a gang.

    Sequences get small integer keys on admission; a plan lists the keys of sequences that left the
    engine since the last plan, so the actors drop their mirrors (and shard 0 its pending features).
    """

    def __init__(self, gang: Gang, scheduler: Scheduler):
        self.gang, self.scheduler = gang, scheduler
        self._keys: dict[int, tuple[Sequence, int]] = {}  # id(seq) -> (seq, key)
        self._next_key = 0

    def _freed(self) -> list[int]:
        running = {id(s) for s in self.scheduler.running}
        return [self._keys.pop(i)[1] for i in [i for i in self._keys if i not in running]]

    def prefill(self, seqs: list[Sequence]) -> list[int]:
        add = []
        for s in seqs:
            self._keys[id(s)] = (s, self._next_key)
            p = s.params
            add.append([self._next_key, s.prompt_ids, s.pages, p.temperature, p.top_k, p.top_p, s.seed])
            self._next_key += 1
        reply = self.gang.call({"op": "prefill", "free": self._freed(), "add": add})
        for s in seqs:
            s.cached_len = len(s.prompt_ids)
        return reply["tokens"]

    def step(self, seqs: list[Sequence]) -> StepResult:
        plan = [[self._keys[id(s)][1], s.cached_len, s.output_ids[-1]] for s in seqs]
        reply = self.gang.call({"op": "step", "free": self._freed(), "seqs": plan})
        for s, tokens in zip(seqs, reply["tokens"]):
            s.cached_len += len(tokens)
        return StepResult(reply["tokens"], reply["seconds"])


class Coordinator(Engine):
    """An :class:`Engine` (scheduler, request state, ``step()``) whose model work runs on a :class:`Gang`.

    When an actor dies or fails, ``step()`` raises :class:`WorkerFailure` naming it and the running
    requests (which are dropped); the gang is released and the next ``step()`` launches a new one, which
    serves the requests still waiting and later ones.
    """

    def __init__(self, options: GangOptions, mode: str, budget: int, engine_config: EngineConfig):
        """``engine_config.max_model_len`` None means the model's; ``num_pages`` None, what fits every actor."""
        connect_ray()
        if options.model in PRESETS:  # written on first use: once here, not by every actor of this node at once
            resolve_model(options.model)
        self.options = options
        gang = Gang(options)
        try:
            loaded = gang.launch()
            self.target = loaded[0].target
            cfg, draft = self.target.config, loaded[-1].draft_config
            self.spec = SpecConfig(mode=mode, budget=budget,
                                   block_size=draft.block_size if draft else (options.block_size or 16))
            self._aux_ids = draft.target_layer_ids if draft else ()
            limit = context_limit(cfg, engine_config.max_model_len)
            self.engine_config = replace(engine_config, max_model_len=limit)
            pages = engine_config.num_pages or min(r.kv_pages for r in loaded)
            self._width = graph_table_width(PagePool(pages, options.page_size), limit, self.spec,
                                            options.cuda_graphs)
            gang.start(self.spec, pages, self._aux_ids, self._width)
        except BaseException:
            gang.release()
            raise
        scheduler = Scheduler(PagePool(pages, options.page_size), self.engine_config, limit, self.spec.cache_slack,
                              1 + self.spec.nodes)
        tok = self.target.tokenizer
        eos = cfg.eos_token_ids or (tok.eos_token_ids if tok else ())
        super().__init__(GangRunner(gang, scheduler), scheduler, tok, limit, cfg.vocab_size, eos, self.target.name)
        self._closed = False

    @property
    def gang(self) -> Gang | None:
        """The actors now serving (None between a failure and the next step)."""
        return self.runner.gang if self.runner is not None else None

    def _relaunch(self):
        gang = Gang(self.options)
        try:
            gang.launch()
            gang.start(self.spec, self.scheduler.pool.num_pages, self._aux_ids, self._width)
        except BaseException:
            gang.release()
            raise
        self.runner = GangRunner(gang, self.scheduler)

    def step(self) -> list[RequestOutput]:
        if self._closed:
            raise RuntimeError("this engine was shut down; create a new LLM")
        if self.runner is None:
            self._relaunch()
        try:
            return super().step()
        except WorkerFailure as e:
            failed = tuple(s.request_id for s in self.scheduler.running)
            for rid in failed:
                self.abort_request(rid)
            self.runner.gang.release()
            self.runner = None
            raise WorkerFailure(f"{e}\n-> request(s) {list(failed)} failed; the engine starts new actors at its next "
                                "step", failed) from None

    def shutdown(self):
        """Release every actor, the placement group and their GPUs; the engine cannot step afterwards."""
        self._closed = True
        if self.runner is not None:
            self.runner.gang.release()
            self.runner = None
