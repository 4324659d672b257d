"""The engine's model work on Ray actors: :class:`EngineActors` (``tp`` shards and a drafter in one placement
group), :class:`RayModels` (what the engine builder loads and starts for ``distributed="ray"``) and
:class:`RayRunner`, the runner the engine steps.

:func:`engine_bundles` is the placement: one bundle per shard (one GPU each) and one for the drafter. A Serve
replica asks Serve for these bundles after its own (STRICT_PACK), so that Serve schedules and autoscales the
whole gang; the engine's actors then take them. Elsewhere the engine makes its own placement group.

The engine (and so the coordination) lives in the process that owns it (the ``LLM``'s, or a Serve replica's):
a step costs no Ray call. One msgpack plan goes to every actor loop over the channel, and shard 0's and the
drafter's replies come back; tensors move between the actors over their groups (NCCL on GPUs, gloo on CPUs).
"""
from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import ray
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kdray.actors.channel import PlanServer, WorkerFailure, pack
from kdray.actors.communicator import CommunicatorTimeout, missing_ranks
from kdray.actors.drafter import DrafterWorker
from kdray.actors.shard import ShardWorker
from kdray.actors.worker import SEE_ALL_GPUS, LoadReport, int32_bytes, int32_rows, prefill_plan
from kdray.engine.args import EngineArgs
from kdray.engine.layout import EngineLayout, ModelFacts
from kdray.engine.runner import launch
from kdray.engine.step import Pending, PrefillBatch, StepBatch, StepResult, add_seconds, first_tokens
from kdray.kernels.tree_build import DraftTree
from kdray.model.loader import check_parallel, resolve_model
from kdray.model.presets import PRESETS
from kdray.spec.grammar import next_token_masks, tree_masks

ShardActor = ray.remote(ShardWorker)
DrafterActor = ray.remote(DrafterWorker)
JOIN_MARGIN_S = 10.0  # the engine waits this much longer than the ranks themselves
WORKER_CPUS = 0.5  # CPUs a shard or drafter asks for: a TP = 2 engine and its drafter place on two cores


def drafter_shares_gpu(args: EngineArgs) -> bool:
    """Whether the drafter takes half of shard 0's GPU: when no live node has a GPU for it beside the shards'
    (or none has GPUs yet)."""
    if not args.device.startswith("cuda") or args.drafter is None:
        return False
    per_node = max((n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]), default=0)
    return per_node < args.tp + 1


def engine_bundles(args: EngineArgs, shared: bool) -> tuple[list[dict], list[int], list[float]]:
    """The placement of one engine's actors (``args`` resolved): its bundles (one per shard, one for the drafter
    unless it ``shared`` shard 0's GPU), and per rank (shards, then the drafter) its bundle and GPU share."""
    gpu, drafter = args.device.startswith("cuda"), args.drafter is not None
    shared = shared and gpu and drafter
    bundles = [{"CPU": WORKER_CPUS, "GPU": 1} if gpu else {"CPU": WORKER_CPUS}
               for _ in range(args.tp + (drafter and not shared))]
    homes, parts = list(range(args.tp + drafter)), [1.0] * (args.tp + drafter)
    if shared:
        bundles[0] = {"CPU": 2 * WORKER_CPUS, "GPU": 1}
        homes[-1], parts[0], parts[-1] = 0, 0.5, 0.5
    return bundles, homes, parts


def _same_bundles(found: list[dict], wanted: list[dict]) -> bool:
    def norm(bundle: dict) -> dict:
        return {k: float(v) for k, v in bundle.items() if v}

    return len(found) == len(wanted) and all(norm(f) == norm(w) for f, w in zip(found, wanted))


def connect_ray():
    """Join a running cluster (``address="auto"``), or start a local one; an existing connection is kept."""
    if ray.is_initialized():
        return
    try:
        ray.init(address="auto")
    except ConnectionError:
        ray.init()


class _Held:
    """Everything the actors of one engine hold, released once: explicitly, when collected, or at exit."""

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


