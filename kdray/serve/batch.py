"""Batch jobs in the OpenAI Batch JSONL format: the format, and running a file's requests (from the
command line against a server here; on the server, :mod:`kdray.serve.batch_store`).

In: ``{"custom_id", "method": "POST", "url", "body"}`` per line. Out: ``{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error": null}`` per line, appended as each
request completes. A job that stops and starts again reads its output first and skips the
``custom_id``s already there, so no line is lost or written twice.
"""
from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kdray.serve.protocol import APIError, parse_json

BATCH_URLS = ("/v1/completions", "/v1/chat/completions", "/v1/messages")  # the last: Anthropic bodies and errors
MAX_LINES = 50_000
SHOWN_PROBLEMS = 20  # invalid lines listed in one error message (all of them go to the error file)

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


@dataclass(frozen=True)
class InvalidLine:
    """A line of a batch input that is no request: its number, its ``custom_id`` if it had one, and why."""

    line: int
    custom_id: str | None
    message: str


def parse_batch_input(data: bytes, endpoint: str | None = None) -> tuple[list[BatchRequest], list[InvalidLine]]:
    """The requests of a batch input file and every line that is not one (each with its number; a line is
    JSON under the request bodies' rules). A file with no request at all, or more than ``MAX_LINES``, raises
    ``ValueError``."""
    requests: list[BatchRequest] = []
    invalid: list[InvalidLine] = []
    seen: set[str] = set()
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            requests.append(_request(line, endpoint, seen))
        except _BadLine as e:
            invalid.append(InvalidLine(number, e.custom_id, f"line {number}: {e}"))
        if len(requests) + len(invalid) > MAX_LINES:
            raise ValueError(f"the batch input holds more than {MAX_LINES} requests, the limit; split it")
    if not requests:
        raise ValueError("the batch input holds no requests" + (f": {describe(invalid)}" if invalid else ""))
    return requests, invalid


def describe(invalid: list[InvalidLine]) -> str:
    """The invalid lines in one message (the first ``SHOWN_PROBLEMS``, then how many more)."""
    shown = "; ".join(p.message for p in invalid[:SHOWN_PROBLEMS])
    more = len(invalid) - SHOWN_PROBLEMS
    return shown + (f"; and {more} more invalid lines" if more > 0 else "")


class _BadLine(ValueError):
    def __init__(self, message: str, custom_id: str | None = None):
        super().__init__(message)
        self.custom_id = custom_id


def _request(line: bytes, endpoint: str | None, seen: set[str]) -> BatchRequest:
    """One line as a request; ``_BadLine`` says what is wrong with it."""
    try:
        row = parse_json(line)
    except APIError as e:
        raise _BadLine(f"{e.message} (each line must be a JSON object with custom_id, method, url and body)") from None
    cid, url, body = row.get("custom_id"), row.get("url"), row.get("body")
    if not isinstance(cid, str) or not cid:
        raise _BadLine("custom_id must be a non-empty string")
    if cid in seen:
        raise _BadLine(f"custom_id '{cid}' repeats an earlier line; custom_ids must be unique", cid)
    seen.add(cid)
    if row.get("method", "POST") != "POST":
        raise _BadLine("method must be POST", cid)
    if url not in BATCH_URLS:
        raise _BadLine(f"url must be one of {', '.join(BATCH_URLS)}, not {str(url)[:100]!r}", cid)
    if endpoint is not None and url != endpoint:
        raise _BadLine(f"url {url} differs from the batch's endpoint {endpoint}", cid)
    if not isinstance(body, dict):
        raise _BadLine(f"body must be a JSON object (the request to {url})", cid)
    return BatchRequest(cid, url, body)


def open_private(path: Path, mode: str = "ab"):
    """``open(path, mode)`` (``"ab"`` or ``"wb"``), creating the file readable by its owner alone (0600)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "ab" else os.O_TRUNC)
    return os.fdopen(os.open(path, flags, 0o600), mode)


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
        self._file = open_private(self.path)

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

    200, 400 and 413 answers are results; 503 and other 5xx answers are retried after their ``Retry-After``
    and connection errors with backoff; any other answer (401, 404, ...) raises :class:`Rejected`.
    Returns the requests still unanswered after ``retries`` tries (run again to finish them). An input with
    invalid lines raises ``ValueError`` listing them before anything is sent.
    """
    import aiohttp

    requests, invalid = parse_batch_input(Path(input_path).read_bytes())
    if invalid:
        raise ValueError(f"{input_path}: {len(invalid)} invalid line(s), nothing was sent: {describe(invalid)}")
    output = BatchOutput(output_path)
    if on_start is not None:
        on_start(len(output.done), len(requests))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = address.rstrip("/")

    async def send(url: str, body: dict) -> tuple[int, dict]:
        for attempt in range(retries):
            try:
                async with session.post(base + url, json=body, headers=headers) as r:
                    if r.status in (200, 400, 413):
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
