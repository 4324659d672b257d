"""The Serve app over real HTTP on localhost: the official ``openai`` client, streaming, concurrency,
cancellation, bad requests (none of which hurts the server), the API key, limits, content types, the
bounded queue and the metrics.

Two apps share one Serve instance: k2-tiny on two tensor-parallel Ray actors (gloo; no tokenizer, so
prompts are token ids) at ``/``, and k2-tiny's weights with a small BPE tokenizer and chat template
(in-process, chain drafting, an API key also on /metrics, room for three requests) at ``/chat``.
"""
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import openai
import pytest
import requests
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from ray.serve import Application
from serve_server import deployment_options, make_chat_checkpoint, metric

from kdray import LLM, SamplingParams
from kdray.engine.args import DEFAULT_MODEL
from kdray.model.presets import K2_TINY
from kdray.serve import ServeArgs, app

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/

pytestmark = pytest.mark.slow  # one Serve instance for the module: ~1 minute on 2 CPU cores

KEY = "sk-test"
CHAT = "tiny-chat"
MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return make_chat_checkpoint(tmp_path_factory.mktemp("models") / CHAT)


@pytest.fixture(scope="module")
def server(serve_cluster, chat_model, tmp_path_factory):
    batches = tmp_path_factory.mktemp("batches")
    return serve_cluster.deploy({
        "/": {"model": "k2-tiny", "device": "cpu", "tp": 2, "batch_dir": str(batches / "tiny")},
        "/chat": {"model": str(chat_model), "served_model_name": CHAT, "device": "cpu", "drafter": "random",
                  "spec": "chain", "api_key": KEY, "protect_metrics": True, "max_num_seqs": 2, "max_queue": 1,
                  "max_request_bytes": 65536, "batch_dir": str(batches / "chat")},
    })


@pytest.fixture(scope="module")
def tiny():
    return LLM(model="k2-tiny", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def chat_llm(chat_model):
    return LLM(model=str(chat_model), device="cpu", dtype="float32")


def greedy(llm, prompts, max_tokens):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=max_tokens))
    return [o.outputs[0] for o in outs]


def client(base, key="none"):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)


def test_builder_defaults_to_the_default_model():
    assert isinstance(app({}), Application)  # what `serve run kdray.serve:app` builds
    assert ServeArgs().model == DEFAULT_MODEL
    with pytest.raises(ValueError, match="modle"):
        app({"modle": "k2-tiny"})


def test_models_and_health(server):
    assert requests.get(f"{server}/health", timeout=10).json()["status"] == "ok"
    assert [m.id for m in client(server).models.list()] == ["k2-tiny"]


def test_completion_equals_llm_greedy(server, tiny):
    prompt, expected = [5, 6, 7, 8, 9], greedy(tiny, [[5, 6, 7, 8, 9]], 8)[0]
    c = client(server)
    r = c.completions.create(model="k2-tiny", prompt=prompt, max_tokens=8, temperature=0,
                             extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == expected.token_ids
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 8)

    ids, finish, usage = [], None, None
    for chunk in c.completions.create(model="k2-tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"return_token_ids": True}):
        for choice in chunk.choices:
            ids += choice.model_extra["token_ids"]
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    assert ids == expected.token_ids and finish == "length" and usage.completion_tokens == 8


def test_several_prompts_n_and_seed(server, tiny):
    c = client(server)
    prompts = [[11, 12, 13], [21, 22]]
    r = c.completions.create(model="k2-tiny", prompt=prompts, max_tokens=4, temperature=0,
                             extra_body={"return_token_ids": True})
    assert [ch.model_extra["token_ids"] for ch in r.choices] == [o.token_ids for o in greedy(tiny, prompts, 4)]
    assert r.usage.prompt_tokens == 5

    sampled = {"model": "k2-tiny", "prompt": [3, 4, 5], "max_tokens": 4, "temperature": 1.0, "n": 3, "seed": 7,
               "extra_body": {"return_token_ids": True}}
    a, b = c.completions.create(**sampled), c.completions.create(**sampled)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.model_extra["token_ids"] for ch in a.choices] == [ch.model_extra["token_ids"] for ch in b.choices]
    assert a.usage.completion_tokens == 12