class EngineActors:
    """The actors of one engine: ``tp`` shards and (unless AR) a drafter, in one STRICT_PACK placement group
    with one bundle per shard and one for the drafter (or, when no node has a GPU to spare, the drafter takes
    half of shard 0's GPU, in shard 0's bundle): the current one when it holds those bundles after its first
    (a Serve replica's), else one of their own."""

    def __init__(self, args: EngineArgs):
        self.args = args
        self._held = _Held()
        self._release = weakref.finalize(self, self._held.release)
        self.placement_group = None
        self.shards: list = []
        self.drafter = None
        self.loops: dict[str, ray.ObjectRef] = {}
        self.groups: dict[str, tuple[str, int]] = {}  # group name -> (backend, size), once launched

    @property
    def actors(self) -> dict[str, object]:
        named = {f"shard {r}": a for r, a in enumerate(self.shards)}
        return named | ({"drafter": self.drafter} if self.drafter is not None else {})

    def _place(self) -> tuple[int, list[int], list[float]]:
        """Take the current placement group's bundles after its first if they are this engine's, else make and
        wait for a placement group of this engine's own; return the first engine bundle's index and per rank
        its bundle (from there) and GPU share."""
        a, current = self.args, ray.util.get_current_placement_group()
        if current is not None:
            for shared in (False, True):
                bundles, homes, parts = engine_bundles(a, shared)
                if _same_bundles(current.bundle_specs[1:], bundles):
                    self.placement_group = current
                    return 1, homes, parts
        bundles, homes, parts = engine_bundles(a, drafter_shares_gpu(a))
        pg = self.placement_group = self._held.pg = placement_group(bundles, strategy="STRICT_PACK")
        if not ray.wait([pg.ready()], timeout=a.place_timeout_s)[0]:
            raise RuntimeError(f"Ray could not place {bundles} on one node within {a.place_timeout_s:.0f} s "
                               f"(available: {ray.available_resources()}); free resources or lower tp")
        return 0, homes, parts

    def launch(self) -> list[LoadReport]:
        """Place the actors, join their groups (warmed, bounded), load the weights; one report per actor, in
        rank order (shards, then the drafter)."""
        a = self.args
        gpu, drafter = a.device.startswith("cuda"), a.drafter is not None
        first, homes, parts = self._place()
        shared = drafter and parts[-1] < 1  # the drafter has half of shard 0's GPU
        for rank, (home, part) in enumerate(zip(homes, parts)):
            peer = rank < a.tp and a.all_reduce == "peer"  # sees every GPU of the node, to map its peers' buffers
            actor = (ShardActor if rank < a.tp else DrafterActor).options(
                num_cpus=WORKER_CPUS, num_gpus=part if gpu else 0, max_restarts=0,
                runtime_env={"env_vars": {SEE_ALL_GPUS: "1"}} if peer else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
                                                                     placement_group_bundle_index=first + home),
            ).remote(rank, a, part)
            if rank < a.tp:
                self.shards.append(actor)
            else:
                self.drafter = actor
        self._held.actors = list(self.actors.values())

        host = ray.util.get_node_ip_address()
        store = self._held.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        sizes = ({"tp": a.tp} if a.tp > 1 else {}) | ({"link": a.tp + 1} if drafter else {})
        backends = {"tp": ("nccl-peer" if a.all_reduce == "peer" else "nccl") if gpu else "gloo",
                    "link": "nccl" if gpu and not shared else "gloo"}  # NCCL refuses two ranks on one GPU
        self.groups = {g: (backends[g], n) for g, n in sizes.items()}
        calls = [actor.join.remote(host, store.port, {g: (backends[g], rank, n) for g, n in sizes.items()
                                                      if g == "link" or rank < a.tp}, a.join_timeout_s)
                 for rank, actor in enumerate(self.actors.values())]

        def absent() -> str:
            gone = {g: missing_ranks(store, g, n) for g, n in sizes.items()}
            return "; ".join(f"group '{g}' is missing rank(s) {m}" for g, m in gone.items() if m)

        self._gather(calls, a.join_timeout_s + JOIN_MARGIN_S, "join their communicators", absent)
        return self._gather([actor.load.remote() for actor in self.actors.values()], a.load_timeout_s,
                            "load weights")

    def start(self, layout: EngineLayout):
        """Build every runner, start every loop and connect it to the channel."""
        actors = self.actors
        self._gather([actor.setup.remote(layout) for actor in actors.values()], self.args.load_timeout_s,
                     "build their runners")
        here = ray.get_runtime_context().get_node_id()
        nodes = ray.util.placement_group_table(self.placement_group)["bundles_to_node_id"].values()
        same_node = set(nodes) == {here}
        server = self._held.server = PlanServer(None if same_node else ray.util.get_node_ip_address())
        self.loops = {name: actor.run.remote(server.address) for name, actor in actors.items()}
        server.accept(list(self.loops), self.args.join_timeout_s, self.check)

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

    def send(self, plan: dict, to: tuple[str, ...] | None = None):
        """Send one plan to every loop (or those of the actors named in ``to``)."""
        self._held.server.broadcast(pack(plan), to)

    def wait(self, replies: tuple[str, ...]) -> list[dict]:
        """The next reply of each actor in ``replies``, in that order."""
        return self._held.server.wait(replies, self.args.step_timeout_s, self.check)

    def release(self):
        """Kill every actor and remove the placement group (their GPUs are free again)."""
        self._release()


