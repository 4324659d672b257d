"""``build``: read the sources, cap them, split by source document, deduplicate, turn seeds into prompts, and
write ``prompts.jsonl`` (training), ``heldout.jsonl`` and ``manifest.json`` to the output directory."""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import sys
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from kdray.drafter_corpus.dedup import Dedup
from kdray.drafter_corpus.sources import (MissingSource, Seed, docstring_seeds, foldoc_seeds, man_seeds, pydoc_seeds,
                                          word_seeds)
from kdray.drafter_corpus.templates import math_seeds, seed_prompts

SOURCES = ("pydoc", "docstrings", "man", "foldoc", "words", "math")
TARGET_TOKENS = 20_000_000
TOKENS_PER_RESPONSE = 200  # the shipped drafter's run: 410k response tokens from 2048 prompts at 256 new tokens


def positive(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number >= 1")
    return int(text)


def add_arguments(ap: argparse.ArgumentParser):
    ap.add_argument("--out", type=Path, required=True, help="corpus directory (created; its files are replaced)")
    ap.add_argument("--seed", type=int, default=0, help="decides the caps' samples, the split, templates, order")
    ap.add_argument("--sources", default=",".join(SOURCES), help=f"comma-separated, of {', '.join(SOURCES)}")
    ap.add_argument("--max-chars", type=positive, default=1200, help="longest passage in a prompt")
    ap.add_argument("--max-per-source", type=positive, default=20000, help="seeds kept per source")
    ap.add_argument("--math-problems", type=positive, default=8000, help="math word problems generated")
    ap.add_argument("--max-per-doc", type=positive, default=300, help="seeds kept per source document")
    ap.add_argument("--prompts-per-seed", type=positive, default=2, help="templates applied to each seed")
    ap.add_argument("--heldout-fraction", type=float, default=0.05, help="of each source's documents")
    ap.add_argument("--heldout-sources", default="", help="comma-separated sources held out whole")
    ap.add_argument("--near-threshold", type=float, default=0.8, help="Jaccard similarity of near-duplicates")
    ap.add_argument("--target-tokens", type=positive, default=TARGET_TOKENS, help="response tokens the corpus is for")
    ap.add_argument("--tokens-per-response", type=positive, default=TOKENS_PER_RESPONSE,
                    help="assumed mean response length, for the estimate of prompts needed")
    ap.add_argument("--packages", help="docstrings: comma-separated distributions (default: all installed, "
                                       "and the standard library as 'python')")
    ap.add_argument("--man-dir", type=Path, default=Path("/usr/share/man"))
    ap.add_argument("--foldoc", type=Path, default=Path("/usr/share/dictd/foldoc"), help="dictd path stem")
    ap.add_argument("--words-file", type=Path, default=Path("/usr/share/dict/words"))


def source_seeds(name: str, args: argparse.Namespace) -> Iterator[Seed]:
    if name == "pydoc":
        return pydoc_seeds(args.max_chars)
    if name == "docstrings":
        return docstring_seeds(args.max_chars, args.packages.split(",") if args.packages else None)
    if name == "man":
        return man_seeds(args.man_dir, args.max_chars)
    if name == "foldoc":
        return foldoc_seeds(args.foldoc, args.max_chars)
    if name == "words":
        return word_seeds(args.words_file)
    return math_seeds(args.math_problems, args.seed)


def capped(seeds: list[Seed], per_doc: int, per_source: int, seed: int) -> list[Seed]:
    """At most ``per_doc`` seeds of each document, then ``per_source`` in all: random samples, order kept."""
    by_doc: dict[str, list[int]] = {}
    for i, s in enumerate(seeds):
        by_doc.setdefault(s.doc, []).append(i)
    kept = sorted(i for doc, idx in by_doc.items()
                  for i in (idx if len(idx) <= per_doc else random.Random(f"{seed}:{doc}").sample(idx, per_doc)))
    if len(kept) > per_source:
        kept = sorted(random.Random(f"{seed}:{seeds[0].source}").sample(kept, per_source))
    return [seeds[i] for i in kept]


def heldout_doc(doc: str, fraction: float, seed: int) -> bool:
    """Whether document ``doc`` is held out (a hash of the seed and the name: the same on every machine)."""
    return zlib.crc32(f"{seed}:{doc}".encode()) % 100_000 < fraction * 100_000


def file_facts(path: Path) -> dict:
    data = path.read_bytes()
    return {"lines": data.count(b"\n"), "sha256": hashlib.sha256(data).hexdigest()}


def counts(records: list[dict]) -> dict:
    return {"prompts": len(records), "documents": len({r["doc"] for r in records}),
            "by_source": dict(sorted(Counter(r["source"] for r in records).items())),
            "by_category": dict(sorted(Counter(r["category"] for r in records).items())),
            "by_source_category": {f"{s}/{c}": n for (s, c), n in sorted(Counter((r["source"], r["category"])
                                                                                  for r in records).items())}}


def build(args: argparse.Namespace) -> dict:
    """Build the corpus in ``args.out``; returns the manifest (also written as ``manifest.json``)."""
    t0 = time.perf_counter()
    names = [s for s in args.sources.split(",") if s]
    held_sources = {s for s in args.heldout_sources.split(",") if s}
    for bad in sorted((set(names) | held_sources) - set(SOURCES)):
        raise ValueError(f"unknown source '{bad}': choose from {', '.join(SOURCES)}")
    if not 0 <= args.heldout_fraction < 1:
        raise ValueError(f"--heldout-fraction {args.heldout_fraction}: give a fraction in [0, 1)")
    sources, seeds, timing = {}, {"train": [], "heldout": []}, {}
    for name in names:
        t = time.perf_counter()
        try:
            found = list(source_seeds(name, args))
        except MissingSource as e:
            print(f"drafter-corpus: source {name} missing: {e}", file=sys.stderr)
            sources[name] = {"status": "missing", "reason": str(e)}
            continue
        kept = capped(found, args.max_per_doc, args.max_per_source, args.seed) if found else []
        for s in kept:
            held = name in held_sources or heldout_doc(s.doc, args.heldout_fraction, args.seed)
            seeds["heldout" if held else "train"].append(s)
        sources[name] = {"status": "ok", "seeds_found": len(found), "seeds_kept": len(kept),
                         "documents": len({s.doc for s in kept})}
        timing[name] = round(time.perf_counter() - t, 1)
        print(f"drafter-corpus: {name}: {len(found)} seeds, {len(kept)} kept ({timing[name]} s)", file=sys.stderr)
    if not any(seeds.values()):
        raise ValueError(f"no seeds: every source of --sources {args.sources} is missing or empty "
                         "(scripts/corpus_sources.sh installs the Debian ones)")

    t = time.perf_counter()
    seed_dedup, prompt_dedup = Dedup(args.near_threshold), Dedup(None)
    drops: Counter = Counter()
    records: dict[str, list[dict]] = {}
    for split in ("train", "heldout"):  # training first: a held-out seed that repeats a training one goes
        records[split] = []
        for s in seeds[split]:
            dup = seed_dedup.duplicate(s.fields["text"])
            if dup:
                drops[f"{split}/{s.source}/{dup}"] += 1
                continue
            rng = random.Random(f"{args.seed}:{s.doc}:{s.fields['text']}")
            for category, prompt in seed_prompts(s, args.prompts_per_seed, rng):
                if prompt_dedup.duplicate(prompt):
                    drops[f"{split}/{s.source}/prompt"] += 1
                else:
                    records[split].append({"id": hashlib.blake2b(prompt.encode(), digest_size=8).hexdigest(),
                                           "source": s.source, "doc": s.doc, "kind": s.kind, "category": category,
                                           "prompt": prompt})
        random.Random(f"{args.seed}:{split}").shuffle(records[split])
    timing["dedup_and_prompts"] = round(time.perf_counter() - t, 1)

    args.out.mkdir(parents=True, exist_ok=True)
    files = {"train": "prompts.jsonl", "heldout": "heldout.jsonl"}
    for split, name in files.items():
        with open(args.out / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records[split])
    needed = math.ceil(args.target_tokens / args.tokens_per_response)
    manifest = {
        "builder": "python -m kdray.drafter_corpus build", "seed": args.seed, "python": platform.python_version(),
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in sorted(vars(args).items())
                    if k not in ("out", "command")},
        "sources": sources,
        "dedup": {"dropped": dict(sorted(drops.items())), "near_threshold": args.near_threshold,
                  "method": "seeds: exact after normalisation, then MinHash (64 permutations, 16 bands) of word "
                            "5-grams; prompts: exact after normalisation"},
        "split": {"by": "source document", "heldout_fraction": args.heldout_fraction,
                  "heldout_sources": sorted(held_sources), "train": counts(records["train"]),
                  "heldout": counts(records["heldout"])},
        "files": {name: file_facts(args.out / name) for name in files.values()},
        "estimate": {"target_tokens": args.target_tokens, "tokens_per_response": args.tokens_per_response,
                     "prompts_needed": needed, "train_prompts": len(records["train"]),
                     "enough": len(records["train"]) >= needed},
        "timing_seconds": {**timing, "total": round(time.perf_counter() - t0, 1)},
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    return manifest
