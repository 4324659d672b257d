"""The engine on Ray actors (CPU: gloo groups, a local cluster): token for token the in-process greedy
DDTree output at TP = 2 and 4, with expert parallelism, on INT4 checkpoints and with a vocabulary the width
does not divide; grammar requests as in-process AR, their masks carried to the shards as the engine made them; a
killed shard fails its request with a clear error, and the engine then serves the next one."""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import jsonschema
import msgpack
import pytest
import torch
import torch.distributed as dist
from k2_checkpoints import make_hf_k2, quantize_experts_int4
from test_grammar import GRAMMAR, MIXED, PLAIN, SCHEMA, THINKING, thinking_params
from test_grammar import PROMPTS as GRAMMAR_PROMPTS
from test_scheduler import record_riding_rows, staggered

from kdray import LLM, SamplingParams
from kdray.actors.channel import pack
from kdray.actors.communicator import CommunicatorTimeout, GlooGroup
from kdray.actors.shard import ShardWorker
from kdray.config import K2Config
from kdray.engine.step import StepBatch
from kdray.kernels.tree_build import DraftTree
from kdray.model.presets import K2_TINY, k2_random_tensors, write_checkpoint
from kdray.spec.grammar import next_token_masks, tree_masks

ray = pytest.importorskip("ray")

GEN = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(2, 1000, (n,), generator=GEN).tolist() for n in (3, 17, 9, 30)]
SPEC = {"drafter": "random", "spec": "ddtree", "budget": 16, "block_size": 4, "num_pages": 96}


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def generate(model: str, prompts, max_tokens: int, **kw):
    """Greedy DDTree tokens in-process (no ``tp``) or on Ray actors; the actors are released afterwards."""
    with LLM(model=model, **SPEC, **kw) as llm:
        return tokens(llm.generate(prompt_token_ids=prompts,
                                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


@functools.cache
def _reference(model: str, prompts: tuple, max_tokens: int) -> tuple:
    return tuple(map(tuple, generate(model, [list(p) for p in prompts], max_tokens)))


def reference(model: str, prompts, max_tokens: int) -> list[list[int]]:
    """``generate(model, prompts, max_tokens)`` in-process: the tokens a run on Ray must equal. Several tests (and
    parametrizations) compare with the same reference; it is computed once per run."""
    return [list(t) for t in _reference(model, tuple(map(tuple, prompts)), max_tokens)]


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    return ray_cluster


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory):
    """A transformers-made K2 with INT4 experts wide enough (128) for TP = 4 at group size 32."""
    pytest.importorskip("compressed_tensors")
    root = tmp_path_factory.mktemp("int4k2")
    make_hf_k2(root / "dense", "grouped", seed=3, moe_inner=128)
    quantize_experts_int4(root / "dense", root / "int4")
    return str(root / "int4")


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """k2-tiny with 8 tokens: random draft trees then hold the true continuation often, so steps accept
    several tokens (the multi-token commit and feature hand-off paths)."""
    cfg = dict(K2_TINY, vocab_size=8, eos_token_id=None)
    path = tmp_path_factory.mktemp("vocab8")
    write_checkpoint(path, cfg, k2_random_tensors(K2Config.from_hf(cfg), seed=5))
    return str(path)


@pytest.fixture(scope="module")
def vocab211(tmp_path_factory):
    """k2-tiny with a vocabulary of 211 tokens (a prime): no TP width but 1 divides it."""
    cfg = dict(K2_TINY, vocab_size=211, eos_token_id=None)
    path = tmp_path_factory.mktemp("vocab211")
    write_checkpoint(path, cfg, k2_random_tensors(K2Config.from_hf(cfg), seed=7))
    return str(path)


@pytest.mark.slow
def test_a_vocabulary_the_width_does_not_divide_is_padded(cluster, vocab211):
    prompts = [[t % 211 for t in p] for p in PROMPTS]
    assert generate(vocab211, prompts, 16, tp=2, distributed="ray") == reference(vocab211, prompts, 16)


# the fields that change the distribution travel in the prefill plan; log-probabilities come back with tokens
FIELDS = SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=3, presence_penalty=-1.0,
                        frequency_penalty=-1.0, repetition_penalty=1.2, logit_bias={17: 2.0}, min_p=0.05,
                        min_tokens=4, logprobs=2, prompt_logprobs=2)


