"""HTTP load on the Serve app: streaming chat, per speculative mode and workload.

For each ``--specs`` entry the benchmark deploys ``kdray.serve:app`` on a local Ray cluster (or, with ``--url``,
loads a server that is already running). Workloads (``--workload``):

- ``chat``: for each concurrency C, C closed-loop clients for ``--seconds``, each sending a streaming chat
  completion (greedy, ``--max-tokens``, a held-out prompt) and the next when it ends. Columns: output tokens/s
  of the server, time to first token p50/p99, per-request tokens/s after the first token (median), requests.
- ``shared-prefix``: requests one after another, each a ``--prefix-tokens`` system prompt shared by all and a
  question of about ``--own-tokens`` tokens (the cache's hit rate is prefix / (prefix + own)), 16 tokens out:
  time to first token p50 (compare ``--args '{"prefix_caching": false}'``), and where it goes:
  client mean minus the replica's mean (its handler -> first token chunk) is the HTTP and Serve path, the
  replica's minus the engine's the handler's own work; ``GET /health`` p50 is that path with no body and no
  engine (compare Serve's ingress: ``RAY_SERVE_ENABLE_HA_PROXY=1``, see ``kdray serve --ingress``).
- ``long-prompt``: C closed-loop streams decode while a ``--long-tokens`` prompt arrives ``--long-every`` seconds
  after the last one's first token, three times: the streams' gaps between chunks until the last arrival is in,
  median, p99 and largest (compare ``--args '{"prefill_chunk": 100000}'``).

``--model k2-shard`` serves one TP8 shard of Kimi K2 at real dimensions (``k2_step.py``'s config, ``--layers`` of
them) with random weights made on the GPU (``load_format="dummy"``: no checkpoint on disk), plain decoding, with
``ttft_engine.py``'s settings; ``--model llama3-8b`` or ``codellama-34b`` serves that dense Llama-family model at its
published dimensions the same way. These have no tokenizer, so their workloads (``shared-prefix`` and
``long-prompt``) send completions of token ids: in ``shared-prefix`` a random ``--prefix-tokens`` prefix shared by
every request, then ``--own-tokens`` ids of its own; in ``long-prompt`` 64 random ids a stream, ``--long-tokens``
an arriving prompt.

    python benchmarks/serve_load.py --specs ar ddtree:64 ddtree:auto --concurrency 1 4 16 64 --md serve.md
    python benchmarks/serve_load.py --model k2-shard --workload shared-prefix --own-tokens 228   # a 90% hit rate
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table  # noqa: E402

K2_SHARD = "k2-shard"  # --model: K2's TP8 shard with random weights, served from its config alone
# --model: dense Llama-family models at their published dimensions (their config.json's values), random weights
DENSE_CONFIGS = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                      max_position_embeddings=131072,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "codellama-34b": dict(vocab_size=32000, hidden_size=8192, intermediate_size=22016, num_hidden_layers=48,
                          num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1000000.0,
                          max_position_embeddings=16384),
}
ID_MODELS = (K2_SHARD, *DENSE_CONFIGS)  # served from a config alone, without a tokenizer: token-id prompts
OWN_TOKENS = 32  # shared-prefix: each request's own tokens after the shared prompt, by default
SHARED_PREFIX_TOKENS_OUT = 16  # output tokens of a shared-prefix request (its time to first token is what counts)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help=f"a model name or path, or one of {', '.join(ID_MODELS)}")
    ap.add_argument("--layers", type=int, default=61, help=f"{K2_SHARD}: decoder layers")
    ap.add_argument("--specs", nargs="+",
                    help="modes to deploy in turn: ar, chain, ddtree:<budget> (a number or auto); default: ar chain "
                         f"ddtree:auto ({', '.join(ID_MODELS)}: ar, they have no drafter)")
    ap.add_argument("--url", help="load this running server instead of deploying (one mode: the server's)")
    ap.add_argument("--args", default="{}", help="more Serve builder arguments, as JSON")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--seconds", type=float, default=20.0, help="per concurrency")
    ap.add_argument("--max-tokens", type=int, default=128, help="chat and long-prompt: each stream's output tokens")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--workload", choices=("chat", "shared-prefix", "long-prompt"), default="chat")
    ap.add_argument("--prefix-tokens", type=int, default=2048, help="shared-prefix: the system prompt's length")
    ap.add_argument("--own-tokens", type=int, default=OWN_TOKENS,
                    help="shared-prefix: each request's own tokens after the shared prompt (about, for text)")
    ap.add_argument("--long-tokens", type=int, default=6000, help="long-prompt: the arriving prompts' length")
    ap.add_argument("--long-every", type=float, default=2.0,
                    help="long-prompt: seconds from one arrival's first token to the next arrival")
    ap.add_argument("--label", default="", help="a note for the table's first column (what --args changed)")
    ap.add_argument("--md", type=Path)
    args = ap.parse_args(argv)
    if args.model in ID_MODELS and args.workload == "chat":
        ap.error(f"--model {args.model} has no tokenizer: it runs the token-id workloads (shared-prefix, long-prompt)")
    if args.prefix_tokens < 0 or args.own_tokens < 1:
        ap.error(f"--prefix-tokens {args.prefix_tokens} must be >= 0 and --own-tokens {args.own_tokens} >= 1")
    args.specs = args.specs or (["ar"] if args.model in ID_MODELS else ["ar", "chain", "ddtree:auto"])
    return args


def id_model_settings(prompt_tokens: int, seqs: int = 4) -> dict:
    """Engine settings for the models served from a config (no drafter: plain decoding), with a context for
    ``prompt_tokens``-token prompts and ``seqs`` requests at once (a few leave room for the KV cache beside the K2
    shard's ~65 GB of weights)."""
    return {"spec": "ar", "max_num_seqs": seqs, "max_model_len": prompt_tokens + 256}


def id_model_config(name: str, layers: int) -> dict:
    """The ``config.json`` of ``name`` (one of ``ID_MODELS``): the K2 shard's (``layers`` of them) or the dense
    model's published one."""
    if name == K2_SHARD:
        from benchmarks.k2_step import shard_hf_config

        return shard_hf_config(layers)
    return {"model_type": "llama", **DENSE_CONFIGS[name]}


def write_id_model_config(name: str, path: Path, layers: int) -> Path:
    """``name`` (one of ``ID_MODELS``) as a checkpoint directory with only its ``config.json`` (served with
    ``load_format="dummy"``)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(id_model_config(name, layers), indent=1))
    return path


def id_prompts(vocab: int, n: int, prefix_tokens: int, own_tokens: int = OWN_TOKENS, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of random ids (from ``seed``): the same ``prefix_tokens`` first, then ``own_tokens`` of their
    own."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(vocab, (prefix_tokens,), generator=g).tolist()
    return [prefix + torch.randint(vocab, (own_tokens,), generator=g).tolist() for _ in range(n)]


def prompts(n: int = 64) -> list[str]:
    """Held-out passages (``kdray.train_drafter``'s held-out topics), each with an instruction."""
    from kdray.train_drafter import INSTRUCTIONS, topic_passages

    heldout = topic_passages(600)[1]
    return [f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{heldout[i % len(heldout)]}" for i in range(n)]


def words(n: int) -> str:
    """About ``n`` tokens of held-out reference text."""
    from kdray.train_drafter import topic_passages

    text, passages = "", topic_passages(2000)[1]
    while len(text) < 4 * n:
        text += passages[len(text) % len(passages)] + "\n\n"
    return text[:4 * n]


def request_body(model: str, prompt: str | list[int], max_tokens: int, system: str | None = None) -> tuple[str, dict]:
    """(path, body) of one streamed greedy request: a chat of ``prompt``'s text (after the ``system`` prompt), or
    for a list of token ids (a model without a tokenizer) a completion that returns the output's token ids."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if isinstance(prompt, list):
        return "/v1/completions", {**body, "prompt": prompt, "return_token_ids": True}
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return "/v1/chat/completions", {**body, "messages": messages}


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: str | list[int], max_tokens: int,
                      system: str | None = None) -> dict:
    """Stream one request (see :func:`request_body`): time to the first chunk with output (chat text or token ids),
    output tokens, decode rate after it and the gaps between chunks."""
    path, body = request_body(model, prompt, max_tokens, system)
    start, first, tokens, stamps = time.perf_counter(), None, 0, []
    async with session.post(f"{url}{path}", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any(c.get("token_ids") or c.get("delta", {}).get("content") for c in chunk["choices"]):
                stamps.append(time.perf_counter())
                first = first or stamps[-1]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - start, "tokens": tokens, "decode_tok_s": (tokens - 1) / (end - first) if end > first
            else 0.0, "end": end, "gaps": [b - a for a, b in zip(stamps, stamps[1:])]}


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


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The server's ``/metrics`` as ``{"name{labels}": value}``."""
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    pairs = (line.rpartition(" ") for line in text.splitlines() if line and not line.startswith("#"))
    return {k: float(v) for k, _, v in pairs}


def since(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


async def shared_prefix(url: str, model: str, args, texts: list[str]) -> dict:
    """Requests one at a time, each the same long system prompt and a question of its own (for the models without a
    tokenizer: the same random token ids, then ``--own-tokens`` of its own): TTFT after the first, at the client, in
    the replica (its handler -> the first token's chunk) and in the engine (submission -> first token; split at the
    launch of the request's prefill into queued and prefill), the last two from the server's metrics."""
    if args.model in ID_MODELS:
        vocab = id_model_config(args.model, args.layers)["vocab_size"]
        asks = id_prompts(vocab, 12, args.prefix_tokens, args.own_tokens)
        system = None
    else:  # held-out prompts cut at ~4 characters a token
        asks, system = [t[:4 * args.own_tokens] for t in texts[:12]], words(args.prefix_tokens)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        runs = [await one_request(session, url, model, asks[0], SHARED_PREFIX_TOKENS_OUT, system)]  # fills the cache
        before = await scrape(session, url)
        runs += [await one_request(session, url, model, asks[i], SHARED_PREFIX_TOKENS_OUT, system)
                 for i in range(1, 12)]
        after = await scrape(session, url)
        health = [await round_trip(session, f"{url}/health") for _ in range(50)]
    ttft = [r["ttft"] for r in runs[1:]]

    def mean(histogram: str) -> float:
        return since(after, before, f"{histogram}_sum") / max(1.0, since(after, before, f"{histogram}_count"))

    return {"ttft_p50": statistics.median(ttft), "ttft_mean": statistics.mean(ttft), "ttft_first": runs[0]["ttft"],
            "server_ttft_mean": mean("kdray_server_time_to_first_token_seconds"),
            "engine_ttft_mean": mean("kdray_time_to_first_token_seconds"),
            "queue_mean": mean("kdray_request_queue_time_seconds"),
            "prefill_mean": mean("kdray_request_prefill_time_seconds"), "health_p50": statistics.median(health)}


async def round_trip(session: aiohttp.ClientSession, url: str) -> float:
    """Seconds for one ``GET url`` and its whole body."""
    start = time.perf_counter()
    async with session.get(url) as r:
        await r.read()
    return time.perf_counter() - start


async def long_prompts(url: str, model: str, args, texts: list[str], streams: int) -> dict:
    """``streams`` closed-loop decoding requests while three long prompts arrive one after another: the streams'
    gaps between chunks, until the last long prompt's first token."""
    if args.model in ID_MODELS:
        vocab = id_model_config(args.model, args.layers)["vocab_size"]
        asks, longs = id_prompts(vocab, streams, 0, 64), id_prompts(vocab, 3, 0, args.long_tokens, seed=1)
    else:
        long_text = words(args.long_tokens)
        asks, longs = texts[:streams], [f"{i}: {long_text}" for i in range(3)]
    gaps: list[float] = []
    arrived = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        await one_request(session, url, model, asks[0], 8)

        async def stream(k):  # every stream keeps decoding until the last arrival has its first token
            while not arrived.is_set():
                gaps.extend((await one_request(session, url, model, asks[k], args.max_tokens))["gaps"])

        async def arrivals():
            for prompt in longs:
                await asyncio.sleep(args.long_every)
                await one_request(session, url, model, prompt, 1)
            arrived.set()

        before = await scrape(session, url)
        await asyncio.gather(arrivals(), *(stream(k) for k in range(streams)))
        after = await scrape(session, url)
    gaps.sort()
    steps = since(after, before, 'kdray_step_seconds_count{stage="total"}')
    within = {float(k.split('le="')[1].split('"')[0]): since(after, before, k) for k in after
              if k.startswith("kdray_step_seconds_bucket") and 'stage="total"' in k}  # upper bound -> steps
    return {"gap_p50": statistics.median(gaps), "gap_p99": gaps[int(0.99 * (len(gaps) - 1))], "gap_max": gaps[-1],
            "steps": steps,
            "slow_steps": steps - within.get(0.1, 0.0),
            "slowest_within": min(b for b, n in within.items() if n >= steps)}


def model_args(args, tmp: Path) -> dict:
    """The Serve builder arguments that choose the model: ``--model`` as given, or for the ``ID_MODELS`` its config
    written to ``tmp`` and served under its name with random weights (``load_format="dummy"``) and their engine
    settings."""
    if args.model not in ID_MODELS:
        return {"model": args.model}
    settings = (id_model_settings(args.prefix_tokens + args.own_tokens) if args.workload == "shared-prefix" else
                id_model_settings(args.long_tokens, seqs=args.concurrency[0] + 2))  # the streams and an arrival
    return {"model": str(write_id_model_config(args.model, tmp, args.layers)), "served_model_name": args.model,
            "load_format": "dummy", **settings}


def deploy(spec: str, args, model: dict) -> str:
    import ray
    from ray import serve

    from kdray.serve import app

    if not ray.is_initialized():
        ray.init(include_dashboard=False, logging_level="ERROR")
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    mode, _, budget = spec.partition(":")
    builder = {**model, "spec": mode, **({"budget": budget} if budget else {}), **json.loads(args.args)}
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
    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:  # an ID_MODELS config, kept while served
        return benchmark(args, model_args(args, Path(tmp)))


def benchmark(args, model: dict) -> int:
    """Deploy each of ``--specs`` with the ``model`` builder arguments (or use ``--url``), run the workload, print
    its table."""
    texts = prompts()
    rows, label = [], (lambda spec: f"{spec or '(running server)'}{' ' + args.label if args.label else ''}")
    for spec in [None] if args.url else args.specs:
        url = args.url or deploy(spec, args, model)
        if args.workload == "shared-prefix":
            r = asyncio.run(shared_prefix(url, args.model, args, texts))
            rows.append([label(spec), str(args.prefix_tokens), str(args.own_tokens), f"{1e3 * r['ttft_first']:.0f}",
                         f"{1e3 * r['ttft_p50']:.0f}", f"{1e3 * r['ttft_mean']:.1f}",
                         f"{1e3 * r['server_ttft_mean']:.1f}", f"{1e3 * r['engine_ttft_mean']:.1f}",
                         f"{1e3 * r['queue_mean']:.1f}", f"{1e3 * r['prefill_mean']:.1f}",
                         f"{1e3 * (r['ttft_mean'] - r['server_ttft_mean']):.1f}",
                         f"{1e3 * (r['server_ttft_mean'] - r['engine_ttft_mean']):.1f}",
                         f"{1e3 * r['health_p50']:.1f}"])
            continue
        if args.workload == "long-prompt":
            r = asyncio.run(long_prompts(url, args.model, args, texts, args.concurrency[0]))
            rows.append([label(spec), str(args.concurrency[0]), str(args.long_tokens), f"{1e3 * r['gap_p50']:.1f}",
                         f"{1e3 * r['gap_p99']:.1f}", f"{r['gap_p99'] / r['gap_p50']:.1f}x",
                         f"{1e3 * r['gap_max']:.0f}",
                         f"{r['slow_steps']:.0f} of {r['steps']:.0f} (slowest <= {1e3 * r['slowest_within']:.0f} ms)"])
            continue
        for c in args.concurrency:
            r = asyncio.run(load(url, args.model, c, args.seconds, args.max_tokens, texts))
            rows.append([label(spec), str(c), f"{r['tok_s']:.0f}", f"{1e3 * r['ttft_p50']:.0f}",
                         f"{1e3 * r['ttft_p99']:.0f}", f"{r['req_tok_s']:.0f}", str(r["requests"])])
            print(" | ".join(rows[-1]), file=sys.stderr)
    header = {"chat": ["mode", "concurrency", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "per-request tok/s",
                       "requests"],
              "shared-prefix": ["mode", "shared prefix tokens", "own tokens", "first TTFT ms",
                                "TTFT p50 ms (later requests)", "TTFT mean ms", "in the replica: TTFT mean ms",
                                "in the engine: TTFT mean ms", "of which queued ms", "of which prefill ms",
                                "HTTP + Serve: client - replica ms", "handler: replica - engine ms",
                                "GET /health p50 ms"],
              "long-prompt": ["mode", "streams", "arriving prompt tokens", "stream gap p50 ms",
                              "stream gap p99 ms", "p99 / p50", "stream gap max ms",
                              "engine steps over 100 ms"]}[args.workload]
    kind = "streaming token-id completions" if args.model in ID_MODELS else "streaming chat"
    out_tokens = SHARED_PREFIX_TOKENS_OUT if args.workload == "shared-prefix" else args.max_tokens
    title = (f"# {datetime.date.today()} serve_load {args.workload}: {args.model}, {kind}, greedy, "
             f"{out_tokens} tokens")
    print(title)
    table = print_table(rows, header)
    if args.md:
        with args.md.open("a") as f:
            f.write(f"{title}\n\n{table}\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
