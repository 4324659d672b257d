"""Reliability of the Serve app on a CPU, against a real server on 127.0.0.1: bad inputs (the audit's list and
seeded random mutations of valid requests) and how they were answered, load (concurrent streams; a full
queue), batch jobs killed with -9 (lines lost or duplicated), and recovery after a TP = 2 shard is killed.

    python benchmarks/reliability.py [--fuzz 500] [--streams 64]

Starts its own local Ray cluster and Serve on a free 127.0.0.1 port; prints one Markdown table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import print_table  # noqa: E402

TINY, TEXT = "/tiny", "/text"  # k2-tiny on two shard actors (token ids); SmolLM2 in-process (text, chat)
EXTREMES = [-(2**63), -1, 0, 2**31, 2**63 - 1, 2**63, 2**64, 10**100, 1e308, -1e308, "x", "", None, True,
            [], {}, [2**64], "\ud800", 0.5]
FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stream", "prompt", "model",
          "ignore_eos", "logprobs", "stream_options", "messages", "max_completion_tokens"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def audit_cases() -> list[tuple[str, str, bytes, str]]:
    """(app, route, body, content type): what the audit sent, and the bodies it found answered 500."""
    j = "application/json"

    def body(**kw) -> bytes:
        return json.dumps({"model": "k2-tiny", "prompt": [5, 6, 7], "max_tokens": 4, **kw}).encode()

    return [
        (TINY, "/v1/completions", body(seed=2**63), j), (TINY, "/v1/completions", body(seed=2**63 - 1, n=2), j),
        (TINY, "/v1/completions", body(top_k=2**63), j), (TINY, "/v1/completions", body(max_tokens=2**63), j),
        (TINY, "/v1/completions", body(prompt=[2**64]), j), (TINY, "/v1/completions", body(temperature=-1), j),
        (TINY, "/v1/completions", b'{"model": "k2-tiny", "prompt": [1], "temperature": NaN}', j),
        (TINY, "/v1/completions", b"[" * 10_000 + b"]" * 10_000, j),
        (TINY, "/v1/completions", b'{"model": "k2-tiny", "prompt": [1], "seed": 1' + b"0" * 5000 + b"}", j),
        (TINY, "/v1/completions", body(), "text/plain"), (TINY, "/v1/completions", b"\xff\xfe", j),
        (TEXT, "/v1/completions", json.dumps({"model": "smollm2-135m", "prompt": "\ud800"}).encode(), j),
        (TEXT, "/v1/chat/completions", json.dumps({"model": "smollm2-135m", "messages": [
            {"role": "user", "content": "\udfff"}]}).encode(), j),
    ]


def fuzz_cases(n: int, rng: random.Random) -> list[tuple[str, str, bytes, str]]:
    """Valid requests with one to three fields replaced by an extreme or malformed value."""
    cases = []
    for _ in range(n):
        text = rng.random() < 0.5
        if text:
            base = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        else:
            base = {"model": "k2-tiny", "prompt": [rng.randrange(1024) for _ in range(3)], "max_tokens": 2}
        for name in rng.sample(FIELDS, rng.randint(1, 3)):
            value = rng.choice(EXTREMES)
            if name in ("max_tokens", "max_completion_tokens") and value is None:
                value = 0  # None means the default: as long as the context
            base[name] = value
        route = "/v1/chat/completions" if text else "/v1/completions"
        cases.append((TEXT if text else TINY, route, json.dumps(base).encode(), "application/json"))
    return cases


def normal(base: str, app: str) -> bool:
    body = ({"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
            if app == TEXT else {"model": "k2-tiny", "prompt": [1, 2], "max_tokens": 1})
    route = "/v1/chat/completions" if app == TEXT else "/v1/completions"
    return (requests.get(f"{base}{app}/health", timeout=60).status_code == 200
            and requests.post(f"{base}{app}{route}", json=body, timeout=120).status_code == 200)


def metric(base: str, app: str, name: str) -> float:
    for line in requests.get(f"{base}{app}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def bad_inputs(base: str, cases) -> dict:
    counts = {"2xx": 0, "4xx": 0, "5xx": 0}
    healthy = True
    for i, (app, route, body, kind) in enumerate(cases):
        r = requests.post(f"{base}{app}{route}", data=body, headers={"Content-Type": kind}, timeout=120)
        counts[f"{r.status_code // 100}xx"] += 1
        if i % 25 == 24:
            healthy &= normal(base, TINY) and normal(base, TEXT)
    restarts = metric(base, TINY, "kdray_engine_restarts_total") + metric(base, TEXT, "kdray_engine_restarts_total")
    return counts | {"healthy": healthy and normal(base, TINY) and normal(base, TEXT), "restarts": restarts}


def big_prompt(base: str) -> tuple[int, float, float]:
    """A 20 MB prompt: its status and seconds, and the seconds /health took meanwhile."""
    prompt = "hello " * ((20 << 20) // 6)
    out = {}

    def send():
        t = time.perf_counter()
        r = requests.post(f"{base}{TEXT}/v1/completions", json={"model": "smollm2-135m", "prompt": prompt},
                          timeout=300)
        out["status"], out["seconds"] = r.status_code, time.perf_counter() - t

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.05)
    t = time.perf_counter()
    requests.get(f"{base}{TEXT}/health", timeout=120)
    health = time.perf_counter() - t
    sender.join()
    return out["status"], out["seconds"], health


def streams(base: str, n: int, max_tokens: int = 32) -> tuple[int, int]:
    """``n`` concurrent streams of distinct prompts against the same prompts unstreamed: (complete and equal,
    tokens lost or duplicated in total)."""
    prompts = [[(7 * i + k) % 1000 + 2 for k in range(4)] for i in range(n)]
    body = {"model": "k2-tiny", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}

    def stream(prompt):
        ids = []
        with requests.post(f"{base}{TINY}/v1/completions", json={**body, "prompt": prompt, "stream": True},
                           stream=True, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    ids += json.loads(line[6:])["choices"][0].get("token_ids", [])
        return ids

    def whole(prompt):
        r = requests.post(f"{base}{TINY}/v1/completions", json={**body, "prompt": prompt}, timeout=600)
        return r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(stream, prompts))
    with ThreadPoolExecutor(8) as pool:
        want = list(pool.map(whole, prompts))
    equal = sum(g == w for g, w in zip(got, want))
    return equal, sum(abs(len(g) - len(w)) for g, w in zip(got, want))


def full_queue(base: str) -> tuple[int, str, float]:
    """Fill the text app's capacity with long streams; the next request's status, Retry-After and seconds."""
    body = {"model": "smollm2-135m", "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    held = [requests.post(f"{base}{TEXT}/v1/completions", json=body, stream=True, timeout=120) for _ in range(4)]
    try:
        t = time.perf_counter()
        r = requests.post(f"{base}{TEXT}/v1/completions", json={**body, "stream": False}, timeout=120)
        return r.status_code, r.headers.get("Retry-After", "-"), time.perf_counter() - t
    finally:
        for h in held:
            h.close()


def pids(class_suffix: str, name_prefix: str = "") -> list[int]:
    from ray._private.state import actors

    return [a["Pid"] for a in actors().values() if a["State"] == "ALIVE" and a["ActorClassName"].endswith(class_suffix)
            and a["Name"].startswith(name_prefix)]


def lines(rows: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": "k2-tiny", "prompt": [i % 1000 + 2, 3], "max_tokens": 8 + i % 8,
                                        "ignore_eos": True}}) + "\n" for i in range(rows)).encode()


def lost_and_duplicated(text: str, rows: int) -> tuple[int, int]:
    ids = [json.loads(line)["custom_id"] for line in text.splitlines()]
    return rows - len(set(ids)), len(ids) - len(set(ids))


def batch_killed_on_the_server(base: str, rows: int = 100) -> tuple[int, int, int]:
    """A job through /v1/batches whose replica is killed with -9 partway: (lines done at the kill, lost,
    duplicated)."""
    f = requests.post(f"{base}{TINY}/v1/files", files={"file": ("in.jsonl", lines(rows))},
                      data={"purpose": "batch"}, timeout=60).json()
    batch = requests.post(f"{base}{TINY}/v1/batches", json={"input_file_id": f["id"],
                                                           "endpoint": "/v1/completions"}, timeout=60).json()
    while True:
        b = requests.get(f"{base}{TINY}/v1/batches/{batch['id']}", timeout=60).json()
        if b["request_counts"]["completed"] >= rows // 4:
            break
        time.sleep(0.05)
    at = b["request_counts"]["completed"]
    os.kill(pids("KdrayServer", "SERVE_REPLICA::app-tiny")[0], signal.SIGKILL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            b = requests.get(f"{base}{TINY}/v1/batches/{batch['id']}", timeout=60).json()
            if b.get("status") == "completed":
                break
        except requests.RequestException:
            pass
        time.sleep(0.5)
    out = requests.get(f"{base}{TINY}/v1/files/{b['output_file_id']}/content", timeout=60).text
    return at, *lost_and_duplicated(out, rows)


def batch_killed_on_the_client(base: str, rows: int = 100) -> tuple[int, int, int]:
    """``kdray batch submit`` killed with -9 partway, then run again: (lines done at the kill, lost,
    duplicated)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp, "in.jsonl"), Path(tmp, "out.jsonl")
        src.write_bytes(lines(rows))
        cmd = [sys.executable, "-m", "kdray.cli", "batch", "submit", str(src), "-o", str(out), "--address",
               f"{base}{TINY}", "--concurrency", "4"]
        job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not out.exists() or out.read_text().count("\n") < rows // 4:
            time.sleep(0.02)
        job.send_signal(signal.SIGKILL)
        job.wait()
        at = out.read_text().count("\n")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
        return at, *lost_and_duplicated(out.read_text(), rows)


