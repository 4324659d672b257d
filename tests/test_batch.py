"""Batch jobs: the JSONL format (every invalid line reported), resume logic, the server's store (private
files, retention, a stalled job failed instead of crash-looping), then 50-request jobs through ``/v1/batches``
and ``kdray batch submit`` against a real Serve instance, each killed halfway and resumed."""
import asyncio
import io
import json
import re
import signal
import stat
import subprocess
import sys
import time

import openai
import pytest
import ray
import requests

from kdray import LLM, SamplingParams
from kdray.serve.batch import BatchOutput, BatchRequest, Rejected, Unsent, parse_batch_input, run_batch, submit
from kdray.serve.batch_store import MAX_STALLED_STARTS, BatchStore
from kdray.serve.protocol import APIError


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

BAD_LINES = [
    ('{"custom_id": "a"', "line 2: malformed JSON"),
    (json.dumps(_line(0)), "line 3: custom_id 'req-0' repeats"),
    (json.dumps({**_line(1), "url": "/v1/embeddings"}), "line 4: url must be one of"),
    (json.dumps({**_line(2), "body": "x"}), "line 5: body must be a JSON object"),
    (json.dumps({**_line(3), "custom_id": 3}), "line 6: custom_id must be a non-empty string"),
    (json.dumps(_line(4)).replace('"prompt": [14, 24]', '"prompt": "\\ud800"'), "line 7: body.prompt: holds a lone"),
    ('{"custom_id": "x", "body": {"temperature": NaN}}', "line 8: malformed JSON.*NaN"),
]


def test_every_invalid_line_is_reported_by_number_and_the_rest_kept():
    text = "\n".join([json.dumps(_line(0))] + [line for line, _ in BAD_LINES] + [json.dumps(_line(9))])
    requests_, invalid = parse_batch_input(text.encode())
    assert [r.custom_id for r in requests_] == ["req-0", "req-9"]
    assert [p.line for p in invalid] == list(range(2, 2 + len(BAD_LINES)))
    for problem, (_, message) in zip(invalid, BAD_LINES):
        assert re.match(message, problem.message), problem.message
    assert invalid[1].custom_id == "req-0" and invalid[0].custom_id is None


def test_an_input_without_a_request_is_refused_whole():
    with pytest.raises(ValueError, match="no requests"):
        parse_batch_input(b"\n\n")
    with pytest.raises(ValueError, match="no requests: line 1: malformed JSON"):
        parse_batch_input(b"{")


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


def test_kdray_batch_refuses_an_input_with_invalid_lines_naming_them_all(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([json.dumps(_line(0)), "{", json.dumps(_line(0)), json.dumps(_line(1))]))
    with pytest.raises(ValueError, match=r"2 invalid line\(s\), nothing was sent: line 2: .*; line 3: custom_id"):
        asyncio.run(submit(src, tmp_path / "out.jsonl", "http://127.0.0.1:9"))
    assert not (tmp_path / "out.jsonl").exists()


# ---- the server's store, without a server -------------------------------------------------------

def _store(root, send=None, retention_days=None) -> BatchStore:
    async def answer(url, body):
        return 200, {"id": "cmpl-x"}

    return BatchStore(root, send or answer, concurrency=2, max_file_bytes=1 << 20, retention_days=retention_days)


def _finish(store: BatchStore, batch_id: str):
    async def wait():
        while store.get_batch(batch_id)["status"] not in ("completed", "failed", "cancelled"):
            await asyncio.sleep(0.01)
    return wait()


def test_store_data_is_private_to_its_user(tmp_path):
    root = tmp_path / "store"

    async def scenario():
        store = _store(root)
        file = store.create_file(io.BytesIO(_jsonl(_rows(3))), "in.jsonl", "batch")
        batch = await store.create_batch({"input_file_id": file["id"], "endpoint": "/v1/completions"})
        await _finish(store, batch["id"])
        await store.close()

    asyncio.run(scenario())
    paths = [root, *root.rglob("*")]
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in paths if p.is_dir()} == {"0o700"}
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in paths if p.is_file()} == {"0o600"}
    assert len([p for p in paths if p.is_file()]) >= 6  # input, output, their records, the batch, its lock


def test_batch_dir_is_made_on_first_use_and_a_bad_one_is_a_clear_error(tmp_path):
    store = _store(tmp_path / "later")
    assert not (tmp_path / "later").exists()  # nothing made until a file or batch needs it
    assert store.list_files(None, 10, None)["data"] == []
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(APIError, match=rf"batch_dir '{blocked}/store' cannot be created .*writable directory") as e:
        _store(blocked / "store").create_file(io.BytesIO(b"{}"), "in.jsonl", "batch")
    assert e.value.status == 500 and e.value.code == "batch_dir_unavailable"


def test_retention_deletes_old_finished_batches_and_uploads_but_keeps_what_is_in_use(tmp_path):
    async def scenario():
        store = _store(tmp_path, retention_days=1)
        old = store.create_file(io.BytesIO(_jsonl(_rows(2))), "old.jsonl", "batch")
        done = await store.create_batch({"input_file_id": old["id"], "endpoint": "/v1/completions"})
        await _finish(store, done["id"])
        unused = store.create_file(io.BytesIO(_jsonl(_rows(2))), "unused.jsonl", "batch")
        await store.close()
        now = time.time()
        assert store.sweep(now) == 0  # nothing is a day old yet
        assert store.sweep(now + 2 * 86400) == 3  # the batch, its input, the unused upload
        for gone in (old["id"], done["output_file_id"], unused["id"]):
            with pytest.raises(APIError, match="not found"):
                store.get_file(gone)
        with pytest.raises(APIError, match="not found"):
            store.get_batch(done["id"])

    asyncio.run(scenario())


