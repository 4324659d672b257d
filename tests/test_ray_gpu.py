"""The engine on Ray actors on GPUs: the NCCL group, the drafter on a share of shard 0's GPU (gloo link)
or on a GPU of its own (NCCL link), tensor and expert parallelism over NCCL on a K2-architecture model
with INT4 experts, grammar requests, and a shard killed while its peer waits in an NCCL collective.

Each test starts a local Ray cluster that sees the number of GPUs it asks for (skipped if the machine
has fewer), so one machine with two GPUs runs every layout."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from test_grammar import MIXED, PLAIN, THINKING
from test_grammar import PROMPTS as GRAMMAR_PROMPTS
from test_ray_runtime import PROMPTS, SPEC, generate, tokens

from kdray import LLM, SamplingParams
from kdray.actors.channel import WorkerFailure
from kdray.actors.communicator import NcclGroup
from kdray.config import K2Config
from kdray.model.presets import K2_TINY, k2_random_tensors, write_checkpoint
from kdray.train_drafter import margin_at

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.gpu

ON_GPU = {"device": "cuda", "dtype": "bfloat16"}
SPEC_GPU = SPEC | ON_GPU
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
NEAR_TIE = 0.02  # of the top logit: how far bf16 partial sums reduced in another order can move a logit
INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
    "g": {"weights": {"num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 32}}}}


@pytest.fixture
def ray_gpus(request):
    """A local Ray cluster with ``request.param`` GPUs (and a CPU per actor)."""
    need = request.param
    if torch.cuda.device_count() < need:
        pytest.skip(f"needs {need} GPUs, this machine has {torch.cuda.device_count()}")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=4, num_gpus=need, include_dashboard=False, logging_level="ERROR")
    yield need
    ray.shutdown()


@pytest.fixture(scope="module")
def int4_k2(tmp_path_factory) -> str:
    """k2-tiny's shape with expert width 128 (64 per rank at TP = 2, INT4 group 32), experts packed INT4,
    and every token routed to all 8 experts: bf16 noise then moves the routing weights a little instead of
    flipping which experts run (a discontinuity no tolerance on the logits could bound)."""
    cfg = dict(K2_TINY, moe_intermediate_size=128, quantization_config=INT4, num_experts_per_tok=8, n_group=1,
               topk_group=1)
    path = tmp_path_factory.mktemp("int4k2")
    write_checkpoint(path, cfg, k2_random_tensors(K2Config.from_hf(cfg), seed=7, int4_experts=True))
    return str(path)


def test_nccl_group_reduces_gathers_and_broadcasts_on_torch_stream():
    pytest.importorskip("cupy")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    group = NcclGroup(store, "tp", 0, 1, timeout_s=30)
    t = torch.arange(6, dtype=torch.bfloat16, device="cuda").view(2, 3)
    assert torch.equal(group.all_reduce(t.clone()), t)
    assert torch.equal(group.all_gather(t, dim=-1), t)
    assert torch.equal(group.broadcast(t.int().contiguous(), 0), t.int())


@pytest.mark.parametrize("ray_gpus", [1], indirect=True)
def test_tp1_with_the_drafter_sharing_the_gpu_equals_in_process(ray_gpus):
    reference = generate("k2-tiny", PROMPTS, 24, **ON_GPU)
    with LLM(model="k2-tiny", **SPEC_GPU, tp=1, distributed="ray") as llm:
        assert llm.engine.runner.actors.placement_group.bundle_specs == [{"CPU": 1, "GPU": 1}]  # shard 0 and the drafter, half a CPU each
        assert llm.engine.runner.actors.groups == {"link": ("gloo", 2)}
        assert tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)) == reference


@pytest.mark.parametrize("ray_gpus", [2], indirect=True)
def test_tp1_with_the_drafter_on_its_own_gpu_links_over_nccl(ray_gpus):
    reference = generate("k2-tiny", PROMPTS, 24, **ON_GPU)
    with LLM(model="k2-tiny", **SPEC_GPU, tp=1, distributed="ray") as llm:
        assert llm.engine.runner.actors.groups == {"link": ("nccl", 2)}
        assert tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)) == reference


TP_BACKENDS = {"nccl": "nccl", "peer": "nccl-peer"}  # EngineArgs.all_reduce -> the tp group's backend


@pytest.mark.parametrize("ray_gpus", [2], indirect=True)
@pytest.mark.parametrize("ep,graphs,all_reduce", [(False, True, "nccl"), (False, False, "nccl"), (True, True, "nccl"),
                                                  (False, True, "peer"), (False, False, "peer"), (True, True, "peer")])
def test_tp2_equals_in_process_in_fp32(ray_gpus, ep, graphs, all_reduce):
    """k2-tiny in fp32 on the GPUs: token for token the in-process output, with the collectives captured inside the
    verify pass's CUDA graph (the default on GPUs) and without graphs; over NCCL and over the one-shot peer kernel
    (two ranks: both sum a + b once in fp32)."""
    fp32 = {"device": "cuda", "dtype": "float32", "cuda_graphs": graphs}
    reference = generate("k2-tiny", PROMPTS, 24, **fp32)
    with LLM(model="k2-tiny", **SPEC, **fp32, tp=2, expert_parallel=ep, distributed="ray",
             all_reduce=all_reduce) as llm:
        groups = llm.engine.runner.actors.groups
        assert groups == {"tp": (TP_BACKENDS[all_reduce], 2), "link": ("gloo", 3)}  # the drafter shares GPU 0
        assert tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)) == reference


@pytest.mark.parametrize("ray_gpus", [2], indirect=True)
@pytest.mark.parametrize("ep,all_reduce", [(False, "nccl"), (True, "nccl"), (False, "peer"), (True, "peer")])
def test_int4_tp2_equals_in_process_up_to_bf16_near_ties(ray_gpus, int4_k2, ep, all_reduce):
    """INT4 experts take bf16 activations, and each rank's partial sums are rounded to bf16 before the
    all-reduce, so at TP = 2 a greedy choice can flip where the in-process logits nearly tie. Each prompt's
    output equals the in-process one up to its first divergence, and there the in-process logit of the token
    TP = 2 chose is within ``NEAR_TIE`` of the top logit."""
    prompts = [[t % 1000 for t in p] for p in PROMPTS]
    with LLM(model=int4_k2, **SPEC_GPU) as local:
        reference = tokens(local.generate(prompt_token_ids=prompts, sampling_params=PARAMS))
        with LLM(model=int4_k2, **SPEC_GPU, tp=2, expert_parallel=ep, distributed="ray", all_reduce=all_reduce) as llm:
            assert llm.engine.runner.actors.groups["tp"] == (TP_BACKENDS[all_reduce], 2)
            got = tokens(llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS))
        for prompt, ours, theirs in zip(prompts, got, reference):
            flip = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            if flip is not None:
                at = margin_at(local.engine.runner.target, prompt + theirs[:flip], [ours[flip]])
                assert at["gaps"][0] <= NEAR_TIE * abs(at["top"]), (prompt, flip, at)


@pytest.mark.parametrize("ray_gpus,tp", [(1, 1), (2, 2)], indirect=["ray_gpus"])
def test_grammar_requests_on_gpus_equal_in_process_in_fp32(ray_gpus, tp, random_k2):
    """structured_outputs on GPU actors in fp32 (plain steps and free thoughts from CUDA graphs, grammar steps eager):
    the masks reach shard 0 over the channel and the other shard over NCCL; token for token the in-process output.
    Free thoughts also alone in their batch, where their steps pipeline (a slot halts at its thought's end)."""
    fp32 = {"device": "cuda", "dtype": "float32"}
    batches = [(GRAMMAR_PROMPTS + [PLAIN] + GRAMMAR_PROMPTS, MIXED + THINKING),
               (GRAMMAR_PROMPTS + [PLAIN], THINKING + MIXED[3:])]
    with LLM(model=random_k2, **SPEC, **fp32) as local:
        reference = [tokens(local.generate(prompt_token_ids=p, sampling_params=s)) for p, s in batches]
    with LLM(model=random_k2, **SPEC, **fp32, tp=tp, distributed="ray") as llm:
        assert [tokens(llm.generate(prompt_token_ids=p, sampling_params=s)) for p, s in batches] == reference


@pytest.mark.parametrize("ray_gpus", [2], indirect=True)
def test_shard_killed_during_nccl_collectives_fails_its_request_and_the_next_succeeds(ray_gpus):
    with LLM(model="k2-tiny", **SPEC_GPU, tp=2, distributed="ray") as llm:
        reference = tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS))
        first = llm.engine.runner.actors
        killer = threading.Timer(1.0, ray.kill, [first.shards[1]])
        killer.start()
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match=r"shard 1 died"):
            llm.generate(prompt_token_ids=[PROMPTS[3]], sampling_params=SamplingParams(max_tokens=1200,
                                                                                       ignore_eos=True))
        killer.join()
        assert time.monotonic() - start < 30
        assert tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)) == reference
        assert llm.engine.runner.actors is not first
