"""The command line of the corpus builder: ``build`` and ``generate``."""
from __future__ import annotations

import argparse
import json
import sys

from kdray.drafter_corpus import __doc__ as USAGE
from kdray.drafter_corpus import build, generate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kdray drafter-corpus", description=USAGE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    build.add_arguments(sub.add_parser("build", help="read the sources and write the prompts, split and manifest"))
    generate.add_arguments(sub.add_parser("generate", help="the target's responses to the training prompts "
                                                           "(resumable)"))
    args = ap.parse_args(argv)
    try:
        if args.command == "build":
            m = build.build(args)
            print(json.dumps({"train": m["split"]["train"]["by_source"], "heldout": m["split"]["heldout"]["prompts"],
                              "dedup": m["dedup"], "estimate": m["estimate"]}, indent=1))
        else:
            rec = generate.generate(args)
            print(json.dumps({k: rec[k] for k in ("shards_done", "shards", "prompts", "response_tokens",
                                                  "tokens_per_response", "prompts_needed")}, indent=1))
    except ValueError as e:  # user mistakes: the message names the thing and the fix
        print(f"drafter-corpus {args.command}: {e}", file=sys.stderr)
        return 2
    return 0
