"""Batch jobs in the OpenAI Batch JSONL format, run on the server or from the command line.

In: ``{"custom_id", "method": "POST", "url", "body"}`` per line. Out: ``{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error": null}`` per line, appended as each
request completes. A job that stops and starts again reads its output first and skips the
``custom_id``s already there, so no line is lost or written twice.
"""
from __future__ import annotations

import asyncio
import email.parser
import email.policy
import fcntl
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kdray.serve.protocol import APIError

logger = logging.getLogger("kdray.serve")
BATCH_URLS = ("/v1/completions", "/v1/chat/completions")
MAX_LINES = 50_000
MAX_FILE_BYTES = 100 << 20
FINAL = ("completed", "failed", "cancelled", "expired")

Send = Callable[[str, dict], Awaitable[tuple[int, dict]]]


class Unsent(Exception):
    """A request got no answer (the server is unreachable or kept refusing); a rerun will retry it."""


class Rejected(ValueError):
    """The server refused the job itself (a wrong address or API key): nothing more is sent."""


@dataclass(frozen=True)
class BatchRequest:
    custom_id: str
    url: str
    body: dict


def parse_batch_input(text: str, endpoint: str | None = None) -> list[BatchRequest]:
    """The requests of a batch input file; a bad line raises ``ValueError`` naming its number."""
    requests, seen = [], set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"line {number}: not valid JSON ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"line {number}: expected a JSON object with custom_id, method, url and body")
        cid, url, body = row.get("custom_id"), row.get("url"), row.get("body")
        if not isinstance(cid, str) or not cid:
            raise ValueError(f"line {number}: custom_id must be a non-empty string")
        if cid in seen:
            raise ValueError(f"line {number}: custom_id '{cid}' repeats an earlier line; custom_ids must be unique")
        if row.get("method", "POST") != "POST":
            raise ValueError(f"line {number}: method must be POST")
        if url not in BATCH_URLS:
            raise ValueError(f"line {number}: url must be one of {', '.join(BATCH_URLS)}, not {url!r}")
        if endpoint is not None and url != endpoint:
            raise ValueError(f"line {number}: url {url} differs from the batch's endpoint {endpoint}")
        if not isinstance(body, dict):
            raise ValueError(f"line {number}: body must be a JSON object (the request to {url})")
        seen.add(cid)
        requests.append(BatchRequest(cid, url, body))
    if not requests:
        raise ValueError("the batch input holds no requests")
    if len(requests) > MAX_LINES:
        raise ValueError(f"the batch input holds {len(requests)} requests; the limit is {MAX_LINES}")
    return requests