def test_chat_equals_llm_greedy_with_stream_and_stop(server, chat_llm):
    tok = chat_llm.tokenizer
    prompt = tok.encode(tok.apply_chat_template(MESSAGES))
    expected = greedy(chat_llm, [prompt], 6)[0].text
    c = client(f"{server}/chat", KEY)
    r = c.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(prompt)

    chunks = list(c.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=6, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"

    stop = expected[len(expected) // 2:][:3]
    r = c.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=6, temperature=0, stop=[stop])
    assert r.choices[0].message.content == expected[:expected.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    chunks = list(c.chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=6, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected[:expected.index(stop)]


def test_serve_load_streams_token_ids_without_a_tokenizer_and_chat_with_one(server):
    """``benchmarks/serve_load.py``'s request: token ids as a completion to k2-tiny (no tokenizer), text as a chat
    to the chat app; both streams' output chunks are found (the first one times the first token) and counted."""
    import asyncio

    import aiohttp

    from benchmarks.serve_load import one_request

    async def both():
        async with aiohttp.ClientSession() as session:
            ids = await one_request(session, server, "k2-tiny", [5, 6, 7, 8, 9], 8)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
            return ids, await one_request(session, f"{server}/chat", CHAT, "hello world", 6)

    for run, n in zip(asyncio.run(both()), (8, 6)):
        assert run["tokens"] == n and run["decode_tok_s"] > 0 and run["ttft"] > 0


def test_api_key_is_required_when_set(server):
    with pytest.raises(openai.AuthenticationError):
        client(f"{server}/chat", "wrong").chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=2)
    assert requests.get(f"{server}/chat/health", timeout=10).status_code == 200  # health stays open


def test_chat_without_a_template_says_why(server):
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client(server).chat.completions.create(model="k2-tiny", messages=MESSAGES, max_tokens=2)


def test_sixteen_concurrent_requests(server, tiny):
    prompts = [[100 + i, 200 + i, 300 + i] for i in range(16)]
    expected = [o.token_ids for o in greedy(tiny, prompts, 6)]
    c = client(server)

    def one(prompt):
        r = c.completions.create(model="k2-tiny", prompt=prompt, max_tokens=6, temperature=0,
                                 extra_body={"return_token_ids": True})
        return r.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(one, prompts)) == expected


def _wait_for(fn, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _idle_free_pages(base: str) -> float:
    """Free KV pages once the engine is idle: the step in flight past the last request's end has been applied."""
    _wait_for(lambda: metric(base, "kdray_num_requests_running") == 0)
    before = None
    while (now := metric(base, "kdray_kv_cache_free_pages")) != before:
        before = now
        time.sleep(0.2)
    return now


def test_cancelled_requests_free_their_pages(server):
    start = _idle_free_pages(server)
    long = {"model": "k2-tiny", "prompt": [7, 8, 9], "max_tokens": 1500, "ignore_eos": True}
    with requests.post(f"{server}/v1/completions", json={**long, "stream": True}, stream=True, timeout=60) as r:
        events = (line for line in r.iter_lines() if line.startswith(b"data: "))
        for _ in range(3):
            assert json.loads(next(events)[6:])["choices"][0]["finish_reason"] is None
        assert metric(server, "kdray_kv_cache_free_pages") < start
    _wait_for(lambda: metric(server, "kdray_kv_cache_free_pages") == start
              and metric(server, "kdray_num_requests_running") == 0)

    with pytest.raises(requests.exceptions.ReadTimeout):  # a non-streaming client that gives up
        requests.post(f"{server}/v1/completions", json=long, timeout=1.5)
    _wait_for(lambda: metric(server, "kdray_kv_cache_free_pages") == start
              and metric(server, "kdray_num_requests_running") == 0)


def test_full_queue_answers_503_with_retry_after(server):
    body = {"model": CHAT, "messages": MESSAGES, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    url = f"{server}/chat/v1/chat/completions"
    held = [requests.post(url, json=body, headers=headers, stream=True, timeout=60) for _ in range(3)]
    try:
        assert [r.status_code for r in held] == [200, 200, 200]  # max_num_seqs 2 + max_queue 1
        r = requests.post(url, json={**body, "stream": False}, headers=headers, timeout=60)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
    finally:
        for r in held:
            r.close()
    _wait_for(lambda: metric(f"{server}/chat", "kdray_num_requests_running", KEY) == 0)


BAD_REQUESTS = [
    # (route, body, field named in the message, param)
    ("/v1/completions", b"{not json", "JSON", None),
    ("/v1/completions", b"[1, 2]", "JSON object", None),
    ("/v1/completions", {"prompt": [1]}, "model", "model"),
    ("/v1/completions", {"model": "gpt-4", "prompt": [1]}, "model", "model"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1] * 2048}, "prompt", "prompt"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "max_tokens": 0}, "max_tokens", "max_tokens"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "max_tokens": 5000}, "max_tokens", "max_tokens"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "max_tokens": "8"}, "max_tokens", "max_tokens"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "temperature": "hot"}, "temperature", "temperature"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "temperature": 5}, "temperature", "temperature"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "top_p": 0}, "top_p", "top_p"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "n": 0}, "n", "n"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "seed": "x"}, "seed", "seed"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "stop": [1]}, "stop", "stop"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "stop": "."}, "stop", "stop"),  # no tokenizer
    ("/v1/completions", {"model": "k2-tiny", "prompt": [[1]] * 19, "n": 16}, "n", "n"),  # over the capacity
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "stream": "yes"}, "stream", "stream"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "logprobs": 21}, "logprobs", "logprobs"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": {"text": "hi"}}, "prompt", "prompt"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": "needs a tokenizer"}, "prompt", "prompt"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [5000]}, "prompt", None),  # past the vocabulary
    ("/v1/chat/completions", {"model": "k2-tiny", "messages": MESSAGES}, "messages", "messages"),
    ("/chat/v1/chat/completions", {"model": CHAT}, "messages", "messages"),
    ("/chat/v1/chat/completions", {"model": CHAT, "messages": [{"role": "bot", "content": "x"}]},
     "messages[0].role", "messages[0].role"),
    ("/chat/v1/chat/completions", {"model": CHAT, "messages": MESSAGES, "max_completion_tokens": -1},
     "max_completion_tokens", "max_completion_tokens"),
    # values that once stopped the engine for everyone, or answered 500
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "seed": 2**63}, "seed", "seed"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "seed": 2**63 - 1, "n": 2}, "seed", "seed"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "seed": -1}, "seed", "seed"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "top_k": 2**63}, "top_k", "top_k"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "max_tokens": 2**63}, "max_tokens", "max_tokens"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [2**64]}, "prompt", None),
    ("/chat/v1/completions", {"model": CHAT, "prompt": "x", "stop": ["x"] * 17}, "stop", "stop"),
    ("/chat/v1/chat/completions", {"model": CHAT, "messages": [{"role": "user", "content": "\ud800"}]},
     "messages[0].content", "messages[0].content"),
    ("/chat/v1/completions", {"model": CHAT, "prompt": "\ud800"}, "prompt", "prompt"),
    ("/v1/completions", b'{"model": "k2-tiny", "prompt": [1], "temperature": NaN}', "NaN", None),
    ("/v1/completions", b'{"model": "k2-tiny", "prompt": [1], "seed": 1' + b"0" * 5000 + b"}", "digits", None),
    ("/v1/completions", b"[" * 10_000 + b"]" * 10_000, "nested too deeply", None),
    ("/v1/completions", b'{"model": "k2-tiny", "x": ' + b"[" * 100 + b"]" * 100 + b"}", "deeper than", "x"),
    ("/v1/completions", b"\xff\xfe", "JSON", None),
]