class RayModels:
    """The engine builder's view of the actors: ``load`` launches them (they load the weights) and reports
    the facts; ``start`` builds their runners and returns the :class:`RayRunner`."""

    def __init__(self, args: EngineArgs):
        check_parallel(args.model, args.tp, args.expert_parallel)  # before any actor starts
        connect_ray()
        if args.model in PRESETS:  # written on first use: once here, not by every actor of this node at once
            resolve_model(args.model)
        self.args = args
        self.actors = EngineActors(args)

    def load(self) -> ModelFacts:
        try:
            reports = self.actors.launch()
        except BaseException:
            self.actors.release()
            raise
        shard0 = reports[0]
        self.vocab_size = shard0.config.vocab_size
        return ModelFacts(shard0.config, shard0.tokenizer, shard0.name,
                          reports[-1].draft_config if self.args.drafter is not None else None,
                          min(r.kv_pages for r in reports))

    def start(self, layout: EngineLayout) -> RayRunner:
        try:
            self.actors.start(layout)
        except BaseException:
            self.actors.release()
            raise
        return RayRunner(self.args, layout, self.actors, self.vocab_size)


def first_tokens_result(reply: dict, batch: PrefillBatch) -> StepResult:
    """Shard 0's reply for ``batch``'s chunks (:func:`~kdray.actors.shard.first_tokens_reply`) as the engine takes
    it."""
    return first_tokens(reply["tokens"], *(reply["logprobs"] or ()), scored=[len(s) for s in batch.scored])


