"""Control-path overhead of the Ray engine: one step plan from the engine to every actor loop and
shard 0's reply, with the model work removed (a ``noop`` plan of a real step's shape on the same
channel), for TP = 1, 2, 4 on the CPU and, on GPUs (NCCL groups), TP = 1 and 2 where there are enough.

Beside it: one engine step of k2-tiny on the same actors, the same step in-process (TP = 1, no Ray), shard
0's verify stage (the target pass over the trees, collectives included), and the ratio to the verify step of
a K2 shard (design.md section 5). On GPUs both engines replay CUDA graphs (the default there).

    python benchmarks/control_path.py [--tp 1 2 4] [--gpu-tp 1 2] [--batch 32]

Starts a local Ray cluster unless one is running; prints one Markdown table.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table  # noqa: E402
from kdray import LLM, SamplingParams  # noqa: E402
from kdray.engine.step import StepBatch  # noqa: E402

# design.md section 5: a TP8 K2 shard's INT4 expert traffic is >= 80 us per MoE layer at 16 tree nodes,
# so >= 61 * 80 us = 4.9 ms per verify step (>= 17 ms at 256 nodes). The smaller figure is the strict one.
K2_SHARD_VERIFY_US = 61 * 80.0
TARGET_US = 200.0
PROMPT_LEN, MAX_TOKENS = 24, 16
SPEC = {"model": "k2-tiny", "drafter": "random", "spec": "ddtree", "budget": 64, "block_size": 16, "num_pages": 512}


def noop_us(llm: LLM, batch: int, tau: int, iters: int) -> list[float]:
    """Round trips of a no-op plan carrying ``batch`` sequences, answered with ``tau`` tokens each (us)."""
    runner = llm.engine.runner
    plan = StepBatch(slots=list(range(batch)), nodes=0)
    for _ in range(20):
        runner.noop(plan, tau)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        runner.noop(plan, tau)
        times.append((time.perf_counter() - t) * 1e6)
    return times


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 1000, (PROMPT_LEN,), generator=g).tolist() for _ in range(batch)]


def step_ms(llm: LLM, batch: int) -> tuple[float, float]:
    """(mean engine-step wall time, mean verify stage on shard 0) in ms, generating for ``batch`` prompts."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts(batch), sampling_params=SamplingParams(max_tokens=2))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts(batch), sampling_params=params)
    wall = time.perf_counter() - t
    steps = max(o.metrics["steps"] for o in outs)
    verify = sum(o.metrics["seconds"]["verify"] for o in outs)  # each step's time is split over its batch
    return 1e3 * wall / (steps + 1), 1e3 * verify / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32, help="sequences per no-op plan")
    ap.add_argument("--step-batch", type=int, default=8, help="sequences in the k2-tiny steps")
    ap.add_argument("--tau", type=int, default=4, help="tokens per sequence in the reply")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--tp", type=int, nargs="*", default=[1, 2, 4], help="CPU widths (none: the GPU rows alone)")
    ap.add_argument("--gpu-tp", type=int, nargs="*", default=[1, 2],
                    help="GPU widths, those that fit the visible GPUs (none: the CPU rows alone)")
    args = ap.parse_args()
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=max(args.tp + args.gpu_tp, default=1) + 1, include_dashboard=False, logging_level="ERROR")
    runs = [("cpu", "float32", tp) for tp in args.tp]
    runs += [("cuda", "bfloat16", tp) for tp in args.gpu_tp if tp <= torch.cuda.device_count()]
    local_step = {}  # the in-process (TP = 1) step, once per device
    for device, dtype in dict.fromkeys((device, dtype) for device, dtype, _ in runs):
        with LLM(device=device, dtype=dtype, **SPEC) as llm:
            local_step[device] = step_ms(llm, args.step_batch)[0]
    rows = []
    for device, dtype, tp in runs:
        with LLM(device=device, dtype=dtype, tp=tp, distributed="ray", **SPEC) as llm:
            times = noop_us(llm, args.batch, args.tau, args.iters)
            step, verify = step_ms(llm, args.step_batch)
            groups = ", ".join(f"{g} {backend} x{n}" for g, (backend, n) in llm.engine.runner.actors.groups.items())
        med, p90 = statistics.median(times), statistics.quantiles(times, n=10)[-1]
        gpu = f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""
        rows.append([str(tp), device + gpu, groups, f"{med:.0f}", f"{p90:.0f}", f"{step:.1f}", f"{local_step[device]:.1f}", f"{verify:.1f}",
                     f"{100 * med / K2_SHARD_VERIFY_US:.1f}%", "yes" if med <= TARGET_US else "no"])
    print(f"\n# {datetime.date.today()} control path. No-op plan: {args.batch} sequences, reply {args.tau} tokens "
          f"each. k2-tiny: DDTree budget {SPEC['budget']}, block {SPEC['block_size']}, {args.step_batch} sequences. "
          f"K2-shard verify step: {K2_SHARD_VERIFY_US / 1e3:.1f} ms (design.md section 5, 16 nodes).")
    print_table(rows, ["TP", "device", "groups", "plan+reply us (median)", "p90 us", "k2-tiny step ms",
                       "in-process TP1 step ms", "k2-tiny verify ms",
                       "plan / K2-shard verify", "<= 200 us"])


if __name__ == "__main__":
    main()
