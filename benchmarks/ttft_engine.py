"""Time to first token inside the engine (no HTTP) for chat requests that share a long system prompt.

One engine (``LLM``, the model's default speculative mode) with prefix caching on, then off: the first request fills
the cache; each later one (the same ``--prefix-tokens`` system prompt, a new short question) is added and stepped
until its first token comes out; p50, min and max over ``--requests`` of them, and how many engine steps that took
(the engine is one step behind the device, so 2: the prefill's step and the next). With ``--profile``, one cached
request's host functions (cProfile, by own time) and device kernels (torch.profiler) are printed as well.
``benchmarks/serve_load.py --workload shared-prefix`` measures the same requests served over HTTP.

``--model k2-shard`` runs the same requests on one TP8 shard of Kimi K2 at real dimensions (``k2_step.py``'s
random-weight shard, ``--layers`` of them; plain decoding, since no drafter exists for it): a random ``--prefix-tokens``
id sequence shared by every prompt, then 32 ids of its own. There an uncached 2k-token prompt's prefill is ~90 ms of
GPU work, as on any large model, where on SmolLM2 it is a few milliseconds.

    python benchmarks/ttft_engine.py --profile
    python benchmarks/ttft_engine.py --model k2-shard
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.serve_load import K2_SHARD, OWN_TOKENS, id_model_settings, id_prompts, words  # noqa: E402
from kdray import LLM, SamplingParams  # noqa: E402
from kdray.model.loader import LoadedTarget  # noqa: E402


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model name or path, or k2-shard")
    ap.add_argument("--prefix-tokens", type=int, default=2048, help="the shared system prompt's length")
    ap.add_argument("--requests", type=int, default=11, help="cached requests timed (after the first)")
    ap.add_argument("--profile", action="store_true", help="profile one more cached request")
    ap.add_argument("--layers", type=int, default=61, help="k2-shard: decoder layers")
    return ap.parse_args(argv)


def ttft(engine, ids: list[int]) -> tuple[float, int]:
    """Seconds from adding a request to its first token, and the engine steps in between; the request then aborts."""
    rid = uuid.uuid4().hex
    t0 = time.perf_counter()
    engine.add_request(rid, ids, SamplingParams(max_tokens=16))
    steps = 0
    while True:
        outs = engine.step()
        steps += 1
        if any(o.request_id == rid and o.outputs[0].token_ids for o in outs):
            break
    took = time.perf_counter() - t0
    engine.abort_request(rid)
    engine.drain()
    return took, steps


def profile(engine, ids: list[int]):
    pr = cProfile.Profile()
    pr.enable()
    took, steps = ttft(engine, ids)
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
    print(f"profiled TTFT {1e3 * took:.2f} ms ({steps} steps)\n{out.getvalue()}")
    if torch.cuda.is_available():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            took, _ = ttft(engine, ids)
        print(f"torch-profiled TTFT {1e3 * took:.2f} ms")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


def k2_shard(layers: int) -> LoadedTarget:
    """``k2_step.py``'s random-weight TP8 shard of K2, as a loaded target (no tokenizer)."""
    from benchmarks.k2_step import random_shard, shard_config

    cfg = shard_config(layers)
    return LoadedTarget(random_shard(cfg), cfg, None, f"k2-shard-{layers}")


def chat_prompts(tok, n: int, prefix_tokens: int) -> list[list[int]]:
    """``n`` chat prompts: the same system prompt of ~``prefix_tokens`` tokens, then a question of their own."""
    system = words(prefix_tokens)
    chats = [[{"role": "system", "content": system},
              {"role": "user", "content": f"Question {i}: what does item {i} mean?"}] for i in range(n)]
    return [tok.encode(tok.apply_chat_template(chat)) for chat in chats]


def main(argv=None) -> int:
    args = parse_args(argv)
    target = k2_shard(args.layers) if args.model == K2_SHARD else None
    for caching in (True, False):
        if target is None:
            llm = LLM(model=args.model, prefix_caching=caching)
            prompts = chat_prompts(llm.tokenizer, args.requests + 2, args.prefix_tokens)
        else:  # the ~65 GB shard is built once; each engine leaves room for a context of the prompts' size
            llm = LLM(model=target, prefix_caching=caching, **id_model_settings(args.prefix_tokens + OWN_TOKENS))
            prompts = id_prompts(target.config.vocab_size, args.requests + 2, args.prefix_tokens)
        first, _ = ttft(llm.engine, prompts[0])
        runs = [ttft(llm.engine, p) for p in prompts[1:args.requests + 1]]
        ms = sorted(1e3 * t for t, _ in runs)
        print(f"prefix_caching={caching}: prompt {len(prompts[1])} tokens; first {1e3 * first:.1f} ms; later p50 "
              f"{ms[len(ms) // 2]:.2f} ms min {ms[0]:.2f} max {ms[-1]:.2f}; steps to first token "
              f"{[s for _, s in runs]}", flush=True)
        if caching and args.profile:
            profile(llm.engine, prompts[-1])
        llm.shutdown()
        del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