@pytest.mark.parametrize("route,body,field,param", BAD_REQUESTS, ids=[f"{i}" for i in range(len(BAD_REQUESTS))])
def test_bad_request_is_a_400_naming_the_field(server, route, body, field, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = requests.post(f"{server}{route}", data=data, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_bad_requests_hurt_no_one(server, tiny):
    """Each bad request (the engine's own checks included) is answered alone: the server keeps its pages and
    its engine, and serves the next request."""
    start = _idle_free_pages(server)
    for body in ({"model": "k2-tiny", "prompt": [1, 2], "max_tokens": 2, "seed": 2**63 - 1},  # the largest seed
                 {"model": "k2-tiny", "prompt": [1, 2], "max_tokens": 2, "top_k": 1 << 20, "temperature": 1}):
        assert requests.post(f"{server}/v1/completions", json=body, timeout=60).status_code == 200
    assert _idle_free_pages(server) == start


def test_content_type_must_be_json(server):
    body = json.dumps({"model": "k2-tiny", "prompt": [1], "max_tokens": 1})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": content_type} if content_type else {}
        r = requests.post(f"{server}/v1/completions", data=body, headers=headers, timeout=30)
        assert r.status_code == 415, content_type
        assert r.json()["error"]["code"] == "unsupported_media_type"
    r = requests.post(f"{server}/v1/completions", data=body, timeout=30,
                      headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200


def test_a_body_over_the_limit_is_a_413_and_the_server_keeps_serving(server):
    url, headers = f"{server}/chat/v1/completions", {"Authorization": f"Bearer {KEY}"}
    big = {"model": CHAT, "prompt": "hello " * 20_000, "max_tokens": 1}  # 120 kB > max_request_bytes 64 kB
    r = requests.post(url, json=big, headers=headers, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit holds while the body streams in
        for _ in range(200):
            yield b" " * 1024
    r = requests.post(url, data=chunks(), headers={**headers, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413
    r = requests.post(url, json={"model": CHAT, "prompt": "hello", "max_tokens": 1}, headers=headers, timeout=30)
    assert r.status_code == 200


def test_the_key_takes_the_bearer_scheme_in_any_case_and_guards_everything_but_health(server):
    url = f"{server}/chat/v1/models"
    for header, status in ((f"Bearer {KEY}", 200), (f"bearer {KEY}", 200), (f"BEARER  {KEY}", 200),
                           (KEY, 401), (f"Basic {KEY}", 401), (f"Bearer {KEY}x", 401)):
        r = requests.get(url, headers={"Authorization": header}, timeout=10)
        assert r.status_code == status, header
    r = requests.get(url, timeout=10)
    assert r.json()["error"]["type"] == "authentication_error" and r.headers["WWW-Authenticate"] == "Bearer"
    for path in ("/metrics", "/openapi.json"):  # protect_metrics is set on this app
        assert requests.get(f"{server}/chat{path}", timeout=10).status_code == 401, path
        assert requests.get(f"{server}/chat{path}", headers={"Authorization": f"Bearer {KEY}"},
                            timeout=10).status_code == 200, path
    assert requests.get(f"{server}/chat/health", timeout=10).status_code == 200
    assert requests.get(f"{server}/metrics", timeout=10).status_code == 200  # open unless protect_metrics
    assert requests.get(f"{server}/docs", timeout=10).status_code == 404  # no page that loads a CDN's scripts


def test_anthropics_x_api_key_header_carries_the_key_and_its_errors_are_anthropic_shaped(server):
    ok = anthropic.Anthropic(base_url=f"{server}/chat", api_key=KEY, max_retries=0, timeout=120)
    assert ok.messages.create(model=CHAT, max_tokens=2, messages=MESSAGES).usage.output_tokens == 2
    wrong = anthropic.Anthropic(base_url=f"{server}/chat", api_key=f"{KEY}x", max_retries=0, timeout=120)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=CHAT, max_tokens=2, messages=MESSAGES)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    r = requests.get(f"{server}/chat/v1/models", headers={"x-api-key": KEY}, timeout=10)
    assert r.status_code == 200


def test_fastapis_own_errors_are_openai_shaped(server):
    r = requests.get(f"{server}/v1/nothing", timeout=10)
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "GET /v1/nothing: no such route", "type": "not_found_error",
                                 "param": None, "code": "not_found"}
    r = requests.get(f"{server}/v1/completions", timeout=10)
    assert r.status_code == 405 and "POST" in r.headers["Allow"]
    assert r.json()["error"]["code"] == "method_not_allowed"
    r = requests.get(f"{server}/v1/batches?limit=-1", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


def test_the_tp2_engine_runs_in_bundles_of_its_replicas_placement_group(server):
    """Serve places the replica and both shard actors as one gang (STRICT_PACK, one node), each in its bundle;
    the fractional CPUs fit small machines."""
    import ray

    (pg_id, table), = [(i, t) for i, t in ray.util.placement_group_table().items()
                       if t["name"].startswith("SERVE_REPLICA::app-root#") and t["state"] == "CREATED"]
    assert table["strategy"] == "STRICT_PACK" and len(set(table["bundles_to_node_id"].values())) == 1
    assert table["bundles"] == {0: {"CPU": 0.5}, 1: {"CPU": 0.5}, 2: {"CPU": 0.5}}  # the replica, shard 0, shard 1
    held, free = ray.cluster_resources(), ray.available_resources()
    assert [held[f"CPU_group_{i}_{pg_id}"] for i in range(3)] == [0.5, 0.5, 0.5]
    assert [free.get(f"CPU_group_{i}_{pg_id}", 0.0) for i in range(3)] == [0.0, 0.0, 0.0]  # each bundle in use


def _shard_pids() -> list[int]:
    """Processes of the live shard actors of the ``/`` app (the only app with shard actors while it runs)."""
    from ray._private.state import actors

    return [a["Pid"] for a in actors().values()
            if a["ActorClassName"].endswith("ShardWorker") and a["State"] == "ALIVE"]


def test_the_first_request_after_a_shard_died_while_idle_is_served(server, tiny):
    pids = _shard_pids()
    assert len(pids) == 2
    os.kill(pids[1], signal.SIGKILL)
    _wait_for(lambda: len(_shard_pids()) < 2)
    r = client(server).completions.create(model="k2-tiny", prompt=[4, 5, 6], max_tokens=3, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == greedy(tiny, [[4, 5, 6]], 3)[0].token_ids
    assert len(_shard_pids()) == 2 and pids[0] not in _shard_pids()  # a new pair of shards


def test_still_serving_after_bad_requests(server, tiny):
    r = client(server).completions.create(model="k2-tiny", prompt=[1, 2, 3], max_tokens=3, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == greedy(tiny, [[1, 2, 3]], 3)[0].token_ids


def test_metrics_in_prometheus_format(server):
    client(f"{server}/chat", KEY).chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=4)
    text = requests.get(f"{server}/chat/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    for name in ("kdray_http_requests_total", "kdray_num_requests_running", "kdray_num_requests_waiting",
                 "kdray_kv_cache_usage_perc", "kdray_prompt_tokens_total", "kdray_generation_tokens_total",
                 'kdray_request_success_total{finished_reason="length"}', "kdray_time_to_first_token_seconds_count",
                 "kdray_time_per_output_token_seconds_count", "kdray_e2e_request_latency_seconds_count",
                 "kdray_acceptance_length_count", "kdray_spec_decode_num_drafts_total",
                 "kdray_spec_decode_num_draft_tokens_total", "kdray_spec_decode_num_accepted_tokens_total",
                 "kdray_engine_restarts_total",
                 'kdray_step_seconds_count{stage="total"}', 'kdray_step_seconds_count{stage="draft"}',
                 'kdray_step_seconds_count{stage="verify"}'):
        assert name in text, name
    assert metric(f"{server}/chat", "kdray_acceptance_length_count", KEY) >= 1
    assert metric(f"{server}/chat", "kdray_generation_tokens_total", KEY) >= 4
    # a streamed request's first token, timed from its arrival at the replica's handler
    before = metric(f"{server}/chat", "kdray_server_time_to_first_token_seconds_count", KEY)
    chunks = client(f"{server}/chat", KEY).chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=4,
                                                                    stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert metric(f"{server}/chat", "kdray_server_time_to_first_token_seconds_count", KEY) == before + 1
    drafts = metric(f"{server}/chat", "kdray_spec_decode_num_drafts_total", KEY)
    # chain drafting verifies the whole block (block size - 1 tokens) per draft
    assert metric(f"{server}/chat", "kdray_spec_decode_num_draft_tokens_total", KEY) % drafts == 0


def test_an_engine_that_cannot_start_reports_its_own_error(serve_cluster, tmp_path):
    """Serve's status names the real error, and the replicas' logs hold no second one from the cleanup (one
    replica tried: Serve's default tries three, each failing the same way)."""
    import glob

    import ray
    from ray import serve

    (tmp_path / "config.json").write_text(json.dumps({**K2_TINY}))  # a config without weights
    with (deployment_options(max_constructor_retry_count=1),
          pytest.raises(RuntimeError, match="Deploying application app-broken failed")):
        serve.run(app({"model": str(tmp_path), "device": "cpu"}), name="app-broken", route_prefix="/broken")
    try:
        (deployment,) = serve.status().applications["app-broken"].deployments.values()
        assert "NoWeightsError" in deployment.message and "no model.safetensors" in deployment.message
        assert "load_format='dummy'" in deployment.message  # and the way to run the config without weights
        logs = ray._private.worker.global_worker.node.get_logs_dir_path()
        replica_logs = glob.glob(f"{logs}/serve/replica_app-broken_*")
        assert replica_logs and not any("AttributeError" in open(f).read() for f in replica_logs)
    finally:
        serve.delete("app-broken")


# ---- property-based: no request can hurt the server ----------------------------------------------

EXTREME_INTS = [-(2**64), -(2**63) - 1, -(2**63), -1, 0, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63,
                2**64, 10**100, 10**4000]
SOME = st.one_of(st.booleans(), st.text(max_size=8), st.floats(allow_nan=False, allow_infinity=False),
                 st.sampled_from(EXTREME_INTS), st.sampled_from(["\ud800", "a\udfffb", "", "0", "1e999"]),
                 st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                           max_size=2))
JUNK = st.one_of(st.none(), SOME)


def _number(cheap, junk=JUNK):
    """Mostly a cheap valid value (the limits included), else an extreme integer or a value of another type."""
    return st.one_of(*[cheap] * 4, st.sampled_from(EXTREME_INTS), junk)


SAMPLING = {
    "max_tokens": _number(st.integers(1, 3), SOME),  # not None: that means a long default
    "max_completion_tokens": _number(st.integers(1, 3)),
    "temperature": _number(st.floats(0, 2)), "top_p": _number(st.floats(0.01, 1)),
    "top_k": _number(st.one_of(st.integers(-1, 5000), st.just(1 << 20))),
    "seed": _number(st.one_of(st.integers(0, 2**63 - 3), st.just(2**63 - 1))),
    "n": _number(st.integers(1, 3)), "stop": st.one_of(st.lists(st.text(min_size=1, max_size=4), max_size=3),
                                                       st.lists(st.text(max_size=4), max_size=20), JUNK),
    "stream": st.one_of(st.booleans(), JUNK), "ignore_eos": st.one_of(st.booleans(), JUNK),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), JUNK),
    "echo": JUNK, "return_token_ids": st.one_of(st.booleans(), JUNK),
    "presence_penalty": _number(st.floats(-2, 2)), "frequency_penalty": _number(st.floats(-2, 2)),
    "repetition_penalty": _number(st.floats(0.01, 10)), "min_p": _number(st.floats(0, 1)),
    "min_tokens": _number(st.integers(0, 4)), "logprobs": _number(st.one_of(st.booleans(), st.integers(0, 21))),
    "top_logprobs": _number(st.integers(0, 21)),
    "logit_bias": st.one_of(st.dictionaries(st.one_of(st.integers(0, 1100).map(str), st.text(max_size=3)),
                                            _number(st.floats(-100, 100)), max_size=3), JUNK),
}
RAW = [b"", b"null", b"[]", b'"x"', b"{", b"\xff\xfe\x00", b'{"temperature": NaN}', b"[" * 50_000,
       b'{"model": "k2-tiny", "prompt": [1], "seed": ' + b"9" * 5000 + b"}", b'{"prompt": "\\udc80"}']


@st.composite
def fuzzed_request(draw):
    """(route under the server, API key, body bytes): a valid request with some fields replaced by extreme or
    malformed values, or a raw body that is no JSON object."""
    chat = draw(st.booleans())
    prefix, key, model = ("/chat", KEY, CHAT) if chat else ("", None, "k2-tiny")
    if draw(st.integers(0, 9)) == 0:
        return prefix, key, draw(st.sampled_from(RAW))
    body = {"model": model, "max_tokens": 2}
    if chat:
        valid = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                "content": st.text(max_size=30)}), min_size=1, max_size=3)
        role = st.one_of(st.sampled_from(["user", "bot", ""]), JUNK)
        message = st.fixed_dictionaries({"role": role, "content": st.one_of(st.text(max_size=30), JUNK)})
        body["messages"] = draw(st.one_of(*[valid] * 6, st.lists(message, max_size=3), JUNK))
    else:
        valid = st.lists(st.integers(0, 1023), min_size=1, max_size=6)
        extreme = st.lists(st.one_of(st.integers(0, 1023), st.sampled_from(EXTREME_INTS)), max_size=6)
        body["prompt"] = draw(st.one_of(*[valid] * 6, st.lists(valid, min_size=1, max_size=3), extreme,
                                        st.lists(extreme, max_size=3), JUNK))
    fields = {**SAMPLING, "model": st.one_of(st.just(model), JUNK)}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)):
        body[name] = draw(fields[name])
    return prefix, key, json.dumps(body).encode()


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=fuzzed_request())
def test_no_request_hurts_the_server(server, case):
    prefix, key, body = case
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {KEY}"} if key else {})
    route = "/v1/chat/completions" if prefix else "/v1/completions"
    r = requests.post(f"{server}{prefix}{route}", data=body, headers=headers, timeout=120)
    event(f"{prefix or '/'}: {r.status_code}")
    assert r.status_code in (200, 400), r.text[:500]
    if r.status_code == 400:
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"] and "Error(" not in error["message"]
    else:
        assert not any(line.startswith('data: {"error"') for line in r.text.splitlines()), r.text[:500]
    assert requests.get(f"{server}{prefix}/health", timeout=30).status_code == 200
    normal = ({"model": CHAT, "messages": MESSAGES, "max_tokens": 1} if prefix else
              {"model": "k2-tiny", "prompt": [1, 2], "max_tokens": 1})
    assert requests.post(f"{server}{prefix}{route}", json=normal, headers=headers, timeout=120).status_code == 200
