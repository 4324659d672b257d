"""The ``kdray`` command: generate, serve, batch and bench.

    kdray generate "The capital of France is" --max-tokens 32
    kdray serve --model k2-tiny --port 8000
    kdray batch submit in.jsonl -o out.jsonl --address http://head:8000
    kdray bench kernels --only tree
    kdray train-drafter --help; kdray drafter-corpus --help
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path

from kdray.engine.args import EngineArgs
from kdray.serve.args import ServeArgs

INGRESS_ENV = {"proxy": {}, "haproxy": {"RAY_SERVE_ENABLE_HA_PROXY": "1"}}  # --ingress -> the Ray cluster's env
BENCHMARKS = {"kernels": "bench_kernels.py", "e2e": "e2e.py", "control": "control_path.py",
              "serve-load": "serve_load.py", "reliability": "reliability.py", "k2-step": "k2_step.py",
              "k2-prefill": "k2_prefill.py", "drafter-tau": "drafter_tau.py",
              "ttft-engine": "ttft_engine.py", "all-reduce": "all_reduce.py"}  # name -> benchmarks/ file


def add_setting_flags(parser: argparse.ArgumentParser, cls, title: str):
    """One ``--flag`` per field of the settings dataclass ``cls`` (its help from the field, its type from the
    annotation; booleans as ``--x/--no-x``). Flags left out stay None, so the dataclass default applies."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kinds = [t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None)]
        kind = kinds[0] if len(kinds) == 1 else str  # a union (budget: a number or "auto") parses in the dataclass
        if kind is dict:  # structured settings (autoscaling_config) belong in a config file
            continue
        flag, default = "--" + f.name.replace("_", "-"), f.default
        text = f.metadata["help"] + ("" if default is None or "default" in f.metadata["help"] else
                                     f" (default: {default})")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            group.add_argument(flag, type=kind, default=None, help=text)


