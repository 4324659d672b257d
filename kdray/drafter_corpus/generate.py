"""``generate``: the target's own greedy responses to a built corpus's training prompts, in shards of
``--shard-size`` prompts (``responses/shard-NNNNN.jsonl``, each written whole, then renamed), so that a rerun
skips the finished shards; it stops once the finished shards hold ``--target-tokens`` response tokens.
``responses/generation.json`` records the settings (a rerun must match them) and the token counts."""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

from kdray.drafter_corpus.build import positive
from kdray.drafter_corpus.files import SETTINGS_FILE, corpus_file, read_jsonl, shard_path
from kdray.engine.args import DEFAULT_MODEL


def add_arguments(ap: argparse.ArgumentParser):
    from kdray.train_drafter import GEN_BATCH, MAX_NEW_TOKENS

    ap.add_argument("--corpus", type=Path, required=True, help="a directory made by `build`")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="target: a preset, HF checkpoint dir or GGUF file")
    ap.add_argument("--device", help="cuda or cpu (default: cuda when a GPU is visible)")
    ap.add_argument("--dtype", help="target dtype (default: bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--max-new-tokens", type=positive, default=MAX_NEW_TOKENS, help="response length cap")
    ap.add_argument("--batch", type=positive, default=GEN_BATCH, help="prompts decoded together (at most)")
    ap.add_argument("--shard-size", type=positive, default=4096, help="prompts per shard (the unit of resuming)")
    ap.add_argument("--target-tokens", type=positive, help="stop at this many response tokens (default: the manifest's)")
    ap.add_argument("--max-shards", type=positive, help="shards to generate in this run (default: until the target)")


def tally(records: list[dict]) -> dict:
    """Prompts and response tokens, in all and per category."""
    prompts, tokens = Counter(), Counter()
    for r in records:
        prompts[r["category"]] += 1
        tokens[r["category"]] += len(r["response_ids"])
    return {"prompts": sum(prompts.values()), "response_tokens": sum(tokens.values()),
            "by_category": {c: {"prompts": prompts[c], "response_tokens": tokens[c]} for c in sorted(prompts)}}


def generate(args: argparse.Namespace) -> dict:
    """Generate the missing shards; returns (and writes) the generation record."""
    import torch

    from kdray.engine.request import SamplingParams
    from kdray.model.loader import load_target, parse_dtype
    from kdray.train_drafter import ar_llm, encode_prompt

    manifest = json.loads(corpus_file(args.corpus, "manifest.json").read_text())
    prompts_path = corpus_file(args.corpus, "prompts.jsonl")
    prompts = read_jsonl(prompts_path)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = parse_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    settings = {"model": args.model, "dtype": str(dtype).removeprefix("torch."), "max_new_tokens": args.max_new_tokens,
                "shard_size": args.shard_size, "prompts_sha256": hashlib.sha256(prompts_path.read_bytes()).hexdigest()}
    out = args.corpus / "responses"
    settings_path = out / SETTINGS_FILE
    if settings_path.is_file():
        before = json.loads(settings_path.read_text())["settings"]
        if before != settings:
            changed = ", ".join(f"{k}: {before.get(k)} -> {v}" for k, v in settings.items() if before.get(k) != v)
            raise ValueError(f"{out} holds responses made with other settings ({changed}): rerun with the same "
                             f"options to resume, or delete {out} to start again")
    out.mkdir(exist_ok=True)
    target_tokens = args.target_tokens or manifest["estimate"]["target_tokens"]
    num_shards = math.ceil(len(prompts) / args.shard_size)
    done = [r for i in range(num_shards) if shard_path(args.corpus, i).is_file()
            for r in read_jsonl(shard_path(args.corpus, i))]
    pending = [i for i in range(num_shards) if not shard_path(args.corpus, i).is_file()]

    def record() -> dict:
        t = tally(done)
        per = t["response_tokens"] / max(1, t["prompts"])
        rec = {"settings": settings, "target_tokens": target_tokens, "shards": num_shards,
               "shards_done": num_shards - len(pending), **t, "tokens_per_response": round(per, 1),
               "prompts_needed": math.ceil(target_tokens / per) if per else None, "prompts_available": len(prompts)}
        settings_path.write_text(json.dumps(rec, indent=1) + "\n")
        return rec

    rec = record()
    todo = pending[:args.max_shards]
    if not todo or rec["response_tokens"] >= target_tokens:
        print(f"generate: nothing to do ({rec['response_tokens']} response tokens of {target_tokens}, "
              f"{rec['shards_done']}/{num_shards} shards)", file=sys.stderr)
        return rec
    target = load_target(args.model, dtype, device)
    ids = {i: [encode_prompt(target.tokenizer, r["prompt"], target.config.vocab_size)
               for r in prompts[i * args.shard_size:(i + 1) * args.shard_size]] for i in todo}
    llm = ar_llm(target, [p for shard in ids.values() for p in shard], args.max_new_tokens, args.batch)
    params = SamplingParams(max_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    made = 0
    for i in todo:
        if rec["response_tokens"] >= target_tokens:
            break
        res = llm.generate(prompt_token_ids=ids[i], sampling_params=params)  # a bar on a terminal
        rows = [{"id": m["id"], "source": m["source"], "category": m["category"], "prompt_ids": p,
                 "response_ids": r.outputs[0].token_ids, "finish_reason": r.outputs[0].finish_reason}
                for m, p, r in zip(prompts[i * args.shard_size:], ids[i], res)]
        tmp = shard_path(args.corpus, i).with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.rename(shard_path(args.corpus, i))
        done += rows
        pending.remove(i)
        made += sum(len(r["response_ids"]) for r in rows)
        rec = record()
        rate = made / (time.perf_counter() - t0)
        left = max(0, target_tokens - rec["response_tokens"]) / max(rate, 1e-9)
        print(f"generate: shard {i + 1}/{num_shards}: {rec['response_tokens']:,} of {target_tokens:,} response "
              f"tokens ({rec['tokens_per_response']} per response), {rate:,.0f} tokens/s, {left / 3600:.1f} h left",
              file=sys.stderr)
    return rec