def test_a_job_whose_replicas_keep_dying_is_failed_not_restarted_forever(tmp_path):
    async def never(url, body):  # the replica dies before any answer
        await asyncio.Event().wait()

    async def scenario():
        store = _store(tmp_path, send=never)
        file = store.create_file(io.BytesIO(_jsonl(_rows(2))), "in.jsonl", "batch")
        batch = await store.create_batch({"input_file_id": file["id"], "endpoint": "/v1/completions"})
        for _ in range(MAX_STALLED_STARTS):
            await asyncio.sleep(0.05)
            assert store.get_batch(batch["id"])["status"] == "in_progress"
            task = store._tasks[batch["id"]]
            task.cancel()  # as a replica's death ends it
            await asyncio.gather(task, return_exceptions=True)
            store._start(batch["id"])  # as the next replica's watcher does
        await _finish(store, batch["id"])
        return store.get_batch(batch["id"])

    failed = asyncio.run(scenario())
    assert failed["status"] == "failed" and failed["errors"]["data"][0]["code"] == "stalled"


# ---- against a running server -------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(serve_cluster, tmp_path_factory):
    """k2-tiny at ``/batch`` of the shared Serve instance (tests that use it are marked slow). Serve's health check
    runs every second (its default: 10 s), so the replica a test kills is replaced within a second or so."""
    batch_dir = tmp_path_factory.mktemp("batches")
    base = serve_cluster.deploy({"/batch": {"model": "k2-tiny", "device": "cpu", "max_num_seqs": 4,
                                            "max_file_bytes": 65536, "batch_dir": str(batch_dir)}},
                                health_check_period_s=1)
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
        time.sleep(0.1)


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
def test_invalid_lines_are_reported_one_by_one_and_the_rest_runs(server):
    """The audit's job: a line whose top_k once stopped the engine, beside malformed and duplicate lines."""
    base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    lines = [_line(0), _line(1, top_k=2**63), "{not json", _line(0), {"custom_id": "x", "url": "/v1/embeddings"},
             _line(2)] + [_line(i) for i in range(3, 7)]
    data = "".join((json.dumps(r) if isinstance(r, dict) else r) + "\n" for r in lines).encode()
    file = client.files.create(file=("in.jsonl", data), purpose="batch")
    batch = _poll_batch(client, client.batches.create(input_file_id=file.id, endpoint="/v1/completions",
                                                      completion_window="24h").id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (10, 6, 4)
    assert [e.line for e in batch.errors.data] == [3, 4, 5]
    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert [(e["error"]["line"], e["custom_id"]) for e in errors] == [(3, None), (4, "req-0"), (5, "x")]
    output = {json.loads(line)["custom_id"]: json.loads(line) for line in
              client.files.content(batch.output_file_id).text.splitlines()}
    assert output["req-1"]["response"]["status_code"] == 400  # the top_k line failed alone
    assert "top_k" in output["req-1"]["response"]["body"]["error"]["message"]
    assert sorted(output) == ["req-0", "req-1", "req-2", "req-3", "req-4", "req-5", "req-6"]

    with pytest.raises(openai.BadRequestError, match="no requests: line 1: url /v1/completions differs"):
        client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_0123456789abcdef01234567")
    r = requests.post(f"{base}/v1/batches", json={"input_file_id": "file-x", "endpoint": "/v1/completions"},
                      timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "file_id"


@pytest.mark.slow
def test_files_are_listed_deleted_and_bounded(server, tmp_path):
    base, batch_dir = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    file = client.files.create(file=("in.jsonl", _jsonl(_rows(2))), purpose="batch")
    assert file.id in [f.id for f in client.files.list(purpose="batch")]
    assert stat.S_IMODE((batch_dir / "files" / f"{file.id}.jsonl").stat().st_mode) == 0o600
    assert stat.S_IMODE((batch_dir / "files").stat().st_mode) == 0o700

    busy = client.files.create(file=("slow.jsonl", _jsonl(_rows(8, slow=True))), purpose="batch")
    batch = client.batches.create(input_file_id=busy.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.ConflictError, match="belongs to batch"):
        client.files.delete(busy.id)
    _poll_batch(client, batch.id)
    for file_id in (file.id, busy.id):
        assert client.files.delete(file_id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file_id)

    r = requests.post(f"{base}/v1/files", files={"file": ("big.jsonl", b"x" * 70_000)}, data={"purpose": "batch"},
                      timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] in ("file_too_large", "request_too_large")
    r = requests.post(f"{base}/v1/files", data=_jsonl(_rows(1)), headers={"Content-Type": "application/jsonl"},
                      timeout=30)
    assert r.status_code == 415
    r = requests.post(f"{base}/v1/files", data=b"--x\r\nbroken", timeout=30,
                      headers={"Content-Type": "multipart/form-data; boundary=x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    page = requests.get(f"{base}/v1/batches?limit=1", timeout=10).json()
    assert len(page["data"]) == 1 and page["has_more"]
    rest = requests.get(f"{base}/v1/batches?limit=100&after={page['last_id']}", timeout=10).json()
    assert page["last_id"] not in [b["id"] for b in rest["data"]] and rest["data"]


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