class BatchOutput:
    """An output JSONL file, appended to one whole line at a time.

    Opening it drops a torn last line (a job killed mid-write) and collects the ``custom_id``s present.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.done: set[str] = set()
        self.failed = 0
        data = self.path.read_bytes() if self.path.exists() else b""
        whole = data[:data.rfind(b"\n") + 1]
        if len(whole) < len(data):
            os.truncate(self.path, len(whole))
        for line in whole.splitlines():
            row = json.loads(line)
            self.done.add(row["custom_id"])
            self.failed += row["response"]["status_code"] != 200
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")

    @property
    def completed(self) -> int:
        return len(self.done) - self.failed

    def write(self, custom_id: str, status: int, body: dict):
        row = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
               "response": {"status_code": status, "request_id": body.get("id") or uuid.uuid4().hex, "body": body},
               "error": None}
        self._file.write((json.dumps(row, separators=(",", ":")) + "\n").encode())
        self._file.flush()
        self.done.add(custom_id)
        self.failed += status != 200

    def close(self):
        self._file.close()


async def run_batch(requests: Iterable[BatchRequest], output: BatchOutput, send: Send, concurrency: int,
                    on_result: Callable[[], None] | None = None) -> list[BatchRequest]:
    """Send each request not yet in ``output``, ``concurrency`` at a time, and record each answer as it
    comes. Returns the requests that stayed :class:`Unsent`."""
    todo = iter([r for r in requests if r.custom_id not in output.done])
    unsent: list[BatchRequest] = []

    async def worker():
        for request in todo:
            try:
                status, body = await send(request.url, request.body)
            except Unsent:
                unsent.append(request)
                continue
            output.write(request.custom_id, status, body)
            if on_result is not None:
                on_result()

    workers = [asyncio.ensure_future(worker()) for _ in range(max(1, concurrency))]
    try:
        await asyncio.gather(*workers)
    finally:  # one worker failed: stop the others
        for w in workers:
            w.cancel()
    return unsent


async def submit(input_path: str | Path, output_path: str | Path, address: str, api_key: str | None = None,
                 concurrency: int = 16, retries: int = 5, on_start: Callable[[int, int], None] | None = None,
                 on_result: Callable[[], None] | None = None) -> list[BatchRequest]:
    """Run a batch file against a running server (``address`` like ``http://host:8000``), client side.

    200 and 400 answers are results; 503 and other 5xx answers are retried after their ``Retry-After``
    and connection errors with backoff; any other answer (401, 404, ...) raises :class:`Rejected`.
    Returns the requests still unanswered after ``retries`` tries (run again to finish them).
    """
    import aiohttp

    requests = parse_batch_input(Path(input_path).read_text())
    output = BatchOutput(output_path)
    if on_start is not None:
        on_start(len(output.done), len(requests))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = address.rstrip("/")

    async def send(url: str, body: dict) -> tuple[int, dict]:
        for attempt in range(retries):
            try:
                async with session.post(base + url, json=body, headers=headers) as r:
                    if r.status in (200, 400):
                        return r.status, await r.json(content_type=None)
                    if r.status < 500:
                        raise Rejected(f"{base}{url} answered {r.status}: {(await r.text())[:300]}")
                    delay = float(r.headers.get("Retry-After", 2 ** attempt))
            except (aiohttp.ClientError, asyncio.TimeoutError):
                delay = 2 ** attempt
            await asyncio.sleep(min(delay, 30))
        raise Unsent(url)

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            return await run_batch(requests, output, send, concurrency, on_result)
        finally:
            output.close()


# ---- server side: files and batch jobs under one directory -------------------------------------

_FILE_ID = re.compile(r"^file-[0-9a-f]{24}$")
_BATCH_ID = re.compile(r"^batch_[0-9a-f]{24}$")


def parse_upload(content_type: str, body: bytes) -> tuple[dict[str, str], tuple[str, bytes] | None]:
    """A ``multipart/form-data`` body as (text fields, (filename, bytes) of the ``file`` field)."""
    if not content_type.startswith("multipart/form-data"):
        raise APIError(400, "upload files as multipart/form-data with fields 'file' and 'purpose'", param="file")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    fields, upload = {}, None
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name == "file":
            upload = (part.get_filename() or "upload.jsonl", part.get_payload(decode=True) or b"")
        elif name:
            fields[name] = part.get_content().strip()
    return fields, upload


class BatchStore:
    """Uploaded files and batch jobs kept under ``root``; a job runs in the replica that created it and
    resumes in a replica that starts later and finds it unfinished (a file lock keeps it to one runner).
    """

    def __init__(self, root: str | Path, send: Send, concurrency: int):
        self.root = Path(root).expanduser()
        (self.root / "files").mkdir(parents=True, exist_ok=True)
        (self.root / "batches").mkdir(parents=True, exist_ok=True)
        self._send, self._concurrency = send, concurrency
        self._tasks: dict[str, asyncio.Task] = {}
        self._watcher: asyncio.Task | None = None

    # files

    def create_file(self, content: bytes, filename: str, purpose: str) -> dict:
        if purpose != "batch":
            raise APIError(400, f"purpose: '{purpose}' is not supported; upload batch inputs with purpose 'batch'",
                           param="purpose")
        if len(content) > MAX_FILE_BYTES:
            raise APIError(400, f"file: {len(content)} bytes exceed the limit of {MAX_FILE_BYTES}", param="file")
        return self._new_file(filename, purpose, content)

    def get_file(self, file_id: str) -> dict:
        meta = self._file_meta(file_id)
        meta["bytes"] = self.file_path(file_id).stat().st_size
        return meta

    def file_path(self, file_id: str) -> Path:
        self._file_meta(file_id)
        return self.root / "files" / f"{file_id}.jsonl"

    def _new_file(self, filename: str, purpose: str, content: bytes) -> dict:
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        (self.root / "files" / f"{file_id}.jsonl").write_bytes(content)
        meta = {"id": file_id, "object": "file", "bytes": len(content), "created_at": int(time.time()),
                "filename": filename, "purpose": purpose, "status": "processed"}
        _write_json(self.root / "files" / f"{file_id}.json", meta)
        return meta

    def _file_meta(self, file_id: str) -> dict:
        return self._record("files", _FILE_ID, file_id, "file")

    def _record(self, folder: str, pattern: re.Pattern, record_id: str, kind: str) -> dict:
        """The JSON record ``<folder>/<record_id>.json``; a malformed or unknown id is a 404 naming it."""
        path = self.root / folder / f"{record_id}.json"
        if not pattern.match(record_id) or not path.is_file():
            raise APIError(404, f"{kind} '{record_id}' not found", param=f"{kind}_id", code=f"{kind}_not_found")
        return json.loads(path.read_text())

    # batches

    def create_batch(self, data: dict) -> dict:
        """``POST /v1/batches``: validate the input file and start the job."""
        file_id, endpoint = data.get("input_file_id"), data.get("endpoint")
        if not isinstance(file_id, str):
            raise APIError(400, "input_file_id: required (the id POST /v1/files returned)", param="input_file_id")
        if endpoint not in BATCH_URLS:
            raise APIError(400, f"endpoint: must be one of {', '.join(BATCH_URLS)}", param="endpoint")
        if data.get("completion_window", "24h") != "24h":
            raise APIError(400, "completion_window: only '24h' is supported", param="completion_window")
        if not isinstance(data.get("metadata") or {}, dict):
            raise APIError(400, "metadata: must be an object of strings", param="metadata")
        try:
            requests = parse_batch_input(self.file_path(file_id).read_text(), endpoint)
        except ValueError as e:
            raise APIError(400, f"input_file_id: {e}", param="input_file_id") from None
        now = int(time.time())
        output = self._new_file("batch_output.jsonl", "batch_output", b"")
        batch = {"id": f"batch_{uuid.uuid4().hex[:24]}", "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": file_id, "completion_window": "24h", "status": "validating",
                 "output_file_id": output["id"], "error_file_id": None, "created_at": now,
                 "in_progress_at": None, "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None,
                 "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": len(requests), "completed": 0, "failed": 0},
                 "metadata": data.get("metadata")}
        self._save(batch)
        self._start(batch["id"])
        return batch

    def get_batch(self, batch_id: str) -> dict:
        return self._record("batches", _BATCH_ID, batch_id, "batch")

    def list_batches(self, limit: int = 20) -> dict:
        paths = sorted((self.root / "batches").glob("batch_*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        data = [json.loads(p.read_text()) for p in paths[:limit]]
        return {"object": "list", "data": data, "has_more": len(paths) > limit,
                "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}

    def cancel_batch(self, batch_id: str) -> dict:
        """Ask the job to stop; the replica running it notices at its next result."""
        batch = self.get_batch(batch_id)
        if batch["status"] not in FINAL:
            batch.update(status="cancelling", cancelling_at=int(time.time()))
            self._save(batch)
            if batch_id in self._tasks:
                self._tasks[batch_id].cancel()
        return batch

    def start(self, interval: float = 10.0):
        """Every ``interval`` seconds, pick up unfinished jobs that no replica is running (their replica
        stopped or was scaled away)."""
        async def watch():
            while True:
                for path in (self.root / "batches").glob("batch_*.json"):
                    if json.loads(path.read_text())["status"] not in FINAL:
                        self._start(path.stem)
                await asyncio.sleep(interval)

        self._watcher = asyncio.get_running_loop().create_task(watch())

    async def close(self):
        tasks = [self._watcher, *self._tasks.values()] if self._watcher else list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _start(self, batch_id: str):
        if batch_id not in self._tasks:
            task = asyncio.get_running_loop().create_task(self._run(batch_id))
            self._tasks[batch_id] = task
            task.add_done_callback(lambda _: self._tasks.pop(batch_id, None))

    async def _run(self, batch_id: str):
        lock = os.open(self.root / "batches" / f"{batch_id}.lock", os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another replica runs it
            os.close(lock)
            return
        output = None
        try:
            batch = self.get_batch(batch_id)
            requests = parse_batch_input(self.file_path(batch["input_file_id"]).read_text(), batch["endpoint"])
            output = BatchOutput(self.file_path(batch["output_file_id"]))
            batch.update(status="in_progress", in_progress_at=batch["in_progress_at"] or int(time.time()))
            self._progress(batch, output)
            await run_batch(requests, output, self._send, self._concurrency, lambda: self._progress(batch, output))
            now = int(time.time())
            batch.update(status="completed", finalizing_at=now, completed_at=now)
            self._progress(batch, output)
        except asyncio.CancelledError:
            if self.get_batch(batch_id)["status"] == "cancelling":
                batch = self.get_batch(batch_id)
                batch.update(status="cancelled", cancelled_at=int(time.time()))
                self._save(batch)
            else:
                raise  # the replica is shutting down: the job stays unfinished and resumes elsewhere
        except Exception:
            logger.exception("batch %s stopped; a replica will resume it", batch_id)
            raise
        finally:
            if output is not None:
                output.close()
            os.close(lock)

    def _progress(self, batch: dict, output: BatchOutput):
        """Persist the counts; stop the job if someone asked to cancel it meanwhile."""
        if self.get_batch(batch["id"])["status"] == "cancelling":
            self._tasks[batch["id"]].cancel()
            return
        batch["request_counts"].update(completed=output.completed, failed=output.failed)
        self._save(batch)

    def _save(self, batch: dict):
        _write_json(self.root / "batches" / f"{batch['id']}.json", batch)


def _write_json(path: Path, obj: dict):
    """Replace ``path`` atomically, so a reader never sees half a record."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)