def shard_killed(base: str) -> tuple[float, int, float, float]:
    """A TP = 2 shard killed mid-request: (seconds until that request heard, its status code in the stream or
    HTTP, seconds until the next request succeeded); then killed while idle: seconds the next request took."""
    body = {"model": "k2-tiny", "prompt": [5, 6, 7], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    result = {}

    def long_request():
        with requests.post(f"{base}{TINY}/v1/completions", json=body, stream=True, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith(b'data: {"error"'):
                    result["code"] = json.loads(line[6:])["error"]["code"]
            result["end"] = time.perf_counter()

    runner = threading.Thread(target=long_request)
    runner.start()
    time.sleep(1.0)
    killed = time.perf_counter()
    os.kill(pids("ShardWorker")[1], signal.SIGKILL)
    runner.join()
    small = {"model": "k2-tiny", "prompt": [5, 6, 7], "max_tokens": 4}
    while requests.post(f"{base}{TINY}/v1/completions", json=small, timeout=600).status_code != 200:
        pass
    recovered = time.perf_counter() - killed
    time.sleep(2.0)  # idle
    os.kill(pids("ShardWorker")[1], signal.SIGKILL)
    time.sleep(1.0)
    t = time.perf_counter()
    idle_status = requests.post(f"{base}{TINY}/v1/completions", json=small, timeout=600).status_code
    return result["end"] - killed, result.get("code"), recovered, (time.perf_counter() - t, idle_status)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fuzz", type=int, default=500, help="random bad requests")
    ap.add_argument("--streams", type=int, default=64, help="concurrent streams")
    args = ap.parse_args()

    import ray
    from ray import serve

    from kdray.serve import app

    # Logical CPUs for scheduling: both apps' replicas and actors, whatever the machine's core count.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    with tempfile.TemporaryDirectory() as batch_dir:
        serve.run(app({"model": "k2-tiny", "device": "cpu", "tp": 2, "max_num_seqs": 64, "max_queue": 64,
                       "batch_dir": batch_dir}), name="app-tiny", route_prefix=TINY)
        serve.run(app({"model": "smollm2-135m", "device": "cpu", "spec": "ar", "max_num_seqs": 2, "max_queue": 2,
                       "batch_dir": batch_dir}), name="app-text", route_prefix=TEXT)
        cases = audit_cases() + fuzz_cases(args.fuzz, random.Random(0))
        bad = bad_inputs(base, cases)
        big = big_prompt(base)
        equal, off = streams(base, args.streams)
        queue = full_queue(base)
        server_job = batch_killed_on_the_server(base)
        client_job = batch_killed_on_the_client(base)
        heard, code, recovered, (idle_s, idle_status) = shard_killed(base)
        serve.shutdown()
    rows = [
        ["bad inputs tried (the audit's list + seeded mutations of valid requests)",
         f"{len(cases)} ({len(audit_cases())} + {args.fuzz})"],
        ["answered 2xx / 4xx / 5xx", f"{bad['2xx']} / {bad['4xx']} / {bad['5xx']}"],
        ["engine restarts; health and a normal request after every 25", f"{bad['restarts']:.0f}; "
         f"{'all passed' if bad['healthy'] else 'FAILED'}"],
        ["a 20 MB prompt", f"{big[0]} in {big[1]:.2f} s; /health meanwhile {big[2]:.2f} s"],
        [f"{args.streams} concurrent streams (k2-tiny, TP = 2, 32 tokens each)",
         f"{equal}/{args.streams} equal to the unstreamed answer; {off} tokens lost or duplicated"],
        ["a full queue (2 running + 2 waiting)", f"{queue[0]} with Retry-After {queue[1]} in {queue[2]:.2f} s"],
        ["batch job of 100 lines, its replica killed -9", f"at line {server_job[0]}: {server_job[1]} lost, "
         f"{server_job[2]} duplicated"],
        ["kdray batch submit of 100 lines killed -9, run again", f"at line {client_job[0]}: {client_job[1]} lost, "
         f"{client_job[2]} duplicated"],
        ["a shard killed mid-request (TP = 2)", f"the request failed after {heard:.2f} s ({code}); the next one "
         f"succeeded {recovered:.1f} s after the kill"],
        ["a shard killed while idle (TP = 2)", f"the next request answered {idle_status} in {idle_s:.1f} s"],
    ]
    print(f"{datetime.date.today()} CPU ({os.cpu_count()} cores), 127.0.0.1")
    print_table(rows, ["check", "result"])


if __name__ == "__main__":
    main()
