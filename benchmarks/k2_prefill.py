"""Prefill of one TP8 shard of Kimi K2 at real dimensions, eager and from a CUDA graph, against its floor.

The engine runs prefill eagerly except for a lone prompt chunk of up to 2048 tokens, which it replays from a CUDA
graph (its time to first token: ``benchmarks/ttft_engine.py --model k2-shard``).

    python -m benchmarks.k2_prefill [--layers 61] [--prompts 1024 4096 16384 65536 8x2048] [--md FILE]
    python -m benchmarks.k2_prefill --model smollm2-135m --prompts 1024 4096 8192 8x1024

The shard is the one ``benchmarks/k2_step.py`` builds (``K2Model`` at K2's dimensions divided for TP8, random
parameters, random INT4 experts); ``--model smollm2-135m`` runs the Llama-family path instead, SmolLM2-135M's
dimensions with random weights (the same prefill attention). A prompt cell ``N`` is one prompt of N tokens, ``BxN``
a batch of B prompts of N tokens each, prefilled into an empty paged latent cache in one pass, ending with the
logits of every prompt's last token (what prefill hands to sampling). A cell ``P+N`` is the prefill of a request
whose first P tokens are in the prefix cache: N new tokens attending to the cached P (the engine's form of a chunk
after cached tokens: the verify pass with a causal mask); compare it with the cell ``P+N``'s whole prompt, ``P+N``
tokens uncached.

Columns: time (median of 3 eager passes after a warm-up); the same pass replayed from a CUDA graph (median of 3; "-"
where it cannot be captured), its GPU time without the host's launches, which the eager pass waits for at up to a
few thousand tokens on a slow host; compute floor = FLOPs / ``FLOOR_FLOP_PER_S`` (issue 21's 790 TFLOP/s, the H200's
dense bf16 rate: a fixed rate, so that the ratios move only with the times; the header prints the rate measured in
the run, which varied from 740 to 784 TFLOP/s between processes on one machine), where FLOPs = 2 x tokens x every
matmul parameter of the shard (projections, the dense layer, the shared experts, the router; not the embedding, and
the vocabulary projection for the last tokens only) + 2 x tokens x 8 routed experts x 3 x hidden x expert width per
MoE layer + causal attention, 2 x heads x (qk + v head dims: 192 + 128 for K2, 64 + 64 for SmolLM2) x N(N+1)/2 per
prompt and layer (for K2 after a cached prefix, chunks of ``PLAIN_CHUNK_TOKENS`` or more count the plain form's dims
over every visible key and kv_b's expansion of the cached rows, shorter ones the absorbed form's 2 x heads x (576 +
512) per query and visible key); the ratios of both times to it; prompt tokens per second (eager); and the GPU time
by kind (attention, routed experts, GEMMs, the rest) from a torch.profiler pass, the largest kernels printed above
the table.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH: a --base kdray can come first
import kdray  # noqa: E402
from benchmarks.common import Ceilings, print_table, run_cells, time_us  # noqa: E402
from benchmarks.k2_step import PAGE, matmul_params, random_shard, shard_config  # noqa: E402
from kdray.config import K2Config, LlamaConfig  # noqa: E402
from kdray.model.batch import prompt_chunks  # noqa: E402
from kdray.model.dummy import fill_random  # noqa: E402
from kdray.model.k2 import PLAIN_CHUNK_TOKENS  # noqa: E402
from kdray.model.llama import LlamaModel  # noqa: E402

# SmolLM2-135M-Instruct's dimensions (its GGUF's metadata), for the Llama-family rows
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
               max_position_embeddings=8192, tie_word_embeddings=True)
TARGETS = {1024: 3.0}  # time / floor of issue 21; 4096 tokens and beyond: 2.0
FLOOR_FLOP_PER_S = 790e12  # the compute floor's rate: issue 21's, the H200's dense bf16 GEMM rate
HEADER = ["prompts", "tokens", "time ms", "graphed ms", "floor ms", "time / floor", "graphed / floor", "target",
          "prompt tok/s", "attention / experts / GEMM / rest ms"]
KINDS = (("attention", ("flash", "fmha", "attention", "softmax", "sdpa", "tva_", "mla_prefill")),
         ("experts", ("w4a16", "moe")),
         ("GEMM", ("gemm", "sm90", "cutlass", "cublas", "nvjet", "xmma", "splitk")))


def parse_cell(cell: str) -> tuple[int, int, int]:
    """``N`` -> (1, 0, N); ``BxN`` -> (B, 0, N); ``P+N`` -> (1, P, N): prompts, cached prefix, new tokens each."""
    if "+" in cell:
        p, _, n = cell.partition("+")
        return 1, int(p), int(n)
    b, _, n = cell.rpartition("x")
    return int(b or 1), 0, int(n)


def prefill_batch(model, B: int, P: int, N: int):
    """B prompts of N new tokens after P cached ones (a random cache): the batch and the cache
    ``[layers, pages, PAGE, *row]``."""
    cfg = model.cfg
    g = torch.Generator("cuda").manual_seed(B * 100003 + P * 7 + N)
    pages = -(-(P + N) // PAGE)
    kv = torch.zeros(cfg.num_hidden_layers, B * pages, PAGE, *model.kv_row_shape, dtype=torch.bfloat16,
                     device="cuda")
    kv.normal_(generator=g)
    table = torch.arange(B * pages, dtype=torch.int32, device="cuda").view(B, pages)
    ids = torch.randint(0, cfg.vocab_size, (B * N,), device="cuda", generator=g)
    positions = (P + torch.arange(N, device="cuda")).repeat(B)
    return prompt_chunks(ids, positions, [N] * B, [P] * B, table, PAGE), kv  # as the engine builds it


def prefill_flops(model, B: int, P: int, N: int) -> float:
    """The FLOPs the module docstring counts."""
    cfg, T = model.cfg, B * N
    vocab_params = cfg.vocab_size * cfg.hidden_size  # the LM head: the last tokens only
    per_token = matmul_params(model) - (0 if cfg.tie_word_embeddings else vocab_params)  # a tied head is not counted
    if isinstance(cfg, K2Config):
        moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
        per_token += cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size * moe_layers
        # the form the model runs: plain from scratch and for chunks of PLAIN_CHUNK_TOKENS or more after cached
        # tokens (whose latent rows kv_b then expands as well), absorbed for shorter chunks
        plain = not P or N >= PLAIN_CHUNK_TOKENS
        dims = cfg.qk_head_dim + cfg.v_head_dim if plain else cfg.kv_cache_dim + cfg.kv_lora_rank
        per_token += (cfg.kv_lora_rank * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
                      * cfg.num_hidden_layers * P / N if plain else 0)  # the cached rows' expansion, per new token
    else:
        dims = 2 * cfg.head_dim
    attention = 2 * cfg.num_attention_heads * dims * B * N * (P + (N + 1) / 2)
    return 2 * T * per_token + 2 * B * vocab_params + attention * cfg.num_hidden_layers


def gpu_time_by_kind(run) -> tuple[dict[str, float], str]:
    """(milliseconds of GPU time per kind of kernel in one ``run()``, its 8 largest kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    by_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
    kinds = {k: 0.0 for k, _ in KINDS} | {"rest": 0.0}
    for name, ms in by_name.items():
        low = name.lower()
        kind = next((k for k, keys in KINDS if any(key in low for key in keys)), "rest")
        kinds[kind] += ms
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return kinds, ", ".join(f"{n[:60]} {ms:.1f} ms" for n, ms in top)


def graphed_ms(run) -> float | None:
    """Median of 3 replays of ``run`` from a CUDA graph in ms, or None (printed why) where it cannot be captured."""
    try:
        return time_us(run, warmup=0, iters=3, graph=True) / 1e3
    except (RuntimeError, torch.OutOfMemoryError) as e:
        print(f"# not captured: {str(e).splitlines()[0]}", flush=True)
        return None


def measure(model, cell: str) -> list[str]:
    B, P, N = parse_cell(cell)
    batch, kv = prefill_batch(model, B, P, N)
    last = batch.cu_q[1:].long() - 1  # [B]

    def run():
        hidden, _ = model(batch, kv)
        return model.logits(hidden[last])

    with torch.no_grad():
        t = time_us(run, warmup=1, iters=3) / 1e3  # the warm-up compiles the kernels and fills the allocator
        kinds, top = gpu_time_by_kind(run)
        tg = graphed_ms(run)
    floor = prefill_flops(model, B, P, N) / FLOOR_FLOP_PER_S * 1e3
    k2 = isinstance(model.cfg, K2Config)  # the targets are issue 21's, for the K2 shard
    target = None if P or not k2 else TARGETS.get(N, 2.0 if N >= 4096 else None)
    print(f"# {cell}: {t:.1f} ms, graphed {tg or 0:.1f} ms (floor {floor:.1f}); largest kernels: {top}", flush=True)
    return [cell, str(B * N), f"{t:.1f}", f"{tg:.1f}" if tg else "-", f"{floor:.1f}", f"{t / floor:.2f}x",
            f"{tg / floor:.2f}x" if tg else "-", f"<= {target}x" if target else "-",
            f"{B * N / t * 1e3:.0f}", " / ".join(f"{kinds[k]:.0f}" for k in ("attention", "experts", "GEMM", "rest"))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("k2", "smollm2-135m"), default="k2")
    ap.add_argument("--layers", type=int, default=61, help="K2's layers")
    ap.add_argument("--prompts", nargs="+", default=["1024", "4096", "16384", "65536", "8x2048", "2080", "2048+32"],
                    help="cells N (one prompt of N tokens), BxN (B prompts of N tokens) or P+N (N tokens after P "
                         "cached ones)")
    ap.add_argument("--label", default="", help="printed in the header (e.g. before / after)")
    ap.add_argument("--md", help="also write the table (with its header line) to this Markdown file")
    args = ap.parse_args()

    ceil = Ceilings.measure()
    head = (f"# k2_prefill {args.label} {datetime.date.today()} {torch.cuda.get_device_name()}: bf16 GEMM "
            f"{ceil.bf16_flop_per_s / 1e12:.0f} TFLOP/s measured (the floor takes {FLOOR_FLOP_PER_S / 1e12:.0f}); "
            f"{args.model}"
            f"{f', {args.layers} layers' if args.model == 'k2' else ''}; kdray from {Path(kdray.__file__).parent}")
    print(head, flush=True)
    if args.model == "k2":
        model = random_shard(shard_config(args.layers))
    else:
        with torch.device("cuda"):
            model = fill_random(LlamaModel(LlamaConfig(**SMOLLM2), torch.bfloat16))
    def oom_row(cell: str) -> list[str]:
        B, _, N = parse_cell(cell)
        return [cell, str(B * N), "OOM"] + ["-"] * (len(HEADER) - 3)

    rows = run_cells(args.prompts, lambda cell: measure(model, cell), oom_row)
    table = print_table(rows, HEADER)
    if args.md:
        Path(args.md).write_text(head + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