def given(args: argparse.Namespace, cls) -> dict:
    """The fields of ``cls`` whose flags were set."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name, None) is not None}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kdray", description="Kimi-K2-class MoE inference with DDTree on Ray")
    sub = ap.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print text and tau")
    add_setting_flags(gen, EngineArgs, "engine")
    gen.add_argument("prompt", help="text, or comma-separated token ids with --token-ids")
    gen.add_argument("--token-ids", action="store_true", help="the prompt is token ids (models without a tokenizer)")
    gen.add_argument("--raw", action="store_true", help="send the text as is, without the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)

    srv = sub.add_parser("serve", help="run the Serve app (OpenAI and Anthropic APIs)")
    srv.add_argument("--host", default="127.0.0.1",
                     help="where Serve listens (default: this machine only; 0.0.0.0 for every interface)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--address", help="Ray cluster address (default: start or join a local one)")
    srv.add_argument("--replace", action="store_true", help="replace a kdray app that already runs on the cluster")
    srv.add_argument("--ingress", choices=sorted(INGRESS_ENV), default="proxy",
                     help="Serve's HTTP ingress: proxy (its Python proxy actor, ~5 ms a request on 2 CPU cores) or "
                          "haproxy (HAProxy straight to the replicas' own HTTP servers, ~1 ms; experimental in Ray "
                          "Serve, and each replica listens on a port of its own, 30000-31000, on --host); haproxy "
                          "starts its own Ray cluster (for a running one, export RAY_SERVE_ENABLE_HA_PROXY=1 before "
                          "`ray start`)")
    add_setting_flags(srv, ServeArgs, "engine and server")

    batch = sub.add_parser("batch", help="run OpenAI Batch JSONL files").add_subparsers(dest="batch_command",
                                                                                        required=True)
    submit = batch.add_parser("submit", help="send every line to a running server; rerun to resume")
    submit.add_argument("input", type=Path)
    submit.add_argument("-o", "--output", type=Path, required=True, help="results JSONL (appended; resumes)")
    submit.add_argument("--address", default="http://127.0.0.1:8000", help="the server's base URL")
    submit.add_argument("--api-key", default=os.environ.get("KDRAY_API_KEY"), help="(default: $KDRAY_API_KEY)")
    submit.add_argument("--concurrency", type=int, default=16, help="requests in flight")

    bench = sub.add_parser("bench", help="run a benchmark from benchmarks/ (a source checkout)")
    bench.add_argument("name", choices=list(BENCHMARKS))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    sub.add_parser("train-drafter", add_help=False, help="train a DFlash drafter for a target (see its --help)")
    sub.add_parser("drafter-corpus", add_help=False, help="build a drafter's training corpus, generate its "
                                                          "responses (see its --help)")
    return ap


def generate(args: argparse.Namespace) -> int:
    from kdray.engine.request import SamplingParams
    from kdray.llm import LLM

    ids = None
    if args.token_ids:
        try:
            ids = [int(t) for t in args.prompt.split(",")]
        except ValueError:
            raise ValueError(f"--token-ids: '{args.prompt}' is not a comma-separated list of integers") from None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    llm = LLM(**given(args, EngineArgs))
    text = args.prompt
    if ids is None and not args.raw and llm.tokenizer is not None and llm.tokenizer.chat_template:
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])  # an instruct model's turn
    prompt = {"prompt_token_ids": [ids]} if ids else {"prompts": text}
    out = llm.generate(**prompt, sampling_params=params)[0]
    c, m = out.outputs[0], out.metrics
    print(c.text if llm.tokenizer is not None else ",".join(map(str, c.token_ids)))
    print(f"tau {m['tau']:.2f} ({len(c.token_ids)} tokens in {m['steps']} steps, finish: {c.finish_reason})",
          file=sys.stderr)
    return 0


def serve_forever(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from kdray.serve import app
    from kdray.serve.server import open_without_key

    settings = given(args, ServeArgs)
    warning = open_without_key(args.host, settings.get("api_key") or os.environ.get("KDRAY_API_KEY"))
    if warning:
        print(f"kdray serve: warning: {warning}", file=sys.stderr)
    os.environ.update(ingress_env(args.ingress, args.address))
    ray.init(address=args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    check_serve(args.host, args.port, args.replace)
    try:
        serve.run(app(settings), name="kdray", route_prefix="/", blocking=True)
    except KeyboardInterrupt:  # Ctrl-C: tear the app down, as `serve run` does
        serve.shutdown()
    return 0


def ingress_env(ingress: str, address: str | None) -> dict[str, str]:
    """The environment the Ray cluster that ``kdray serve`` starts needs for Serve's ``ingress`` (read by every
    Serve process at start-up, so a running cluster cannot take it)."""
    env = INGRESS_ENV[ingress]
    if env and (address or os.environ.get("RAY_ADDRESS")):
        raise ValueError(f"--ingress {ingress} needs a Ray cluster started with "
                         f"{' '.join(f'{k}={v}' for k, v in env.items())}: leave out --address (and RAY_ADDRESS) to "
                         "start one, or export it before `ray start` and use the default --ingress")
    return env


def check_serve(host: str, port: int, replace: bool):
    """Refuse to deploy where it would not do what was asked: Serve already running on the cluster with other
    HTTP options (Serve would keep them), or a kdray app already there (unless ``replace``)."""
    from ray import serve
    from ray.serve.context import _get_global_client

    running = _get_global_client().http_config
    if (running.host, running.port) != (host, port):
        raise ValueError(f"Serve already runs on this cluster at {running.host}:{running.port} and keeps those "
                         f"HTTP options, so it cannot listen on {host}:{port}; run kdray serve --host {running.host} "
                         f"--port {running.port}, or stop it first (serve shutdown)")
    if not replace and "kdray" in serve.status().applications:
        raise ValueError("an app named 'kdray' already runs on this cluster's Serve; pass --replace to redeploy it "
                         "with these settings (its API key and all), or stop it first (serve shutdown)")


def batch_submit(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kdray.serve.batch import submit

    bar = None

    def start(done: int, total: int):
        nonlocal bar
        bar = tqdm(total=total, initial=done, unit="req", desc=args.input.name)

    unsent = asyncio.run(submit(args.input, args.output, args.address, args.api_key, args.concurrency,
                                on_start=start, on_result=lambda: bar.update(1)))
    bar.close()
    if unsent:
        print(f"{len(unsent)} requests got no answer from {args.address}; run the same command again to send "
              "only those", file=sys.stderr)
        return 1
    print(f"all results are in {args.output}", file=sys.stderr)
    return 0


def bench(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / BENCHMARKS[args.name]
    if not script.is_file():
        print(f"{script} not found: kdray bench runs the benchmarks of a source checkout", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(script), *args.args])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train-drafter"]:  # its flags are kdray.train_drafter's own
        from kdray.train_drafter import main as train_drafter

        try:
            return train_drafter(argv[1:])
        except ValueError as e:
            print(f"kdray train-drafter: {e}", file=sys.stderr)
            return 2
    if argv[:1] == ["drafter-corpus"]:  # python -m kdray.drafter_corpus
        from kdray.drafter_corpus.cli import main as drafter_corpus

        return drafter_corpus(argv[1:])
    args = _parser().parse_args(argv)
    command = {"generate": generate, "serve": serve_forever, "batch": batch_submit, "bench": bench}[args.command]
    try:
        return command(args)
    except ValueError as e:  # kdray's configuration errors say what to fix: no traceback needed
        print(f"kdray {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
