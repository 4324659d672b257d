"""End to end on a real target: AR, chain (DFlash) and DDTree over tree budgets, and a losslessness check.

Rows: AR, chain, DDTree at each budget. Columns: tau (tokens per target step) and tokens/s at batch 1 and at
batch 16, greedy, on held-out prompts (``kdray.train_drafter``'s held-out topics of ``pydoc_data.topics``).
Each timed run follows an identical warm-up run (kernels compiled, CUDA graphs captured). Prints one
Markdown table and writes it (``--md``), the numbers (``--json``) and a PNG (``--png``: tau and tokens/s
against the budget, AR and chain as reference lines).

Losslessness: greedy DDTree against greedy AR on ``--lossless-prompts`` held-out prompts; a divergence is
reported with the target's logit margin (top-1 minus top-2) at that token.

    python benchmarks/e2e.py --model smollm2-135m --png benchmarks/results/e2e.png
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import target_and_drafter  # noqa: E402
from kdray.engine.args import AUTO_MAX_NODES
from kdray.engine.request import SamplingParams
from kdray.llm import LLM
from kdray.model.dflash import DFlashDrafter
from kdray.train_drafter import kv_pages, margin_at, topic_prompts


def budget(value: str) -> int | str:
    return value if value == "auto" else int(value)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", help="DFlash checkpoint directory (default: the preset's built-in drafter)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--budgets", type=budget, nargs="+", default=[16, 32, 64, 128, 256, "auto"],
                    help="DDTree budgets (0: a DDTree engine that verifies no draft; auto: chosen each step)")
    ap.add_argument("--batch", type=int, default=16, help="the batched column")
    ap.add_argument("--batch1-prompts", type=int, default=4, help="prompts decoded one at a time")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lossless-prompts", type=int, default=20)
    ap.add_argument("--lossless-tokens", type=int, default=128)
    ap.add_argument("--lossless-budgets", type=budget, nargs="+", default=[64, 256])
    ap.add_argument("--cuda-graphs", choices=("on", "off"), default="on", help="on cuda (default: on)")
    ap.add_argument("--png", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    return ap.parse_args(argv)


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, one_at_a_time: bool) -> dict:
    """Generate (greedy) after a warm-up run of the first group -> tokens, steps, seconds and the outputs."""
    params = SamplingParams(max_tokens=max_tokens)
    groups = [[p] for p in prompts] if one_at_a_time else [prompts]
    tokens = steps = accepted = engine_steps = 0
    seconds, device, outputs = 0.0, 0.0, []
    llm.generate(prompt_token_ids=groups[0], sampling_params=params, use_tqdm=False)
    for g in groups:
        sync()
        t = time.perf_counter()
        res = llm.generate(prompt_token_ids=g, sampling_params=params, use_tqdm=False)
        sync()
        seconds += time.perf_counter() - t
        outputs += [r.outputs[0].token_ids for r in res]
        tokens += sum(len(r.outputs[0].token_ids) for r in res)
        steps += sum(r.metrics["steps"] for r in res)
        accepted += sum(r.metrics["accepted_tokens"] for r in res)
        engine_steps += 1 + max(r.metrics["steps"] for r in res)  # the prefill, then the batch's steps
        device += sum(sum(r.metrics["seconds"].values()) for r in res)  # each step's device time, shared out
    return {"tokens": tokens, "steps": steps, "seconds": seconds, "tau": accepted / max(1, steps),
            "tok_s": tokens / seconds, "outputs": outputs,
            "host_ms": 1e3 * (seconds - device) / engine_steps, "gpu_busy": device / seconds}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def lossless_report(target, prompts, ar_out, dd_out) -> dict:
    """First divergence of each prompt's DDTree output from AR, with the target's margin there."""
    diverged = []
    for k, (p, a, d) in enumerate(zip(prompts, ar_out, dd_out)):
        if a == d:
            continue
        i = next((j for j, (x, y) in enumerate(zip(a, d)) if x != y), min(len(a), len(d)))
        chosen = [x[i] for x in (a, d) if i < len(x)]
        m = margin_at(target, p + a[:i], chosen)
        diverged.append({"prompt": k, "token": i, "ar": a[i] if i < len(a) else None,
                         "ddtree": d[i] if i < len(d) else None, **m})
    return {"prompts": len(prompts), "identical": len(prompts) - len(diverged), "divergences": diverged}


def table(rows: list[dict], header: str, batch: int) -> str:
    ar = next(r for r in rows if r["mode"] == "ar")
    lines = [header, "", f"| mode | budget | tau | tok/s batch 1 | vs AR | host ms/step | GPU-busy | "
                         f"tok/s batch {batch} | vs AR | host ms/step | GPU-busy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b1, bn = r["batch1"], r["batchN"]
        lines.append(f"| {r['mode']} | {'-' if r['budget'] is None else r['budget']} | {b1['tau']:.2f} | {b1['tok_s']:.1f} | "
                     f"{b1['tok_s'] / ar['batch1']['tok_s']:.2f}x | {b1['host_ms']:.2f} | {b1['gpu_busy']:.0%} | "
                     f"{bn['tok_s']:.1f} | {bn['tok_s'] / ar['batchN']['tok_s']:.2f}x | {bn['host_ms']:.2f} | "
                     f"{bn['gpu_busy']:.0%} |")
    lines.append("")
    lines.append("host ms/step: wall time per engine step not covered by the step's device time (the host work the "
                 "GPU waits for); GPU-busy: the steps' device time over wall time (prefill device time counts as "
                 "idle, so both are conservative).")
    return "\n".join(lines)


def plot(rows: list[dict], title: str, batch: int, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tree = [r for r in rows if r["mode"] == "ddtree" and isinstance(r["budget"], int) and r["budget"] > 0]
    ref = {r["mode"]: r for r in rows if r["mode"] in ("ar", "chain")}
    budgets = [r["budget"] for r in tree]
    fig, (ax_tau, ax_tps) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_tau.plot(budgets, [r["batch1"]["tau"] for r in tree], "o-", color="C0", label="DDTree")
    for mode, style in (("chain", "--"), ("ar", ":")):
        if mode in ref:
            ax_tau.axhline(ref[mode]["batch1"]["tau"], ls=style, color="gray", label=mode)
    ax_tau.set(xlabel="tree budget (draft nodes)", ylabel="tau (tokens per step)", xscale="log")
    for col, color, name in (("batch1", "C0", "batch 1"), ("batchN", "C1", f"batch {batch}")):
        ax_tps.plot(budgets, [r[col]["tok_s"] for r in tree], "o-", color=color, label=f"DDTree, {name}")
        for mode, style in (("chain", "--"), ("ar", ":")):
            if mode in ref:
                ax_tps.axhline(ref[mode][col]["tok_s"], ls=style, color=color, alpha=0.7, label=f"{mode}, {name}")
    ax_tps.set(xlabel="tree budget (draft nodes)", ylabel="tokens / s", xscale="log")
    for ax in (ax_tau, ax_tps):
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def bench(args, target, drafter, graphs: bool, prompts: dict, pages: int, on_row) -> tuple[list, dict]:
    """Every configuration in turn -> (rows, losslessness reports); ``on_row(rows, lossless)`` after each."""
    rows, lossless, ar_outputs = [], {}, None
    for mode, budget in [("ar", None), ("chain", None)] + [("ddtree", b) for b in args.budgets]:
        llm = LLM(model=target, drafter=None if mode == "ar" else drafter, spec=mode,
                  budget=64 if budget is None else budget,
                  max_num_seqs=max(args.batch, args.lossless_prompts), num_pages=pages, cuda_graphs=graphs)
        row = {"mode": mode, "budget": budget, "batch1": run(llm, prompts["b1"], args.max_tokens, True),
               "batchN": run(llm, prompts["bN"], args.max_tokens, False)}
        if llm.engine.policy is not None:
            row["policy"] = llm.engine.policy.report()
        if mode == "ar" or budget in args.lossless_budgets:
            outs = run(llm, prompts["lossless"], args.lossless_tokens, False)["outputs"]
            if mode == "ar":
                ar_outputs = outs
            else:
                lossless[budget] = lossless_report(target, prompts["lossless"], ar_outputs, outs)
        del llm
        gc.collect()
        for col in ("batch1", "batchN"):
            row[col].pop("outputs")
        rows.append(row)
        print(f"{mode} {budget or ''}: tau {row['batch1']['tau']:.2f}, {row['batch1']['tok_s']:.1f} tok/s (batch 1), "
              f"{row['batchN']['tok_s']:.1f} tok/s (batch {len(prompts['bN'])})", file=sys.stderr)
        on_row(rows, lossless)
    return rows, lossless


def main(argv=None) -> int:
    args = parse_args(argv)
    target, dtype, drafter_path = target_and_drafter(args)
    drafter = DFlashDrafter.from_pretrained(drafter_path, dtype, args.device)
    heldout = topic_prompts(target.tokenizer, target.config.vocab_size)[1]
    prompts = {"b1": heldout[:args.batch1_prompts], "bN": heldout[:args.batch],
               "lossless": heldout[:args.lossless_prompts]}
    pages = kv_pages([len(p) for p in heldout[:max(args.batch, args.lossless_prompts)]],
                     max(args.max_tokens, args.lossless_tokens), AUTO_MAX_NODES + 17)
    graphs = args.device == "cuda" and args.cuda_graphs == "on"
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    title = (f"e2e: {args.model} + DFlash drafter `{Path(drafter_path).name}`, {str(dtype)[6:]}, {gpu}, "
             f"{'CUDA graphs' if graphs else 'eager (no CUDA graphs)'}; greedy, {args.max_tokens} new tokens, "
             f"held-out prompts ({len(prompts['b1'])} one at a time, {len(prompts['bN'])} batched); "
             f"{datetime.date.today()}")

    def save(rows, lossless):
        if args.json:
            args.json.write_text(json.dumps({"header": title, "rows": rows, "lossless": lossless}, indent=1))

    rows, lossless = bench(args, target, drafter, graphs, prompts, pages, save)
    md = table(rows, title, len(prompts["bN"]))
    notes = [f"losslessness, ddtree budget {budget}: {r['identical']}/{r['prompts']} held-out prompts "
             f"x {args.lossless_tokens} tokens identical to greedy AR"
             + "".join(f"; prompt {d['prompt']} diverges at token {d['token']} (AR {d['ar']}, DDTree {d['ddtree']}, "
                       f"target top-1/top-2 logit margin {d['margin']:.3f})" for d in r["divergences"])
             for budget, r in lossless.items()]
    md = "\n\n".join([md, *notes])
    print(md)
    if args.md:
        args.md.write_text(md + "\n")
    if args.png:
        plot(rows, title.split(";")[0], len(prompts["bN"]), args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
