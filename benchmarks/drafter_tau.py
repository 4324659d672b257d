"""Held-out acceptance per category: chain and DDTree tau of one or two drafters on a built corpus's held-out prompts.

Prompts: the first ``--prompts-per-category`` of each category in the corpus's ``heldout.jsonl`` (explanation,
code, math, writing, conversation, how-to), rendered with the target's chat template. Each drafter runs chain and
DDTree at each budget, greedy and at each temperature (seeded per prompt), all prompts batched. Tau is tokens per
target step, the bonus token counted (``kdray.train_drafter.tau_of``, as the training log's held-out tau).
Prints one Markdown table (rows: category x sampling x mode, then all categories together; columns: each drafter)
and writes it (``--md``) and the numbers (``--json``).

    python benchmarks/drafter_tau.py --corpus corpus/ --compare runs/drafter --json drafter_tau.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import target_and_drafter  # noqa: E402
from kdray.drafter_corpus.files import heldout_by_category
from kdray.engine.args import DEFAULT_MODEL
from kdray.engine.request import SamplingParams
from kdray.model.dflash import DFlashDrafter
from kdray.train_drafter import encode_prompt, spec_llm, tau_of

ALL = "all"  # the row of every category together


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, required=True, help="a corpus made by python -m kdray.drafter_corpus build")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--drafter", help="DFlash checkpoint directory (default: the preset's built-in drafter)")
    ap.add_argument("--compare", help="a second DFlash checkpoint directory, measured beside --drafter")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256], help="DDTree budgets")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7], help="0: greedy")
    ap.add_argument("--prompts-per-category", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed of the first prompt (the next: +1, ...)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    return ap.parse_args(argv)


def category_prompts(corpus: Path, target, per_category: int) -> dict[str, list[list[int]]]:
    """Token ids of the first ``per_category`` held-out prompts of each category."""
    return {c: [encode_prompt(target.tokenizer, r["prompt"], target.config.vocab_size) for r in rows[:per_category]]
            for c, rows in heldout_by_category(corpus).items()}


def measure(target, drafter: DFlashDrafter, prompts: dict[str, list[list[int]]], args) -> dict:
    """Tau per (mode, temperature, category) -> ``{mode: {temperature: {category or "all": tau}}}``."""
    flat = [p for ps in prompts.values() for p in ps]
    spans, start = {}, 0
    for c, ps in prompts.items():
        spans[c] = slice(start, start + len(ps))
        start += len(ps)
    out = {}
    modes = [("chain", max(args.budgets))] + [(f"ddtree {b}", b) for b in args.budgets]  # chain: budget sizes pages
    for mode, budget in modes:
        llm = spec_llm(target, drafter, flat, args.max_tokens, mode.split()[0], budget)
        out[mode] = {}
        for t in args.temperatures:
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=t, seed=args.seed + i)
                      for i in range(len(flat))]
            res = llm.generate(prompt_token_ids=flat, sampling_params=params, use_tqdm=False)
            out[mode][t] = {**{c: tau_of(res[s]) for c, s in spans.items()}, ALL: tau_of(res)}
            print(f"{mode}, temperature {t}: tau {out[mode][t][ALL]:.2f}", file=sys.stderr)
    return out


def table(results: dict[str, dict], categories: list[str], header: str) -> str:
    """Rows category x sampling x mode, a tau column per drafter (and the second's ratio to the first)."""
    names = list(results)
    first = results[names[0]]
    ratio = len(names) == 2
    lines = [header, "", "| category | sampling | mode | " + " | ".join(f"tau {n}" for n in names)
             + (f" | {names[1]} / {names[0]} |" if ratio else " |"),
             "|---|---|---|" + "---|" * (len(names) + ratio)]
    for c in [*categories, ALL]:
        for t in next(iter(first.values())):
            for mode in first:
                taus = [results[n][mode][t][c] for n in names]
                cells = [f"{x:.2f}" for x in taus] + ([f"{taus[1] / taus[0]:.2f}x"] if ratio else [])
                lines.append(f"| {c} | {'greedy' if t == 0 else f'T={t}'} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    target, dtype, drafter = target_and_drafter(args)
    paths = {"shipped" if args.drafter is None else Path(drafter).name: drafter}
    if args.compare:
        name = Path(args.compare).name
        paths[name if name not in paths else args.compare] = args.compare
    prompts = category_prompts(args.corpus, target, args.prompts_per_category)
    results = {}
    for name, path in paths.items():
        print(f"drafter {name} ({path})", file=sys.stderr)
        results[name] = measure(target, DFlashDrafter.from_pretrained(path, dtype, args.device), prompts, args)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    header = (f"drafter tau: {args.model}, {str(dtype)[6:]}, {device}; held-out prompts of {args.corpus} "
              f"({', '.join(f'{c} {len(p)}' for c, p in prompts.items())}), {args.max_tokens} new tokens; "
              f"drafters: {', '.join(f'{n} = {p}' for n, p in paths.items())}; {datetime.date.today()}")
    md = table(results, list(prompts), header)
    print(md)
    if args.md:
        args.md.write_text(md + "\n")
    if args.json:
        args.json.write_text(json.dumps({"header": header, "drafters": paths, "prompts": {c: len(p) for c, p in
                                         prompts.items()}, "tau": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
