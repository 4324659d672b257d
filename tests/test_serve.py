"""The Serve app over real HTTP on localhost: the official ``openai`` client, streaming, concurrency,
cancellation, bad requests, the API key, the bounded queue and the metrics.

Two apps share one Serve instance: k2-tiny on two tensor-parallel Ray actors (gloo; no tokenizer, so
prompts are token ids) at ``/``, and k2-tiny's weights with a small BPE tokenizer and chat template
(in-process, chain drafting, an API key, room for three requests) at ``/chat``.
"""
import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
from ray.serve import Application
from serve_server import make_chat_checkpoint, metric

from kdray import LLM, SamplingParams
from kdray.engine.args import DEFAULT_MODEL
from kdray.serve import ServeArgs, app

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
                  "spec": "chain", "api_key": KEY, "max_num_seqs": 2, "max_queue": 1,
                  "batch_dir": str(batches / "chat")},
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
    _wait_for(lambda: metric(base, "kdray_requests_running") == 0)
    before = None
    while (now := metric(base, "kdray_kv_free_pages")) != before:
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
        assert metric(server, "kdray_kv_free_pages") < start
    _wait_for(lambda: metric(server, "kdray_kv_free_pages") == start and metric(server, "kdray_requests_running") == 0)

    with pytest.raises(requests.exceptions.ReadTimeout):  # a non-streaming client that gives up
        requests.post(f"{server}/v1/completions", json=long, timeout=1.5)
    _wait_for(lambda: metric(server, "kdray_kv_free_pages") == start and metric(server, "kdray_requests_running") == 0)


def test_full_queue_answers_503_with_retry_after(server):
    body = {"model": CHAT, "messages": MESSAGES, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    url = f"{server}/chat/v1/chat/completions"
    held = [requests.post(url, json=body, headers=headers, stream=True, timeout=60) for _ in range(3)]
    try:
        assert [r.status_code for r in held] == [200, 200, 200]  # max_num_seqs 2 + max_queue 1
        r = requests.post(url, json={**body, "stream": False}, headers=headers, timeout=60)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
    finally:
        for r in held:
            r.close()
    _wait_for(lambda: metric(f"{server}/chat", "kdray_requests_running") == 0)


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
    ("/v1/completions", {"model": "k2-tiny", "prompt": [1], "logprobs": 2}, "logprobs", "logprobs"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": {"text": "hi"}}, "prompt", "prompt"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": "needs a tokenizer"}, "prompt", "prompt"),
    ("/v1/completions", {"model": "k2-tiny", "prompt": [5000]}, "prompt", None),  # past the vocabulary
    ("/v1/chat/completions", {"model": "k2-tiny", "messages": MESSAGES}, "messages", "messages"),
    ("/chat/v1/chat/completions", {"model": CHAT}, "messages", "messages"),
    ("/chat/v1/chat/completions", {"model": CHAT, "messages": [{"role": "bot", "content": "x"}]},
     "messages[0].role", "messages[0].role"),
    ("/chat/v1/chat/completions", {"model": CHAT, "messages": MESSAGES, "max_completion_tokens": -1},
     "max_completion_tokens", "max_completion_tokens"),
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


def test_still_serving_after_bad_requests(server, tiny):
    r = client(server).completions.create(model="k2-tiny", prompt=[1, 2, 3], max_tokens=3, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == greedy(tiny, [[1, 2, 3]], 3)[0].token_ids


def test_metrics_in_prometheus_format(server):
    client(f"{server}/chat", KEY).chat.completions.create(model=CHAT, messages=MESSAGES, max_tokens=4)
    text = requests.get(f"{server}/chat/metrics", timeout=10).text
    for name in ("kdray_http_requests_total", "kdray_queue_length", "kdray_prompt_tokens_total",
                 "kdray_generation_tokens_total", "kdray_time_to_first_token_seconds_count",
                 "kdray_time_per_output_token_seconds_count", "kdray_acceptance_length_count",
                 'kdray_step_seconds_count{stage="total"}', 'kdray_step_seconds_count{stage="draft"}',
                 'kdray_step_seconds_count{stage="verify"}'):
        assert name in text, name
    assert metric(f"{server}/chat", "kdray_acceptance_length_count") >= 1
    assert metric(f"{server}/chat", "kdray_generation_tokens_total") >= 4
