"""One TP8 shard of Kimi K2 at real dimensions: a verify pass replayed from a CUDA graph, against its floor.

    python -m benchmarks.k2_step [--layers 61] [--prefix 4096] [--grid 1x0 1x16 1x64 1x256 8x0 32x64] [--md FILE]

The shard is ``kdray.model.k2.K2Model`` built from a ``K2Config`` at K2's dimensions divided for TP8 (8 of 64
heads, expert width 2048/8, dense width 18432/8, vocabulary 163840/8; q/kv down-projections and the router
whole), its parameters filled with random values in place on the GPU (INT4 experts as random bytes: every
nibble uniform, so no expert row shares a common-mode part). Tokens route apart in the first layers; deeper, the
random attention gives a batch's tokens a common part that grows with depth, and they lean to the same experts
(RESULTS.md, session 58: at layer 50 of a 1024-token prefill, 724 tokens choose one expert).
A grid cell ``BxN`` is a batch of B sequences, each verifying 1 + N tokens (the bonus token and an N-node draft;
N = 0 is plain decoding) after a cached prefix of ``--prefix`` tokens; the draft is a chain (a tree of the same
size costs the same: every kernel reads the whole mask tile). The pass ends with the vocabulary-parallel logits.

Columns: time, the median of graph replays; floor = max(bytes / copy rate, FLOPs / bf16 GEMM rate), both rates
measured in the same run, bytes = every non-expert weight at 2 bytes per parameter (the embedding's used rows
only) + the routed experts the batch touches in each layer (counted from its actual routing) + the latent KV
read and written (activations not counted), FLOPs = 2 x parameters x tokens for every matmul (routed experts
per routed slot) + the absorbed attention's 2 x heads x keys x (576 + 512) per query; kernels per layer =
kernels, copies and memsets of one eager pass (torch.profiler) / layers; the projected TP8 step = shard time +
2 x layers all-reduces of the hidden states. A single GPU cannot measure NCCL, so the all-reduce times are those
measured on two H200s inside a graph (issue 12): 11.7 us for 1 token and 34.7 us for 257, linear in the token
count (an extrapolation past 257 tokens); --allreduce-us overrides them.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH: a --base kdray can come first
import kdray  # noqa: E402
from benchmarks.common import Ceilings, print_table, run_cells  # noqa: E402
from kdray.config import K2Config  # noqa: E402
from kdray.model.batch import ForwardBatch, causal_tree_mask  # noqa: E402
from kdray.model.dummy import fill_random  # noqa: E402
from kdray.model.k2 import K2Model, MoE  # noqa: E402

PAGE = 64
TARGETS = {(1, 0): 1.5, (32, 64): 1.5}  # time / floor targets of issue 12; 1xN trees: 1.3
HEADER = ["batch x nodes", "tokens", "experts / layer", "time ms", "floor ms", "bound", "time / floor", "target",
          "kernels / layer", "TP8 step ms"]


def shard_hf_config(layers: int) -> dict:
    """K2 (Thinking: INT4 experts, YaRN 64) as one TP8 shard computes it, as an HF ``config.json``'s dict."""
    return {
        "model_type": "kimi_k2", "vocab_size": 163840 // 8, "hidden_size": 7168, "intermediate_size": 18432 // 8,
        "moe_intermediate_size": 2048 // 8, "num_hidden_layers": layers, "first_k_dense_replace": 1,
        "num_attention_heads": 64 // 8, "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "routed_scaling_factor": 2.827, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
        "max_position_embeddings": 262144, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
            "g": {"weights": {"num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 32}}}}}


def shard_config(layers: int) -> K2Config:
    """The shard's parsed config."""
    return K2Config.from_hf(shard_hf_config(layers))


def random_shard(cfg: K2Config) -> K2Model:
    """The shard with random weights made in place on the GPU (no host copy of the ~65 GB), laid out as a load
    leaves them there."""
    with torch.device("cuda"):
        return fill_random(K2Model(cfg, torch.bfloat16))


def weight_bytes(model: K2Model, cfg: K2Config) -> tuple[int, int, int]:
    """(non-expert weight bytes at 2 bytes per parameter without the embedding, embedding bytes per token,
    bytes of one routed expert)."""
    expert_names = ("w13_packed", "w13_scale", "w2_packed", "w2_scale")
    dense = sum(2 * t.numel() for n, t in list(model.named_parameters()) + list(model.named_buffers())
                if n.split(".")[-1] not in expert_names and "embed_tokens" not in n and not n.endswith("inv_freq"))
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    expert = sum(getattr(moe, n)[0].numel() * getattr(moe, n).element_size() for n in expert_names)
    return dense, 2 * cfg.hidden_size, expert


def matmul_params(model: K2Model) -> int:
    """Parameters that multiply every token (all 2-D float weights but the embedding and the routed experts)."""
    return sum(t.numel() for n, t in model.named_parameters() if t.dim() == 2 and t.is_floating_point()
               and "embed_tokens" not in n)


def verify_batch(cfg: K2Config, B: int, N: int, prefix: int, device: str = "cuda",
                 dtype: torch.dtype = torch.bfloat16):
    """B sequences of 1 + N tokens after ``prefix`` cached positions: the batch and a random latent cache."""
    g = torch.Generator(device).manual_seed(B * 1000 + N)
    q = N + 1
    pages = -(-(prefix + q) // PAGE)
    kv = torch.empty(cfg.num_hidden_layers, B * pages, PAGE, cfg.kv_cache_dim, dtype=dtype, device=device)
    kv.normal_(generator=g)  # [layers, P, S, 576]
    table = torch.arange(B * pages, dtype=torch.int32, device=device).view(B, pages)
    ids = torch.randint(0, cfg.vocab_size, (B * q,), device=device, generator=g)
    positions = (prefix + torch.arange(q, device=device)).repeat(B)
    return ForwardBatch.build(ids, positions, [q] * B, [prefix] * B, table, PAGE, causal_tree_mask([q] * B, device)), kv


def touched_experts(model: K2Model, run) -> list[int]:
    """Distinct experts each MoE layer routes to during ``run()`` (sigmoid + bias top-k, recomputed in torch)."""
    counts, hooks = [], []

    def count(moe, args):
        x = args[0]
        choice = torch.sigmoid(x.float() @ moe.gate.float().t()) + moe.e_score_correction_bias
        counts.append(choice.topk(moe.cfg.num_experts_per_tok, dim=-1).indices.unique().numel())

    for m in model.modules():
        if isinstance(m, MoE):
            hooks.append(m.register_forward_pre_hook(count))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return counts


def profile(run) -> tuple[int, str]:
    """(GPU activities of one eager ``run()``: kernels, copies, memsets; the 12 largest by device time)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in events:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us()
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return len(events), ", ".join(f"{n[:48]} {t / 1e3:.2f} ms" for n, t in top)


def replay_ms(run) -> float:
    """Median of CUDA-graph replays of ``run()`` (captured once; replays for ~1 s, 3 to 25 of them)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    gc.collect()
    gc.disable()  # collecting an old graph during the capture would invalidate it
    try:
        with torch.cuda.stream(stream):
            run()  # warm-up on the capture stream
            with torch.cuda.graph(graph):
                run()
    finally:
        gc.enable()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times, start = [], time.perf_counter()
    while len(times) < 3 or (len(times) < 25 and time.perf_counter() - start < 1.0):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def allreduce_us(tokens: int, one: float, t257: float) -> float:
    return one + (tokens - 1) * (t257 - one) / 256


def parse_cell(cell: str) -> tuple[int, int]:
    """``BxN`` -> (B sequences, N draft nodes each)."""
    B, N = (int(v) for v in cell.split("x"))
    return B, N


def measure(model: K2Model, cfg: K2Config, ceil: Ceilings, cell: str, args) -> list[str]:
    """One grid cell ``BxN``: time it, count what it must move and compute, return its table row."""
    B, N = parse_cell(cell)
    batch, kv = verify_batch(cfg, B, N, args.prefix)
    T = B * (N + 1)

    def run():
        hidden, _ = model(batch, kv)
        return model.logits(hidden)

    with torch.no_grad():
        run()  # compiles kernels, warms the allocator
        touched = touched_experts(model, run)
        kernels, top = profile(run)
        t = replay_ms(run)
    dense_bytes, embed_row_bytes, expert_bytes = weight_bytes(model, cfg)
    kv_bytes = cfg.num_hidden_layers * B * (args.prefix + 2 * (N + 1)) * cfg.kv_cache_dim * 2
    moved = dense_bytes + T * embed_row_bytes + sum(touched) * expert_bytes + kv_bytes
    keys = args.prefix + (N + 2) / 2  # prefix plus the chain's mean visible length
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    flops = (2 * T * matmul_params(model)
             + 2 * T * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size * moe_layers
             + 2 * cfg.num_attention_heads * T * keys * (cfg.kv_cache_dim + cfg.kv_lora_rank) * cfg.num_hidden_layers)
    t_bytes, t_flops = moved / ceil.copy_bytes_per_s * 1e3, flops / ceil.bf16_flop_per_s * 1e3
    floor = max(t_bytes, t_flops)
    step = t + 2 * cfg.num_hidden_layers * allreduce_us(T, *args.allreduce_us) / 1e3
    target = TARGETS.get((B, N), 1.3 if B == 1 and N > 0 else None)
    print(f"# {cell}: {t:.2f} ms (floor {floor:.2f}: bytes {t_bytes:.2f}, FLOPs {t_flops:.2f}); {kernels} GPU "
          f"activities per eager pass; top: {top}", flush=True)
    return [f"{B}x{N}", str(T), f"{statistics.mean(touched):.0f}", f"{t:.2f}", f"{floor:.2f}",
            "bytes" if t_bytes >= t_flops else "FLOPs", f"{t / floor:.2f}x", f"<= {target}x" if target else "-",
            f"{kernels / cfg.num_hidden_layers:.1f}", f"{step:.2f}"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--grid", nargs="+", default=["1x0", "1x16", "1x64", "1x256", "8x0", "32x64"],
                    help="cells BxN: B sequences verifying 1 + N tokens each")
    ap.add_argument("--allreduce-us", type=float, nargs=2, default=(11.7, 34.7), metavar=("ONE", "T257"),
                    help="all-reduce time of 1 and of 257 tokens' hidden states (us)")
    ap.add_argument("--label", default="", help="printed in the header (e.g. before / after)")
    ap.add_argument("--md", help="also write the table (with its header line) to this Markdown file")
    args = ap.parse_args()

    ceil = Ceilings.measure()
    head = (f"# k2_step {args.label} {datetime.date.today()} {torch.cuda.get_device_name()}: copy "
            f"{ceil.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 GEMM {ceil.bf16_flop_per_s / 1e12:.0f} TFLOP/s; "
            f"{args.layers} layers, prefix {args.prefix}; kdray from {Path(kdray.__file__).parent}")
    print(head, flush=True)
    cfg = shard_config(args.layers)
    model = random_shard(cfg)
    dense_bytes, _, expert_bytes = weight_bytes(model, cfg)
    print(f"# weights: {dense_bytes / 1e9:.2f} GB non-expert, {expert_bytes / 1e6:.2f} MB per expert, "
          f"{torch.cuda.memory_allocated() / 1e9:.1f} GB allocated", flush=True)

    def oom_row(cell: str) -> list[str]:  # a cell past the GPU's memory (32x64 on an 80 GB H100)
        B, N = parse_cell(cell)
        return [cell, str(B * (N + 1)), "-", "OOM"] + ["-"] * (len(HEADER) - 4)

    rows = run_cells(args.grid, lambda cell: measure(model, cfg, ceil, cell, args), oom_row)
    table = print_table(rows, HEADER)
    if args.md:
        Path(args.md).write_text(head + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