@functools.cache
def in_process_fields():
    """The in-process outputs (tokens, log-probabilities) under ``FIELDS``, computed once for both TP widths."""
    with LLM(model="k2-tiny", **SPEC) as llm:
        return llm.generate(prompt_token_ids=PROMPTS, sampling_params=FIELDS)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_k2_tiny_on_ray_equals_in_process_and_shutdown_releases_all(cluster, tp):
    expected = reference("k2-tiny", PROMPTS, 24)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    in_process_outs = in_process_fields()
    in_process = [o.outputs[0] for o in in_process_outs]
    free = ray.available_resources().get("CPU", 0)
    with LLM(model="k2-tiny", **SPEC, tp=tp, distributed="ray") as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
        assert tokens(outs) == expected
        on_ray_outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=FIELDS)
        on_ray = [o.outputs[0] for o in on_ray_outs]
        assert [c.token_ids for c in on_ray] == [c.token_ids for c in in_process]
        assert [list(d) for c in on_ray for d in c.logprobs] == [list(d) for c in in_process for d in c.logprobs]
        assert [c.cumulative_logprob for c in on_ray] == pytest.approx([c.cumulative_logprob for c in in_process],
                                                                        abs=1e-3)
        for a, b in zip(on_ray_outs, in_process_outs):  # the prompts' log-probabilities come back from the prefill
            assert [list(d or ()) for d in a.prompt_logprobs] == [list(d or ()) for d in b.prompt_logprobs]
        pg = llm.engine.runner.actors.placement_group
    # Every stage is timed under its own name on Ray too: the drafter's draft and build, the shards' rest.
    assert all(outs[0].metrics["seconds"][stage] > 0 for stage in ("draft", "build", "verify", "accept", "commit"))
    deadline = time.monotonic() + 30  # resources come back asynchronously
    while ray.available_resources().get("CPU", 0) < free and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == free
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["ar", "ddtree"])
def test_grammar_requests_on_ray_equal_in_process_ar(cluster, random_k2, spec):
    """structured_outputs on Ray: the engine's matchers make the masks (the first tokens' in the prefill plan, the tree
    nodes' mid-step from the drafter's trees, or without a drafter the roots'), which reach every shard: greedy and
    seeded grammar requests and a plain one batched with them give in-process AR's tokens; those that end parse and
    follow the schema. So do grammars after free thoughts, whose masks reach the shards once a thought, with
    other grammars in the batch (its steps unpipelined) and alone (pipelined: the shards halt a slot whose thought
    ended until the engine has seen that end)."""
    prompts, params = GRAMMAR_PROMPTS + [PLAIN] + GRAMMAR_PROMPTS, MIXED + THINKING
    alone = thinking_params(False)
    with LLM(model=random_k2, spec="ar") as llm:
        expected = [o.outputs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        expected_alone = llm.generate(prompt_token_ids=GRAMMAR_PROMPTS + [PLAIN], sampling_params=alone)
    kw = {"drafter": "random", "budget": 16, "block_size": 8} if spec == "ddtree" else {}
    with LLM(model=random_k2, spec=spec, tp=2, distributed="ray", **kw) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        outs_alone = llm.generate(prompt_token_ids=GRAMMAR_PROMPTS + [PLAIN], sampling_params=alone)
    assert tokens(outs_alone) == tokens(expected_alone)
    assert [o.outputs[0].token_ids for o in outs] == [c.token_ids for c in expected]
    ended = [o.outputs[0] for o in outs[:3] if o.outputs[0].finish_reason == "stop"]
    assert ended
    for c in ended:
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_a_grammar_steps_masks_reach_the_shards_as_the_engine_makes_them(random_k2):
    """The Ray transport of a grammar step's masks, through msgpack: the drafter's packed trees to the engine, the
    rows of the sequences with a grammar to shard 0, which rebuilds every node's row of the padded batch. Each row
    is in-process tree_masks' (trees that follow the grammar, so deep nodes' rows restrict), rows without a grammar
    and the padding's allow everything; without a drafter, each root's next-token mask."""
    from kdray.actors.ray_runner import RayRunner  # (needs Ray)

    with LLM(model=random_k2, spec="ar") as llm:
        grammars, tok, V = llm.engine.grammars, llm.tokenizer, llm.config.vocab_size
    states = [grammars.start(GRAMMAR), None, grammars.start(GRAMMAR)]
    for t in tok.encode('{"a": "'):
        states[0].accept(t)
    paths = [tok.encode('ada", "b": true'), [], tok.encode('{"a": "bob')]
    nodes, padded = 12, 4  # three sequences padded to four rows
    tokens = torch.zeros(3, 1 + nodes, dtype=torch.int64)
    parents = torch.full((3, 1 + nodes), -1, dtype=torch.int32)
    for b, path in enumerate(paths):  # the path as a chain from the root, a wrong sibling beside each of its nodes
        chain = path[:nodes // 2]
        for i, t in enumerate(chain):
            tokens[b, 1 + 2 * i], parents[b, 1 + 2 * i] = t, 2 * i - 1 if i else 0
            tokens[b, 2 + 2 * i], parents[b, 2 + 2 * i] = (t + 1) % V, 2 * i - 1 if i else 0
    counts = torch.tensor([1 + 2 * len(p[:nodes // 2]) for p in paths], dtype=torch.int32)
    tree = DraftTree(tokens=tokens, parents=parents, depths=torch.zeros_like(parents), num_nodes=counts,
                     mask=torch.zeros(3, 1 + nodes, 1, dtype=torch.int32))
    for drafter, n in (("random", nodes), (None, 0)):
        batch = StepBatch(slots=[0, 1, 2], nodes=n, grammars=states)
        sent = []
        actors = SimpleNamespace(wait=lambda names: [msgpack.unpackb(pack({"trees": tree.pack().numpy().tobytes()}))],
                                 send=lambda plan, to: sent.append((msgpack.unpackb(pack(plan)), to)))
        RayRunner(SimpleNamespace(drafter=drafter, tp=2), None, actors, V)._send_masks(actors, batch, [0, 2])
        [(frame, to)] = sent
        assert to == ("shard 0",)
        shard = ShardWorker(0, SimpleNamespace(device="cpu"), 1.0)
        shard.channel = SimpleNamespace(recv=lambda: frame)
        shard.target = SimpleNamespace(config=SimpleNamespace(vocab_size=V))
        shard.runner = SimpleNamespace(padded=lambda b: padded)
        got = shard._allowed(batch, [0, 2]).view(padded, 1 + n, -1)
        expected = (tree_masks(states, tree, V) if drafter else next_token_masks(states, V)).view(3, 1 + n, -1)
        assert torch.equal(got[:3], expected) and (got[3] == -1).all() and (got[1] == -1).all()
        assert (got[[0, 2], 0] != -1).any(-1).all()  # the roots' rows restrict
        if drafter:
            assert (got[[0, 2], 3::2] != -1).any(-1).sum() >= 6  # and so do deep nodes' on the grammar's paths


@pytest.mark.slow
def test_prompt_chunks_riding_on_ray_equal_in_process(cluster, monkeypatch):
    """TP = 2 and the drafter's actor, requests arriving while others decode: each lone prompt chunk rides in the
    step plan (the shards' verify pass; its features and first token then reach the drafter's actor, whose trees
    root at that token) and the outputs are the in-process run's."""
    rows = record_riding_rows(monkeypatch)
    with LLM(model="k2-tiny", **SPEC, tp=2, distributed="ray", prefill_chunk=8) as llm:
        assert staggered(llm.engine, SamplingParams(max_tokens=24, ignore_eos=True), PROMPTS) == \
            reference("k2-tiny", PROMPTS, 24)
    assert {n for n in rows if n is not None} >= {1, 8}  # 17 tokens: 8, 8 and 1, riding


@pytest.mark.slow
def test_dummy_weights_reach_the_shards_and_the_drafters_actor(cluster, tmp_path):
    """``load_format="dummy"`` on a directory with only k2-tiny's config.json: each shard builds its slice with random
    weights and the drafter's actor its target head (none reads a weight file), and they decode together."""
    (tmp_path / "config.json").write_text(json.dumps(K2_TINY))
    out = generate(str(tmp_path), PROMPTS, 8, tp=2, distributed="ray", load_format="dummy")
    assert [len(t) for t in out] == [8] * len(PROMPTS) and all(0 <= t < 1024 for s in out for t in s)


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(2, False), (4, False), (2, True)])
def test_int4_checkpoint_on_ray_equals_in_process(cluster, int4_checkpoint, tp, ep):
    prompts = [[t % 320 for t in p] for p in PROMPTS]
    assert (generate(int4_checkpoint, prompts, 16, tp=tp, expert_parallel=ep, distributed="ray")
            == reference(int4_checkpoint, prompts, 16))


@pytest.mark.slow
def test_killed_shard_fails_its_request_clearly_and_the_next_succeeds(cluster, small_vocab):
    from kdray.actors.channel import WorkerFailure

    prompts = [[t % 8 for t in p] for p in PROMPTS]
    reference = generate(small_vocab, prompts, 24)
    with LLM(model=small_vocab, **SPEC, tp=2, distributed="ray") as llm:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert tokens(outs) == reference
        assert max(o.metrics["tau"] for o in outs) > 1  # multi-token steps happened
        first = llm.engine.runner.actors
        killer = threading.Timer(1.0, ray.kill, [first.shards[1]])
        killer.start()
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match=r"shard 1 died") as failure:
            llm.generate(prompt_token_ids=[prompts[3]],
                         sampling_params=SamplingParams(max_tokens=1200, ignore_eos=True))
        killer.join()
        assert time.monotonic() - start < 30
        assert len(failure.value.request_ids) == 1
        assert tokens(llm.generate(prompt_token_ids=prompts, sampling_params=params)) == reference
        assert llm.engine.runner.actors is not first


TWO_CORES = """
import json, ray
from kdray import LLM, SamplingParams, StructuredOutputsParams
llm = LLM(model="k2-tiny", drafter="random", spec="ddtree", budget=16, block_size=4, num_pages=96, tp=2,
          distributed="ray", place_timeout_s=60)
out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=8, ignore_eos=True))
print(json.dumps([ray.cluster_resources()["CPU"], out[0].outputs[0].token_ids]))
"""


@pytest.mark.slow
def test_tp2_and_its_drafter_place_on_a_two_core_machine_without_a_hand_made_ray_init():
    """``LLM(tp=2, distributed="ray")`` starts Ray itself on a machine of two cores (Ray told so, and told to
    start its own instance rather than join one running here), and its two shards and drafter fit."""
    ray_dir = tempfile.mkdtemp(prefix="kr")  # short: Ray's sockets live under it
    env = os.environ | {"RAY_ADDRESS": "local", "RAY_OVERRIDE_RESOURCES": '{"CPU": 2}', "RAY_TMPDIR": ray_dir}
    try:
        done = subprocess.run([sys.executable, "-c", TWO_CORES], env=env, capture_output=True, text=True,
                              timeout=300, check=False)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    cpus, tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert cpus == 2 and tokens == reference("k2-tiny", [[5, 6, 7]], 8)[0]


def test_group_join_timeout_names_the_absent_rank():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    with pytest.raises(CommunicatorTimeout, match=r"rank\(s\) \[1\] of 2 did not join"):
        GlooGroup(store, "tp", 0, 2, timeout_s=1.0)
