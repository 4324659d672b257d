"""Batch jobs: the JSONL format and resume logic, then 50-request jobs through ``/v1/batches`` and
``kdray batch submit`` against a real Serve instance, each killed halfway and resumed."""
import asyncio
import json
import signal
import subprocess
import sys
import time

import openai
import pytest
import ray
import requests

from kdray import LLM, SamplingParams
from kdray.serve.batch import (BatchOutput, BatchRequest, Rejected, Unsent, parse_batch_input, parse_upload, run_batch,
                               submit)


def _line(i: int, max_tokens: int = 2, **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
            "body": {"model": "k2-tiny", "prompt": [10 + i, 20 + i], "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True, "return_token_ids": True, **body}}


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _results(path) -> dict[str, dict]:
    """custom_id -> output row, asserting that no custom_id appears twice."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [r["custom_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a custom_id was written twice"
    return {r["custom_id"]: r for r in rows}


# ---- the file format and resume, without a server ----------------------------------------------

BAD_INPUTS = [
    ('{"custom_id": "a"\n', "line 1: not valid JSON"),
    (json.dumps(_line(0)) + "\n" + json.dumps(_line(0)) + "\n", "line 2: custom_id 'req-0' repeats"),
    (json.dumps({**_line(0), "url": "/v1/embeddings"}), "line 1: url must be one of"),
    (json.dumps({**_line(0), "body": "x"}), "line 1: body must be a JSON object"),
    (json.dumps({**_line(0), "custom_id": 3}), "line 1: custom_id must be a non-empty string"),
    ("\n\n", "no requests"),
]


@pytest.mark.parametrize("text,error", BAD_INPUTS, ids=["json", "duplicate", "url", "body", "custom_id", "empty"])
def test_bad_input_names_the_line(text, error):
    with pytest.raises(ValueError, match=error):
        parse_batch_input(text)


def test_output_drops_a_torn_line_and_remembers_what_is_done(tmp_path):
    out = BatchOutput(tmp_path / "out.jsonl")
    out.write("a", 200, {"id": "cmpl-1"})
    out.write("b", 400, {"error": {"message": "max_tokens: ..."}})
    out.close()
    with open(tmp_path / "out.jsonl", "a") as f:
        f.write('{"id": "batch_req_x", "custom_id": "c", "resp')  # killed mid-write
    again = BatchOutput(tmp_path / "out.jsonl")
    assert again.done == {"a", "b"} and (again.completed, again.failed) == (1, 1)
    again.close()
    assert (tmp_path / "out.jsonl").read_text().count("\n") == 2


def test_run_batch_skips_done_ids_and_leaves_unsent_ones_for_later(tmp_path):
    requests_ = [BatchRequest(f"r{i}", "/v1/completions", {"i": i}) for i in range(6)]
    out = BatchOutput(tmp_path / "out.jsonl")
    out.write("r0", 200, {})
    seen = []

    async def send(url, body):
        seen.append(body["i"])
        if body["i"] == 3:
            raise Unsent(url)
        return 200, {"id": f"cmpl-{body['i']}"}

    unsent = asyncio.run(run_batch(requests_, out, send, concurrency=2))
    out.close()
    assert sorted(seen) == [1, 2, 3, 4, 5] and [r.custom_id for r in unsent] == ["r3"]
    assert set(_results(tmp_path / "out.jsonl")) == {"r0", "r1", "r2", "r4", "r5"}


def test_upload_parsing_keeps_the_file_bytes():
    content = (json.dumps(_line(0) | {"custom_id": "naïve ✓"}, ensure_ascii=False) + "\n").encode() + bytes(range(256))
    prepared = requests.Request("POST", "http://x/v1/files", files={"file": ("in.jsonl", content)},
                                data={"purpose": "batch"}).prepare()
    fields, (name, data) = parse_upload(prepared.headers["Content-Type"], prepared.body)
    assert fields == {"purpose": "batch"} and name == "in.jsonl" and data == content


# ---- against a running server -------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(serve_cluster, tmp_path_factory):
    """k2-tiny at ``/batch`` of the shared Serve instance (tests that use it are marked slow)."""
    batch_dir = tmp_path_factory.mktemp("batches")
    base = serve_cluster.deploy({"/batch": {"model": "k2-tiny", "device": "cpu", "max_num_seqs": 4,
                                            "batch_dir": str(batch_dir)}})
    return f"{base}/batch", batch_dir


def _rows(n: int, slow: bool = False) -> list[dict]:
    """``n`` lines; every 25th asks for max_tokens 0 (a 400 recorded as that line's result)."""
    return [_line(i, max_tokens=0 if i % 25 == 7 else (4 + i % 12 if slow else 2)) for i in range(n)]


def _check(results: dict[str, dict], rows: list[dict]):
    assert set(results) == {r["custom_id"] for r in rows}
    for row in rows:
        response = results[row["custom_id"]]["response"]
        if row["body"]["max_tokens"] == 0:
            assert response["status_code"] == 400 and "max_tokens" in response["body"]["error"]["message"]
        else:
            assert response["status_code"] == 200
            assert len(response["body"]["choices"][0]["token_ids"]) == row["body"]["max_tokens"]


def _poll_batch(client, batch_id, timeout=180.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            batch = client.batches.retrieve(batch_id)
            if batch.status in ("completed", "failed", "cancelled"):
                return batch
        except (openai.APIConnectionError, openai.InternalServerError):  # a replica restarting
            pass
        assert time.monotonic() < deadline, "the batch did not finish"
        time.sleep(0.5)


@pytest.mark.slow
def test_batch_of_50_through_the_batches_api(server, tmp_path):
    base, _ = server
    rows = _rows(50)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    file = client.files.create(file=("in.jsonl", _jsonl(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    batch = _poll_batch(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (50, 48, 2)
    (tmp_path / "out.jsonl").write_bytes(client.files.content(batch.output_file_id).content)
    results = _results(tmp_path / "out.jsonl")
    _check(results, rows)

    llm = LLM(model="k2-tiny", device="cpu", dtype="float32")
    first = llm.generate(prompt_token_ids=[rows[0]["body"]["prompt"]], sampling_params=SamplingParams(max_tokens=2))
    assert results["req-0"]["response"]["body"]["choices"][0]["token_ids"] == first[0].outputs[0].token_ids


@pytest.mark.slow
def test_batches_api_rejects_bad_input(server):
    base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    dup = client.files.create(file=("dup.jsonl", _jsonl([_line(1), _line(1)])), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="line 2: custom_id 'req-1' repeats"):
        client.batches.create(input_file_id=dup.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="differs from the batch's endpoint"):
        client.batches.create(input_file_id=dup.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_0123456789abcdef01234567")
    r = requests.post(f"{base}/v1/batches", json={"input_file_id": "file-x", "endpoint": "/v1/completions"},
                      timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "file_id"


@pytest.mark.slow
def test_cancelled_batch_stops(server):
    base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    file = client.files.create(file=("in.jsonl", _jsonl(_rows(50, slow=True))), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = _poll_batch(client, batch.id)
    assert batch.status == "cancelled" and batch.request_counts.completed < 48


def _wait_lines(path, at_least: int, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    while not path.exists() or path.read_text().count("\n") < at_least:
        assert time.monotonic() < deadline, f"fewer than {at_least} results appeared"
        time.sleep(0.05)
    return path.read_text().count("\n")


@pytest.mark.slow
def test_server_job_killed_halfway_resumes_in_a_new_replica(server):
    base, batch_dir = server
    rows = _rows(50, slow=True)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    file = client.files.create(file=("in.jsonl", _jsonl(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    output = batch_dir / "files" / f"{batch.output_file_id}.jsonl"
    written = _wait_lines(output, 8)
    (replica,) = [a for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::app-batch#")]
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)
    assert written < 50, "the job finished before it could be killed; make its requests slower"
    batch = _poll_batch(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.total == 50
    _check(_results(output), rows)


@pytest.mark.slow
def test_kdray_batch_killed_halfway_and_resumed(server, tmp_path):
    base, _ = server
    rows = _rows(50, slow=True)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(_jsonl(rows))
    cmd = [sys.executable, "-m", "kdray.cli", "batch", "submit", str(src), "-o", str(out), "--address", base,
           "--concurrency", "2"]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        written = _wait_lines(out, 5)
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
    assert written < 50, "the job finished before it could be killed; make its requests slower"
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    _check(_results(out), rows)


@pytest.mark.slow
def test_kdray_batch_stops_when_the_server_refuses_the_job(server, tmp_path):
    base, _ = server
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl(_rows(3)))
    with pytest.raises(Rejected, match="404"):
        asyncio.run(submit(src, tmp_path / "out.jsonl", f"{base}/wrong-prefix"))
    assert (tmp_path / "out.jsonl").read_text() == ""  # nothing recorded: a rerun sends everything
