"""Closed-loop HTTP load on the Serve app: streaming chat at several concurrencies, per speculative mode.

For each ``--specs`` entry the benchmark deploys ``kdray.serve:app`` on a local Ray cluster (or, with ``--url``,
loads a server that is already running), then for each concurrency C keeps C clients busy for ``--seconds``:
each sends a streaming chat completion (greedy, ``--max-tokens``, a held-out prompt), waits for its last
chunk, sends the next. Columns: output tokens/s of the server, time to first token p50/p99, per-request
tokens/s after the first token (median), requests completed.

    python benchmarks/serve_load.py --specs ar chain ddtree --concurrency 1 4 16 64 --md serve.md
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table  # noqa: E402


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--specs", nargs="+", default=["ar", "chain", "ddtree:auto"],
                    help="modes to deploy in turn: ar, chain, ddtree:<budget> (a number or auto)")
    ap.add_argument("--url", help="load this running server instead of deploying (one mode: the server's)")
    ap.add_argument("--args", default="{}", help="more Serve builder arguments, as JSON")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--seconds", type=float, default=20.0, help="per concurrency")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--md", type=Path)
    return ap.parse_args(argv)


def prompts(n: int = 64) -> list[str]:
    """Held-out passages (``kdray.train_drafter``'s held-out topics), each with an instruction."""
    from kdray.train_drafter import INSTRUCTIONS, topic_passages

    heldout = topic_passages(600)[1]
    return [f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{heldout[i % len(heldout)]}" for i in range(n)]


async def one_request(session: aiohttp.ClientSession, url: str, model: str, text: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start, first, tokens = time.perf_counter(), None, 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - start, "tokens": tokens, "decode_tok_s": (tokens - 1) / (end - first) if end > first
            else 0.0, "end": end}


async def load(url: str, model: str, concurrency: int, seconds: float, max_tokens: int, texts: list[str]) -> dict:
    """``concurrency`` closed-loop clients for ``seconds``; requests still running at the end are waited for
    but only tokens of requests that finished inside the window count."""
    done: list[dict] = []
    deadline = time.perf_counter() + seconds
    timeout = aiohttp.ClientTimeout(total=600)

    async def client(k: int, session):
        i = k
        while time.perf_counter() < deadline:
            done.append(await one_request(session, url, model, texts[i % len(texts)], max_tokens))
            i += concurrency

    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await one_request(session, url, model, texts[0], 8)  # warm-up: graphs of this batch size and below
        start = time.perf_counter()
        await asyncio.gather(*(client(k, session) for k in range(concurrency)))
    window = [d for d in done if d["end"] <= deadline]
    span = min(time.perf_counter(), deadline) - start
    ttft = sorted(d["ttft"] for d in done)
    return {"tok_s": sum(d["tokens"] for d in window) / span, "ttft_p50": statistics.median(ttft),
            "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "req_tok_s": statistics.median(d["decode_tok_s"] for d in done), "requests": len(done)}


def deploy(spec: str, args) -> str:
    import ray
    from ray import serve

    from kdray.serve import app

    if not ray.is_initialized():
        ray.init(include_dashboard=False, logging_level="ERROR")
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    mode, _, budget = spec.partition(":")
    builder = {"model": args.model, "spec": mode, **({"budget": budget} if budget else {}), **json.loads(args.args)}
    serve.run(app(builder), name="load", route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{args.port}"
    import requests

    deadline = time.monotonic() + 600
    while True:
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return url
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {spec} app did not become healthy")
        time.sleep(1)


def main(argv=None) -> int:
    args = parse_args(argv)
    texts = prompts()
    rows = []
    for spec in [None] if args.url else args.specs:
        url = args.url or deploy(spec, args)
        for c in args.concurrency:
            r = asyncio.run(load(url, args.model, c, args.seconds, args.max_tokens, texts))
            rows.append([spec or "(running server)", str(c), f"{r['tok_s']:.0f}", f"{1e3 * r['ttft_p50']:.0f}",
                         f"{1e3 * r['ttft_p99']:.0f}", f"{r['req_tok_s']:.0f}", str(r["requests"])])
            print(" | ".join(rows[-1]), file=sys.stderr)
    header = ["mode", "concurrency", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "per-request tok/s",
              "requests"]
    title = (f"# {datetime.date.today()} serve_load: {args.model}, streaming chat, greedy, {args.max_tokens} "
             f"tokens, closed loop, {args.seconds:.0f} s per concurrency")
    print(title)
    table = print_table(rows, header)
    if args.md:
        args.md.write_text(f"{title}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