class RayRunner:
    """What the engine asks of a runner (``prefill``, ``step``), done as step plans on :class:`EngineActors`.

    When an actor dies or fails, the call raises :class:`WorkerFailure` naming it; the actors are released and
    the next call launches new ones (with the same layout), which serve the requests still waiting.
    """

    def __init__(self, args: EngineArgs, layout: EngineLayout, actors: EngineActors, vocab_size: int):
        self.args, self.layout, self.vocab_size = args, layout, vocab_size
        self.actors: EngineActors | None = actors
        self._closed = False
        # the last step's actors and the function that reads its replies (once; they stay queued until read)
        self._last_step: tuple[EngineActors, Callable[[], list[dict]]] | None = None

    def _send(self, plan: dict, replies: tuple[str, ...], then: Callable[[EngineActors], None] | None = None
              ) -> Callable[[], list[dict]]:
        """Send ``plan`` to every actor loop (launching new actors after a failure), then run ``then(actors)`` (the
        rest of the step's exchange); returns the function that waits for the replies of ``replies``. A failure, on
        sending or waiting, releases the actors and raises :class:`WorkerFailure`."""
        if self._closed:
            raise RuntimeError("this engine was shut down; create a new LLM")
        if self.actors is None:
            actors = EngineActors(self.args)
            try:
                actors.launch()
                actors.start(self.layout)
            except BaseException:
                actors.release()
                raise
            self.actors = actors
        actors = self.actors

        def guarded(fn):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - the actors may be mid-plan: never send them another
                actors.release()
                if self.actors is actors:
                    self.actors = None
                what = e if isinstance(e, WorkerFailure) else f"the step plan failed ({type(e).__name__}: {e})"
                raise WorkerFailure(f"{what}\nthe engine starts new actors at its next step") from None

        guarded(lambda: actors.send(plan))
        if then is not None:
            guarded(lambda: then(actors))
        return lambda: guarded(lambda: actors.wait(replies))

    def _send_masks(self, actors: EngineActors, batch: StepBatch, seqs: list[int]) -> float:
        """A grammar step's masks to shard 0 (which hands them to the others): each tree node's after its path, the
        trees sent by the drafter (the roots alone without one), for the sequences ``seqs`` with a grammar -> the
        seconds spent making and sending them (the step's "build" stage, as in-process)."""
        B, width = len(batch.slots), 1 + batch.nodes
        packed = actors.wait(("drafter",))[0]["trees"] if self.args.drafter is not None else None
        start = time.perf_counter()
        if packed is None:
            masks = next_token_masks(batch.grammars, self.vocab_size)  # [B, W]
        else:
            tree = DraftTree.unpack(int32_rows(packed, B), batch.nodes)
            masks = tree_masks(batch.grammars, tree, self.vocab_size)  # [B * (1+N), W]
        actors.send({"op": "allowed", "masks": int32_bytes(masks.view(B, width, -1)[seqs])}, ("shard 0",))
        return time.perf_counter() - start

    def launch(self, prefill: PrefillBatch | None, step: StepBatch | None) -> tuple[Pending | None, Pending | None]:
        """:func:`~kdray.engine.runner.launch` on the actors: a riding chunk goes in the step plan, to run inside the
        shards' verify pass, else a prefill plan goes first."""
        return launch(self, prefill, step, self.layout.cuda_graphs)

    def prefill(self, batch: PrefillBatch) -> Pending[StepResult]:
        wait = self._send(prefill_plan(batch), ("shard 0",))

        return Pending(lambda: first_tokens_result(wait()[0], batch))

    def step(self, batch: StepBatch) -> Pending[StepResult]:
        """One plan to every actor; the replies are read when the engine asks (after it launched the next step)."""
        return self.run_step(batch)[1]

    def run_step(self, batch: StepBatch, prefill: PrefillBatch | None = None, rows: int = 0
                 ) -> tuple[Pending | None, Pending[StepResult]]:
        """:meth:`step`, with ``prefill``'s lone chunk riding in it (padded to ``rows``) -> (the chunk's result or
        None, the step's), both read from the one plan's replies."""
        drafter = ("drafter",) if self.args.drafter is not None else ()
        plan = {"op": "step", "slots": batch.slots, "nodes": batch.nodes, "pages": batch.pages,
                "thoughts": {slot: (end, None if mask is None else int32_bytes(mask))
                             for slot, (end, mask) in batch.thoughts.items()}}
        if prefill is not None:
            plan.update(chunk=prefill_plan(prefill), rows=rows)
        masks: dict[str, float] = {}  # a grammar step's: the engine's time making its masks
        seqs = [b for b, g in enumerate(batch.grammars or ()) if g is not None]
        before = self._last_step

        def send_masks(actors: EngineActors):
            if before is not None and before[0] is actors:  # in flight (thoughts pipeline): its replies queue first
                before[1]()
            masks["build"] = self._send_masks(actors, batch, seqs)

        if seqs:
            plan["grammars"] = seqs
        wait, replies = self._send(plan, ("shard 0", *drafter), send_masks if seqs else None), []

        def replied() -> list[dict]:
            if not replies:
                replies.extend(wait())
            return replies

        self._last_step = (self.actors, replied)

        def result() -> StepResult:
            shard, *draft = replied()
            return StepResult(shard["tokens"], add_seconds(shard["seconds"], *(d["seconds"] for d in draft), masks),
                              draft[0]["masses"] if draft else None, shard["logprobs"])

        first = Pending(lambda: first_tokens_result(replied()[0]["first"], prefill)) if prefill is not None else None
        return first, Pending(result)

    def noop(self, batch: StepBatch, tau: int) -> list[list[int]]:
        """A step-shaped plan with no model work (the control-path benchmark): its round trip."""
        return self._send({"op": "noop", "slots": batch.slots, "nodes": batch.nodes, "pages": batch.pages,
                           "tau": tau}, ("shard 0",))()[0]["tokens"]

    def shutdown(self):
        """Release every actor, the placement group and their GPUs; the engine cannot step afterwards."""
        self._closed = True
        if self.actors is not None:
            self.actors.release()
            self.actors = None
